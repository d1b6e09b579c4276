"""The Triton backend's kernels under the Triton interpreter (``TRITON_INTERPRET=1``) on the CPU,
against the float64 oracle.

The interpreter is chosen when Triton first loads, so the cases run in one subprocess with it on:
this file, run as a script that takes one case per line as JSON and answers each with a line (a
process per case spent most of its time importing torch and Triton). The backend is built here with small tiles (the CUDA tiles
would take minutes to interpret), two vocabulary splits and a two-program backward grid, so that
every case crosses several tiles, splits and programs. Each case runs the four-GEMM path
(statistics, then the recomputing backward) or the three-GEMM one (``loss_pass.chunks.run_loss_pass``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def held_gradient_kernels(case: dict) -> dict:
    """The Triton backend's small kernels against the torch code they replace: the scaled copy (one
    scale, one per row), the finished hidden rows (with and without a factor), the chosen rows added
    to a two-part float32 weight gradient (``TorchLoss``'s steps), the per-row terms
    (``softmax.chosen_logit_grad``, ``triton_loss.direct_factor``, the scaled hidden rows), the
    labels path's fit (``TorchLoss.fit_declared``), the rows' references and their stale check
    (``devkit.kernel_references``) and the summary (``softmax.summarize``): relative differences."""
    from functools import partial

    import torch

    from devkit.kernel_references import torch_row_references, torch_stale_references
    from devkit.oracle import relative_error
    from megatron_fused_lm.ops.backends import contract
    from megatron_fused_lm.ops.backends.contract import PROPORTIONAL_TOLERANCE, NeededGrads, UpstreamGrads
    from megatron_fused_lm.ops.backends.torch_loss import TorchLoss, add_chosen_terms
    from megatron_fused_lm.ops.backends.triton_loss import direct_factor
    from megatron_fused_lm.ops.backends.triton_reference import (
        EMPTY_REFERENCE,
        MAX_ABOVE_REFERENCE,
        MAX_BELOW_REFERENCE,
        REFERENCE_HEADROOM,
    )  # fmt: skip
    from megatron_fused_lm.ops.kernels.chosen_token_kernel import add_chosen_rows, finish_hidden_grad
    from megatron_fused_lm.ops.kernels.fit_kernel import fit_declared
    from megatron_fused_lm.ops.kernels.merge_kernel import StaleCheck, merge_parts, summarize_parts
    from megatron_fused_lm.ops.kernels.reference_kernel import row_references as kernel_row_references
    from megatron_fused_lm.ops.kernels.row_terms_kernel import row_terms
    from megatron_fused_lm.ops.kernels.scale_kernel import scale_into
    from megatron_fused_lm.ops.softmax import OUTSIDE_VOCAB, SoftmaxSummary, chosen_logit_grad, summarize

    torch.manual_seed(case["seed"])
    tokens, hidden_size, vocab = case["shape"]
    dtype = getattr(torch, case["dtype"])
    hidden, weight = torch.randn(tokens, hidden_size).to(dtype), torch.randn(vocab, hidden_size).to(dtype)
    # Repeated rows, rows of another shard (-1) and tokens whose term is 0 (skipped by the kernel).
    target_column = torch.randint(-1, 4, (tokens,))
    chosen = torch.randn(tokens) * (torch.rand(tokens) > 0.2)
    product, factor = torch.randn(tokens, hidden_size), torch.randn(tokens)
    errors, steps = {}, TorchLoss()
    for with_factor in (False, True):
        expected, actual = product.clone(), product.clone()
        add_chosen_terms(expected, target_column, chosen, weight, factor if with_factor else None)
        finish_hidden_grad(actual, factor if with_factor else None, chosen, target_column, weight, actual)
        errors[f"finish_hidden_factor_{with_factor}"] = relative_error(actual, expected)
    logit_grads = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected, actual = (contract.allocate_parts(hidden, weight, NeededGrads(False, True))[1] for _ in range(2))
    for parts in (expected, actual):
        contract.add_weight_product(parts, logit_grads, hidden, accumulate=False)
    steps.add_chosen_rows(expected, target_column, chosen, hidden)
    add_chosen_rows(actual, target_column, chosen, hidden)
    errors["chosen_rows"] = max(
        relative_error(actual_part, expected_part) for actual_part, expected_part in zip(actual, expected, strict=True)
    )
    for scale in (torch.tensor(0.37), torch.randn(tokens)):
        source, scaled = torch.randn(tokens, hidden_size), torch.empty(tokens, hidden_size, dtype=dtype)
        scale_into(source, scale, scaled)
        errors[f"scale_{scale.dim()}"] = relative_error(
            scaled, steps.scaled_copy(source, scale, torch.empty_like(scaled))
        )
    # The per-row terms, with a temperature per row: confident rows (log-probs near 0) and targets so
    # unlikely that exp(logprob) is subnormal in float32 among them.
    logprob = -torch.rand(tokens) * 3
    logprob[::4] = -torch.rand(tokens)[::4] * 1e-6
    logprob[1::4] = -torch.rand(tokens)[1::4] * 20 - 90
    summary = SoftmaxSummary(
        logprob, torch.rand(tokens), torch.randn(tokens) + 5, torch.randn(tokens), torch.randn(tokens)
    )
    upstream, temperature = UpstreamGrads(torch.randn(tokens), torch.randn(tokens)), torch.rand(tokens) + 0.5
    reference, weight_row_scale = summary.lse - torch.rand(tokens), torch.rand(tokens)
    operand, chosen_weight = torch.empty(tokens, hidden_size, dtype=dtype), torch.empty(tokens)
    kernel_chosen, kernel_factor = row_terms(
        target_column, summary, upstream, temperature, reference, weight_row_scale, hidden, operand, chosen_weight
    )
    torch_chosen = chosen_logit_grad(target_column, summary, *upstream) / temperature
    torch_factor = direct_factor(reference, summary.lse, upstream.logprob, temperature)
    errors["row_chosen"] = relative_error(kernel_chosen, torch_chosen)
    errors["row_factor"] = relative_error(kernel_factor, torch_factor)
    errors["row_chosen_weight"] = relative_error(chosen_weight, torch_chosen * weight_row_scale)
    errors["row_operand"] = relative_error(operand, (hidden * (torch_factor * weight_row_scale)[:, None]).to(dtype))
    # The fit: an upstream proportional to the declared weights but for one row, one that is, one
    # orthogonal to them (the fit falls back to 1) and zeros (0); the correction against the
    # upstream's size over the scale (the difference is rounding there), none for zeros (0 / 0,
    # behind a closed gate).
    declared = (torch.rand(tokens) > 0.3).float()
    fits = {
        "off": 0.3 * declared + (torch.arange(tokens) == 2), "on": 0.3 * declared,
        "orthogonal": (1 - declared) * torch.randn(tokens), "zero": torch.zeros(tokens),
    }  # fmt: skip
    for name, upstream_grad in fits.items():
        for assumed in (None, 0.25):
            (scale, correction, ran), (torch_scale, torch_correction, torch_ran) = (
                fit(upstream_grad, declared, assumed) for fit in (partial(fit_declared, tolerance=PROPORTIONAL_TOLERANCE),
                                                                 steps.fit_declared)
            )  # fmt: skip
            errors[f"fit_{name}_{assumed}_scale"] = relative_error(scale, torch_scale)
            errors[f"fit_{name}_{assumed}_gate"] = float(ran != torch_ran)
            if name != "zero":
                size = upstream_grad.abs().max() / torch_scale.abs()
                errors[f"fit_{name}_{assumed}_correction"] = float((correction - torch_correction).abs().max() / size)
    # The references (a sample of 5 rows and the chosen token) and their stale check against maxima
    # far above, far below, inside the bounds and -inf (a shard keeping none of a row's columns).
    columns = torch.where(target_column >= 0, target_column, -1)
    kernel_reference = kernel_row_references(
        hidden, weight, columns, temperature, 5, REFERENCE_HEADROOM, torch.empty(tokens)
    )
    errors["reference"] = relative_error(
        kernel_reference, torch_row_references(hidden, weight, columns, temperature, 5)
    )
    # Under a cap of 2 (the products here reach about 10): the estimate capped before the temperature.
    capped_reference = kernel_row_references(
        hidden, weight, columns, temperature, 5, REFERENCE_HEADROOM, torch.empty(tokens), softcap=2.0
    )
    errors["capped_reference"] = relative_error(
        capped_reference, torch_row_references(hidden, weight, columns, temperature, 5, softcap=2.0)
    )
    local = torch.randn(2, tokens, 4).abs()
    local[..., 0] = kernel_reference + torch.tensor([-100.0, -20.0, 0.0, 50.0])[torch.arange(tokens) % 4]
    local[0, ::5, 0] = -torch.inf
    local[1, ::5, 0], local[1, ::5, 1] = -torch.inf, 0.0
    stale, refresh = kernel_reference.clone(), torch.empty(tokens, dtype=torch.int8)
    merged = merge_parts(local, StaleCheck(stale, refresh, MAX_ABOVE_REFERENCE, MAX_BELOW_REFERENCE, EMPTY_REFERENCE))
    expected_reference, expected_refresh = torch_stale_references(kernel_reference, merged[:, 0])
    errors["stale_reference"] = relative_error(stale, expected_reference)
    errors["stale_refresh"] = float((refresh != expected_refresh).sum())
    # The summary of two ranks' statistics (every row keeps columns in one at least), ids outside the vocabulary among them.
    local[1, ::5, 0], local[1, ::5, 1] = torch.randn(tokens)[::5], 1.0
    summary_columns = torch.where(torch.arange(tokens) % 7 == 0, OUTSIDE_VOCAB, columns)
    out = SoftmaxSummary(*(torch.empty(tokens) for _ in SoftmaxSummary._fields))
    summarize_parts(local[:, 1:].contiguous(), summary_columns[1:], SoftmaxSummary(*(field[1:] for field in out)))
    expected_summary = summarize(merge_parts(local[:, 1:].contiguous()), summary_columns[1:])
    for name, actual_field, expected_field in zip(SoftmaxSummary._fields, out, expected_summary, strict=True):
        errors[f"summary_{name}"] = relative_error(actual_field[1:], expected_field)
    return errors


def merge_kernel_case(case: dict) -> dict:
    """``merge_parts`` on the float32 statistics of uneven column blocks of float64 logits (one
    block empty), against the float64 statistics of the whole rows: the largest relative error of
    each statistic; and whether the first rows merged alone equal the same rows of the whole call."""
    import torch

    from megatron_fused_lm.ops.kernels.merge_kernel import merge_parts
    from megatron_fused_lm.ops.softmax import NUM_STATISTICS, block_statistics

    torch.manual_seed(case["seed"])
    tokens, vocab = case["tokens"], case["vocab"]
    logits = torch.randn(tokens, vocab, dtype=torch.float64) * 4
    logits[: tokens // 2, 7] += 30  # confident rows
    target_column = torch.randint(0, vocab, (tokens,))
    edges = [0, 1, 1, 40, vocab // 2, vocab]  # the block [1, 1) has no columns
    parts = torch.empty(len(edges) - 1, tokens, NUM_STATISTICS)
    for index, (start, stop) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        if start == stop:
            parts[index] = torch.tensor([float("-inf"), 0.0, 0.0, 0.0])
            continue
        inside = (target_column >= start) & (target_column < stop)
        parts[index] = block_statistics(logits[:, start:stop].float(), torch.where(inside, target_column - start, -1))
    merged = merge_parts(parts)
    expected = block_statistics(logits, target_column)
    errors = {
        name: float(((merged[:, column].double() - expected[:, column]).abs() / expected[:, column].abs().clamp(min=1)).max())
        for column, name in enumerate(("max", "sumexp", "sumexp_z", "target"))
    }  # fmt: skip
    errors["rows_alone_equal"] = all(
        torch.equal(merge_parts(parts[:, :count].contiguous()), merged[:count]) for count in (1, 3)
    )
    return errors


def finished_pass(backend, problem, chunk_step, options):
    """The package's loss-in-forward pass (``run_loss_pass``) over ``problem``, its held gradients
    finished for an upstream gradient of 1, as the backward finishes them: ``Gradients``."""
    import torch

    from megatron_fused_lm.ops.backends.contract import Gradients, NeededGrads, finish_weight
    from megatron_fused_lm.ops.loss_pass.chunks import run_loss_pass

    state = backend.allocate(problem, NeededGrads(hidden=True, weight=True), options)
    run_loss_pass(backend, problem, chunk_step, state, options, accumulate=False)
    dtype, one = problem.weight.dtype, torch.ones(())
    hidden = backend.scaled_copy(
        state.held_hidden, one, torch.empty_like(state.held_hidden, dtype=problem.hidden.dtype)
    )
    return Gradients(hidden, finish_weight(state.held_weight, one, dtype, True, backend.scaled_copy))


def several_targets_case(case: dict) -> dict:
    """The four-GEMM path's backend with ``k`` targets per row (``target_column [n, k]``, a repeated
    id among them), as ``fused_forward`` and ``fused_backward`` drive it, against the float64
    oracle of ``log_softmax(...).gather``: relative errors of the log-probs and both gradients; with
    ``softcap``, of the capped head."""
    import torch

    from devkit.oracle import capped, relative_error
    from megatron_fused_lm.ops.backends.contract import NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
    from megatron_fused_lm.ops.backends.triton import TritonBackend
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.kept_tokens import every_column
    from megatron_fused_lm.ops.kernels.tiles import Tiles
    from megatron_fused_lm.ops.options import HeadOptions
    from megatron_fused_lm.ops.several_targets import gathered_logits, statistics_column
    from megatron_fused_lm.ops.softmax import summarize

    tiles = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
    tuning = TritonTuning(forward_tiles=tiles, backward_tiles=tiles, tiles_per_split=2, programs=2,
                          dz_block_bytes=16 * 64 * 4)  # fmt: skip
    backend = TritonBackend(tuning)
    torch.manual_seed(case["seed"])
    tokens, hidden_size, vocab, k = case["shape"]
    dtype = getattr(torch, case["dtype"])
    hidden = (torch.randn(tokens, hidden_size) * case.get("hidden_scale", 2.0)).to(dtype)
    weight = (torch.randn(vocab, hidden_size) / hidden_size**0.5).to(dtype)
    softcap = case.get("softcap")
    ids = torch.randint(0, vocab, (tokens, k))
    ids[:, 1] = ids[:, 0]
    temperature = torch.rand(tokens) * 1.5 + 0.5
    grad_logprob, grad_entropy = torch.randn(tokens, k), torch.randn(tokens)
    if case.get("zero_entropy_grad"):
        grad_entropy = None
    problem = ShardProblem(hidden, weight, ids, temperature, every_column(hidden.device))
    options = HeadOptions(token_chunk=16, entropy_grad=grad_entropy is not None, softcap=softcap)
    if case.get("three_gemm"):  # the loss-in-forward pass, its chunk step reading the k logits
        logprob = torch.empty(tokens, k)

        def chunk_step(rows, local):
            target_logits = gathered_logits(hidden[rows], weight, ids[rows], temperature[rows], softcap)
            summary = summarize(local, statistics_column(ids[rows]), target_logits)
            logprob[rows] = summary.logprob
            upstream = UpstreamGrads(grad_logprob[rows], None if grad_entropy is None else grad_entropy[rows])
            return summary, upstream, None

        grads = finished_pass(backend, problem, chunk_step, options)
    else:
        stats = backend.local_statistics(problem._replace(target_column=statistics_column(ids)), options)
        summary = summarize(stats)
        logprob = summarize(stats, None, gathered_logits(hidden, weight, ids, temperature, softcap)).logprob
        grads = backend.local_gradients(
            problem, SavedStatistics(summary.lse, summary.mean_logit), UpstreamGrads(grad_logprob, grad_entropy),
            NeededGrads(hidden=True, weight=True), options,
        )  # fmt: skip
    leaves = [tensor.double().requires_grad_() for tensor in (hidden, weight)]
    log_probs = torch.log_softmax(capped(leaves[0] @ leaves[1].t(), softcap) / temperature.double()[:, None], dim=-1)
    exact, entropy = log_probs.gather(-1, ids), -(log_probs.exp() * log_probs).sum(-1)
    entropy_term = 0.0 if grad_entropy is None else (entropy * grad_entropy.double()).sum()
    ((exact * grad_logprob.double()).sum() + entropy_term).backward()
    return {
        "logprob": relative_error(logprob, exact.detach()),
        "grad_hidden": relative_error(grads.hidden, leaves[0].grad),
        "grad_weight": relative_error(grads.weight, leaves[1].grad),
    }


def kept_mask_builder_case(case: dict) -> dict:
    """The Triton ``kept_mask`` builder against the torch one (``kept_tokens.torch_kept_mask``) on
    sets with repeats, empty sets, ids of another shard and ``max_rows`` padding rows; and what each
    reports for malformed sets: ``{name: [triton's error, torch's error]}``, "" for none."""
    import torch

    from megatron_fused_lm.ops.kept_tokens import KeptSets, torch_kept_mask
    from megatron_fused_lm.ops.kernels.kept_mask_kernel import kept_mask

    torch.manual_seed(case["seed"])
    rows, vocab_shard, first_id = 9, 70, 70  # the second of two shards
    targets = torch.randint(0, 2 * vocab_shard, (rows,))
    counts = torch.randint(1, 600, (rows,))  # several steps of the kernel's loop
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    ids = torch.randint(0, 2 * vocab_shard, (int(offsets[-1]),))
    ids[offsets[:-1]] = targets
    # The first rows - 2 rows' sets; the last two rows are max_rows padding.
    valid = KeptSets(offsets[: rows - 1], ids[: int(offsets[rows - 2])], targets, rows - 2, first_id, 2 * vocab_shard)
    results = {"agree": [str(torch.equal(kept_mask(valid, vocab_shard), torch_kept_mask(valid, vocab_shard))), ""]}
    malformed = {
        "decreasing": valid._replace(offsets=valid.offsets.flip(0)),
        "short": valid._replace(token_ids=valid.token_ids[:-1]),
        "outside": valid._replace(token_ids=torch.where(valid.token_ids == valid.token_ids[-1], 999, valid.token_ids)),
        "left_out": valid._replace(targets=torch.where(torch.arange(rows) == 0, -5, valid.targets)),
    }
    for name, sets in malformed.items():
        errors = []
        for build in (kept_mask, torch_kept_mask):
            try:
                build(sets, vocab_shard)
                errors.append("")
            except ValueError as error:
                errors.append(str(error))
        results[name] = errors
    return results


def topk_case(case: dict) -> dict:
    """The Triton top-k's keys (``backends.triton_topk``: tile maxima, thresholds, candidates in
    split slots) as log-probs and ids against a float64 oracle, for each ``k`` of ``case["ks"]``,
    two chunks of rows (the first of two row tiles), 40 column tiles in 10 splits of 4. Row 0 holds 40 equal largest logits, 32
    of them in one column tile (more than a tile's picks); row 2 holds 12 equal ones, 3 in each
    tile of the last split (more than the split's slots: a write past them would land in row 3's
    first slot, where row 3 keeps its largest); both take the torch form, lower ids first. Row 1
    ties its largest logit across three tiles, the rest are random; ``k = 12`` exceeds a quarter of
    the column tiles (the torch form for every row). Float32 gives each row its own temperature.
    Row 5's hidden states are NaN: ``{k: [the other rows' ids equal, their max log-prob error over
    the largest |logit|]}``, and ``"nan"``: whether row 5 got ids in the vocabulary (not the keys'
    empty slots) for every ``k``."""
    import torch

    from devkit.oracle import capped
    from megatron_fused_lm.ops.backends.triton_topk import top_keys
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.kernels.tiles import Tiles
    from megatron_fused_lm.ops.softmax import softcapped, summarize
    from megatron_fused_lm.ops.top_keys import keyed_logits

    small = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
    tuning = TritonTuning(forward_tiles=small, tiles_per_split=4, programs=2)
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    tokens, hidden_size, vocab = case["shape"]
    # Integer hidden states and tied weight rows in eighths: every row's product with a tied row is
    # exact in float32 whatever the summation order (the interpreter's matmul rounds by column).
    hidden = (torch.randn(tokens, hidden_size) * 3).round()

    def tied(row):
        return (hidden[row] / hidden[row].norm() * 32).round() / 8

    weight = torch.randn(vocab, hidden_size) / hidden_size**0.5
    weight[64:104] = tied(0)  # 32 in the tile [64, 96), 8 in the next
    weight[[5, 200, 1100]] = tied(1)
    last_split = [first + offset for first in (1160, 1190, 1220, 1250) for offset in range(3)]
    weight[last_split] = tied(2)
    weight[[10, 11]] = tied(3)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if dtype == torch.float32:
        temperature = torch.rand(tokens) * 1.5 + 0.5
    else:
        temperature = torch.full((1,), 0.7).expand(tokens)
    softcap = case.get("softcap")
    exact_logits = capped(hidden.double() @ weight.double().t(), softcap) / temperature.double()[:, None]
    exact, scale = torch.log_softmax(exact_logits, -1), float(exact_logits.abs().max())
    order = torch.sort(exact, dim=1, descending=True, stable=True).indices  # equal: the lower id first

    def block_logits(index):
        return softcapped(hidden[index].float() @ weight.float().t(), softcap) / temperature[index, None]

    nan_row = 5
    hidden[nan_row] = float("nan")  # its neighbours' keys must not notice it
    others = torch.arange(tokens) != nan_row
    results, in_vocabulary = {}, True
    for k in case["ks"]:
        stats, keys = top_keys(hidden, weight, temperature, softcap, k, 0, block_logits, token_chunk=17, tuning=tuning)
        logits, ids = keyed_logits(keys)
        in_vocabulary &= bool(((ids[nan_row] >= 0) & (ids[nan_row] < vocab)).all())
        logprob = logits - summarize(stats).lse[:, None]
        results[k] = [
            bool((ids[others] == order[others, :k]).all()),
            float((logprob.double() - exact.gather(1, order[:, :k]))[others].abs().max()) / scale,
        ]
    results["nan"] = in_vocabulary
    return results


def candidates_case(case: dict) -> dict:
    """Top-k's candidates kernel (``kernels.topk_kernel``) against the statistics kernel's tile maxima
    (``split_statistics``' ``tile_maxima``), which must walk the same tiles: with each row's smallest
    tile maximum as its threshold and room for every logit at or above it, the candidates hold each
    tile's maximum. ``{temperature: [no slot overflowed and every column in the vocabulary, each
    tile's largest candidate the bits of its tile maximum, the largest |error| of the candidates'
    logits]}``, one temperature for all rows and one per row; the vocabulary ends inside a tile and
    a split."""
    import torch

    from megatron_fused_lm.ops.kernels.softmax_stats_kernel import split_statistics
    from megatron_fused_lm.ops.kernels.tiles import Tiles
    from megatron_fused_lm.ops.kernels.topk_kernel import collect_candidates

    tiles = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    tokens, hidden_size, vocab = case["shape"]
    hidden, weight = torch.randn(tokens, hidden_size).to(dtype), torch.randn(vocab, hidden_size).to(dtype)
    column_tiles, tiles_per_split = -(-vocab // tiles.block_n), 3
    num_splits, slots = -(-column_tiles // tiles_per_split), tiles_per_split * tiles.block_n
    no_targets, every_column = torch.full((tokens,), -1), torch.empty(0, dtype=torch.int32)
    results = {}
    for name, temperature in (("uniform", torch.full((1,), 0.7).expand(tokens)), ("per_row", torch.rand(tokens) + 0.5)):
        tile_maxima = torch.empty(tokens, column_tiles)
        split_statistics(
            hidden, weight, no_targets, temperature, every_column, tiles, tiles_per_split, tile_maxima=tile_maxima
        )
        threshold = tile_maxima.min(dim=1).values.contiguous()
        candidates = torch.empty(tokens, num_splits, slots)
        columns = torch.empty(tokens, num_splits, slots, dtype=torch.int32)
        count = collect_candidates(
            hidden, weight, temperature, tiles, tiles_per_split, threshold, candidates, columns, tiles.block_n
        )
        filled = torch.arange(slots) < count[:, :, None]
        values = torch.where(filled, candidates, float("-inf")).view(tokens, -1)
        columns = torch.where(filled, columns, 0).long().view(tokens, -1)
        by_tile = torch.full_like(tile_maxima, float("-inf")).scatter_reduce(
            1, columns // tiles.block_n, values, "amax"
        )
        logits = (hidden.double() @ weight.double().t()) / temperature.double()[:, None]
        results[name] = [
            bool((count <= slots).all() & (columns < vocab).all()),
            torch.equal(by_tile, tile_maxima),
            float(torch.where(filled.view(tokens, -1), logits.gather(1, columns) - values.double(), 0.0).abs().max()),
        ]
    return results


def corrections_case(case: dict) -> dict:
    """The three-GEMM ops through their public form on the Triton backend (the interpreter counts as
    a device Triton runs on), with upstream gradients the forward did not assume: the labels path's
    declared weights (as declared: the correcting pass's gate closed; another upstream: open), a
    weight gradient into an accumulator for another scale than it arrives with, on either path.
    Relative errors of the gradients against the float64 oracle."""
    import torch

    from devkit.oracle import reference, relative_error
    from megatron_fused_lm import fused_linear_cross_entropy, fused_linear_loss, losses
    from megatron_fused_lm.ops.backends.triton import TritonBackend
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.kernels.tiles import Tiles

    tiles = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
    backend = TritonBackend(
        TritonTuning(forward_tiles=tiles, backward_tiles=tiles, tiles_per_split=2, programs=2, stored_block_bytes=2**30)
    )
    torch.manual_seed(case["seed"])
    tokens, hidden_size, vocab = case["shape"]
    hidden, weight = torch.randn(tokens, hidden_size) * 2, torch.randn(vocab, hidden_size) / hidden_size**0.5
    targets = torch.randint(0, vocab, (tokens,))
    declared = (torch.rand(tokens) > 0.3).float()
    errors = {}

    def leaves():
        return hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    # A skipped micro-batch's zeros (the fit is 0: nothing to correct, no 0 / 0) and an upstream
    # orthogonal to the declaration (the fit is 0, the correction is all of it).
    upstreams = {
        "declared": 0.37 * declared, "other": torch.randn(tokens), "zero": torch.zeros(tokens),
        "orthogonal": (1 - declared) * torch.randn(tokens),
    }  # fmt: skip
    declared_size = reference(hidden, weight, targets, grad_logprob=-declared).grad_weight.abs().max()
    for name, upstream in upstreams.items():
        hidden_leaf, weight_leaf = leaves()
        per_token = fused_linear_cross_entropy(
            hidden_leaf, weight_leaf, targets, declared, backend=backend, token_chunk=16
        )
        (per_token * upstream).sum().backward()
        expected = reference(hidden, weight, targets, grad_logprob=-upstream)
        errors[f"labels_{name}_hidden"] = relative_error(hidden_leaf.grad, expected.grad_hidden)
        errors[f"labels_{name}_weight"] = relative_error(weight_leaf.grad, expected.grad_weight)
        accumulator = torch.zeros_like(weight)
        per_token = fused_linear_cross_entropy(
            *leaves(), targets, declared, backend=backend, token_chunk=16, weight_grad_into=accumulator,
            weight_grad_scale=1.0,
        )  # fmt: skip
        (per_token * upstream).sum().backward()
        # Into the accumulator the forward added the declared gradient and the correction takes it
        # back: within rounding of that gradient's size (a zero upstream's expected one has none).
        size = torch.maximum(expected.grad_weight.abs().max(), declared_size).double()
        errors[f"labels_{name}_into"] = float((accumulator.double() - expected.grad_weight.double()).abs().max() / size)
    upstream = torch.full((tokens,), 0.37 / tokens)
    accumulator = torch.zeros_like(weight)
    result = fused_linear_loss(
        *leaves(), targets, losses.cross_entropy, loss_inputs={"weight": torch.full((tokens,), 1.0 / tokens)},
        backend=backend, token_chunk=16, weight_grad_into=accumulator, weight_grad_scale=1.0,
    )  # fmt: skip
    (0.37 * result.loss).backward()
    errors["loss_other_scale_into"] = relative_error(
        accumulator, reference(hidden, weight, targets, grad_logprob=-upstream).grad_weight
    )
    return errors


def default_tuning_case(case: dict) -> dict:
    """The public ops with ``backend="triton"`` and no tuning, on CPU tensors, as a user debugging a
    kernel runs them: the rules that read the device's properties (multiprocessors, shared memory,
    memory) take the CPU for an H100. Log-prob, entropy and both gradients of the recompute op, and
    the three-GEMM loss's gradients, against the float64 oracle. With ``vocab_size``, over the
    weight's first rows only (the padded rows large, so that one leaking in shows), and the padded
    rows' gradients (``padded_weight_grad``: how many of their entries are not 0)."""
    import torch

    from devkit.oracle import max_abs_error, reference, relative_error
    from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, losses

    torch.manual_seed(case["seed"])
    tokens, hidden_size, vocab = case["shape"]
    vocab_size = case.get("vocab_size") or vocab
    hidden, weight = torch.randn(tokens, hidden_size) * 2, torch.randn(vocab, hidden_size) / hidden_size**0.5
    weight[vocab_size:] *= 20
    # Extreme logits: ``spread`` scales them; ``shift`` moves every one through a constant feature
    # that every weight row reads, so the products themselves carry it, as a model's would.
    hidden = hidden * case.get("spread", 1.0)
    if "shift" in case:
        hidden[:, -1], weight[:, -1] = case["shift"] / 10, 10.0
    targets = torch.randint(0, vocab_size, (tokens,))
    grad_logprob, grad_entropy = torch.randn(tokens), torch.randn(tokens)
    true = weight[:vocab_size]
    expected = reference(
        hidden, true, targets, grad_logprob=grad_logprob, grad_entropy=grad_entropy, softcap=case.get("softcap")
    )
    options = dict(backend="triton", vocab_size=case.get("vocab_size"), softcap=case.get("softcap"))
    hidden_leaf, weight_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprob, entropy = fused_linear_logprob(hidden_leaf, weight_leaf, targets, return_entropy=True, **options)
    (logprob * grad_logprob + entropy * grad_entropy).sum().backward()
    errors = {
        "logprob": max_abs_error(logprob, expected.logprob),
        "entropy": max_abs_error(entropy, expected.entropy),
        "hidden_grad": relative_error(hidden_leaf.grad, expected.grad_hidden),
        "weight_grad": relative_error(weight_leaf.grad[:vocab_size], expected.grad_weight),
        "padded_weight_grad": float(torch.count_nonzero(weight_leaf.grad[vocab_size:])),
    }
    hidden_leaf, weight_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    weights = torch.full((tokens,), 1.0 / tokens)
    result = fused_linear_loss(
        hidden_leaf, weight_leaf, targets, losses.cross_entropy, loss_inputs={"weight": weights}, **options
    )
    result.loss.backward()
    expected = reference(hidden, true, targets, grad_logprob=-weights, softcap=case.get("softcap"))
    errors["loss_hidden_grad"] = relative_error(hidden_leaf.grad, expected.grad_hidden)
    errors["loss_weight_grad"] = relative_error(weight_leaf.grad[:vocab_size], expected.grad_weight)
    errors["loss_padded_weight_grad"] = float(torch.count_nonzero(weight_leaf.grad[vocab_size:]))
    return errors


