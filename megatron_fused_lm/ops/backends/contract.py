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

import inspect
from typing import Callable, Iterator, List, NamedTuple, Optional, Protocol

import torch

from ..products import add_product
from ..softmax import SoftmaxSummary, TargetIndex


class ShardProblem(NamedTuple):
    """One rank's share of the work: the rows, this rank's weight shard, the rows' targets,
    temperatures and kept columns (on the logits path ``hidden`` holds the rows' logits and
    ``weight`` is ``None``)."""

    hidden: torch.Tensor  # [n, H] float32, bfloat16 or float16 (logits: [n, vocab_shard])
    weight: Optional[torch.Tensor]  # [vocab_shard, H], hidden's dtype
    target_column: torch.Tensor  # [n] (or [n, k]) int64: the target's row in the shard, -1 where another shard owns it
    temperature: torch.Tensor  # [n] float32, positive: divides each row's logits
    kept_mask: torch.Tensor  # [n, words] int32 bitmask of the columns each row keeps (kept_tokens), or [0]: all

    def rows(self, rows: slice) -> ShardProblem:
        """The problem of a chunk's rows: every per-row tensor sliced, the weight whole."""
        return ShardProblem(self.hidden[rows], self.weight, *(value[rows] for value in self[2:]))


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


class ChunkGrads(NamedTuple):
    """A chunk of the three-GEMM pass as its gradient phase takes it: its rows, their summary and
    per-row upstream gradients, the weight gradient's row scale (``None``: 1) times those, and
    whether the weight gradient adds to what its parts hold."""

    rows: slice
    summary: SoftmaxSummary
    upstream: UpstreamGrads
    weight_row_scale: Optional[torch.Tensor]
    accumulate: bool


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
    # One target per row: the targets' reads a backend's torch steps share (``softmax.TargetIndex``
    # of ``ShardProblem.target_column``), made once per pass; None: each step makes its own.
    target_index: Optional[TargetIndex] = None

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
    each, its methods' parameters named as here: the ops pass them by name). Tensors are this
    rank's shard; nothing here communicates."""

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

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice, options) -> Optional[torch.Tensor]:
        """GEMM 1 over a chunk: its statistics ``[k, 4]``, the block kept in ``state``."""

    def summarize(self, parts: torch.Tensor, target_column: torch.Tensor, out) -> None:
        """Rows' statistics merged over ``parts [P, k, 4]`` (one per rank), summarized into ``out``."""

    def chunk_gradients(self, problem: ShardProblem, state: LossState, chunk: ChunkGrads, options) -> None:
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
    def scaled_copy(self, source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out = source * scale``, rounded once into ``out``'s dtype."""

    def fit_declared(self, upstream: torch.Tensor, declared: torch.Tensor, weight_grad_scale: Optional[float]) -> tuple:
        """The labels path's backward check: ``(scale [], correction [n], ran [])``."""

    # Kept tokens and top-k.
    def kept_mask(self, sets, vocab_shard: int) -> torch.Tensor:
        """The bitmask of kept sets (``kept_tokens``' form), its values checked."""

    def top_keys(self, hidden, weight, temperature, softcap, k, first_id, block_logits, token_chunk):
        """Each row's ``k`` largest logits' keys on this shard (``top_keys``)."""


# The Protocol's members, methods and attributes, in its order; its methods.
BACKEND_MEMBERS = tuple(name for name in [*Backend.__annotations__, *vars(Backend)] if not name.startswith("_"))
BACKEND_METHODS = tuple(name for name in BACKEND_MEMBERS if callable(getattr(Backend, name, None)))
# Each method's parameters, without self: the ops pass them by name.
BACKEND_PARAMETERS = {name: tuple(inspect.signature(getattr(Backend, name)).parameters)[1:] for name in BACKEND_METHODS}


# The held gradients' float32 parts (``LossState.held_weight``) and the checks of an upstream
# gradient against the declared one: shared by the backends and the pass (``loss_pass``).

ScaledCopy = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]  # a backend's scaled_copy

NARROWING_SHARE = 8  # the first step narrows 1 / NARROWING_SHARE of a part's rows, through a temporary

# How far an upstream gradient may stray from ``c * declared_weights`` (relative to its largest
# entry) and still count as that: float32 rounding of a mask times a scale, not a different loss.
PROPORTIONAL_TOLERANCE = 1e-5


def deviates(difference: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    """0-dim bool: whether ``difference`` (per row) exceeds ``PROPORTIONAL_TOLERANCE`` of the
    largest ``upstream``, on the device."""
    if upstream.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=upstream.device)
    return difference.abs().amax() > PROPORTIONAL_TOLERANCE * upstream.abs().amax()


def proportional_fit(upstream: torch.Tensor, declared: torch.Tensor) -> torch.Tensor:
    """``c`` (0-dim float32) that best fits ``upstream ~ c * declared`` (``[n]`` float32, ``n >= 1``),
    on the device. Where ``c * declared`` explains nothing of the upstream (within
    ``PROPORTIONAL_TOLERANCE`` of its largest entry: declared weights all 0, an upstream orthogonal
    to them), 1, or 0 for an upstream of zeros: any scale is exact, the correction taking the
    rest, but the correction is divided by ``c``, so it must not vanish where one is needed."""
    norm, dot = (declared * declared).sum(), (upstream * declared).sum()
    scale = dot / norm.clamp(min=torch.finfo(torch.float32).tiny)
    largest = upstream.abs().amax()
    explains = scale.abs() * declared.abs().amax() > PROPORTIONAL_TOLERANCE * largest
    return torch.where(explains, scale, (largest > 0).float())


