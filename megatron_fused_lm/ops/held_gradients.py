"""A loss-in-forward pass's gradients, held in float32 from the forward until the backward scales
them by the upstream gradient and rounds each once (``docs/DESIGN.md``, "Precision"), and the
chosen token's gradient term, which both backends add here in float32.

Each step that has a Triton kernel takes it for CUDA tensors where Triton can run
(``triton_runs``) and otherwise runs the torch code beside it, which computes the same.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .contract import Gradients, token_chunks
from .products import add_product
from .triton_support import triton_unavailable_reason

NARROWING_ROWS = 4096  # rows per step when the float32 weight gradient is narrowed in place


def triton_runs(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels take these tensors: CUDA, Triton installed, unit last strides."""
    return all(
        triton_unavailable_reason(tensor.device) is None and (tensor.dim() == 0 or tensor.stride(-1) == 1)
        for tensor in tensors
    )


def scaled_copy(source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = source * scale`` (``scale`` a 0-dim float32 tensor, or ``None``: 1), computed in
    float32 and rounded once into ``out``'s dtype; ``out`` may be ``source``. Returns ``out``.
    The kernel reads the scale on the device: ``mul`` by a 0-dim CUDA tensor broadcasts it as an
    operand, which leaves PyTorch's vectorized elementwise path."""
    if scale is None:
        return out.copy_(source)
    if source.is_contiguous() and out.is_contiguous() and triton_runs(source):
        from .kernels.scale_kernel import scale_into

        scale_into(source, scale, out)
        return out
    return torch.mul(source, scale, out=out)


def finish_hidden_rows(
    product: torch.Tensor,
    factor: Optional[torch.Tensor],
    chosen: torch.Tensor,
    target_column: torch.Tensor,
    weight: torch.Tensor,
) -> None:
    """``product [k, H]`` (float32) becomes ``factor * product + chosen * weight[target_column]``,
    the chosen tokens' term added where ``target_column >= 0``; ``factor``, ``chosen`` ``[k]``
    float32 (``factor`` ``None``: 1)."""
    if triton_runs(product, weight):
        from .kernels.chosen_token_kernel import finish_hidden_grad

        finish_hidden_grad(product, factor, chosen, target_column, weight, product)
        return
    if factor is not None:
        product.mul_(factor.unsqueeze(1))
    coefficient = torch.where(target_column >= 0, chosen, 0.0).unsqueeze(1)
    product.addcmul_(coefficient, weight[target_column.clamp(min=0)].float())


class WeightAccumulator:
    """``grad_weight [V, H]`` summed over token chunks in float32 (``parts``: ``(first_row, [R, H])``
    pieces), returned in the weight's dtype by ``result``. For a 16-bit weight the accumulator is
    two halves, so that the result can be narrowed into the first half's memory."""

    def __init__(self, weight: torch.Tensor):
        self.dtype, self.shape = weight.dtype, weight.shape
        vocab = weight.shape[0]
        middle = vocab if weight.dtype == torch.float32 else -(-vocab // 2)
        self.parts = [
            (start, weight.new_empty(stop - start, weight.shape[1], dtype=torch.float32))
            for start, stop in ((0, middle), (middle, vocab))
            if stop > start
        ]
        self.added = False

    def add(self, logit_grads: torch.Tensor, hidden: torch.Tensor) -> None:
        """Add ``logit_grads.T @ hidden`` for one token chunk (``logit_grads [rows, V]``, ``hidden
        [rows, H]``, one dtype)."""
        for start, part in self.parts:
            add_product(part, logit_grads[:, start : start + part.shape[0]].t(), hidden, accumulate=self.added)
        self.added = True

    def add_rows(self, target_column: torch.Tensor, chosen: torch.Tensor, hidden: torch.Tensor) -> None:
        """Add ``chosen[t] * hidden[t]`` to row ``target_column[t]`` for every token ``t`` with
        ``target_column[t] >= 0``, after this chunk's ``add``, summed per row in float32 in a fixed
        order (deterministic); ``chosen [n]`` float32, ``hidden [n, H]``."""
        if triton_runs(hidden, *(part for _, part in self.parts)):
            from .kernels.chosen_token_kernel import add_chosen_rows

            add_chosen_rows(self.parts, target_column, chosen, hidden)
            return
        values = chosen.unsqueeze(1) * hidden.float()
        # Tokens outside a part write zeros to distinct rows, so that none piles onto one row.
        spare = torch.arange(target_column.shape[0], device=hidden.device)
        for start, part in self.parts:
            inside = (target_column >= start) & (target_column < start + part.shape[0])
            rows = torch.where(inside, target_column - start, spare % part.shape[0])
            part.index_put_((rows,), torch.where(inside.unsqueeze(1), values, 0.0), accumulate=True)

    def result(self, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gradient times ``scale`` (0-dim float32; ``None``: 1) in the weight's dtype, rounded
        once; zeros when nothing was added. The accumulator is consumed."""
        parts, self.parts = self.parts, []
        if not self.added:
            return torch.zeros(self.shape, dtype=self.dtype, device=parts[0][1].device)
        (_, first), *rest = parts
        if not rest:  # float32: the accumulator is the result
            return scaled_copy(first, scale, first)
        ((second_start, second),) = rest
        out = torch.empty(0, dtype=self.dtype, device=first.device)
        out.set_(first.untyped_storage(), 0, self.shape, (self.shape[1], 1))
        # Narrowed row r lands in bytes [2rH, 2(r+1)H) of the first half, below the float32 rows not
        # yet read (>= 4rH): each step reads its rows into a temporary before writing them.
        for rows in token_chunks(first.shape[0], NARROWING_ROWS):
            out[rows] = scaled_copy(first[rows], scale, out.new_empty(first[rows].shape))
        for rows in token_chunks(second.shape[0], NARROWING_ROWS):  # onto float32 rows read above
            out[second_start + rows.start : second_start + rows.stop] = scaled_copy(
                second[rows], scale, out.new_empty(second[rows].shape)
            )
        return out


class HeldGradients(NamedTuple):
    """What the loss path keeps for its backward (``None``: not asked for); ``contract.HeldGradients``."""

    hidden: Optional[torch.Tensor]  # [n, H] float32: this shard's partial hidden gradient
    weight: Optional[WeightAccumulator]
    hidden_dtype: torch.dtype

    @classmethod
    def allocate(cls, hidden: torch.Tensor, weight: torch.Tensor, needed) -> HeldGradients:
        """Empty float32 holders for the gradients ``needed`` asks for."""
        return cls(
            hidden.new_empty(hidden.shape, dtype=torch.float32) if needed.hidden else None,
            WeightAccumulator(weight) if needed.weight else None,
            hidden.dtype,
        )

    def add_chosen(
        self,
        rows: slice,
        target_column: torch.Tensor,
        chosen: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        factor: Optional[torch.Tensor] = None,
    ) -> None:
        """Finish a chunk's rows: the hidden gradient's product (already in ``self.hidden[rows]``)
        times ``factor`` plus ``chosen * weight[target_column]``, and ``chosen * hidden`` added to
        the weight gradient's chosen rows. ``hidden`` are the chunk's rows."""
        if self.hidden is not None:
            finish_hidden_rows(self.hidden[rows], factor, chosen, target_column, weight)
        if self.weight is not None:
            self.weight.add_rows(target_column, chosen, hidden)

    def scaled(self, scale: torch.Tensor) -> Gradients:
        """Both gradients times the upstream ``scale`` (0-dim float32), each rounded once into its
        parameter's dtype (``contract.Gradients``); the held tensors are consumed."""
        hidden = None
        if self.hidden is not None:
            hidden = scaled_copy(self.hidden, scale, torch.empty_like(self.hidden, dtype=self.hidden_dtype))
        return Gradients(hidden, None if self.weight is None else self.weight.result(scale))