def rows_product_case(case: dict) -> dict:
    """``rows_product`` with each operand row-major, a transposed view or every other column of a
    wider tensor, the output row-major or transposed, written or accumulated, ungated or behind an
    open or a closed gate: each result's largest error against float64, over the float64 product of
    the operands' absolute values (a summation's bound), and whether a closed gate left the output's
    bits as they were."""
    import itertools

    import torch

    from megatron_fused_lm.ops.kernels.rows_product_kernel import rows_product
    from megatron_fused_lm.ops.kernels.tiles import Tiles

    torch.manual_seed(case["seed"])
    (rows, inner, columns), dtype = case["shape"], getattr(torch, case["dtype"])
    tiles = Tiles(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="tf32x3")

    def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
        if layout == "transposed":
            return values.t().contiguous().t()
        if layout == "strided":
            wide = values.new_zeros(values.shape[0], 2 * values.shape[1])
            wide[:, ::2] = values
            return wide[:, ::2]
        return values.clone()

    left, right = torch.randn(rows, inner).to(dtype), torch.randn(inner, columns).to(dtype)
    start = torch.randn(rows, columns)
    bound = left.double().abs() @ right.double().abs() + start.double().abs()
    errors, closed_gate_changed = {}, 0
    operand_layouts = ("row_major", "transposed", "strided")
    for left_layout, right_layout, out_layout, accumulate, gate in itertools.product(
        operand_layouts, operand_layouts, ("row_major", "transposed"), (False, True), (None, 0, 1)
    ):
        out = laid_out(start, out_layout)
        gate_tensor = None if gate is None else torch.tensor(gate, dtype=torch.int32)
        rows_product(out, laid_out(left, left_layout), laid_out(right, right_layout), accumulate, tiles, gate_tensor)
        if gate == 0:
            closed_gate_changed += int(not torch.equal(out, start))
            continue
        expected = left.double() @ right.double() + (start.double() if accumulate else 0.0)
        name = f"left={left_layout},right={right_layout},out={out_layout},accumulate={accumulate},gate={gate}"
        errors[name] = float(((out.double() - expected).abs() / bound).max())
    # An empty depth: zeros written, nothing added, nothing written behind a closed gate.
    empty_left, empty_right = left[:, :0], right[:0]
    empty_depth = []
    for accumulate, gate in itertools.product((False, True), (None, 0, 1)):
        out = start.clone()
        gate_tensor = None if gate is None else torch.tensor(gate, dtype=torch.int32)
        rows_product(out, empty_left, empty_right, accumulate, tiles, gate_tensor)
        written = not accumulate and gate != 0
        empty_depth.append(torch.equal(out, torch.zeros_like(start) if written else start))
    return {"errors": errors, "closed_gate_changed": closed_gate_changed, "empty_depth": empty_depth}


