"""A loss-in-forward pass's gradients, held in float32 from the forward until the backward scales
them by the upstream gradient and rounds each once (``docs/DESIGN.md``, "Precision"), and the
chosen token's gradient term, added in float32.

The weight gradient is held as float32 row parts: one for a float32 weight; two halves for a
16-bit one, so that the rounded result fits in the first half's memory. ``HeldSteps`` holds the
steps in pure torch; the Triton backend overrides the ones it has kernels for.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .contract import Gradients, LossState, NeededGrads
from .products import add_product

NARROWING_ROWS = 4096  # rows of the first step when the float32 weight gradient is narrowed in place


def allocate(
    hidden: torch.Tensor, weight: torch.Tensor, needed: NeededGrads
) -> tuple[torch.Tensor, List[torch.Tensor]]:
    """``(held_hidden [n, H], held_weight parts)`` in float32 for the gradients ``needed`` asks for
    (a 1-D empty tensor and no parts for the others). Zero rows give zeros: no chunk writes them."""
    empty = hidden.new_zeros if hidden.shape[0] == 0 else hidden.new_empty
    held_hidden = empty(hidden.shape, dtype=torch.float32) if needed.hidden else hidden.new_empty(0)
    held_weight = []
    if needed.weight:
        vocab = weight.shape[0]
        middle = vocab if weight.dtype == torch.float32 else -(-vocab // 2)
        held_weight = [
            empty(stop - start, weight.shape[1], dtype=torch.float32)
            for start, stop in ((0, middle), (middle, vocab))
            if stop > start
        ]
    return held_hidden, held_weight


def add_weight_product(
    held_weight: List[torch.Tensor], logit_grads: torch.Tensor, hidden: torch.Tensor, accumulate: bool
) -> None:
    """Add ``logit_grads.T @ hidden`` (``[rows, V]``, ``[rows, H]``, one dtype) to the parts (or
    write it, for the first chunk)."""
    start = 0
    for part in held_weight:
        add_product(part, logit_grads[:, start : start + part.shape[0]].t(), hidden, accumulate=accumulate)
        start += part.shape[0]


def narrowing_steps(rows: int) -> List[slice]:
    """The steps that narrow a float32 part of ``rows`` rows into its own memory: ``[0,
    NARROWING_ROWS)``, then ``[a, 2a)`` until ``rows``.

    Narrowed row ``r`` lands in bytes ``[2rH, 2(r+1)H)``, over float32 rows ``[r/2, (r+1)/2)``. A
    step ``[a, b)`` with ``b <= 2a`` therefore writes only over rows below ``a``, read by earlier
    steps, and reads bytes ``[4aH, 4bH)``, above all it writes: it runs as one launch, without a
    temporary. Only the first step, which writes over what it reads, goes through a temporary."""
    steps, start, stop = [], 0, min(NARROWING_ROWS, rows)
    while start < rows:
        steps.append(slice(start, stop))
        start, stop = stop, min(2 * stop, rows)
    return steps


class HeldSteps:
    """The steps that touch the held gradients element by element, in torch; a backend with kernels
    for them overrides ``scaled_copy`` and ``add_chosen``."""

    def scaled_copy(self, source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out = source * scale`` (``scale`` a 0-dim float32 tensor, or ``None``: 1), computed in
        float32 and rounded once into ``out``'s dtype; ``out`` may be ``source``. Returns ``out``."""
        return out.copy_(source) if scale is None else torch.mul(source, scale, out=out)

    def add_chosen_columns(
        self,
        state: LossState,
        rows: slice,
        target_column: torch.Tensor,
        chosen: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        factor: Optional[torch.Tensor] = None,
    ) -> None:
        """``add_chosen`` for one target per row (``[k]``) or several (``target_column`` and
        ``chosen`` ``[k, m]``: one call per target column, the factor applied by the first)."""
        if target_column.dim() == 1:
            self.add_chosen(state, rows, target_column, chosen, hidden, weight, factor)
            return
        for target in range(target_column.shape[1]):
            column, term = target_column[:, target].contiguous(), chosen[:, target].contiguous()
            self.add_chosen(state, rows, column, term, hidden, weight, factor if target == 0 else None)

    def add_chosen(
        self,
        state: LossState,
        rows: slice,
        target_column: torch.Tensor,
        chosen: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        factor: Optional[torch.Tensor] = None,
    ) -> None:
        """Finish a chunk's rows: the hidden gradient's product (already in ``held_hidden[rows]``)
        becomes ``factor * product + chosen * weight[target_column]``, and ``chosen * hidden`` is
        added to the weight gradient's rows ``target_column``, summed per row in float32 in a fixed
        order (deterministic). ``target_column``, ``chosen``, ``factor`` ``[k]`` (``factor`` ``None``:
        1; columns ``< 0``: another shard's token, no term); ``hidden [k, H]`` the chunk's rows."""
        if state.held_hidden.dim() == 2:
            product = state.held_hidden[rows]
            if factor is not None:
                product.mul_(factor.unsqueeze(1))
            coefficient = torch.where(target_column >= 0, chosen, 0.0).unsqueeze(1)
            product.addcmul_(coefficient, weight[target_column.clamp(min=0)].float())
        if not state.held_weight:
            return
        values = chosen.unsqueeze(1) * hidden.float()
        # Tokens outside a part write zeros to distinct rows, so that none piles onto one row.
        spare = torch.arange(target_column.shape[0], device=hidden.device)
        start = 0
        for part in state.held_weight:
            inside = (target_column >= start) & (target_column < start + part.shape[0])
            part_rows = torch.where(inside, target_column - start, spare % part.shape[0])
            part.index_put_((part_rows,), torch.where(inside.unsqueeze(1), values, 0.0), accumulate=True)
            start += part.shape[0]

    def finish(
        self,
        held_hidden: torch.Tensor,
        held_weight: List[torch.Tensor],
        scale: Optional[torch.Tensor],
        dtypes: tuple[torch.dtype, torch.dtype],
        narrow_in_place: bool,
    ) -> Gradients:
        """Both held gradients times the upstream ``scale`` (0-dim float32; ``None``: 1), each rounded
        once into its parameter's dtype (``dtypes``: hidden's, the weight's; ``None`` where not
        held). With ``narrow_in_place`` the weight gradient is written into the held parts' own
        memory, which it then occupies (eager autograd); otherwise into new memory (a custom
        operator may not return its inputs' memory)."""
        hidden_dtype, weight_dtype = dtypes
        hidden = None
        if held_hidden.dim() == 2:
            hidden = self.scaled_copy(held_hidden, scale, torch.empty_like(held_hidden, dtype=hidden_dtype))
        if not held_weight:
            return Gradients(hidden, None)
        (first, *rest), hidden_size = held_weight, held_weight[0].shape[1]
        shape = (sum(part.shape[0] for part in held_weight), hidden_size)
        if not rest:  # float32: the held part is the result
            out = first if narrow_in_place else torch.empty_like(first)
            return Gradients(hidden, self.scaled_copy(first, scale, out))
        if narrow_in_place:
            out = torch.empty(0, dtype=weight_dtype, device=first.device)
            out.set_(first.untyped_storage(), 0, shape, (hidden_size, 1))
        else:
            out = first.new_empty(shape, dtype=weight_dtype)
        start = 0
        for index, part in enumerate(held_weight):
            overlapping = narrow_in_place and index == 0
            for rows in narrowing_steps(part.shape[0]) if overlapping else (slice(0, part.shape[0]),):
                target = out[start + rows.start : start + rows.stop]
                if overlapping and rows.start == 0:
                    target.copy_(self.scaled_copy(part[rows], scale, target.new_empty(target.shape)))
                else:
                    self.scaled_copy(part[rows], scale, target)
            start += part.shape[0]
        return Gradients(hidden, out)
