"""How the Triton backend shapes its launches and chunks: the rules, and ``TritonTuning``, the public
object that fixes any of their choices instead (tile sweeps and the interpreter tests do).
``docs/benchmarks/constants.md`` has the measurements behind each rule.

- Tiles: the constants below; a forward kernel that stores a block from 16-bit operands takes the
  first of ``STORING_CANDIDATES`` whose shared memory (``shared_memory_bytes``) fits the device.
- Vocabulary splits of the forward kernel: the column tiles per split (``TILES_PER_SPLIT``) whose
  splits of one token tile leave the least idle time in the last wave of programs; chosen from the
  vocabulary alone, so that a row's result does not depend on the other rows of the call.
- Recompute backward: token chunks of ``TOKEN_CHUNK`` rows, vocabulary chunks within
  ``WORKING_SET_BYTES`` plus ``WORKING_SET_GRADIENT_SHARE`` of the gradients' bytes.
- Loss-in-forward pass: token chunks whose stored block takes at most the stored-block budget
  (``TritonTuning.stored_block_bytes``; by default ``STORED_BLOCK_SHARE`` of the device's memory),
  the rows split evenly over the chunks: one chunk wherever the whole block fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from ..kernels.tiles import Tiles

TOKEN_CHUNK = 8192
WORKING_SET_BYTES = 256 * 2**20
WORKING_SET_GRADIENT_SHARE = 0.1
RESERVE_BYTES = 32 * 2**20  # of the working set, for the statistics and small temporaries
VOCAB_CHUNK_MULTIPLE = 256  # keeps the cuBLAS products on whole tiles
# The stored block's default budget, a share of the device's memory, which holds 8192 tokens of a
# 151936-id vocabulary (2.3 GiB in 16 bits) in one chunk on an 80 GB card.
STORED_BLOCK_SHARE = 1 / 32
REFERENCE_ROWS = 512  # weight rows sampled for each row's reference (plus the chosen token's)

GPU_16BIT_TILES = Tiles(
    block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32"
)
GPU_16BIT_GRAD_TILES = Tiles(
    block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32"
)
# Float32 operands multiply by 3xTF32 ("tf32x3": float32's accuracy on tensor cores), in order of
# preference: the first tiles whose shared memory fits the device (an H100 or H200: the first).
GPU_FLOAT32_CANDIDATES = (
    Tiles(block_m=128, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3, dot_precision="tf32x3"),
    Tiles(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3, dot_precision="tf32x3"),
)
# Forward tiles of 16-bit operands that store a (16-bit) block, in order of preference; a kernel
# takes the first that fits the device with its store (an H100 or H200: the first; the last fits
# within 163 KiB).
STORING_CANDIDATES = (
    Tiles(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, dot_precision="tf32"),
    Tiles(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32"),
    Tiles(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, dot_precision="tf32"),
)
SHARED_MEMORY_MARGIN = 2560  # bytes Triton takes besides the tiles (barriers, reductions)
HOPPER_SHARED_MEMORY = 232448  # bytes per block an H100 or H200 grants (its opt-in maximum)
# What the rules read of a device without CUDA properties (the Triton interpreter on CPU tensors):
# an H100's, so that a debugging run makes the launch and chunk choices an H100 would.
H100_PROPERTIES = SimpleNamespace(
    multi_processor_count=132, total_memory=85_017_493_504, shared_memory_per_block_optin=HOPPER_SHARED_MEMORY
)
TILES_PER_SPLIT = range(6, 17)  # candidates of the split rule


def shared_memory_bytes(tiles: Tiles, operand_bytes: int, store_bytes: int) -> int:
    """Shared memory of the forward kernel with these tiles: ``num_stages`` pipelined operand tiles
    and, when it stores the block, the staging of one half-width output tile of ``store_bytes``."""
    operands = tiles.num_stages * (tiles.block_m + tiles.block_n) * tiles.block_k * operand_bytes
    return operands + tiles.block_m * tiles.block_n // 2 * store_bytes + SHARED_MEMORY_MARGIN


def fitting_tiles(candidates, operand_bytes: int, store_bytes: int, device: Optional[torch.device]) -> Tiles:
    """The first of ``candidates`` whose shared memory fits ``device`` (``None``: an H100's), else the last."""
    limit = HOPPER_SHARED_MEMORY if device is None else shared_memory_limit(device)
    fitting = (tiles for tiles in candidates if shared_memory_bytes(tiles, operand_bytes, store_bytes) <= limit)
    return next(fitting, candidates[-1])


def device_properties(device: torch.device):
    """CUDA's properties of ``device``, or ``H100_PROPERTIES`` where it has none."""
    return torch.cuda.get_device_properties(device) if device.type == "cuda" else H100_PROPERTIES


def shared_memory_limit(device: torch.device) -> int:
    return getattr(device_properties(device), "shared_memory_per_block_optin", HOPPER_SHARED_MEMORY)


@dataclass(frozen=True)
class TritonTuning:
    """Fixed choices for the Triton backend; each field left ``None`` is chosen per problem by the
    rules above.

    Attributes:
        forward_tiles: the forward kernel's launch shape (also the loss-in-forward pass's).
        backward_tiles: the recompute backward kernel's launch shape, and ``rows_product``'s on both
            paths (``batch_invariant``, float32 operands).
        tiles_per_split: the forward kernel's column tiles per vocabulary split.
        programs: programs of the persistent backward grid, and the wave size of the split rule
            (the multiprocessor count).
        dz_block_bytes: bytes of one recompute-backward ``dz`` block.
        reference_rows: weight rows sampled for each row's reference in the loss-in-forward pass.
        stored_block_bytes: the loss-in-forward pass's memory budget for one chunk's stored logits
            (its chunks take as many rows as fit; by default ``STORED_BLOCK_SHARE`` of the
            device's memory).
    """

    forward_tiles: Optional[Tiles] = None
    backward_tiles: Optional[Tiles] = None
    tiles_per_split: Optional[int] = None
    programs: Optional[int] = None
    dz_block_bytes: Optional[int] = None
    reference_rows: Optional[int] = None
    stored_block_bytes: Optional[int] = None

    def forward_tiles_for(
        self, dtype: torch.dtype, stored: Optional[torch.dtype] = None, device: Optional[torch.device] = None
    ) -> Tiles:
        """The forward kernel's tiles for operands of ``dtype``, storing a block of ``stored`` (or
        nothing) on ``device``."""
        if self.forward_tiles is not None:
            return self.forward_tiles
        if dtype == torch.float32:
            return fitting_tiles(GPU_FLOAT32_CANDIDATES, 4, 0 if stored is None else stored.itemsize, device)
        if stored is None:
            return GPU_16BIT_TILES
        return fitting_tiles(STORING_CANDIDATES, 2, stored.itemsize, device)

    def backward_tiles_for(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> Tiles:
        if self.backward_tiles is not None:
            return self.backward_tiles
        return fitting_tiles(GPU_FLOAT32_CANDIDATES, 4, 0, device) if dtype == torch.float32 else GPU_16BIT_GRAD_TILES

    def programs_for(self, device: torch.device) -> int:
        """One program per multiprocessor: the 16-bit tiles take most of its shared memory."""
        return self.programs or device_properties(device).multi_processor_count

    def tiles_per_split_for(self, vocab: int, tiles: Tiles, device: torch.device) -> int:
        """The candidate whose splits of one token tile, run ``programs`` at a time, leave the least
        idle time in the last wave (ties: fewer splits). It does not depend on the number of tokens,
        so that a row's statistics are merged in the same order whatever rows share the call (batch
        invariance); a whole wave of splits per token tile also fills every wave of a larger call."""
        if self.tiles_per_split is not None:
            return self.tiles_per_split
        programs = self.programs_for(device)
        col_tiles = -(-vocab // tiles.block_n)

        def column_tiles_per_slot(per_split: int) -> int:
            splits = -(-col_tiles // per_split)
            return -(-splits // programs) * per_split

        candidates = {min(per_split, col_tiles) for per_split in TILES_PER_SPLIT}
        return min(candidates, key=lambda per_split: (column_tiles_per_slot(per_split), -per_split))

    def stored_block_bytes_for(self, device: torch.device) -> int:
        """The stored block's budget on ``device``."""
        if self.stored_block_bytes is not None:
            return self.stored_block_bytes
        return int(STORED_BLOCK_SHARE * device_properties(device).total_memory)

    def dz_block_bytes_for(self, gradient_bytes: int, accumulator_bytes: int) -> int:
        """Bytes of the recompute backward's ``dz`` block: what the working-set target leaves."""
        if self.dz_block_bytes is not None:
            return self.dz_block_bytes
        budget = WORKING_SET_BYTES + WORKING_SET_GRADIENT_SHARE * gradient_bytes
        return int(budget - accumulator_bytes - RESERVE_BYTES)


def loss_token_chunk(num_tokens: int, vocab: int, bytes_per_logit: int, tiles: Tiles, budget: int) -> int:
    """Rows per loss-in-forward chunk: at most as many whole token tiles as ``budget`` bytes hold at
    ``bytes_per_logit`` (the stored block's), and as few as still need that many chunks, so that
    the rows split evenly (a short last chunk would run every phase at low occupancy)."""
    limit = max(tiles.block_m, budget // (bytes_per_logit * vocab) // tiles.block_m * tiles.block_m)
    chunks = max(1, -(-num_tokens // limit))
    even = max(1, -(-num_tokens // chunks))
    return min(limit, -(-even // tiles.block_m) * tiles.block_m)
