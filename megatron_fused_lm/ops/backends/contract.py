"""The backend contract: what a backend receives and returns (``ShardProblem`` ... ``LossState``),
and every member the ops call on one (``Backend``).

A backend works on this rank's vocabulary shard only and never communicates. Its four-GEMM path
(``local_statistics``, ``local_gradients``) gives the shard's statistics in the forward and its
gradients in the backward. Its three-GEMM path is a set of phases over a ``LossState`` whose chunk
loop the pass owns (``loss_pass.chunks.run_loss_pass``): every rank calls the chunk's step (which
may communicate) exactly once per chunk, in order, whatever the backend does. ``docs/DESIGN.md``
("Contracts") says why each piece is where it is.

Shapes: ``n`` token rows, ``H`` hidden size, ``vocab_shard`` rows of this rank's weight shard.
"""

from __future__ import annotations

from typing import Iterator, List, NamedTuple, Optional, Protocol

import torch


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


def token_chunks(num_tokens: int, token_chunk: int) -> Iterator[slice]:
    """Slices of ``[0, num_tokens)`` of at most ``token_chunk`` rows each."""
    for start in range(0, num_tokens, token_chunk):
        yield slice(start, min(start + token_chunk, num_tokens))


class Backend(Protocol):
    """Every member the ops call on a backend (``registry.resolve`` checks a backend object has
    each). Tensors are this rank's shard; nothing here communicates."""

    name: str  # how HeadOptions names it (registry.by_name)
    gates_on_device: bool  # a correcting pass's gate read by its kernels (LossState.gate); else on the host

    # The four-GEMM path.
    def local_statistics(self, problem: ShardProblem, options) -> torch.Tensor:
        """The shard's statistics ``[n, 4]`` float32 (``softmax.NUM_STATISTICS``)."""

    def local_gradients(
        self, problem: ShardProblem, saved: SavedStatistics, upstream: UpstreamGrads, needed: NeededGrads, options
    ) -> Gradients:
        """The shard's gradients (``Gradients`` gives their dtypes)."""

    # The three-GEMM path's phases, in the order the chunk loop calls them.
    def allocate(
        self, problem: ShardProblem, needed: NeededGrads, options, held_weight: Optional[List[torch.Tensor]] = None
    ) -> LossState:
        """The pass's tensors; the weight gradient added into ``held_weight`` where given."""

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice) -> Optional[torch.Tensor]:
        """GEMM 1 over a chunk: its statistics ``[k, 4]``, the block kept in ``state``."""

    def summarize(self, parts: torch.Tensor, target_column: torch.Tensor, out) -> None:
        """Rows' statistics merged over ``parts [P, k, 4]`` (one per rank), summarized into ``out``."""

    def chunk_gradients(
        self,
        problem: ShardProblem,
        state: LossState,
        rows: slice,
        summary,
        upstream: UpstreamGrads,
        weight_row_scale: Optional[torch.Tensor],
        accumulate: bool,
        options,
    ) -> None:
        """GEMMs 2 and 3 over a chunk, into ``state``'s held gradients."""

    def add_chosen_rows(
        self,
        held_weight: List[torch.Tensor],
        target_column: torch.Tensor,
        chosen: torch.Tensor,
        hidden: torch.Tensor,
    ) -> None:
        """Each row's chosen-token term of the weight gradient, once per pass."""

    # The steps on the held gradients.
    def add_chosen(self, product, target_column, chosen, weight, factor=None) -> None:
        """A chunk's hidden gradient rows finished in place with the chosen tokens' term."""

    def scaled_copy(self, source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out = source * scale``, rounded once into ``out``'s dtype."""

    def fit_declared(self, upstream: torch.Tensor, declared: torch.Tensor, assumed: Optional[float]) -> tuple:
        """The labels path's backward check: ``(scale [], correction [n], ran [])``."""

    # Kept tokens and top-k.
    def kept_mask(self, sets, vocab_shard: int) -> torch.Tensor:
        """The bitmask of kept sets (``kept_tokens``' form), its values checked."""

    def top_keys(self, hidden, weight, temperature, k, first_id, block_logits, token_chunk):
        """Each row's ``k`` largest logits' keys on this shard (``top_keys``)."""


# The Protocol's members, methods and attributes, in its order.
BACKEND_MEMBERS = tuple(name for name in [*Backend.__annotations__, *vars(Backend)] if not name.startswith("_"))
