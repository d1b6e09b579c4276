"""The Triton backend as one object: its four-GEMM path (``triton_recompute``), its three-GEMM path
(``triton_loss``), its kept-token masks and top-k, with the launch choices of one ``TritonTuning``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kept_tokens import KeptSets
from ..kernels.kept_mask_kernel import kept_mask
from . import triton_topk
from .triton_loss import TritonLoss
from .triton_recompute import TritonRecompute
from .triton_tuning import TritonTuning


@dataclass(frozen=True)
class TritonBackend(TritonRecompute, TritonLoss):
    """The Triton kernels on CUDA; ``tuning`` fixes any of their launch choices (``backend=
    TritonBackend(TritonTuning(...))`` on any public op; the default chooses each by its rule)."""

    tuning: TritonTuning = field(default_factory=TritonTuning)

    @property
    def name(self) -> str:
        """``"triton"``, or with a tuning of its own a name of that tuning."""
        return "triton" if self.tuning == TritonTuning() else f"triton:{self.tuning!r}"

    def kept_mask(self, sets: KeptSets, vocab_shard: int) -> torch.Tensor:
        """The ``kept_mask`` of ``sets`` by one program per row (``kernels.kept_mask_kernel``)."""
        return kept_mask(sets, vocab_shard)

    def top_keys(self, hidden, weight, temperature, softcap, k, first_id, block_logits, token_chunk):
        """``triton_topk.top_keys`` with this tuning."""
        return triton_topk.top_keys(
            hidden,
            weight,
            temperature=temperature,
            softcap=softcap,
            k=k,
            first_id=first_id,
            block_logits=block_logits,
            token_chunk=token_chunk,
            tuning=self.tuning,
        )
