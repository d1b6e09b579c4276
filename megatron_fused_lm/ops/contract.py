"""The backend contract: what the autograd boundary hands a backend, what it gets back, and the loop
that drives a loss-in-forward pass.

A backend works on this rank's vocabulary shard only and never communicates. A recompute backend
(``RecomputeBackend``) gives the shard's statistics in the forward and its gradients in the
backward (four GEMMs). A loss-in-forward backend (``LossBackend``) gives named phases per token
chunk over the tensors of a ``LossState``, and ``run_loss_pass`` owns the chunk loop: every rank calls the chunk's step (which may
communicate) exactly once per chunk, in order, whatever the backend does. ``docs/DESIGN.md``
("Contracts") says why each piece is where it is.

Shapes: ``n`` token rows, ``H`` hidden size, ``vocab_shard`` rows of this rank's weight shard.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, NamedTuple, Optional, Protocol

import torch

from .softmax import SoftmaxSummary


class ShardProblem(NamedTuple):
    """One rank's share of the work: the rows, this rank's weight shard, the rows' targets,
    temperatures and kept columns."""

    hidden: torch.Tensor  # [n, H] float32, bfloat16 or float16
    weight: torch.Tensor  # [vocab_shard, H], hidden's dtype
    target_column: torch.Tensor  # [n] int64: the target's row in the shard, -1 where another shard owns it
    temperature: torch.Tensor  # [n] float32, positive: divides each row's logits
    kept_mask: torch.Tensor  # [n, words] int32 bitmask of the columns each row keeps (kept_tokens), or [0]: all


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


class LossState(NamedTuple):
    """The tensors a loss-in-forward pass keeps between its phases: what the phases mutate."""

    block: torch.Tensor  # [token_chunk, vocab_shard]: the current chunk's logits, as the backend keeps them
    reference: torch.Tensor  # float32, what the block is stored against (Triton): [token_chunk] or tile maxima; or [0]
    held_hidden: torch.Tensor  # [n, H] float32: this shard's partial hidden gradient, or [0]
    held_weight: List[torch.Tensor]  # float32 row parts of the weight gradient, or none

    @property
    def token_chunk(self) -> int:
        """Rows per chunk: the block's; a function of the problem's shapes only, so equal on every rank."""
        return self.block.shape[0]


class LossBackend(Protocol):
    """The loss-in-forward path (three GEMMs), as named phases over a ``LossState``; an implementation
    is a ``held_gradients.HeldSteps``, whose steps finish the held gradients."""

    def allocate(self, problem: ShardProblem, needed: NeededGrads) -> LossState:
        """The pass's tensors: the block (its rows are the token chunk) and the held gradients."""
        ...

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice) -> torch.Tensor:
        """The chunk's logits (the first GEMM) kept in ``state.block``, and this shard's statistics
        of them ``[k, 4]``."""
        ...

    def chunk_gradients(
        self,
        problem: ShardProblem,
        state: LossState,
        rows: slice,
        summary: SoftmaxSummary,
        upstream: UpstreamGrads,
        accumulate: bool,
    ) -> None:
        """The chunk's ``dz`` and its two products (the other GEMMs) into the held gradients, from
        the merged statistics and the upstream gradients: the hidden gradient's rows written, the
        weight gradient added to what it holds (``accumulate``) or written."""
        ...


# ``chunk_step(rows, local_statistics [k, 4]) -> (summary, upstream)``: merges a chunk's shard
# statistics across the group (it may communicate) and evaluates the loss's per-token gradients.
ChunkStep = Callable[[slice, torch.Tensor], "tuple[SoftmaxSummary, UpstreamGrads]"]


def token_chunks(num_tokens: int, token_chunk: int) -> Iterator[slice]:
    """Slices of ``[0, num_tokens)`` of at most ``token_chunk`` rows each."""
    for start in range(0, num_tokens, token_chunk):
        yield slice(start, min(start + token_chunk, num_tokens))


def run_loss_pass(
    backend: LossBackend,
    problem: ShardProblem,
    chunk_step: ChunkStep,
    needed: NeededGrads,
    held_weight: Optional[List[torch.Tensor]] = None,
) -> LossState:
    """The three-GEMM pass: per token chunk, the backend's statistics, ``chunk_step`` (once per
    chunk, chunks in order, on every rank) and, when a gradient is needed, the backend's gradients.
    The weight gradient adds into ``held_weight`` where given (float32 row parts: an earlier pass's,
    or a caller's accumulator); otherwise into parts the backend allocates, which the first chunk
    writes. Returns the state, whose held gradients are the pass's result."""
    adds = held_weight is not None and needed.weight
    state = backend.allocate(problem, NeededGrads(needed.hidden, needed.weight and not adds))
    if adds:
        state = state._replace(held_weight=held_weight)
    for rows in token_chunks(problem.hidden.shape[0], state.token_chunk):
        summary, upstream = chunk_step(rows, backend.chunk_statistics(problem, state, rows))
        if needed.hidden or needed.weight:
            backend.chunk_gradients(problem, state, rows, summary, upstream, adds or rows.start > 0)
    return state
