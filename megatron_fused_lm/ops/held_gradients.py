"""A loss-in-forward pass's gradients, held in float32 from the forward until the backward scales
them by the upstream gradient and rounds each once (``docs/DESIGN.md``, "Precision"), and the
chosen token's gradient term, which both backends add here in float32.

The weight gradient is held as float32 row parts: one for a float32 weight; two halves for a
16-bit one, so that the rounded result fits in the first half's memory. Each step that has a
Triton kernel takes it for CUDA tensors where Triton can run (``triton_runs``) and otherwise runs
the torch code beside it, which computes the same.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .contract import Gradients, NeededGrads
from .products import add_product
from .triton_support import triton_unavailable_reason

NARROWING_ROWS = 4096  # rows of the first step when the float32 weight gradient is narrowed in place


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


def add_chosen_rows(
    held_weight: List[torch.Tensor], target_column: torch.Tensor, chosen: torch.Tensor, hidden: torch.Tensor
) -> None:
    """Add ``chosen[t] * hidden[t]`` to the weight gradient's row ``target_column[t]`` for every token
    with ``target_column[t] >= 0``, summed per row in float32 in a fixed order (deterministic);
    ``chosen [n]`` float32, ``hidden [n, H]``."""
    if triton_runs(hidden, *held_weight):
        from .kernels.chosen_token_kernel import add_chosen_rows as add_chosen_rows_kernel

        add_chosen_rows_kernel(held_weight, target_column, chosen, hidden)
        return
    values = chosen.unsqueeze(1) * hidden.float()
    # Tokens outside a part write zeros to distinct rows, so that none piles onto one row.
    spare = torch.arange(target_column.shape[0], device=hidden.device)
    start = 0
    for part in held_weight:
        inside = (target_column >= start) & (target_column < start + part.shape[0])
        rows = torch.where(inside, target_column - start, spare % part.shape[0])
        part.index_put_((rows,), torch.where(inside.unsqueeze(1), values, 0.0), accumulate=True)
        start += part.shape[0]


def add_chosen(
    held_hidden: torch.Tensor,
    held_weight: List[torch.Tensor],
    rows: slice,
    target_column: torch.Tensor,
    chosen: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    factor: Optional[torch.Tensor] = None,
) -> None:
    """Finish a chunk's rows: the hidden gradient's product (already in ``held_hidden[rows]``) times
    ``factor`` plus ``chosen * weight[target_column]``, and ``chosen * hidden`` added to the weight
    gradient's chosen rows. ``hidden`` are the chunk's rows."""
    if held_hidden.dim() == 2:
        finish_hidden_rows(held_hidden[rows], factor, chosen, target_column, weight)
    if held_weight:
        add_chosen_rows(held_weight, target_column, chosen, hidden)


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


def scaled_gradients(
    held_hidden: torch.Tensor,
    held_weight: List[torch.Tensor],
    scale: Optional[torch.Tensor],
    hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    narrow_in_place: bool,
) -> Gradients:
    """Both held gradients times the upstream ``scale`` (0-dim float32; ``None``: 1), each rounded once into its
    parameter's dtype (``None`` where not held). With ``narrow_in_place`` the weight gradient is
    written into the held parts' own memory, which it then occupies (eager autograd); otherwise
    into new memory (a custom operator may not return its inputs' memory)."""
    hidden = None
    if held_hidden.dim() == 2:
        hidden = scaled_copy(held_hidden, scale, torch.empty_like(held_hidden, dtype=hidden_dtype))
    if not held_weight:
        return Gradients(hidden, None)
    (first, *rest), hidden_size = held_weight, held_weight[0].shape[1]
    shape = (sum(part.shape[0] for part in held_weight), hidden_size)
    if not rest:  # float32: the held part is the result
        return Gradients(hidden, scaled_copy(first, scale, first if narrow_in_place else torch.empty_like(first)))
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
                target.copy_(scaled_copy(part[rows], scale, target.new_empty(target.shape)))
            else:
                scaled_copy(part[rows], scale, target)
        start += part.shape[0]
    return Gradients(hidden, out)
