"""A loss-in-forward pass's gradients, held in float32 from the forward until the backward scales
them by the upstream gradient and rounds each once (``docs/DESIGN.md``, "Precision"); where the
weight gradient goes (``WeightGradSink``); and the chosen token's gradient term, added in float32.

The weight gradient is held as float32 row parts: one for a float32 weight; two halves for a
16-bit one, so that the rounded result fits in the first half's memory. ``HeldSteps`` holds the
element-wise steps in pure torch; the Triton backend overrides the ones it has kernels for.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from .accumulation import PendingWeightGrad
from .contract import NeededGrads, ShardProblem
from .loss_in_forward import deviates, proportional_fit
from .products import add_product

NARROWING_SHARE = 8  # the first step narrows 1 / NARROWING_SHARE of a part's rows, through a temporary


@dataclasses.dataclass(frozen=True)
class WeightGradSink:
    """Where a three-GEMM pass puts the weight gradient, decided once by the public op: float32 row
    parts of the pass's own (``accumulator`` is ``None``), finished into the weight's dtype by the
    backward; or a caller's float32 ``accumulator`` (``weight_grad_into``), into which the forward
    adds ``scale`` times the gradient, followed by ``pending`` until the backward."""

    accumulator: Optional[torch.Tensor] = None
    scale: float = 1.0  # the upstream gradient the held gradients are for
    pending: Optional[PendingWeightGrad] = None

    @classmethod
    def into(cls, accumulator: torch.Tensor, scale: float, rows: int) -> WeightGradSink:
        """A caller's ``accumulator`` (checked by the public op), its record opened for ``rows`` rows."""
        return cls(accumulator, scale, PendingWeightGrad(accumulator, scale, rows))


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