def allocate_parts(
    hidden: torch.Tensor, weight: torch.Tensor, needed: NeededGrads
) -> tuple[torch.Tensor, List[torch.Tensor]]:
    """``(held_hidden [n, H], held_weight parts)`` in float32 for the gradients ``needed`` asks for
    (a 1-D empty tensor and no parts for the others): one part for a float32 weight, two halves
    for a 16-bit one, so that the rounded result fits in the first half's memory. Zero rows give
    zeros: no chunk writes them."""
    empty = hidden.new_zeros if hidden.shape[0] == 0 else hidden.new_empty
    held_hidden = empty(hidden.shape, dtype=torch.float32) if needed.hidden else hidden.new_empty(0)
    held_weight = []
    if needed.weight:
        vocab = weight.shape[0]
        # The second half starts on a 16-byte boundary of the block's rows (products.add_product).
        middle = vocab if weight.dtype == torch.float32 else min(vocab, -(-vocab // 16) * 8)
        held_weight = [
            empty(stop - start, weight.shape[1], dtype=torch.float32)
            for start, stop in ((0, middle), (middle, vocab))
            if stop > start
        ]
    return held_hidden, held_weight


def allocate_state(problem: ShardProblem, needed: NeededGrads, held_weight: Optional[List[torch.Tensor]]):
    """``(held_hidden, held_weight, chosen)`` of a ``LossState`` for ``problem``, as
    ``allocate_parts`` makes them; the weight gradient added into ``held_weight`` where given (the
    caller's ``weight_grad_into`` as one part, or the held parts a correction adds to)."""
    hidden, weight = problem.hidden, problem.weight
    held_hidden, own = allocate_parts(hidden, weight, needed._replace(weight=needed.weight and not held_weight))
    parts = (held_weight or own) if needed.weight else []
    chosen = problem.target_column.new_empty(problem.target_column.shape, dtype=torch.float32)
    return held_hidden, parts, chosen if parts else hidden.new_empty(0)


def add_weight_product(
    held_weight: List[torch.Tensor], logit_grads: torch.Tensor, hidden: torch.Tensor, accumulate: bool
) -> None:
    """Add ``logit_grads.T @ hidden`` (``[rows, V]``, ``[rows, H]``, one dtype) to the parts (or
    write it, for the first chunk)."""
    start = 0
    for part in held_weight:
        add_product(part, logit_grads[:, start : start + part.shape[0]].t(), hidden, accumulate=accumulate)
        start += part.shape[0]


def narrowing_steps(num_rows: int) -> List[slice]:
    """The steps that narrow a float32 part of ``num_rows`` rows into its own memory: ``[0, a)``
    with ``a = ceil(num_rows / NARROWING_SHARE)``, then ``[a, 2a)``, ``[2a, 4a)`` ... until
    ``num_rows``.

    Narrowed row ``r`` lands in bytes ``[2rH, 2(r+1)H)``, over float32 rows ``[r/2, (r+1)/2)``. A
    step ``[a, b)`` with ``b <= 2a`` therefore writes only over rows below ``a``, read by earlier
    steps, and reads bytes ``[4aH, 4bH)``, above all it writes: it runs as one launch, without a
    temporary. Only the first step, which writes over what it reads, goes through a temporary (an
    eighth of the part in the weight's dtype: five launches in all)."""
    steps, start, stop = [], 0, min(-(-num_rows // NARROWING_SHARE), num_rows)
    while start < num_rows:
        steps.append(slice(start, stop))
        start, stop = stop, min(2 * stop, num_rows)
    return steps


def finish_weight(
    held_weight: List[torch.Tensor],
    scale: Optional[torch.Tensor],
    dtype: torch.dtype,
    narrow_in_place: bool,
    scaled_copy: ScaledCopy,
) -> Optional[torch.Tensor]:
    """The held weight gradient (its float32 parts) times the upstream ``scale`` (0-dim float32;
    ``None``: 1), rounded once into ``dtype`` by the backend's ``scaled_copy``; ``None`` without
    parts. With ``narrow_in_place`` it is written into the parts' own memory, which it then
    occupies (eager autograd); otherwise into new memory (a custom operator may not return its
    inputs' memory)."""
    if not held_weight:
        return None
    (first, *rest), hidden_size = held_weight, held_weight[0].shape[1]
    shape = (sum(part.shape[0] for part in held_weight), hidden_size)
    if not rest:  # float32: the held part is the result
        return scaled_copy(first, scale, first if narrow_in_place else torch.empty_like(first))
    if narrow_in_place:
        out = torch.empty(0, dtype=dtype, device=first.device)
        out.set_(first.untyped_storage(), 0, shape, (hidden_size, 1))
    else:
        out = first.new_empty(shape, dtype=dtype)
    start = 0
    for index, part in enumerate(held_weight):
        overlapping = narrow_in_place and index == 0
        for rows in narrowing_steps(part.shape[0]) if overlapping else (slice(0, part.shape[0]),):
            target = out[start + rows.start : start + rows.stop]
            if overlapping and rows.start == 0:
                target.copy_(scaled_copy(part[rows], scale, target.new_empty(target.shape)))
            else:
                scaled_copy(part[rows], scale, target)
        start += part.shape[0]
    return out
