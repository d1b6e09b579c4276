"""The backend contract: what the autograd boundary hands a backend, what it gets back, and the loop
that drives a loss-in-forward pass.

A backend works on this rank's vocabulary shard only and never communicates. A recompute backend
(``RecomputeBackend``) gives the shard's statistics in the forward and its gradients in the
backward (four GEMMs). A loss-in-forward backend (``LossBackend``) gives a pass of named phases per
token chunk, and ``run_loss_pass`` owns the chunk loop: every rank calls the chunk's step (which may
communicate) exactly once per chunk, in order, whatever the backend does. ``docs/DESIGN.md``
("Contracts") says why each piece is where it is.

Shapes: ``n`` token rows, ``H`` hidden size, ``vocab_shard`` rows of this rank's weight shard.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Optional, Protocol

import torch

from .softmax import SoftmaxSummary


class ShardProblem(NamedTuple):
    """One rank's share of the work: the rows, this rank's weight shard and the rows' targets."""

    hidden: torch.Tensor  # [n, H] float32, bfloat16 or float16
    weight: torch.Tensor  # [vocab_shard, H], hidden's dtype
    target_column: torch.Tensor  # [n] int64: the target's row in the shard, -1 where another shard owns it
    temperature: float  # divides the logits


class SavedStatistics(NamedTuple):
    """What the recompute backward needs per row, over the whole vocabulary (every rank's shard)."""

    lse: torch.Tensor  # [n] float32: log sum exp z
    mean_logit: torch.Tensor  # [n] float32: sum p z


class UpstreamGrads(NamedTuple):
    """Gradients of the loss with respect to the per-row log-prob and entropy; ``None``: no term."""

    logprob: Optional[torch.Tensor]  # [n] float32
    entropy: Optional[torch.Tensor]  # [n] float32

    @classmethod
    def from_autograd(
        cls, grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]
    ) -> Optional[UpstreamGrads]:
        """The gradients autograd hands a backward (``None`` for an unused output) in float32;
        ``None`` when nothing flows back."""
        if grad_logprob is None and grad_entropy is None:
            return None
        return cls(*(None if grad is None else grad.float() for grad in (grad_logprob, grad_entropy)))

    def rows(self, rows: slice) -> UpstreamGrads:
        return UpstreamGrads(*(None if grad is None else grad[rows] for grad in self))


class NeededGrads(NamedTuple):
    """Which gradients autograd asks for."""

    hidden: bool
    weight: bool


class Gradients(NamedTuple):
    """A backend's gradients; ``None`` where not asked for.

    ``hidden [n, H]`` is in hidden's dtype and *partial*: this shard's vocabulary only (the caller
    sums it over the tensor-parallel group, in that dtype, as Megatron's column-parallel layer
    does). ``weight [vocab_shard, H]`` is in the weight's dtype and complete for the shard.
    """

    hidden: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]


class RecomputeBackend(Protocol):
    """The four-GEMM path: products accumulate in float32."""

    def local_statistics(self, problem: ShardProblem) -> torch.Tensor:
        """This shard's statistics ``[n, 4]`` float32 (``softmax`` says what they are)."""
        ...

    def local_gradients(
        self, problem: ShardProblem, saved: SavedStatistics, upstream: UpstreamGrads, needed: NeededGrads
    ) -> Gradients:
        """This shard's gradients for the upstream gradients ``upstream``."""
        ...


class HeldGradients(Protocol):
    """A loss-in-forward pass's gradients, held in float32 until the backward."""

    def scaled(self, scale: torch.Tensor) -> Gradients:
        """Both gradients times the upstream ``scale`` (0-dim float32), each rounded once into its
        parameter's dtype; what was held is consumed."""
        ...


class LossPass(Protocol):
    """One loss-in-forward call of a backend: three GEMMs, one visit per token chunk."""

    token_chunk: int  # rows per chunk; a function of the problem's shapes only, so equal on every rank

    def chunk_statistics(self, rows: slice) -> torch.Tensor:
        """The chunk's logits (the first GEMM) and this shard's statistics of them ``[k, 4]``."""
        ...

    def chunk_gradients(self, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads) -> None:
        """The chunk's ``dz`` and its two products (the other GEMMs), from the merged statistics."""
        ...

    def held(self) -> HeldGradients:
        """The gradients summed over the chunks."""
        ...


class LossBackend(Protocol):
    def start(self, problem: ShardProblem, needed: NeededGrads) -> LossPass: ...


# ``chunk_step(rows, local_statistics [k, 4]) -> (summary, upstream)``: merges a chunk's shard
# statistics across the group (it may communicate) and evaluates the loss's per-token gradients.
ChunkStep = Callable[[slice, torch.Tensor], "tuple[SoftmaxSummary, UpstreamGrads]"]


def token_chunks(num_tokens: int, token_chunk: int) -> Iterator[slice]:
    """Slices of ``[0, num_tokens)`` of at most ``token_chunk`` rows each."""
    for start in range(0, num_tokens, token_chunk):
        yield slice(start, min(start + token_chunk, num_tokens))


def run_loss_pass(
    backend: LossBackend, problem: ShardProblem, chunk_step: ChunkStep, needed: NeededGrads
) -> Optional[HeldGradients]:
    """The three-GEMM pass: per token chunk, the backend's statistics, ``chunk_step`` (once per
    chunk, chunks in order, on every rank) and, when a gradient is needed, the backend's gradients.
    Returns the held gradients, or ``None`` when none is needed."""
    loss_pass = backend.start(problem, needed)
    for rows in token_chunks(problem.hidden.shape[0], loss_pass.token_chunk):
        summary, upstream = chunk_step(rows, loss_pass.chunk_statistics(rows))
        if needed.hidden or needed.weight:
            loss_pass.chunk_gradients(rows, summary, upstream)
    return loss_pass.held() if needed.hidden or needed.weight else None
