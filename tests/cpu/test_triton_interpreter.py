"""The Triton backend's kernels under the Triton interpreter (``TRITON_INTERPRET=1``) on the CPU,
against the float64 oracle.

The interpreter is chosen when Triton first loads, so each case runs in a subprocess: this file,
run as a script with the case as JSON. The backend is built here with small tiles (the CUDA tiles
would take minutes to interpret), two vocabulary splits and a two-program backward grid, so that
every case crosses several tiles, splits and programs. Each case runs the four-GEMM path
(statistics, then the recomputing backward) or the three-GEMM one (``contract.run_loss_pass``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def held_gradient_kernels(case: dict) -> dict:
    """The Triton backend's kernels for the held gradients against the torch steps they replace
    (``held_gradients.HeldSteps``): relative differences of the scaled copy, the finished hidden rows (with and
    without a factor) and the chosen rows added to a two-part float32 weight gradient."""
    import torch

    from devkit.oracle import relative_error
    from megatron_fused_lm.ops import held_gradients
    from megatron_fused_lm.ops.contract import LossState, NeededGrads
    from megatron_fused_lm.ops.kernels.chosen_token_kernel import add_chosen_rows, finish_hidden_grad
    from megatron_fused_lm.ops.kernels.scale_kernel import scale_into

    torch.manual_seed(case["seed"])
    tokens, hidden_size, vocab = case["shape"]
    dtype = getattr(torch, case["dtype"])
    hidden, weight = torch.randn(tokens, hidden_size).to(dtype), torch.randn(vocab, hidden_size).to(dtype)
    # Repeated rows, rows of another shard (-1) and tokens whose term is 0 (skipped by the kernel).
    target_column = torch.randint(-1, 4, (tokens,))
    chosen = torch.randn(tokens) * (torch.rand(tokens) > 0.2)
    product, factor = torch.randn(tokens, hidden_size), torch.randn(tokens)
    errors, steps, rows = {}, held_gradients.HeldSteps(), slice(0, tokens)
    for with_factor in (False, True):
        expected, actual = product.clone(), product.clone()
        state = LossState(None, None, expected, [])
        steps.add_chosen(state, rows, target_column, chosen, hidden, weight, factor if with_factor else None)
        finish_hidden_grad(actual, factor if with_factor else None, chosen, target_column, weight, actual)
        errors[f"finish_hidden_factor_{with_factor}"] = relative_error(actual, expected)
    logit_grads = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected, actual = (held_gradients.allocate(hidden, weight, NeededGrads(False, True))[1] for _ in range(2))
    for parts in (expected, actual):
        held_gradients.add_weight_product(parts, logit_grads, hidden, accumulate=False)
    steps.add_chosen(LossState(None, None, hidden.new_empty(0), expected), rows, target_column, chosen, hidden, weight)
    add_chosen_rows(actual, target_column, chosen, hidden)
    errors["chosen_rows"] = max(
        relative_error(actual_part, expected_part) for actual_part, expected_part in zip(actual, expected, strict=True)
    )
    scale, source = torch.tensor(0.37), torch.randn(tokens, hidden_size)
    scaled = torch.empty(tokens, hidden_size, dtype=dtype)
    scale_into(source, scale, scaled)
    errors["scale"] = relative_error(scaled, torch.mul(source, scale).to(dtype))
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


def several_targets_case(case: dict) -> dict:
    """The four-GEMM path's backend with ``k`` targets per row (``target_column [n, k]``, a repeated
    id among them), as ``fused_forward`` and ``fused_backward`` drive it, against the float64
    oracle of ``log_softmax(...).gather``: relative errors of the log-probs and both gradients."""
    import torch

    from devkit.oracle import relative_error
    from megatron_fused_lm.ops.backends.triton_loss import TritonLoss
    from megatron_fused_lm.ops.backends.triton_recompute import TritonRecompute
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.contract import NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads, run_loss_pass
    from megatron_fused_lm.ops.kept_tokens import every_column
    from megatron_fused_lm.ops.kernels.tiles import Tiles
    from megatron_fused_lm.ops.several_targets import gathered_logits, statistics_column
    from megatron_fused_lm.ops.softmax import summarize

    tiles = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
    tuning = TritonTuning(forward_tiles=tiles, backward_tiles=tiles, tiles_per_split=2, programs=2,
                          dz_block_bytes=16 * 64 * 4)  # fmt: skip
    backend = TritonRecompute(token_chunk=16, tuning=tuning)
    torch.manual_seed(case["seed"])
    tokens, hidden_size, vocab, k = case["shape"]
    dtype = getattr(torch, case["dtype"])
    hidden = (torch.randn(tokens, hidden_size) * 2).to(dtype)
    weight = (torch.randn(vocab, hidden_size) / hidden_size**0.5).to(dtype)
    ids = torch.randint(0, vocab, (tokens, k))
    ids[:, 1] = ids[:, 0]
    temperature = torch.rand(tokens) * 1.5 + 0.5
    grad_logprob, grad_entropy = torch.randn(tokens, k), torch.randn(tokens)
    if case.get("zero_entropy_grad"):
        grad_entropy = None
    problem = ShardProblem(hidden, weight, ids, temperature, every_column(hidden.device))
    if case.get("three_gemm"):  # the loss-in-forward pass, its chunk step reading the k logits
        logprob = torch.empty(tokens, k)
        backend = TritonLoss(entropy_grad=grad_entropy is not None, token_chunk=16, tuning=tuning)

        def chunk_step(rows, local):
            target_logits = gathered_logits(hidden[rows], weight, ids[rows], temperature[rows])
            summary = summarize(local, statistics_column(ids[rows]), target_logits)
            logprob[rows] = summary.logprob
            upstream = UpstreamGrads(grad_logprob[rows], None if grad_entropy is None else grad_entropy[rows])
            return summary, upstream

        state = run_loss_pass(backend, problem, chunk_step, NeededGrads(hidden=True, weight=True))
        grads = backend.finish(state.held_hidden, state.held_weight, torch.ones(()), (dtype, dtype), True)
    else:
        stats = backend.local_statistics(problem._replace(target_column=statistics_column(ids)))
        summary = summarize(stats)
        logprob = summarize(stats, None, gathered_logits(hidden, weight, ids, temperature)).logprob
        grads = backend.local_gradients(
            problem, SavedStatistics(summary.lse, summary.mean_logit), UpstreamGrads(grad_logprob, grad_entropy),
            NeededGrads(hidden=True, weight=True),
        )  # fmt: skip
    leaves = [tensor.double().requires_grad_() for tensor in (hidden, weight)]
    log_probs = torch.log_softmax(leaves[0] @ leaves[1].t() / temperature.double()[:, None], dim=-1)
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
    two chunks of rows, 40 column tiles in 10 splits of 4. Row 0 holds 40 equal largest logits, 32
    of them in one column tile (more than a tile's picks); row 2 holds 12 equal ones, 3 in each
    tile of the last split (more than the split's slots: a write past them would land in row 3's
    first slot, where row 3 keeps its largest); both take the torch form, lower ids first. Row 1
    ties its largest logit across three tiles, the rest are random; ``k = 12`` exceeds a quarter of
    the column tiles (the torch form for every row). Float32 gives each row its own temperature.
    ``{k: [ids equal, max log-prob error over the largest |logit|]}``, and ``"nan"``: whether a
    row of NaN hidden states gets ids in the vocabulary (not the keys' empty slots)."""
    import torch

    from megatron_fused_lm.ops.backends.triton_topk import top_keys
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.kernels.tiles import Tiles
    from megatron_fused_lm.ops.softmax import summarize
    from megatron_fused_lm.ops.top_keys import keyed_logits

    small = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
    tuning = TritonTuning(forward_tiles=small, tiles_per_split=4, programs=2)
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    tokens, hidden_size, vocab = case["shape"]
    hidden = torch.randn(tokens, hidden_size) * 3
    weight = torch.randn(vocab, hidden_size) / hidden_size**0.5
    weight[64:104] = hidden[0] / hidden[0].norm() * 4  # 32 in the tile [64, 96), 8 in the next
    weight[[5, 200, 1100]] = hidden[1] / hidden[1].norm() * 4
    last_split = [first + offset for first in (1160, 1190, 1220, 1250) for offset in range(3)]
    weight[last_split] = hidden[2] / hidden[2].norm() * 4
    weight[[10, 11]] = hidden[3] / hidden[3].norm() * 4
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if dtype == torch.float32:
        temperature = torch.rand(tokens) * 1.5 + 0.5
    else:
        temperature = torch.full((1,), 0.7).expand(tokens)
    exact_logits = hidden.double() @ weight.double().t() / temperature.double()[:, None]
    exact, scale = torch.log_softmax(exact_logits, -1), float(exact_logits.abs().max())
    order = torch.sort(exact, dim=1, descending=True, stable=True).indices  # equal: the lower id first

    def block_logits(index):
        return (hidden[index].float() @ weight.float().t()) / temperature[index, None]

    results = {}
    for k in case["ks"]:
        stats, keys = top_keys(hidden, weight, temperature, k, 0, block_logits, token_chunk=17, tuning=tuning)
        logits, ids = keyed_logits(keys)
        logprob = logits - summarize(stats).lse[:, None]
        results[k] = [
            bool((ids == order[:, :k]).all()),
            float((logprob.double() - exact.gather(1, order[:, :k])).abs().max()) / scale,
        ]
    hidden[5] = float("nan")
    _, keys = top_keys(hidden, weight, temperature, 2, 0, block_logits, token_chunk=17, tuning=tuning)
    results["nan"] = bool(((keyed_logits(keys)[1] >= 0) & (keyed_logits(keys)[1] < vocab)).all())
    return results


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

    from devkit.oracle import max_abs_error, reference, relative_error
    from megatron_fused_lm.ops.backends.triton_loss import TritonLoss
    from megatron_fused_lm.ops.backends.triton_recompute import TritonRecompute
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.contract import NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
    from megatron_fused_lm.ops.kept_tokens import KeptSets, every_column, torch_kept_mask
    from megatron_fused_lm.ops.kernels.kept_mask_kernel import kept_mask
    from megatron_fused_lm.ops.kernels.tiles import Tiles
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
    options = dict(
        token_chunk=case.get("token_chunk"), batch_invariant=case.get("batch_invariant", False), tuning=tuning
    )
    if case.get("three_gemm"):
        backend = TritonLoss(entropy_grad=case["entropy_grad"], **options)

        def run(rows):
            return three_gemm_pass(
                backend, hidden[rows], weight, targets[rows], temperature[rows], grad_logprob[rows],
                None if grad_entropy is None else grad_entropy[rows], case.get("shards", 1),
                lambda first, count: kept_mask_of(rows, first, count),
            )  # fmt: skip
    else:  # one rank: every target in this shard
        backend = TritonRecompute(**options)

        def run(rows):
            problem = ShardProblem(hidden[rows], weight, targets[rows], temperature[rows], kept_mask_of(rows, 0, vocab))
            summary = summarize(backend.local_statistics(problem))
            upstream = UpstreamGrads(grad_logprob[rows], None if grad_entropy is None else grad_entropy[rows])
            saved = SavedStatistics(summary.lse, summary.mean_logit)
            grads = backend.local_gradients(problem, saved, upstream, NeededGrads(hidden=True, weight=True))
            return summary.logprob, summary.entropy, grads

    logprob, entropy, grads = run(slice(0, tokens))
    rows_alone_equal = None
    if case.get("batch_invariant"):  # the first rows in a call of their own: bitwise as in the whole?
        alone = run(slice(0, min(tokens, 5)))
        rows_alone_equal = all(
            torch.equal(part, whole[: part.shape[0]]) for part, whole in zip(alone[:2], (logprob, entropy), strict=True)
        ) and torch.equal(alone[2].hidden, grads.hidden[: alone[2].hidden.shape[0]])
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy, kept=kept)
    sampled = weight[:: -(-weight.shape[0] // case["reference_rows"])] if case.get("reference_rows") else weight
    logits = hidden.double() @ weight.double().t() / temperature.double()[:, None]
    sampled_max = (hidden.double() @ sampled.double().t() / temperature.double()[:, None]).amax(1)
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


def three_gemm_pass(backend, hidden, weight, targets, temperature, grad_logprob, grad_entropy, shards, kept_mask_of):
    """The package's loss-in-forward pass (``run_loss_pass``) with the vocabulary split into
    ``shards`` equal shards, one pass per shard as each rank of a tensor-parallel group would run
    it (``kept_mask_of(first column, columns)``: its kept_mask); the chunk step merges the shards'
    statistics as the group's all-gather does. Returns
    ``(logprob, entropy, Gradients)`` with the hidden gradient summed over the shards and the
    weight gradient's shards stacked."""
    import torch

    from megatron_fused_lm.ops.contract import Gradients, NeededGrads, ShardProblem, UpstreamGrads, run_loss_pass
    from megatron_fused_lm.ops.softmax import merge_statistics, summarize

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
            return summarize(local_statistics), UpstreamGrads(None, None)

        run_loss_pass(backend, problem, record, NeededGrads(hidden=False, weight=False))
    # ... then each shard's gradients, its chunks in order, merged with the others' statistics.
    logprob, entropy = torch.empty(tokens), torch.empty(tokens)
    partials = []
    for problem in problems:
        chunk_starts = []

        def chunk_step(rows, local_statistics, chunk_starts=chunk_starts):
            chunk_starts.append(rows.start)
            summary = summarize(merge_statistics(torch.stack([part[rows.start] for part in local])))
            logprob[rows], entropy[rows] = summary.logprob, summary.entropy
            upstream = [None if grad is None else grad[rows] for grad in (grad_logprob, grad_entropy)]
            return summary, UpstreamGrads(*upstream)

        state = run_loss_pass(backend, problem, chunk_step, NeededGrads(hidden=True, weight=True))
        # An upstream gradient of 1: unscaled.
        partials.append(
            backend.finish(state.held_hidden, state.held_weight, torch.ones(()), (hidden.dtype, weight.dtype), True)
        )
        assert chunk_starts == sorted(chunk_starts) and len(set(chunk_starts)) == len(chunk_starts)
    grad_hidden = torch.stack([grads.hidden.float() for grads in partials]).sum(0).to(hidden.dtype)
    return logprob, entropy, Gradients(grad_hidden, torch.cat([grads.weight for grads in partials]))


def run_case(**case) -> dict:
    case = dict(dict(seed=0, temperature=1.0, hidden_scale=1.0, entropy_grad=True), **case)
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(case)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Bounds per input dtype: (max |log-prob or entropy error|, max gradient error relative to the
# largest entry). float32 runs IEEE float32 products: measured errors are 0.5-2e-6, and 1e-5
# leaves room for other summation orders. float16 inputs are exact in the float32 products, so
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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_topk(dtype):
    # The Triton top-k: thresholds from the first launch's tile maxima, candidates from the second
    # in split slots, a crowded row past a tile's picks and one past its split's slots, ties across
    # tiles (lower ids first), k past a quarter of the column tiles, per-row temperatures, a NaN
    # row, two chunks of rows.
    results = run_case(kind="topk", dtype=dtype, shape=[34, 24, 1280], ks=[1, 2, 9, 12], seed=6)
    assert results.pop("nan")
    for k, (ids_equal, logprob_error) in results.items():
        # float32 logits of up to 84 here (the crowded row's), each rounded by a few 1e-7 of it.
        assert ids_equal and logprob_error <= 1e-6, (k, ids_equal, logprob_error)


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


def test_batch_invariant_three_gemm_refuses_float32_weights():
    # A float32 block holds exponentials against row references from products over the chunk's
    # rows: no form the option could keep.
    import torch

    from megatron_fused_lm.ops.backends.triton_loss import TritonLoss
    from megatron_fused_lm.ops.contract import NeededGrads, ShardProblem
    from megatron_fused_lm.ops.kept_tokens import every_column

    problem = ShardProblem(
        torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(4, dtype=torch.long), torch.ones(4), every_column("cpu")
    )
    with pytest.raises(ValueError, match="needs 16-bit weights"):
        TritonLoss(batch_invariant=True).allocate(problem, NeededGrads(True, True))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_held_gradient_kernels_match_the_torch_code(dtype):
    # Both sum the same float32 terms per element (the chosen rows in token order), and round the
    # same float32 sum into the same dtype once.
    errors = run_case(kind="held_gradient_kernels", dtype=dtype, shape=[41, 300, 9], seed=8)
    assert all(error <= 1e-6 for error in errors.values()), errors


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
    print(json.dumps(run_case_here(json.loads(sys.argv[1]))))


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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_several_targets_per_row(dtype):
    # k = 3 ids per row (one repeated) over two token chunks and several vocabulary blocks: the
    # backward kernel adds each id's term to the float32 tile, the shared term taking their sum.
    result = run_case(kind="several_targets", dtype=dtype, shape=[24, 40, 131, 3], seed=12)
    value_tol, grad_tol = TOLERANCE[dtype]
    assert result["logprob"] <= value_tol, result
    assert result["grad_hidden"] <= grad_tol and result["grad_weight"] <= grad_tol, result
