"""The Triton backend: a fused Triton forward; a Triton recompute + ``dz`` kernel and cuBLAS products
in the backward.

Forward: ``split_statistics`` computes ``[num_splits, n, 4]`` statistics straight from hidden and
weight tiles (nothing of size ``[n, vocab_shard]`` exists); ``merge_statistics`` merges the splits
on the GPU.

Backward, blocked in two dimensions so that the memory stays bounded and ``grad_weight`` stays
accurate without a float32 ``[vocab_shard, H]`` accumulator: an outer loop over token chunks of
``TOKEN_CHUNK`` rows, an inner loop over vocabulary chunks sized so that one ``dz`` block in the
weight's dtype fills what the memory target leaves (``dz_block_bytes``). Per block,
``logit_grad_block`` recomputes ``hidden @ weight.T`` tile by tile and writes ``dz / T`` straight
from its epilogue, and cuBLAS adds ``dz @ w`` into a float32 ``[token chunk, H]`` accumulator for
``grad_hidden`` (exact over the vocabulary chunks) and ``dz.T @ h`` into ``grad_weight`` (rounded
to the weight's dtype once per token chunk). Working set besides the returned gradients: the
``dz`` block plus the float32 ``[token chunk, H]`` accumulator.

Three GEMMs (``loss_gradients``, for a loss known in the forward): per token chunk of
``loss_token_chunk`` rows, the forward kernel computes the statistics and keeps the chunk's
logits as exponentials against one reference per row (``stored_exponentials`` says how the
reference is chosen and checked). Once the caller has turned the statistics into upstream
gradients, cuBLAS runs the two products on that block as it is, scaled per row, when the loss has
no entropy term; with one, ``stored_logit_grads`` first rewrites the block as ``dz``.
Both gradients stay in float32 (``stored_gradients``) until the backward scales them by the upstream
gradient and rounds each once, however many chunks there are.

Both kernels read their operands through tensor descriptors (TMA on Hopper), which need unit last
strides and 16-byte aligned rows: other layouts are copied once per call (``addressable``).

Tile rule (measurements in ``docs/BENCHMARKS.md``): 16-bit inputs use 256 x 128 x 64 forward
tiles and 128 x 256 x 64 backward tiles, 8 warps, 3 stages, 8 token tiles per group; the forward's
column tiles per split (6 to 16) are chosen per shape to fill the last wave of programs; the
backward grid is persistent, one program per multiprocessor. float32 inputs use 64 x 64 x 32
tiles with IEEE float32 products. Each choice can be fixed instead through a ``TritonBackend``
field (tile sweeps do; so do the tests, which run the kernels under the Triton interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .chunking import token_chunks
from .contract import ChunkUpstream, Gradients, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from .products import add_product
from .softmax_stats import MAX, NUM_STATISTICS, TARGET, merge_statistics
from .stored_exponentials import (
    REFERENCE_ROWS,
    chosen_token_grad,
    row_factor,
    row_references,
    stale_references,
    stored_dtype,
)
from .stored_gradients import StoredGradients, WeightAccumulator, take_chosen
from .triton_kernels.chosen_token_kernel import add_chosen_rows, finish_hidden_grad
from .triton_kernels.descriptors import addressable, addressable_empty
from .triton_kernels.logit_grad_kernel import logit_grad_block
from .triton_kernels.softmax_stats_kernel import refresh_stored_exp, split_statistics
from .triton_kernels.stored_grad_kernel import stored_logit_grads
from .triton_kernels.tiles import Tiles

TOKEN_CHUNK = 8192
# The backward's working set besides the returned gradients is held to the memory target,
# WORKING_SET_BYTES plus WORKING_SET_GRADIENT_SHARE of the gradient bytes; RESERVE_BYTES of it
# stay for the statistics and small temporaries, the float32 accumulator takes its share, and the
# dz block gets the rest (fewer, larger blocks measured up to 5 % faster at 4096 tokens).
WORKING_SET_BYTES = 256 * 2**20
WORKING_SET_GRADIENT_SHARE = 0.1
RESERVE_BYTES = 32 * 2**20
VOCAB_CHUNK_MULTIPLE = 256  # keeps the cuBLAS products on whole tiles
# The three-GEMM path keeps one token chunk's logits: STORED_LOGITS_BYTES of them at most. Larger
# chunks cost memory and save per-chunk time: at 32768 x 4096 x 151936 on an H100 the pass took
# 1.22x the three GEMMs with 1536-row chunks (512 MiB), 1.17x with 3072 rows (1 GiB).
STORED_LOGITS_BYTES = 2**30

GPU_16BIT_TILES = Tiles(
    block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32"
)
GPU_16BIT_GRAD_TILES = Tiles(
    block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32"
)
GPU_FLOAT32_TILES = Tiles(
    block_m=64, block_n=64, block_k=32, group_m=8, num_warps=8, num_stages=3, dot_precision="ieee"
)
TILES_PER_SPLIT = range(6, 17)  # candidates; the rule picks the one that fills the last wave best


def choose_tiles(dtype: torch.dtype) -> tuple[Tiles, Tiles]:
    """Tiles of the forward kernel and of the backward kernel for operands of ``dtype``."""
    if dtype == torch.float32:
        return GPU_FLOAT32_TILES, GPU_FLOAT32_TILES
    return GPU_16BIT_TILES, GPU_16BIT_GRAD_TILES


def multiprocessors(device: torch.device) -> int:
    """Programs that run at once with the 16-bit tiles: one per multiprocessor (they take most of
    its shared memory)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_tiles_per_split(num_tokens: int, vocab: int, tiles: Tiles, programs: int) -> int:
    """Column tiles per vocabulary split: the candidate whose programs, run ``programs`` at a
    time, leave the least idle time in the last wave (ties: fewer splits)."""
    row_tiles, col_tiles = -(-num_tokens // tiles.block_m), -(-vocab // tiles.block_n)

    def column_tiles_per_slot(per_split: int) -> int:
        split_programs = row_tiles * -(-col_tiles // per_split)
        return -(-split_programs // programs) * per_split

    candidates = {min(per_split, col_tiles) for per_split in TILES_PER_SPLIT}
    return min(candidates, key=lambda per_split: (column_tiles_per_slot(per_split), -per_split))


def loss_token_chunk(num_tokens: int, vocab: int, bytes_per_logit: int, tiles: Tiles) -> int:
    """Rows per three-GEMM chunk: at most as many whole token tiles as ``STORED_LOGITS_BYTES``
    holds, and as few as still need that many chunks, so that the rows split evenly (a short last
    chunk would run every phase at low occupancy)."""
    limit = max(tiles.block_m, STORED_LOGITS_BYTES // (bytes_per_logit * vocab) // tiles.block_m * tiles.block_m)
    chunks = max(1, -(-num_tokens // limit))
    even = max(1, -(-num_tokens // chunks))
    return min(limit, -(-even // tiles.block_m) * tiles.block_m)


def memory_target_dz_bytes(gradient_bytes: int, accumulator_bytes: int) -> int:
    """Bytes left for the backward's ``dz`` block by the memory target."""
    budget = WORKING_SET_BYTES + WORKING_SET_GRADIENT_SHARE * gradient_bytes
    return int(budget - accumulator_bytes - RESERVE_BYTES)


@dataclass(frozen=True)
class TritonBackend:
    """The Triton backend. Each field left ``None`` is chosen per problem by the rule above.

    Attributes:
        token_chunk: backward rows per outer chunk (``TOKEN_CHUNK``); the forward needs no chunks.
        forward_tiles, backward_tiles: the kernels' launch shapes (``choose_tiles``).
        tiles_per_split: the forward's column tiles per vocabulary split.
        programs: programs of the persistent backward grid (the multiprocessor count), and the
            wave size of the forward's split rule.
        dz_block_bytes: bytes of one backward ``dz`` block (``memory_target_dz_bytes``).
        reference_rows: weight rows the three-GEMM path samples for each row's reference
            (``stored_exponentials.REFERENCE_ROWS``).
    """

    token_chunk: Optional[int] = None
    forward_tiles: Optional[Tiles] = None
    backward_tiles: Optional[Tiles] = None
    tiles_per_split: Optional[int] = None
    programs: Optional[int] = None
    dz_block_bytes: Optional[int] = None
    reference_rows: Optional[int] = None

    def local_statistics(self, problem: ShardProblem) -> torch.Tensor:
        """This shard's statistics ``[n, 4]`` (float32)."""
        hidden, weight = problem.hidden, problem.weight
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, NUM_STATISTICS, dtype=torch.float32)
        tiles = self.forward_tiles or choose_tiles(weight.dtype)[0]
        tiles_per_split = self.tiles_per_split or choose_tiles_per_split(
            hidden.shape[0], weight.shape[0], tiles, self._programs(weight.device)
        )
        parts = split_statistics(
            hidden, weight, problem.targets.columns(), 1.0 / problem.temperature, tiles, tiles_per_split
        )
        return merge_statistics(parts)

    def local_gradients(
        self, problem: ShardProblem, saved: SavedStatistics, upstream: UpstreamGrads, needed: NeededGrads
    ) -> Gradients:
        """This shard's gradients (``contract.Gradients`` gives their dtypes)."""
        hidden, weight = problem.hidden, problem.weight
        num_tokens, hidden_size = hidden.shape
        vocab = weight.shape[0]
        grad_hidden = hidden.new_empty(hidden.shape) if needed.hidden else None
        grad_weight = weight.new_empty(weight.shape) if needed.weight else None
        if num_tokens == 0:
            return Gradients(grad_hidden, None if grad_weight is None else grad_weight.zero_())

        token_chunk = min(self.token_chunk or TOKEN_CHUNK, num_tokens)
        accumulator_bytes = token_chunk * hidden_size * 4 if needed.hidden else 0
        dz_bytes = self.dz_block_bytes
        if dz_bytes is None:
            gradient_bytes = sum(
                grad.numel() * grad.element_size() for grad in (grad_hidden, grad_weight) if grad is not None
            )
            dz_bytes = memory_target_dz_bytes(gradient_bytes, accumulator_bytes)
        multiple = VOCAB_CHUNK_MULTIPLE
        vocab_chunk = dz_bytes // weight.element_size() // token_chunk
        vocab_chunk = min(vocab, max(multiple, vocab_chunk // multiple * multiple))
        # Row stride a multiple of VOCAB_CHUNK_MULTIPLE: the kernel stores through a tensor descriptor.
        logit_grads = weight.new_empty(token_chunk, -(-vocab_chunk // multiple) * multiple)
        hidden_acc = hidden.new_empty(token_chunk, hidden_size, dtype=torch.float32) if needed.hidden else None
        tiles = self.backward_tiles or choose_tiles(weight.dtype)[1]
        programs = self._programs(weight.device)
        hidden_operand, weight_operand = addressable(hidden), addressable(weight)
        target_columns = problem.targets.columns()
        saved = SavedStatistics(*(part.contiguous() for part in saved))
        upstream = UpstreamGrads(*(None if part is None else part.contiguous() for part in upstream))

        for tokens in token_chunks(num_tokens, token_chunk):
            rows = tokens.stop - tokens.start
            token_saved = SavedStatistics(*(part[tokens] for part in saved))
            token_upstream = UpstreamGrads(*(None if part is None else part[tokens] for part in upstream))
            for columns in token_chunks(vocab, vocab_chunk):
                block = logit_grad_block(
                    logit_grads[:rows, : columns.stop - columns.start],
                    hidden_operand[tokens],
                    weight_operand[columns],
                    target_columns[tokens] - columns.start,
                    token_saved,
                    token_upstream,
                    1.0 / problem.temperature,
                    tiles,
                    programs,
                )
                if hidden_acc is not None:
                    add_product(hidden_acc[:rows], block, weight[columns], accumulate=columns.start > 0)
                if grad_weight is not None:
                    add_product(grad_weight[columns], block.t(), hidden[tokens], accumulate=tokens.start > 0)
            if grad_hidden is not None:
                grad_hidden[tokens] = hidden_acc[:rows]
        return Gradients(grad_hidden, grad_weight)

    def loss_gradients(
        self, problem: ShardProblem, chunk_upstream: ChunkUpstream, needed: NeededGrads
    ) -> StoredGradients:
        """Both gradients in float32, each chunk's logits computed once (``contract.Backend``)."""
        hidden, weight = problem.hidden, problem.weight
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        inv_temperature = 1.0 / problem.temperature
        tiles = self.forward_tiles or choose_tiles(weight.dtype)[0]
        block_dtype = stored_dtype(weight.dtype)
        # The products read the block itself where it has the weight's dtype; elsewhere (float16
        # operands) dz goes to a block of its own.
        direct = block_dtype == weight.dtype
        bytes_per_logit = block_dtype.itemsize + (0 if direct else weight.element_size())
        token_chunk = self.token_chunk or loss_token_chunk(num_tokens, vocab, bytes_per_logit, tiles)
        token_chunk = min(token_chunk, max(num_tokens, 1))
        # float32 outputs also keep cuBLAS from reducing split-K partials in 16 bits (long
        # vocabulary sums, few tokens).
        grad_hidden = hidden.new_empty(hidden.shape, dtype=torch.float32) if needed.hidden else None
        weight_grad = WeightAccumulator(weight) if needed.weight else None
        stored = addressable_empty(hidden, token_chunk, vocab, block_dtype)
        logit_grads = stored if direct else addressable_empty(hidden, token_chunk, vocab, weight.dtype)
        hidden_operand, weight_operand = addressable(hidden), addressable(weight)
        target_columns = problem.targets.columns()
        for tokens in token_chunks(num_tokens, token_chunk):
            rows = tokens.stop - tokens.start
            chunk_hidden, columns, block = hidden_operand[tokens], target_columns[tokens], stored[:rows]
            tiles_per_split = self.tiles_per_split or choose_tiles_per_split(
                rows, vocab, tiles, self._programs(weight.device)
            )
            reference = row_references(
                chunk_hidden, weight, columns, inv_temperature, self.reference_rows or REFERENCE_ROWS
            )
            parts = split_statistics(
                chunk_hidden, weight_operand, columns, inv_temperature, tiles, tiles_per_split, block, reference
            )
            local = merge_statistics(parts)
            reference, refresh = stale_references(reference, local[:, MAX])
            refresh_stored_exp(
                chunk_hidden, weight_operand, inv_temperature, tiles, tiles_per_split, block, reference, refresh
            )
            saved, upstream = chunk_upstream(tokens, local)
            if grad_hidden is None and weight_grad is None:
                continue
            saved = SavedStatistics(*(part.contiguous() for part in saved))
            upstream = UpstreamGrads(*(None if part is None else part.contiguous() for part in upstream))
            factor = chosen = None
            if direct and upstream.entropy is None:
                # The block is dz up to the per-row factor, the chosen token aside: the products read it.
                factor = row_factor(upstream.logprob, saved.lse, reference, inv_temperature)
                chosen = chosen_token_grad(columns, local[:, TARGET], saved.lse, upstream.logprob, inv_temperature)
                take_chosen(block, columns)
                operand = block
            else:
                operand = stored_logit_grads(
                    block, reference, logit_grads[:rows], columns, saved, upstream, inv_temperature
                )
            if grad_hidden is not None:
                product = add_product(grad_hidden[tokens], operand, weight, accumulate=False)
                if factor is not None:
                    finish_hidden_grad(product, factor, chosen, columns, weight_operand, product)
            if weight_grad is not None:
                chunk_rows = hidden[tokens]
                if factor is not None:
                    chunk_rows = (chunk_rows * factor.unsqueeze(1)).to(weight.dtype)
                weight_grad.add(operand, chunk_rows)
                if factor is not None:
                    add_chosen_rows(weight_grad.parts, columns, chosen, chunk_hidden)
        return StoredGradients(grad_hidden, weight_grad, hidden.dtype)

    def _programs(self, device: torch.device) -> int:
        return self.programs or multiprocessors(device)
