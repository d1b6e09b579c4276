"""The CuTe backend: the Triton backend with its forward statistics computed by a CuTe DSL kernel
on Hopper (``cute_kernels.statistics_kernel``). Every other pass, and a forward the CuTe kernel does
not take (``statistics_unsupported``), runs Triton's kernels, with one logged reason per kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..._logging import warn_once
from ..kernels.merge_kernel import merge_parts
from ..options import HeadOptions
from ..softmax import NUM_STATISTICS
from .contract import ShardProblem
from .triton import TritonBackend
from .triton_tuning import TritonTuning

# Column tiles (of 128) per vocabulary split: a function of the vocabulary alone, so a row's
# statistics do not depend on the other rows of the call (docs/DESIGN.md, "Batch invariance").
TILES_PER_SPLIT = 8


def statistics_unsupported(problem: ShardProblem, softcap: Optional[float]) -> Optional[str]:
    """Why the CuTe statistics kernel does not take ``problem`` (under the logits' ``softcap``), or
    ``None`` where it does."""
    hidden, weight = problem.hidden, problem.weight
    if softcap is not None:
        return "softcap is not in the CuTe kernel yet"
    if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        return f"it takes bfloat16 or float16 operands of one dtype, got {hidden.dtype} and {weight.dtype}"
    if problem.kept_mask.numel():
        return "kept_tokens is not in the CuTe kernel yet"
    if problem.target_column.dim() != 1:
        return "several targets per row are not in the CuTe kernel yet"
    if hidden.shape[1] % 8 or hidden.stride(1) != 1 or weight.stride(1) != 1:
        return "its TMA loads need unit-stride rows of a multiple of 8 elements"
    if any(tensor.stride(0) % 8 or tensor.data_ptr() % 16 for tensor in (hidden, weight)):
        return "its TMA loads need 16-byte-aligned rows"
    return None


@dataclass(frozen=True)
class CuteBackend(TritonBackend):
    """Triton's backend with the forward statistics of the CuTe kernel (``backend="cute"``)."""

    @property
    def name(self) -> str:
        """``"cute"``, or with a Triton tuning of its own a name of that tuning."""
        return "cute" if self.tuning == TritonTuning() else f"cute:{self.tuning!r}"

    def local_statistics(self, problem: ShardProblem, options: HeadOptions) -> torch.Tensor:
        """This shard's statistics ``[n, 4]`` (float32): the CuTe kernel's splits, merged by Triton's
        ``merge_parts`` (its order fixed by the number of parts)."""
        if problem.hidden.shape[0] == 0:
            return problem.hidden.new_empty(0, NUM_STATISTICS, dtype=torch.float32)
        reason = statistics_unsupported(problem, options.softcap)
        if reason is not None:
            warn_once(f"backend='cute' computes these forward statistics with Triton: {reason}")
            return super().local_statistics(problem, options)
        from ..cute_kernels.statistics_kernel import cute_split_statistics

        parts = cute_split_statistics(
            problem.hidden,
            problem.weight,
            target_column=problem.target_column,
            temperature=problem.temperature,
            tiles_per_split=TILES_PER_SPLIT,
        )
        return merge_parts(parts)
