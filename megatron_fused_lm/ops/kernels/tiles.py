"""A kernel's launch shape: tile sizes, program ordering, warps and pipeline depth."""

from __future__ import annotations

from typing import NamedTuple


class Tiles(NamedTuple):
    """One kernel launch's shape.

    ``block_m`` tokens x ``block_n`` vocabulary rows per output tile, ``block_k`` of the hidden
    dimension per ``tl.dot`` step; ``group_m`` token tiles are walked together so that their
    hidden rows and the weight rows they share stay in L2; ``num_warps`` and ``num_stages`` as
    for any Triton kernel; ``dot_precision`` is ``tl.dot``'s ``input_precision`` ("tf32x3" for
    float32 inputs: three TF32 products, so float32 means float32's accuracy and not TF32's).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    dot_precision: str

    def launch_options(self) -> dict:
        """The kernels' tile constants and Triton launch options, as keyword arguments."""
        return dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            GROUP_M=self.group_m,
            DOT_PRECISION=self.dot_precision,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )

    def with_kept_columns(self, has_kept: bool) -> Tiles:
        """These tiles, one pipeline stage fewer where the forward kernel reads a kept-columns mask
        (``epilogue.kept_tile``) beside the block it stores: the store's staging and the
        mask's spread take shared memory the deepest pipelines fill (Hopper, bf16: 245792 bytes of
        232448). Without a store the tuned depth fits and is kept: one stage fewer slows the forward
        (docs/benchmarks/constants.md, kept-token masks)."""
        return self._replace(num_stages=self.num_stages - 1) if has_kept and self.num_stages > 2 else self
