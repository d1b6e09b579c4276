"""The backend contract: what a backend receives and returns, and the loop that drives a
loss-in-forward pass.

A backend works on this rank's vocabulary shard only and never communicates. Its four-GEMM path
(``local_statistics``, ``local_gradients``) gives the shard's statistics in the forward and its
gradients in the backward. Its three-GEMM path is a set of phases over a ``LossState``, and
``run_loss_pass`` owns their chunk loop: every rank calls the chunk's step (which may communicate)
exactly once per chunk, in order, whatever the backend does. ``backends`` has the two backends;
``docs/DESIGN.md`` ("Contracts") says why each piece is where it is.

Shapes: ``n`` token rows, ``H`` hidden size, ``vocab_shard`` rows of this rank's weight shard.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, NamedTuple, Optional

import torch

from .softmax import SoftmaxSummary


class ShardProblem(NamedTuple):
    """One rank's share of the work: the rows, this rank's weight shard, the rows' targets,
    temperatures and kept columns."""

    hidden: torch.Tensor  # [n, H] float32, bfloat16 or float16
    weight: torch.Tensor  # [vocab_shard, H], hidden's dtype
    target_column: torch.Tensor  # [n] (or [n, k]) int64: the target's row in the shard, -1 where another shard owns it
    temperature: torch.Tensor  # [n] float32, positive: divides each row's logits
    kept_mask: torch.Tensor  # [n, words] int32 bitmask of the columns each row keeps (kept_tokens), or [0]: all


class SavedStatistics(NamedTuple):
    """What a backward that recomputes the logits needs per row, over the whole vocabulary."""

    lse: torch.Tensor  # [n] float32: log sum exp z
    mean_logit: torch.Tensor  # [n] float32: sum p z


class UpstreamGrads(NamedTuple):
    """Gradients of the loss with respect to the per-row log-prob and entropy; ``None``: no term."""

    logprob: Optional[torch.Tensor]  # [n] (or [n, k]) float32
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


class LossState(NamedTuple):
    """The tensors a loss-in-forward pass keeps between its phases: what the phases mutate."""

    block: torch.Tensor  # [token_chunk, vocab_shard]: the current chunk's logits, as the backend keeps them
    reference: torch.Tensor  # float32, what the block is stored against (Triton): [token_chunk] or tile maxima; or [0]
    held_hidden: torch.Tensor  # [n, H] float32: this shard's partial hidden gradient, or [0]
    held_weight: List[torch.Tensor]  # float32 row parts of the weight gradient (a caller's accumulator), or none
    chosen: torch.Tensor  # [n] (or [n, k]) float32: each row's chosen-token term of the weight gradient, or [0]
    # A correcting pass's 0-dim bool: where it is false, a backend that decides on the device
    # (``gates_on_device``) skips the products; None: the forward's pass, which always runs.
    gate: Optional[torch.Tensor] = None

    @property
    def token_chunk(self) -> int:
        """Rows per chunk: the block's; a function of the problem's shapes only, so equal on every rank."""
        return self.block.shape[0]


# ``chunk_step(rows, local_statistics [k, 4]) -> (summary, upstream, weight_scale)``: merges a
# chunk's shard statistics across the group (it may communicate), summarizes them and evaluates
# the loss's per-row gradients: those of the hidden gradient, and ``weight_scale [k]`` (or
# ``None``: 1) times them for the weight gradient.
ChunkStep = Callable[[slice, torch.Tensor], "tuple[SoftmaxSummary, UpstreamGrads, Optional[torch.Tensor]]"]


def token_chunks(num_tokens: int, token_chunk: int) -> Iterator[slice]:
    """Slices of ``[0, num_tokens)`` of at most ``token_chunk`` rows each."""
    for start in range(0, num_tokens, token_chunk):
        yield slice(start, min(start + token_chunk, num_tokens))


def run_loss_pass(phases, problem: ShardProblem, chunk_step: ChunkStep, state: LossState, options, adds: bool) -> None:
    """The three-GEMM pass over ``state`` (``phases.allocate``'s): per token chunk, the phases'
    statistics (GEMM 1), ``chunk_step`` (once per chunk, chunks in order, on every rank) and, when
    a gradient is needed, the phases' gradients (GEMMs 2 and 3; the weight gradient written by the
    first chunk, or added to what ``state.held_weight`` holds where it ``adds``: a caller's
    accumulator); then each row's chosen-token term of the weight gradient, once."""
    for rows in token_chunks(problem.hidden.shape[0], state.token_chunk):
        summary, upstream, weight_scale = chunk_step(rows, phases.chunk_statistics(problem, state, rows))
        if state.held_hidden.dim() == 2 or state.held_weight:
            accumulate = adds or rows.start > 0
            phases.chunk_gradients(problem, state, rows, summary, upstream, weight_scale, accumulate, options)
    if state.held_weight:
        phases.add_chosen_rows(state.held_weight, problem.target_column, state.chosen, problem.hidden)