def run_case_here(case: dict) -> dict:
    """Run one case in this process (the interpreter must already be on); returns its errors."""
    import torch

    if case.get("kind") == "held_gradient_kernels":
        return held_gradient_kernels(case)
    if case.get("kind") == "merge":
        return merge_kernel_case(case)
    if case.get("kind") == "several_targets":
        return several_targets_case(case)
    if case.get("kind") == "kept_mask_builder":
        return kept_mask_builder_case(case)
    if case.get("kind") == "topk":
        return topk_case(case)
    if case.get("kind") == "candidates":
        return candidates_case(case)
    if case.get("kind") == "corrections":
        return corrections_case(case)
    if case.get("kind") == "default_tuning":
        return default_tuning_case(case)
    if case.get("kind") == "rows_product":
        return rows_product_case(case)

    from devkit.oracle import capped, max_abs_error, reference, relative_error
    from megatron_fused_lm.ops.backends.contract import NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
    from megatron_fused_lm.ops.backends.triton import TritonBackend
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.kept_tokens import KeptSets, every_column, torch_kept_mask
    from megatron_fused_lm.ops.kernels.kept_mask_kernel import kept_mask
    from megatron_fused_lm.ops.kernels.tiles import Tiles
    from megatron_fused_lm.ops.options import HeadOptions
    from megatron_fused_lm.ops.softmax import summarize

    small_tiles = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
    # A wider forward tile spans several dz programs' columns (the GPU's tiles hold 128 or more).
    forward_tiles = small_tiles._replace(block_n=case.get("forward_block_n", 32))
    tuning = TritonTuning(
        forward_tiles=forward_tiles,
        backward_tiles=small_tiles,
        tiles_per_split=2,
        programs=2,
        dz_block_bytes=case.get("dz_block_bytes"),
        reference_rows=case.get("reference_rows"),
        stored_block_bytes=2**30,  # what a GPU's share of its memory would give: one chunk of these rows
    )
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    tokens, hidden_size, vocab = case["shape"]
    hidden = torch.randn(tokens, hidden_size) * case["hidden_scale"]
    weight = torch.randn(vocab, hidden_size) / hidden_size**0.5
    if case.get("dominant_row") is not None:
        # One vocabulary row lies far above the others' logits for the first half of the tokens, and
        # it is not among the rows the reference samples: those rows' stored exponentials are refreshed.
        direction = torch.nn.functional.normalize(torch.randn(hidden_size), dim=0)
        hidden[: tokens // 2] += 3.0 * direction
        weight[case["dominant_row"]] = 30.0 * direction
    if case.get("far_shard_gap"):
        # The vocabulary's second half (another rank's shard) lies that far above the first, whose
        # ids alone the rows keep: that shard keeps none of them, and its sampled reference lies
        # far above the rows' lse.
        direction = torch.nn.functional.normalize(torch.randn(hidden_size), dim=0)
        hidden += 10.0 * direction
        weight[vocab // 2 :] += case["far_shard_gap"] / 10.0 * direction
    if case.get("strided"):
        hidden = torch.stack([hidden, torch.randn_like(hidden)], -1)[..., 0]
        weight = weight.t().contiguous().t()
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    targets = torch.randint(0, case.get("distinct_targets", vocab), (tokens,))
    # "per_row": each row its own temperature, from 0.5 to 2; a number, as the ops pass it: one value
    # seen by every row (stride 0), which the kernels read as a scalar.
    per_row = case["temperature"] == "per_row"
    temperature = torch.rand(tokens) * 1.5 + 0.5 if per_row else torch.full((1,), case["temperature"]).expand(tokens)
    grad_logprob = torch.randn(tokens)
    grad_entropy = torch.randn(tokens) if case["entropy_grad"] else None
    # "kept": each row keeps up to that many random ids and its target (kept_tokens), as the
    # Triton builder's bitmask; it must equal the torch builder's.
    kept, builders_agree = None, None
    if case.get("kept"):
        kept = torch.rand(tokens, vocab) < case["kept"] / vocab
        if case.get("far_shard_gap"):
            targets %= vocab // 2
            kept[:, vocab // 2 :] = False
        if case.get("kept_none_in_half"):  # rows keeping nothing in the second half: one shard empty
            targets[: tokens // 2] %= vocab // 2
            kept[: tokens // 2, vocab // 2 :] = False
        if case.get("dominant_row") is not None:  # left out: the kept maximum lies far below the reference
            targets[targets == case["dominant_row"]] += 1
            kept[:, case["dominant_row"]] = False
        kept[torch.arange(tokens), targets] = True
        kept_row, kept_id = kept.nonzero().unbind(1)
        kept_row, kept_id = torch.cat([kept_row, kept_row[::3]]), torch.cat([kept_id, kept_id[::3]])  # repeats
        builders_agree = True

    def kept_mask_of(rows, first, count):
        if kept is None:
            return every_column(hidden.device)
        inside = (kept_row >= rows.start) & (kept_row < rows.stop)
        row, order = kept_row[inside] - rows.start, (kept_row[inside] - rows.start).argsort(stable=True)
        offsets = torch.cat([row.new_zeros(1), torch.bincount(row, minlength=rows.stop - rows.start).cumsum(0)])
        sets = KeptSets(offsets, kept_id[inside][order], targets[rows], rows.stop - rows.start, first, vocab)
        mask = kept_mask(sets, count)
        nonlocal builders_agree
        builders_agree = builders_agree and torch.equal(mask, torch_kept_mask(sets, count))
        return mask

    # The backend alone, as the ops call it.
    backend = TritonBackend(tuning)
    options = HeadOptions(
        token_chunk=case.get("token_chunk"), batch_invariant=case.get("batch_invariant", False),
        entropy_grad=case["entropy_grad"], softcap=case.get("softcap"),
    )  # fmt: skip
    if case.get("three_gemm"):

        def run(rows):
            return three_gemm_pass(
                backend, options, hidden[rows], weight, targets[rows], temperature[rows], grad_logprob[rows],
                None if grad_entropy is None else grad_entropy[rows], case.get("shards", 1),
                lambda first, count: kept_mask_of(rows, first, count),
            )  # fmt: skip
    else:  # one rank: every target in this shard

        def run(rows):
            problem = ShardProblem(hidden[rows], weight, targets[rows], temperature[rows], kept_mask_of(rows, 0, vocab))
            summary = summarize(backend.local_statistics(problem, options))
            upstream = UpstreamGrads(grad_logprob[rows], None if grad_entropy is None else grad_entropy[rows])
            saved = SavedStatistics(summary.lse, summary.mean_logit)
            grads = backend.local_gradients(problem, saved, upstream, NeededGrads(hidden=True, weight=True), options)
            return summary.logprob, summary.entropy, grads

    logprob, entropy, grads = run(slice(0, tokens))
    rows_alone_equal = None
    if case.get("batch_invariant"):  # the first rows in a call of their own: bitwise as in the whole?
        alone = run(slice(0, min(tokens, 5)))
        rows_alone_equal = all(
            torch.equal(part, whole[: part.shape[0]]) for part, whole in zip(alone[:2], (logprob, entropy), strict=True)
        ) and torch.equal(alone[2].hidden, grads.hidden[: alone[2].hidden.shape[0]])
    expected = reference(
        hidden, weight, targets, temperature, grad_logprob, grad_entropy, kept=kept, softcap=case.get("softcap")
    )
    sampled = weight[:: -(-weight.shape[0] // case["reference_rows"])] if case.get("reference_rows") else weight
    softcap = case.get("softcap")
    logits = capped(hidden.double() @ weight.double().t(), softcap) / temperature.double()[:, None]
    sampled_max = (capped(hidden.double() @ sampled.double().t(), softcap) / temperature.double()[:, None]).amax(1)
    return {
        "rows_far_above_sample": int((logits.amax(1) - sampled_max > 60).sum()),
        "logprob": max_abs_error(logprob, expected.logprob),
        "entropy": max_abs_error(entropy, expected.entropy),
        "grad_hidden": relative_error(grads.hidden, expected.grad_hidden),
        "grad_weight": relative_error(grads.weight, expected.grad_weight),
        "grad_weight_zero": not grads.weight.any().item(),
        "grad_dtypes": [str(grads.hidden.dtype), str(grads.weight.dtype)],
        "rows_alone_equal": rows_alone_equal,
        "kept_builders_agree": builders_agree,
        "grad_weight_left_out": None if kept is None else grads.weight[~kept.any(0)].abs().max().item(),
    }


def three_gemm_pass(backend, options, hidden, weight, targets, temperature, grad_logprob, grad_entropy, shards,
                    kept_mask_of):  # fmt: skip
    """The package's loss-in-forward pass (``run_loss_pass``) with the vocabulary split into
    ``shards`` equal shards, one pass per shard as each rank of a tensor-parallel group would run
    it (``kept_mask_of(first column, columns)``: its kept_mask); the chunk step merges the shards'
    statistics as the group's all-gather does and summarizes them by the backend (its merge
    kernel). Returns ``(logprob, entropy, Gradients)`` with the hidden gradient summed over the
    shards and the weight gradient's shards stacked."""
    import torch

    from megatron_fused_lm.ops.backends.contract import Gradients, NeededGrads, ShardProblem, UpstreamGrads
    from megatron_fused_lm.ops.loss_pass.chunks import run_loss_pass
    from megatron_fused_lm.ops.softmax import SoftmaxSummary

    tokens, vocab = targets.shape[0], weight.shape[0]
    shard_rows = vocab // shards
    problems = [
        ShardProblem(
            hidden,
            weight[shard * shard_rows : (shard + 1) * shard_rows],
            torch.where(targets // shard_rows == shard, targets - shard * shard_rows, -1),
            temperature,
            kept_mask_of(shard * shard_rows, shard_rows),
        )
        for shard in range(shards)
    ]
    # First every shard's statistics per chunk (what the other ranks contribute to the gather)...
    local = [{} for _ in problems]
    for shard, problem in enumerate(problems):

        def record(rows, local_statistics, shard=shard):
            local[shard][rows.start] = local_statistics.clone()
            return None, UpstreamGrads(None, None), None

        state = backend.allocate(problem, NeededGrads(hidden=False, weight=False), options)
        run_loss_pass(backend, problem, record, state, options, accumulate=False)
    # ... then each shard's gradients, its chunks in order, merged with the others' statistics.
    logprob, entropy = torch.empty(tokens), torch.empty(tokens)
    partials = []
    for problem in problems:
        chunk_starts = []

        def chunk_step(rows, local_statistics, chunk_starts=chunk_starts, problem=problem):
            chunk_starts.append(rows.start)
            summary = SoftmaxSummary(*(torch.empty(rows.stop - rows.start) for _ in SoftmaxSummary._fields))
            parts = torch.stack([part[rows.start] for part in local])
            backend.summarize(parts, problem.target_column[rows], summary)
            logprob[rows], entropy[rows] = summary.logprob, summary.entropy
            upstream = [None if grad is None else grad[rows] for grad in (grad_logprob, grad_entropy)]
            return summary, UpstreamGrads(*upstream), None

        partials.append(finished_pass(backend, problem, chunk_step, options))
        assert chunk_starts == sorted(chunk_starts) and len(set(chunk_starts)) == len(chunk_starts)
    grad_hidden = torch.stack([grads.hidden.float() for grads in partials]).sum(0).to(hidden.dtype)
    return logprob, entropy, Gradients(grad_hidden, torch.cat([grads.weight for grads in partials]))


CASE_TIMEOUT = 300  # seconds


class Interpreter:
    """The subprocess that runs the cases with the interpreter on; started on the first case and
    again after one that killed it. What the cases print goes to a log file, read on failure."""

    process = None
    log = None

    @classmethod
    def run(cls, case: dict) -> dict:
        if cls.process is None or cls.process.poll() is not None:
            env = dict(
                os.environ,
                TRITON_INTERPRET="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            )
            cls.log = tempfile.TemporaryFile(mode="w+")
            cls.process = subprocess.Popen(
                [sys.executable, __file__, "--serve"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=cls.log, text=True,
            )  # fmt: skip
        cls.process.stdin.write(json.dumps(case) + "\n")
        cls.process.stdin.flush()
        ready, _, _ = select.select([cls.process.stdout], [], [], CASE_TIMEOUT)
        line = cls.process.stdout.readline() if ready else ""
        if not line:  # timed out or died: its log says why
            cls.process.kill()
            cls.process.wait()
            cls.log.seek(0)
            raise AssertionError(f"the interpreter's process stopped on {case}:\n{cls.log.read()[-3000:]}")
        reply = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply["result"]


def serve() -> None:
    """Answer each case read from stdin with one line of JSON: ``{"result": ...}`` or ``{"error":
    traceback}``; what the cases print goes to stderr."""
    import traceback

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        try:
            reply = {"result": run_case_here(json.loads(line))}
        except Exception:
            reply = {"error": traceback.format_exc()[-3000:]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def run_case(**case) -> dict:
    case = dict(dict(seed=0, temperature=1.0, hidden_scale=1.0, entropy_grad=True), **case)
    return Interpreter.run(case)


# Bounds per input dtype: (max |log-prob or entropy error|, max gradient error relative to the
# largest entry). float32 runs float32 products (the interpreter computes "tf32x3" in float32):
# measured errors are 0.5-2e-6, and 1e-5 leaves room for other summation orders. float16 inputs are exact in the float32 products, so
# the values keep float32 accuracy (measured 1e-6); the gradients are rounded to float16 two or
# three times (the stored offsets, dz and the result, 2^-11 relative each), measured 3-6e-4. A dropped or misplaced term costs O(0.1).
TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (1e-5, 2e-3)}


def check(result: dict, dtype: str) -> None:
    value_tol, grad_tol = TOLERANCE[dtype]
    assert result["logprob"] <= value_tol and result["entropy"] <= value_tol, result
    assert result["grad_hidden"] <= grad_tol and result["grad_weight"] <= grad_tol, result


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kept_tokens(dtype, three_gemm, shards):
    # Each row's softmax over its kept set (kept_tokens: a dozen ids of 211 with repeats, its
    # target among them), against the float64 oracle over the same sets, within the same bounds
    # as the whole vocabulary: a column left out that leaked in costs O(0.1). Two shards: half the
    # rows keep nothing on the second (its statistics are an empty block; float16's stored offsets
    # then read tiles whose maximum is -inf). Peaked rows (hidden scale 4), per-row temperatures;
    # with an entropy term (float16 offsets) and without (exponentials, refreshed where the kept
    # maximum lies far below the sampled rows' reference).
    if shards == 2 and not three_gemm:
        pytest.skip("the recompute backend takes one shard here; two ranks run in test_ops_kept_tokens.py")
    for entropy_grad in (True, False):
        result = run_case(
            dtype=dtype, shape=[37, 45, 212], temperature="per_row", hidden_scale=4.0, three_gemm=three_gemm,
            kept=12, kept_none_in_half=True, shards=shards, entropy_grad=entropy_grad, token_chunk=16,
        )  # fmt: skip
        check(result, dtype)
        assert result["kept_builders_agree"], result
        assert result["grad_weight_left_out"] == 0.0, result


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["exponentials", "offsets"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kept_tokens_on_a_shard_far_above(dtype, entropy_grad):
    # Two shards: every row keeps ids of the first only, and the second's logits lie 150 above: its
    # exponentials' reference must not meet the rows' lse (exp(150) overflows into NaN gradients).
    result = run_case(
        dtype=dtype, shape=[24, 40, 212], kept=12, far_shard_gap=150.0, three_gemm=True, shards=2,
        entropy_grad=entropy_grad, token_chunk=16,
    )  # fmt: skip
    check(result, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kept_tokens_far_below_reference(dtype):
    # A dominant vocabulary row among those the three-GEMM pass samples for its exponentials'
    # references, left out of every kept set: the kept maximum lies ~100 below the reference, where
    # exponentials underflow (float32 weights, no entropy term: the exponentials block); those rows
    # are stored again against their own maximum.
    result = run_case(
        dtype=dtype, shape=[37, 45, 212], dominant_row=0, kept=12, three_gemm=True, entropy_grad=False,
        token_chunk=16,
    )  # fmt: skip
    assert result["rows_far_above_sample"] == 0  # the dominant row is sampled: the reference is high, not low
    check(result, dtype)


def test_topk_with_a_softcap():
    # The same rows under a cap of 150 (the crowded rows' logits of 93 bend by a third): the
    # candidates and statistics kernels cap each tile's logits, the torch form its block's.
    results = run_case(kind="topk", dtype="float32", shape=[20, 24, 1280], ks=[1, 2, 9, 12], seed=6, softcap=150.0)
    assert results.pop("nan")
    for k, (ids_equal, logprob_error) in results.items():
        assert ids_equal and logprob_error <= 1e-6, (k, ids_equal, logprob_error)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_topk(dtype):
    # The Triton top-k: thresholds from the first launch's tile maxima, candidates from the second
    # in split slots, a crowded row past a tile's picks and one past its split's slots, ties across
    # tiles (lower ids first), k past a quarter of the column tiles, per-row temperatures, a NaN
    # row, two chunks of rows.
    results = run_case(kind="topk", dtype=dtype, shape=[20, 24, 1280], ks=[1, 2, 9, 12], seed=6)
    assert results.pop("nan")
    for k, (ids_equal, logprob_error) in results.items():
        # float32 logits of up to 93 here (a crowded row's), each rounded by a few 1e-7 of it.
        assert ids_equal and logprob_error <= 1e-6, (k, ids_equal, logprob_error)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_topk_candidates_walk_the_statistics_tiles(dtype):
    # The candidates kernel's logits are the statistics kernel's, bit for bit: each tile's maximum
    # comes back among the candidates with the same bits (per-row temperatures included).
    results = run_case(kind="candidates", dtype=dtype, shape=[20, 24, 300], seed=3)
    for name, (in_slots, same_bits, error) in results.items():
        # float32 logits of |z| up to ~40 here, against float64: a few 1e-6.
        assert in_slots and same_bits and error <= 1e-4, (name, in_slots, same_bits, error)


def test_kept_mask_builder():
    # The Triton builder sets the torch builder's bits (repeats, other shards' ids, padding rows)
    # and reports the same malformed sets with the same messages.
    results = run_case(kind="kept_mask_builder", seed=4)
    assert results.pop("agree")[0] == "True"
    expected = {
        "decreasing": "never decrease",
        "short": "never decrease",
        "outside": "outside the vocabulary",
        "left_out": "target is outside its kept_tokens set",
    }
    for name, (triton_error, torch_error) in results.items():
        assert expected[name] in triton_error and triton_error == torch_error, (name, triton_error, torch_error)


@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_odd_sizes_and_temperature(dtype, three_gemm):
    # Prime vocabulary (not a multiple of the tile) and hidden size (not a multiple of block_k).
    result = run_case(dtype=dtype, shape=[37, 45, 211], temperature=0.7, hidden_scale=2.0, three_gemm=three_gemm)
    check(result, dtype)
    assert result["grad_dtypes"] == [f"torch.{dtype}"] * 2


@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_temperature_per_row(dtype, three_gemm):
    # Each row its own temperature (0.5 to 2), over three token chunks and several vocabulary
    # blocks, so that a chunk reading another chunk's temperatures would show.
    result = run_case(
        dtype=dtype, shape=[40, 33, 601], temperature="per_row", hidden_scale=2.0, token_chunk=16,
        dz_block_bytes=16 * 256 * 4, seed=11, three_gemm=three_gemm,
    )  # fmt: skip
    check(result, dtype)


@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
def test_peaky_logits(three_gemm):
    result = run_case(dtype="float32", shape=[20, 48, 97], hidden_scale=30.0, seed=1, three_gemm=three_gemm)
    # Logits reach about 200 here: float32 rounding of the logits themselves is ~1e-5 (measured
    # log-prob error 1.4e-5), so the value bound scales with them.
    assert result["logprob"] <= 1e-4 and result["entropy"] <= 1e-4, result
    assert result["grad_hidden"] <= 1e-5 and result["grad_weight"] <= 1e-5, result


def test_backward_blocked_over_tokens_and_vocabulary():
    # 3 token chunks (the last partial) x vocabulary blocks of 256 columns (the last partial).
    result = run_case(dtype="float32", shape=[40, 33, 601], token_chunk=16, dz_block_bytes=16 * 256 * 4, seed=2)
    check(result, "float32")


@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
def test_entropy_grad_false_and_strided_inputs(three_gemm):
    result = run_case(
        dtype="float16", shape=[24, 40, 131], entropy_grad=False, strided=True, seed=3, three_gemm=three_gemm
    )
    check(result, "float16")


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["direct", "dz_pass"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_three_gemm_token_chunks(dtype, entropy_grad):
    # 3 token chunks (the last partial), each one forward and its products (after a dz pass for an
    # entropy term or float16 operands); the weight gradient summed over them.
    result = run_case(
        dtype=dtype, shape=[40, 33, 601], token_chunk=16, seed=4, three_gemm=True, entropy_grad=entropy_grad
    )
    check(result, dtype)


def test_three_gemm_offsets_tiles_wider_than_a_dz_program():
    # float16 offsets against tile maxima of 256 columns, which the dz kernel's programs of 128
    # columns read two to a tile (a wrong tile index reads another tile's maximum, or past the end).
    result = run_case(
        dtype="float16", shape=[20, 24, 601], three_gemm=True, entropy_grad=True, forward_block_n=256, seed=8,
        temperature=0.7,
    )  # fmt: skip
    check(result, "float16")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_three_gemm_repeated_targets(dtype):
    # Three distinct targets over 40 tokens in two chunks: the chosen tokens' weight-gradient
    # terms are summed per row over long runs of tokens (direct products for float32).
    result = run_case(
        dtype=dtype, shape=[40, 33, 101], token_chunk=24, seed=7, three_gemm=True, entropy_grad=False,
        distinct_targets=3,
    )  # fmt: skip
    check(result, dtype)


@pytest.mark.parametrize("temperature", [1.0, "per_row"], ids=["one_temperature", "per_row"])
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["direct", "dz_pass"])
def test_three_gemm_refreshed_references(entropy_grad, temperature):
    # A row's reference comes from 4 sampled weight rows and its target; a dominant row outside
    # them lies far above that for about half the tokens (the precondition below), so their
    # stored exponentials are rewritten against the true maximum, in row tiles that also hold
    # rows which keep theirs. Without the refresh those exponentials overflow (inf, then NaN).
    result = run_case(
        dtype="float32", shape=[40, 48, 97], three_gemm=True, reference_rows=4, dominant_row=60,
        entropy_grad=entropy_grad, seed=5, temperature=temperature,
    )  # fmt: skip
    assert result["rows_far_above_sample"] >= 10, result
    # Logits reach about 120: the value bound scales with them, as in test_peaky_logits.
    assert result["logprob"] <= 1e-4 and result["entropy"] <= 1e-4, result
    assert result["grad_hidden"] <= 1e-5 and result["grad_weight"] <= 1e-5, result


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["direct", "dz_pass"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_three_gemm_two_shards(dtype, entropy_grad):
    # The vocabulary split over two shards as under tensor parallelism: each row's target lies in
    # one shard, so the other forms every term but the chosen token's; two token chunks.
    result = run_case(
        dtype=dtype, shape=[32, 40, 2 * 67], token_chunk=16, seed=6, three_gemm=True, shards=2,
        entropy_grad=entropy_grad,
    )  # fmt: skip
    check(result, dtype)


def test_upstream_gradients_the_forward_did_not_assume():
    # float32 products and a float32 block: within float32 rounding of the oracle whether the
    # correcting pass's gate is closed (an upstream as declared), open (another one), or the
    # accumulator was given another scale.
    errors = run_case(kind="corrections", shape=[24, 32, 97], seed=11)  # two chunks of rows
    assert all(error <= 1e-5 for error in errors.values()), errors


def test_the_default_tuning_takes_an_h100_where_there_is_no_cuda_device():
    import torch

    from megatron_fused_lm.ops.backends import triton_tuning

    cpu, tuning = torch.device("cpu"), triton_tuning.TritonTuning()
    assert tuning.programs_for(cpu) == 132 and triton_tuning.shared_memory_limit(cpu) == 232448
    assert tuning.stored_block_bytes_for(cpu) == int(85_017_493_504 / 32)


def test_the_public_ops_with_the_default_tuning_on_cpu_tensors():
    # No CUDA device to ask for its properties: the default tuning takes an H100's. float32 inputs
    # run the float32 tiles' products (3xTF32 on a GPU, float32 here), a few 1e-6 from float64.
    errors = run_case(kind="default_tuning", shape=[12, 32, 300], seed=5)
    assert all(error <= 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize(
    "extreme",
    [{"shift": -3000.0}, {"shift": 3000.0}, {"spread": 400.0}],
    ids=["all_negative", "all_positive", "huge_spread"],
)
def test_the_public_ops_with_extreme_logits(extreme):
    # A shift of every logit changes no log-prob, entropy or gradient; a running maximum that
    # starts at 0, or an exponential that overflows, costs O(1) or NaN. The bound: float32 rounding
    # of logits of magnitude 3000 (8 ulps, 2.9e-3), which every probability, hence every gradient,
    # inherits (measured 1.4e-3 to 2.2e-3 relative at a shift of 3000, 1e-5 unshifted).
    errors = run_case(kind="default_tuning", shape=[12, 32, 300], seed=7, **extreme)
    assert all(error <= 8 * 2**-23 * 3000 + 2e-5 for error in errors.values()), errors


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["exponentials", "entropy"])
@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap(dtype, three_gemm, entropy_grad):
    # Logits of spread about 8 (peaked rows reach 30) under a cap of 5: tanh saturates on each
    # row's largest columns, so a cap left out, or a slope missing from a gradient (the recompute
    # kernel's, the dz kernel's from exponentials or float16 offsets, the chosen token's), costs
    # O(0.1). Per-row temperatures, backward blocks of 256 columns, the bounds of check().
    result = run_case(
        dtype=dtype, shape=[40, 33, 601], temperature="per_row", hidden_scale=8.0, token_chunk=16,
        dz_block_bytes=16 * 256 * 4, seed=12, three_gemm=three_gemm, entropy_grad=entropy_grad, softcap=5.0,
    )  # fmt: skip
    check(result, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
def test_softcap_with_kept_tokens(three_gemm, dtype):
    # Each row's softmax over its kept set of a capped head: the kept mask and the cap's slope in
    # the same kernels (three GEMMs: float16 stores offsets; float32 exponentials, which without an
    # entropy term hold the slope, -inf columns giving 0).
    for entropy_grad in (True, False):
        result = run_case(
            dtype=dtype, shape=[37, 45, 212], temperature="per_row", hidden_scale=8.0, three_gemm=three_gemm,
            kept=12, entropy_grad=entropy_grad, token_chunk=16, softcap=5.0,
        )  # fmt: skip
        check(result, dtype)
        assert result["grad_weight_left_out"] == 0.0, result


def test_softcap_on_two_shards():
    # The three-GEMM pass per shard of two; one vocabulary row far above the others for half the rows
    # (logits near 90, capped to about 72) and not among the rows the reference samples: their
    # stored exponentials are refreshed against the capped maximum.
    result = run_case(
        dtype="float32", shape=[40, 33, 600], token_chunk=16, seed=13, three_gemm=True,
        entropy_grad=False, softcap=100.0, shards=2, dominant_row=333, reference_rows=8,
    )  # fmt: skip
    assert result["rows_far_above_sample"] > 0, result
    # Logits near 72: their float32 rounding alone is some 1e-5 (as test_peaky_logits' bound).
    assert result["logprob"] <= 1e-4 and result["entropy"] <= 1e-4, result
    assert result["grad_hidden"] <= 1e-5 and result["grad_weight"] <= 1e-5, result


@pytest.mark.parametrize("softcap", [3.0, 0.3])
def test_the_public_ops_with_a_softcap(softcap):
    # The public ops with backend="triton" (default tuning): log-probs, entropy, gradients, the
    # three-GEMM loss's, under a cap of 3 on logits of order 10; and of 0.3, where the largest reach
    # 100 caps and exp(2 u / softcap) overflows to inf (tanh must then be 1, not NaN). There the
    # gradients come from the few columns not yet saturated, whose slope 1 - t^2, read back from a
    # float32 t within 1e-4 of 1 (as autograd's tanh backward reads its output), keeps 1e-3.
    errors = run_case(kind="default_tuning", shape=[12, 32, 300], seed=8, spread=3.0, softcap=softcap)
    grad_bound = 1e-5 if softcap == 3.0 else 1e-3
    assert errors.pop("logprob") <= 1e-5 and errors.pop("entropy") <= 1e-5, errors
    assert all(error <= grad_bound for error in errors.values()), errors


def test_the_public_ops_over_the_true_vocabulary():
    # vocab_size=291 of a head padded to 300 rows, whose padded rows score 20 times higher: a padded
    # column in a softmax costs O(1), and their weight rows must get no gradient at all.
    errors = run_case(kind="default_tuning", shape=[12, 32, 300], vocab_size=291, seed=6)
    assert errors["padded_weight_grad"] == 0 and errors["loss_padded_weight_grad"] == 0, errors
    assert all(error <= 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize(
    "dtype, three_gemm",
    [("float32", False), ("float16", False), ("float16", True)],
    ids=["float32-recompute", "float16-recompute", "float16-three_gemm"],
)
def test_batch_invariant(dtype, three_gemm):
    # The hidden product by rows_product, whose float32 sums continue across vocabulary chunks in one
    # order: the dz block's budget holds 16 rows x 256 columns, so the whole call's 16-row chunks
    # take 256 columns and a 5-row call 768. Against float64, and the first rows alone bitwise as
    # in the whole call (cuBLAS's beta=1 form, used without the option, fails the second check).
    budget = 16 * 256 * (4 if dtype == "float32" else 2)
    result = run_case(
        dtype=dtype, shape=[40, 48, 1100], token_chunk=16, dz_block_bytes=budget, seed=9, three_gemm=three_gemm,
        batch_invariant=True,
    )  # fmt: skip
    check(result, dtype)
    assert result["rows_alone_equal"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_product_in_every_layout(dtype):
    # Float32 operands take another route per layout (the product transposed, or a k-major copy of
    # the right operand); odd sizes cross partial tiles, and a depth or a strided operand that a
    # descriptor cannot address is copied. Each element's error against float64 within 1e-6 of its
    # sum of |terms| (the interpreter multiplies float32 in float32: measured 9e-8, 45 terms'
    # float32 summation bounded by 2.7e-6 and near sqrt(45) x 6e-8 = 4e-7 at most in practice; a
    # dropped tile or term costs O(0.1)); a closed gate writes nothing; an empty depth writes zeros.
    result = run_case(kind="rows_product", dtype=dtype, shape=[37, 45, 29], seed=3)
    assert result["closed_gate_changed"] == 0 and all(result["empty_depth"]), result
    assert len(result["errors"]) == 72 and max(result["errors"].values()) <= 1e-6, result


def test_batch_invariant_three_gemm_refuses_float32_weights():
    # A float32 block holds exponentials against row references from products over the chunk's
    # rows: no form the option could keep.
    import torch

    from megatron_fused_lm.ops.backends.contract import NeededGrads, ShardProblem
    from megatron_fused_lm.ops.backends.triton import TritonBackend
    from megatron_fused_lm.ops.kept_tokens import every_column
    from megatron_fused_lm.ops.options import HeadOptions

    problem = ShardProblem(
        torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(4, dtype=torch.long), torch.ones(4), every_column("cpu")
    )
    with pytest.raises(ValueError, match="needs 16-bit weights"):
        TritonBackend().allocate(problem, NeededGrads(True, True), HeadOptions(batch_invariant=True))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_held_gradient_kernels_match_the_torch_code(dtype):
    # The chosen terms sum the same float32 terms per element (the chosen rows in token order) and
    # round the same float32 sum once; the per-row terms take the same float32 operations in
    # another order (Triton's expm1 is Kahan's form: a few ulps), and the scaled hidden rows may
    # then round to the neighbouring value of the weight's dtype (2^-11 for float16). The
    # references are an estimate with 20 of headroom: the interpreter's float16 products
    # accumulate in float16 (a GPU's in float32), 1e-3 of the logits bounds both.
    errors = run_case(kind="held_gradient_kernels", dtype=dtype, shape=[41, 300, 9], seed=8)
    assert errors.pop("stale_refresh") == 0, errors
    assert errors.pop("reference") <= 1e-3, errors
    assert errors.pop("row_operand") <= 2**-11, errors
    assert all(error <= 2e-6 for error in errors.values()), errors


def test_merge_kernel_against_float64():
    # Float32 statistics of each block round by a few ulps; the merge adds a few more per part.
    errors = run_case(kind="merge", tokens=37, vocab=300, seed=3)
    assert errors.pop("rows_alone_equal")
    assert all(error <= 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
def test_zero_tokens(three_gemm):
    result = run_case(dtype="float32", shape=[0, 16, 50], three_gemm=three_gemm)
    assert result["grad_weight_zero"]


if __name__ == "__main__":
    serve()


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no_entropy"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_several_targets_per_row_three_gemm(dtype, entropy):
    # The loss-in-forward pass with k = 3 ids per row (one repeated): every target's element of the
    # stored block's dz zeroed (float16 offsets, the dz kernel) or of the block the products read
    # directly (float32 exponentials without an entropy term), the shared term over their sum, each
    # distinct column's whole term added in float32 (softmax.chosen_logit_grad), two token chunks.
    # bfloat16's direct read runs on a GPU (test_loss_parity.py).
    result = run_case(
        kind="several_targets", dtype=dtype, shape=[24, 40, 131, 3], seed=13, three_gemm=True,
        zero_entropy_grad=not entropy,
    )  # fmt: skip
    value_tol, grad_tol = TOLERANCE[dtype]
    assert result["logprob"] <= value_tol, result
    assert result["grad_hidden"] <= grad_tol and result["grad_weight"] <= grad_tol, result


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no_entropy"])
@pytest.mark.parametrize("three_gemm", [False, True], ids=["recompute", "three_gemm"])
def test_several_targets_per_row_with_a_softcap(three_gemm, entropy):
    # k = 3 ids per row under a cap of 4 on logits of spread 8: each id's chosen term takes the
    # cap's slope at its own logit (softmax.product_grad in several_row_terms, the kernels' tiles).
    result = run_case(
        kind="several_targets", dtype="float32", shape=[24, 40, 131, 3], seed=14, three_gemm=three_gemm,
        zero_entropy_grad=not entropy, hidden_scale=8.0, softcap=4.0,
    )  # fmt: skip
    value_tol, grad_tol = TOLERANCE["float32"]
    assert result["logprob"] <= value_tol, result
    assert result["grad_hidden"] <= grad_tol and result["grad_weight"] <= grad_tol, result


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_several_targets_per_row(dtype):
    # k = 3 ids per row (one repeated) over two token chunks and several vocabulary blocks: the
    # backward kernel adds each id's term to the float32 tile, the shared term taking their sum.
    result = run_case(kind="several_targets", dtype=dtype, shape=[24, 40, 131, 3], seed=12)
    value_tol, grad_tol = TOLERANCE[dtype]
    assert result["logprob"] <= value_tol, result
    assert result["grad_hidden"] <= grad_tol and result["grad_weight"] <= grad_tol, result