def allocate_state(problem: ShardProblem, needed: NeededGrads, held_weight: Optional[List[torch.Tensor]]):
    """``(held_hidden, held_weight, chosen)`` of a ``contract.LossState`` for ``problem``, as
    ``allocate`` makes them; the weight gradient into ``held_weight`` where given (a caller's
    accumulator). Shared by the backends."""
    hidden, weight = problem.hidden, problem.weight
    held_hidden, own = allocate(hidden, weight, needed._replace(weight=needed.weight and not held_weight))
    parts = (held_weight or own) if needed.weight else []
    chosen = problem.target_column.new_empty(problem.target_column.shape, dtype=torch.float32)
    return held_hidden, parts, chosen if parts else hidden.new_empty(0)


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
    """The steps that narrow a float32 part of ``rows`` rows into its own memory: ``[0, a)`` with
    ``a = ceil(rows / NARROWING_SHARE)``, then ``[a, 2a)``, ``[2a, 4a)`` ... until ``rows``.

    Narrowed row ``r`` lands in bytes ``[2rH, 2(r+1)H)``, over float32 rows ``[r/2, (r+1)/2)``. A
    step ``[a, b)`` with ``b <= 2a`` therefore writes only over rows below ``a``, read by earlier
    steps, and reads bytes ``[4aH, 4bH)``, above all it writes: it runs as one launch, without a
    temporary. Only the first step, which writes over what it reads, goes through a temporary (an
    eighth of the part in the weight's dtype: five launches in all)."""
    steps, start, stop = [], 0, min(-(-rows // NARROWING_SHARE), rows)
    while start < rows:
        steps.append(slice(start, stop))
        start, stop = stop, min(2 * stop, rows)
    return steps


class HeldSteps:
    """The steps that touch the held gradients element by element, in torch; a backend with kernels
    for them overrides ``scaled_copy``, ``add_chosen``, ``add_chosen_rows`` and ``fit_declared``."""

    def fit_declared(
        self, upstream: torch.Tensor, declared: torch.Tensor, assumed: Optional[float]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The labels path's backward check, on the device: ``(scale [], correction [n], ran [])``,
        the scale ``c`` of the declared weights ``w`` (``assumed``, or else fitted to the upstream
        gradient ``u``), the log-prob gradient of the difference ``-(u - c w)`` that the weight
        gradient still lacks (over ``c`` where fitted: it is scaled by ``c`` with the held one), and
        whether the difference is more than rounding."""
        scale = upstream.new_tensor(assumed) if assumed is not None else proportional_fit(upstream, declared)
        difference = upstream - scale * declared
        correction = -difference if assumed is not None else -difference / scale
        return scale, correction, deviates(difference, upstream)

    def scaled_copy(self, source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out = source * scale`` (``scale`` a 0-dim float32 tensor, one per row ``[n]``, or
        ``None``: 1), computed in float32 and rounded once into ``out``'s dtype; ``out`` may be
        ``source``. Returns ``out``."""
        if scale is None:
            return out.copy_(source)
        return torch.mul(source, scale if scale.dim() == 0 else scale.unsqueeze(1), out=out)

    def add_chosen(
        self,
        product: torch.Tensor,
        target_column: torch.Tensor,
        chosen: torch.Tensor,
        weight: torch.Tensor,
        factor: Optional[torch.Tensor] = None,
    ) -> None:
        """Finish a chunk's hidden gradient rows in place: the product ``[k, H]`` (float32) becomes
        ``factor * product + chosen * weight[target_column]``. ``target_column``, ``chosen`` and
        ``factor`` ``[k]`` (``factor`` ``None``: 1; columns ``< 0``: another shard's token, no
        term); several targets, ``[k, m]``: each column's term added in turn."""
        if factor is not None:
            product.mul_(factor.unsqueeze(1))
        columns = target_column.view(target_column.shape[0], -1)
        for target in range(columns.shape[1]):
            column, term = columns[:, target], chosen.view(columns.shape)[:, target]
            coefficient = torch.where(column >= 0, term, 0.0).unsqueeze(1)
            product.addcmul_(coefficient, weight[column.clamp(min=0)].float())

    def add_chosen_rows(
        self, held_weight: List[torch.Tensor], target_column: torch.Tensor, chosen: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """Add ``chosen[t] * hidden[t]`` to the weight gradient's row ``target_column[t]`` (its
        float32 row parts in order), summed per row in float32 in a fixed order (deterministic);
        ``[n]`` or, several targets, ``[n, m]`` columns and terms; columns ``< 0``: no term."""
        columns, per_row = target_column.reshape(-1), target_column.shape[1] if target_column.dim() == 2 else 1
        rows = hidden if per_row == 1 else hidden.repeat_interleave(per_row, dim=0)  # one row per term
        values = chosen.reshape(-1, 1) * rows.float()
        # Terms outside a part go to distinct rows as zeros, so that none piles onto one row.
        spare = torch.arange(columns.shape[0], device=hidden.device)
        start = 0
        for part in held_weight:
            inside = (columns >= start) & (columns < start + part.shape[0])
            part_rows = torch.where(inside, columns - start, spare % part.shape[0])
            part.index_put_((part_rows,), torch.where(inside.unsqueeze(1), values, 0.0), accumulate=True)
            start += part.shape[0]

    def finish_weight(
        self, held_weight: List[torch.Tensor], scale: Optional[torch.Tensor], dtype: torch.dtype, narrow_in_place: bool
    ) -> Optional[torch.Tensor]:
        """The held weight gradient (its float32 parts) times the upstream ``scale`` (0-dim float32;
        ``None``: 1), rounded once into ``dtype``; ``None`` without parts. With ``narrow_in_place``
        it is written into the parts' own memory, which it then occupies (eager autograd);
        otherwise into new memory (a custom operator may not return its inputs' memory)."""
        if not held_weight:
            return None
        (first, *rest), hidden_size = held_weight, held_weight[0].shape[1]
        shape = (sum(part.shape[0] for part in held_weight), hidden_size)
        if not rest:  # float32: the held part is the result
            return self.scaled_copy(first, scale, first if narrow_in_place else torch.empty_like(first))
        if narrow_in_place:
            out = torch.empty(0, dtype=dtype, device=first.device)
            out.set_(first.untyped_storage(), 0, shape, (hidden_size, 1))
        else:
            out = first.new_empty(shape, dtype=dtype)
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
        return out
