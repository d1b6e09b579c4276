"""The backend contract: what the shared autograd plumbing hands a backend, and what it gets back.

A backend computes, for this rank's vocabulary shard only, the softmax statistics of
``hidden @ weight.T / temperature`` in the forward and the two gradients in the backward (four
GEMMs: the backward recomputes the logits), or, when the loss is known in the forward, both at once
(three GEMMs: ``loss_gradients``). The input checks (``inputs``), the collectives and the autograd
formulas (``library``, ``loss``) are shared, so a backend never communicates and never sees the
public options.

Shapes: ``n`` token rows, ``H`` hidden size, ``vocab_shard`` rows of this rank's weight shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Protocol

import torch

if TYPE_CHECKING:
    from .stored_gradients import StoredGradients


class ShardTargets(NamedTuple):
    """Each row's target, seen from this rank's vocabulary shard."""

    local: torch.Tensor  # [n] int64: the target's row in the shard, clamped into it so it always indexes
    owned: torch.Tensor  # [n] bool: whether this shard holds the row's target

    def columns(self) -> torch.Tensor:
        """``[n]`` int64: the target's row in the shard, or -1 where another shard owns it."""
        return torch.where(self.owned, self.local, -1).contiguous()


class SavedStatistics(NamedTuple):
    """What the backward needs per row, over the whole vocabulary (every rank's shard)."""

    lse: torch.Tensor  # [n] float32: log sum exp z
    mean_logit: torch.Tensor  # [n] float32: sum p z, the mean logit under the softmax


class UpstreamGrads(NamedTuple):
    """Gradients of the loss with respect to the per-row outputs; ``None``: no contribution."""

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


class Gradients(NamedTuple):
    """A backend's gradients; ``None`` where not asked for.

    ``hidden [n, H]`` is in hidden's dtype and *partial*: this shard's vocabulary only (the caller
    sums it over the tensor-parallel group, in that dtype, as Megatron's own column-parallel layer
    does). ``weight [vocab_shard, H]`` is in the weight's dtype and complete for the shard.
    """

    hidden: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]


class ShardProblem(NamedTuple):
    """One rank's share of the work: the rows, this rank's weight shard and the rows' targets."""

    hidden: torch.Tensor  # [n, H] float32, bfloat16 or float16
    weight: torch.Tensor  # [vocab_shard, H], hidden's dtype
    targets: ShardTargets
    temperature: float  # divides the logits


class NeededGrads(NamedTuple):
    """Which gradients autograd asks for."""

    hidden: bool
    weight: bool


# ``chunk_upstream(rows, local_statistics [k, 4]) -> (saved, upstream)`` for the token chunk ``rows``
# (a slice of the problem's rows): turns this shard's statistics of the chunk into what its logits'
# gradient needs. It may communicate (every rank calls it once per chunk, chunks in order, with the
# same chunk boundaries), so a backend calls it exactly once per chunk it walks.
ChunkUpstream = Callable[[slice, torch.Tensor], "tuple[SavedStatistics, UpstreamGrads]"]


class Backend(Protocol):
    """One implementation behind ``backend=``: products accumulate in float32."""

    def local_statistics(self, problem: ShardProblem) -> torch.Tensor:
        """This shard's statistics ``[n, 4]`` float32 (``softmax_stats`` says what they are)."""
        ...

    def local_gradients(
        self, problem: ShardProblem, saved: SavedStatistics, upstream: UpstreamGrads, needed: NeededGrads
    ) -> Gradients:
        """This shard's gradients for the upstream gradients ``upstream``."""
        ...

    def loss_gradients(
        self, problem: ShardProblem, chunk_upstream: ChunkUpstream, needed: NeededGrads
    ) -> "StoredGradients":
        """Both gradients from one visit per token chunk (three GEMMs, for a loss known in the
        forward): the chunk's logits, their statistics, ``chunk_upstream`` for the chunk's upstream
        gradients, then the chunk's ``dz`` and its two products. The chunks cover the rows in
        order; their boundaries depend on the problem's shapes only, so they match across ranks.
        The gradients stay in float32 until the backward scales them (``stored_gradients``)."""
        ...
