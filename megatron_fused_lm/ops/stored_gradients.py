"""The loss path's gradients, kept in float32 from the forward until the backward.

``fused_linear_loss`` finishes its gradients in the forward, before the upstream gradient is
known: the scale that Megatron's schedule (one over the number of micro-batches) or a loss
normalization puts on the loss. Rounded to the parameters' 16-bit dtype in the forward and
multiplied by that scale in the backward, each gradient would be rounded twice (measured on an
H100 with a scale of 0.37: up to 1.3x the recompute path's error against float64). Kept in
float32, each is scaled and rounded once, in the backward (``StoredGradients.scaled``).

Memory: the weight gradient's float32 accumulator exists anyway when the rows come in several
chunks; for a 16-bit weight it is two halves, and the result is narrowed into the first half's
memory, so the peak is the accumulator alone. Between forward and backward the path holds the
float32 hidden gradient ``[n, H]`` and weight accumulator ``[V, H]``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .chunking import token_chunks
from .contract import Gradients
from .products import add_product

NARROWING_ROWS = 4096  # rows per step when the float32 weight gradient is narrowed in place


def scaled_copy(source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = source * scale`` (``scale`` a 0-dim float32 tensor, or ``None``: 1), computed in
    float32 and rounded once into ``out``'s dtype; ``out`` may be ``source``. Returns ``out``.

    Contiguous CUDA tensors take a Triton kernel where Triton can run: ``mul`` by a 0-dim CUDA
    tensor reads it as a broadcast operand, which turns off PyTorch's vectorized elementwise path
    (4 ms instead of about 1 for a 151936 x 4096 weight gradient on an H100)."""
    from .backends import triton_unavailable_reason  # here: backends imports the backends, which import this

    if scale is None:
        return out.copy_(source)
    if source.is_contiguous() and out.is_contiguous() and triton_unavailable_reason(source.device) is None:
        from .triton_kernels.scale_kernel import scale_into

        scale_into(source, scale, out)
        return out
    return torch.mul(source, scale, out=out)


def take_chosen(block: torch.Tensor, target_column: torch.Tensor) -> torch.Tensor:
    """Zero the chosen token's element of each row of ``block [n, v]`` whose target this shard owns
    (``target_column [n]`` int64; -1: another shard's) and return those elements, float32 ``[n]``
    (0 elsewhere), for the caller to add in float32.

    That element carries the row's largest gradient term. Rounded with the rest of the block into
    a 16-bit operand, it gives every row of a uniformly weighted loss the same relative error, and
    rounded again where it meets a 16-bit result it cost 1.3x the recompute path's gradient error
    (measured on an H100); kept out, 1.03x. One element per row: the scatter is deterministic."""
    owned = (target_column >= 0).unsqueeze(1)
    column = target_column.clamp(min=0).unsqueeze(1)
    chosen = block.gather(1, column)
    block.scatter_(1, column, torch.where(owned, 0.0, chosen).to(block.dtype))
    return torch.where(owned, chosen.float(), 0.0).squeeze(1)


class WeightAccumulator:
    """``grad_weight [V, H]`` summed over token chunks in float32 (``parts``: ``(first_row, [R, H])``
    pieces), returned in the weight's dtype by ``result``."""

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

    def add_rows(self, target_column: torch.Tensor, coefficient: torch.Tensor, hidden: torch.Tensor) -> None:
        """Add ``coefficient[t] * hidden[t]`` to row ``target_column[t]`` for every token ``t`` with
        ``target_column[t] >= 0``, in float32, after this chunk's ``add``; ``coefficient [n]`` float32,
        ``hidden [n, H]``. ``index_put_`` sums the tokens that share a row in a fixed order:
        deterministic. (The Triton backend does the same with ``chosen_token_kernel.add_chosen_rows``
        on ``parts``.)"""
        values = coefficient.unsqueeze(1) * hidden.float()
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


class StoredGradients(NamedTuple):
    """What the loss path keeps for its backward (``None``: not asked for)."""

    hidden: Optional[torch.Tensor]  # [n, H] float32: this shard's partial hidden gradient
    weight: Optional[WeightAccumulator]
    hidden_dtype: torch.dtype

    def scaled(self, scale: torch.Tensor) -> Gradients:
        """Both gradients times the upstream ``scale`` (0-dim float32), each rounded once into its
        parameter's dtype (``contract.Gradients``); the stored tensors are consumed."""
        hidden = None
        if self.hidden is not None:
            hidden = scaled_copy(self.hidden, scale, torch.empty_like(self.hidden, dtype=self.hidden_dtype))
        return Gradients(hidden, None if self.weight is None else self.weight.result(scale))
