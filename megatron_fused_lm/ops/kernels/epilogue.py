"""Triton functions the kernels share: the walk over output tiles and hidden steps (and the walk
along a vocabulary split, which gives every launch over the splits the same logits tiles), the
rows' temperatures and kept columns, the per-row inputs of a gradient epilogue, and the logits'
gradient itself (``softmax.logit_grad``, compiled from the same source the torch code runs)."""

import types

import triton
import triton.language as tl

from ..softmax import logit_grad

# softmax.logit_grad's own code, with this module's globals (Triton looks for triton.language there).
logit_grad_tile = triton.jit(types.FunctionType(logit_grad.__code__, globals(), logit_grad.__name__))


@triton.jit
def grouped_tile(index, num_row_tiles, num_columns, GROUP_M: tl.constexpr):
    """``(row tile, column)`` of the ``index``-th program or tile, walking ``GROUP_M`` row tiles
    across all ``num_columns`` columns (column tiles or vocabulary splits) before the next group,
    so that the hidden rows and weight rows they share stay in L2."""
    per_group = GROUP_M * num_columns
    first_row_tile = (index // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_row_tiles - first_row_tile, GROUP_M)
    within = index % per_group
    return first_row_tile + within % rows_in_group, within // rows_in_group


@triton.jit
def next_k_step(k_step, k_steps):
    """The hidden step after ``k_step`` in a flat loop over (tile, hidden step): 0 starts a tile.
    The counters advance at the top of the loop, so the next tile's loads stay in flight during a
    tile's epilogue."""
    return tl.where(k_step == k_steps - 1, 0, k_step + 1)


@triton.jit
def product_step(hidden_desc, weight_desc, row0, col0, k_step, acc, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc`` plus one hidden step of the tile ``hidden[row0:] @ weight[col0:].T`` (float32
    accumulator; the descriptors read zeros past the edges)."""
    hidden_tile = hidden_desc.load([row0, k_step * BLOCK_K])
    weight_tile = weight_desc.load([col0, k_step * BLOCK_K])
    return tl.dot(hidden_tile, weight_tile.T, acc, input_precision=DOT_PRECISION)


@triton.jit
def split_walk(
    num_tokens,
    vocab,
    hidden_size,
    tiles_per_split,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Where this program of a launch over (token tile, vocabulary split) starts: ``(row0, split,
    col0, k_step, k_steps, num_steps)``, its token tile's first row and its split of
    ``tiles_per_split`` column tiles (``grouped_tile`` order), ``split_step``'s state before the
    first step (``col0`` a tile before the split's first, ``k_step`` a tile's last hidden step), the
    hidden steps per tile, and the steps of its flat loop over (column tile, hidden step)."""
    num_row_tiles = tl.cdiv(num_tokens, BLOCK_M)
    row_tile, split = grouped_tile(tl.program_id(0), num_row_tiles, num_splits, GROUP_M)
    first_col_tile = split * tiles_per_split
    num_col_tiles = tl.minimum(tl.cdiv(vocab, BLOCK_N) - first_col_tile, tiles_per_split)
    k_steps = tl.cdiv(hidden_size, BLOCK_K)
    return row_tile * BLOCK_M, split, (first_col_tile - 1) * BLOCK_N, k_steps - 1, k_steps, num_col_tiles * k_steps


@triton.jit
def split_step(
    hidden_desc,
    weight_desc,
    row0,
    col0,
    k_step,
    k_steps,
    acc,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``(col0, k_step, acc)`` after the next step of a program's walk along its split (``split_walk``):
    the next hidden step (0: the next column tile, ``col0`` advanced) added into ``acc``. The tile
    ``[row0:, col0:]`` is finished where ``k_step == k_steps - 1``."""
    k_step = next_k_step(k_step, k_steps)
    if k_step == 0:
        col0 += BLOCK_N
    return (
        col0,
        k_step,
        product_step(
            hidden_desc,
            weight_desc,
            row0=row0,
            col0=col0,
            k_step=k_step,
            acc=acc,
            BLOCK_K=BLOCK_K,
            DOT_PRECISION=DOT_PRECISION,
        ),
    )


def softcap_arguments(softcap) -> tuple:
    """The launch arguments ``capped_tanh`` reads: the cap (1.0 standing in for none) and whether
    there is one, a compile-time flag, so a head without a cap runs the kernels it always ran."""
    return (1.0 if softcap is None else softcap), dict(HAS_SOFTCAP=softcap is not None)


@triton.jit
def capped_tanh(acc, softcap):
    """``tanh(acc / softcap)`` in float32 as ``1 - 2 / (exp(2 acc / softcap) + 1)``, which saturates
    to +-1 where the exponential overflows or vanishes (no NaN); the softcapped logit is ``softcap``
    times it (``softmax.softcapped``), its slope ``1 - tanh^2`` (``softmax.product_grad``)."""
    return 1.0 - 2.0 / (tl.exp(acc * (2.0 / softcap)) + 1.0)


@triton.jit
def capped_slope(logits, softcap, inv_temperature):
    """The cap's slope ``1 - tanh^2`` at logits ``z`` already divided by the temperature, the tanh
    read back as ``z T / softcap`` and clamped to [-1, 1] (``softmax.product_grad``); by one
    reciprocal per row, not a division per element (the special-function unit the exponentials use)."""
    tanh = tl.minimum(tl.maximum(logits * (1.0 / (softcap * inv_temperature)), -1.0), 1.0)
    return 1.0 - tanh * tanh


@triton.jit
def capped_products(acc, softcap, HAS_SOFTCAP: tl.constexpr):
    """The products ``acc`` softcapped (``softcap * tanh(acc / softcap)``), or as they are."""
    if HAS_SOFTCAP:
        acc = softcap * capped_tanh(acc, softcap)
    return acc


@triton.jit
def split_logits(
    acc,
    inv_temperature,
    softcap,
    vocab,
    col0,
    rows,
    row_valid,
    kept_ptr,
    stride_kept_row,
    kept_words,
    HAS_KEPT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``(logits, col_valid)`` of a finished tile ``acc [BLOCK_M, BLOCK_N]`` of a split's walk: the
    float32 logits (``capped_products``) divided by the temperature, -inf on the columns past ``vocab`` and those the
    rows do not keep (``kept_tile``), which ``col_valid`` (bool, ``[1 or BLOCK_M, BLOCK_N]``) names.
    Every launch over the splits computes its logits here, so those of one tile are the same bits
    in all of them."""
    # Offsets within the tile against scalars: no per-element column indices (registers).
    col_valid = (tl.arange(0, BLOCK_N) < vocab - col0)[None, :]
    if HAS_KEPT:
        col_valid = col_valid & kept_tile(
            kept_ptr,
            stride_kept_row,
            kept_words=kept_words,
            rows=rows,
            row_valid=row_valid,
            first_col=col0,
            BLOCK_N=BLOCK_N,
        )
    return tl.where(col_valid, capped_products(acc, softcap, HAS_SOFTCAP) * inv_temperature, float("-inf")), col_valid


def temperature_arguments(temperature) -> tuple:
    """The launch arguments ``inverse_temperature`` reads: the rows' temperatures ``[n]`` (float32)
    and whether every row shares one, which the ops give as a stride-0 tensor for a number: the
    kernels then scale by one scalar, not by a per-row vector beside the accumulator (what that
    costs: docs/benchmarks/features.md, temperature)."""
    uniform = temperature.stride(0) == 0 or temperature.numel() <= 1
    return (temperature if uniform else temperature.contiguous()), dict(UNIFORM_TEMPERATURE=uniform)


@triton.jit
def inverse_temperature(temperature_ptr, rows, row_valid, UNIFORM_TEMPERATURE: tl.constexpr):
    """``1 / temperature`` to multiply a ``[BLOCK_M, BLOCK_N]`` tile of the ``rows``' logits by: a
    scalar when every row shares it, else ``[BLOCK_M, 1]``."""
    if UNIFORM_TEMPERATURE:
        inverse = 1.0 / tl.load(temperature_ptr)
    else:
        inverse = (1.0 / tl.load(temperature_ptr + rows, mask=row_valid, other=1.0))[:, None]
    return inverse


def kept_arguments(kept_mask) -> tuple[tuple, dict]:
    """The launch arguments ``kept_tile`` reads: the ``kept_mask`` (``kept_tokens`` gives the form),
    its row stride and words per row, and whether it restricts the columns (``[0]``: it does not)."""
    has_kept = kept_mask.dim() == 2
    pointers = (kept_mask, kept_mask.stride(0) if has_kept else 0, kept_mask.shape[1] if has_kept else 0)
    return pointers, dict(HAS_KEPT=has_kept)


@triton.jit
def kept_tile(kept_ptr, stride_kept_row, kept_words, rows, row_valid, first_col, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` bool: which of the columns ``first_col + [0, BLOCK_N)`` (``first_col``
    a multiple of 32) each of the ``rows`` keeps (its bit in the row's mask words; the words past the
    shard read as none). The tile's ``BLOCK_N / 32`` words per row are loaded as one small tile and
    spread over the columns in registers, faster than a load per element (docs/benchmarks/constants.md,
    kept-token masks). The spread is a ``tl.gather`` on 16-bit tiles
    (128 columns or more), a reshape of the words' bits on the 64-column float32 tiles, for which
    Triton 3.6 cannot compile the gather (``TritonGPUOptimizeThreadLocality`` fails)."""
    tl.static_assert(BLOCK_N % 32 == 0, "a tile's columns must be whole mask words")
    WORDS: tl.constexpr = BLOCK_N // 32
    word = (first_col >> 5) + tl.arange(0, WORDS)
    where = kept_ptr + rows.to(tl.int64)[:, None] * stride_kept_row + word[None, :]
    words = tl.load(where, mask=row_valid[:, None] & (word < kept_words)[None, :], other=0)
    if BLOCK_N >= 128:
        columns = tl.arange(0, BLOCK_N)
        spread = tl.gather(words, tl.broadcast_to((columns >> 5)[None, :], [rows.shape[0], BLOCK_N]), axis=1)
        kept = ((spread >> (columns & 31)[None, :]) & 1) != 0
    else:
        bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
        kept = tl.reshape(bits.to(tl.int8), [rows.shape[0], BLOCK_N]) != 0
    return kept


def row_upstream_arguments(target_column, saved, upstream) -> tuple[tuple, dict]:
    """The launch arguments ``row_upstream`` reads: its five pointers (the ``[n]`` tensors, or
    ``[n, k]`` contiguous target columns and log-prob gradients for several targets per row; an
    absent upstream term points at ``saved.lse``, never read) and its three flags."""
    grad_logprob, grad_entropy = upstream
    pointers = (
        target_column,
        saved.lse,
        saved.mean_logit,
        saved.lse if grad_logprob is None else grad_logprob,
        saved.lse if grad_entropy is None else grad_entropy,
    )
    num_targets = 1 if target_column.dim() == 1 else target_column.shape[1]
    flags = dict(HAS_GRAD_LOGPROB=grad_logprob is not None, HAS_GRAD_ENTROPY=grad_entropy is not None)
    return pointers, dict(flags, NUM_TARGETS=num_targets)


@triton.jit
def row_upstream(
    rows,
    row_valid,
    target_column_ptr,
    lse_ptr,
    mean_logit_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
):
    """``(target_column, lse, mean_logit, grad_logprob, grad_entropy)`` of the rows (``[BLOCK_M]``;
    -1: the target is another shard's). The pointers of a term that is off are never read: its
    values are stand-ins that ``logit_grad_tile`` ignores. Several targets per row
    (``NUM_TARGETS > 1``): no single target (-1), and the log-prob gradients' row sum, which the
    shared term takes; ``add_targets`` adds each target's own."""
    if NUM_TARGETS == 1:
        target_column = tl.load(target_column_ptr + rows, mask=row_valid, other=-1)
    else:
        target_column = tl.zeros_like(rows).to(tl.int64) - 1
    lse = tl.load(lse_ptr + rows, mask=row_valid, other=0.0)
    mean_logit = lse
    grad_entropy = lse
    if HAS_GRAD_ENTROPY:
        mean_logit = tl.load(mean_logit_ptr + rows, mask=row_valid, other=0.0)
        grad_entropy = tl.load(grad_entropy_ptr + rows, mask=row_valid, other=0.0)
    grad_logprob = lse
    if HAS_GRAD_LOGPROB:
        first = rows.to(tl.int64) * NUM_TARGETS
        grad_logprob = tl.load(grad_logprob_ptr + first, mask=row_valid, other=0.0)
        for target in tl.static_range(1, NUM_TARGETS):
            grad_logprob += tl.load(grad_logprob_ptr + first + target, mask=row_valid, other=0.0)
    return target_column, lse, mean_logit, grad_logprob, grad_entropy


@triton.jit
def add_targets(
    grad,
    rows,
    row_valid,
    first_col,
    target_column_ptr,
    grad_logprob_ptr,
    NUM_TARGETS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``grad [BLOCK_M, BLOCK_N]`` (the tile whose first column is the shard's ``first_col``) plus
    each of the rows' ``NUM_TARGETS`` targets' ``+g_lp`` where the tile holds the target (a repeated
    id adds once per entry), in float32 before the tile is rounded. Unrolled: ``k`` selects per
    tile, and each ``k`` compiles its own kernel."""
    for target in tl.static_range(NUM_TARGETS):
        where = rows.to(tl.int64) * NUM_TARGETS + target
        column = tl.load(target_column_ptr + where, mask=row_valid, other=-1)
        upstream = tl.load(grad_logprob_ptr + where, mask=row_valid, other=0.0)
        # Offsets within the tile against per-row scalars: no per-element column indices.
        is_target = tl.arange(0, BLOCK_N)[None, :] == (column - first_col)[:, None]
        grad = tl.where(is_target, grad + upstream[:, None], grad)
    return grad


@triton.jit
def zero_targets(grad, rows, row_valid, first_col, target_column_ptr, NUM_TARGETS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``grad [BLOCK_M, BLOCK_N]`` (the tile whose first column is ``first_col``) with each of the
    rows' ``NUM_TARGETS`` targets' elements 0: the loss-in-forward path adds their whole terms in
    float32 (``softmax.chosen_logit_grad``)."""
    for target in tl.static_range(NUM_TARGETS):
        column = tl.load(target_column_ptr + rows.to(tl.int64) * NUM_TARGETS + target, mask=row_valid, other=-1)
        grad = tl.where(tl.arange(0, BLOCK_N)[None, :] == (column - first_col)[:, None], 0.0, grad)
    return grad
