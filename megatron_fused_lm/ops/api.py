"""The public ops: per-token log-probs, entropy and losses over a vocabulary-parallel LM head, fused
(from the hidden states and the weight shard, without building the ``[tokens, vocab_shard]``
logits) and unfused (from a materialized logits shard, for the stock path)."""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import registry
from .backends.contract import ShardProblem
from .boundary import Logits, crossed
from .inputs import (
    RowSelection,
    check_linear_inputs,
    check_logits,
    check_out_of_vocab,
    check_weight_grad_into,
    live_columns,
    row_temperatures,
    select_rows,
)
from .kept_tokens import KeptTokens, as_kept_tokens, checked_sets, every_column
from .loss_pass.chunks import (
    ChunkLoss,
    LossFn,
    check_declared_inputs,
    check_loss_inputs,
    check_per_token,
    check_rows_independent,
    has_entropy_term,
    per_token_losses,
)
from .loss_pass.held import run_held_pass
from .loss_pass.weight_grad import WeightGradSink
from .options import HeadOptions, check_weight_grad_scale
from .rank_check import check_across_ranks

Tensor = torch.Tensor


class FusedLoss(NamedTuple):
    """What ``fused_linear_loss`` and ``logits_loss`` return."""

    loss: Tensor  # [] float32: the sum of the per-token losses; differentiable w.r.t. hidden and weight
    logprob: Tensor  # [...] (or [..., k] for several targets) float32, detached: a metric
    entropy: Tensor  # [...] float32, detached: a metric


def _prepare(
    op: str,
    source: Tensor,
    weight: Optional[Tensor],
    targets: Tensor,
    *,
    backend,
    tp_group,
    temperature,
    mask: Optional[Tensor] = None,
    max_rows: Optional[int] = None,
    kept_tokens: Optional[KeptTokens] = None,
    out_of_vocab: str = "error",
    several: bool = False,
    loss_inputs: Optional[Dict[str, Tensor]] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    **options,
) -> tuple[HeadOptions, RowSelection, ShardProblem]:
    """The public op ``op``'s inputs and options checked, on this rank and then across the ranks of
    ``tp_group`` (before anything else communicates), its backend resolved once, its selected rows
    (``several``: ``k`` targets each) and their ``ShardProblem``. ``source`` and ``weight`` are the
    hidden states and the weight, whose problem holds the selected hidden rows in the weight's dtype (the products run
    in it) and the weight's rows below ``vocab_size`` (``inputs.live_columns``; a view, through which
    the padded rows get no gradient); or the logits and ``None``, whose problem holds the selected
    rows' live columns in the place of the hidden rows and no weight."""
    if weight is None:
        check_logits(source)
    else:
        check_linear_inputs(source, weight)
    resolved = registry.resolve(backend, source.device)
    options = HeadOptions.checked(backend=resolved.name, tp_group=tp_group, softcap=softcap, **options)
    kept_tokens, out_of_vocab = as_kept_tokens(kept_tokens), check_out_of_vocab(out_of_vocab)
    # The checked values, so that ranks passing equal options in other types agree (softcap apart).
    settings = {name: value for name, value in options.fields().items() if name not in ("tp_group_name", "softcap")}
    settings.update(max_rows=max_rows, out_of_vocab=out_of_vocab)
    check_across_ranks(
        op,
        tp_group,
        source,
        weight,
        targets=targets,
        mask=mask,
        temperature=temperature,
        kept_tokens=kept_tokens,
        loss_inputs=loss_inputs,
        vocab_size=vocab_size,
        softcap=options.softcap,
        settings=settings,
    )
    vocab_shard = source.shape[-1] if weight is None else weight.shape[0]
    live = live_columns(vocab_shard, vocab_size, tp_group)  # checked before the targets are read against it
    selection = select_rows(
        targets,
        source.shape[:-1],
        mask=mask,
        max_rows=max_rows,
        vocab_shard=vocab_shard,
        tp_group=tp_group,
        out_of_vocab=out_of_vocab,
        several=several,
        vocab_size=vocab_size,
        device=source.device,
    )
    if weight is None:
        selected = selection.take(source)[:, :live]
    else:
        weight = weight[:live]
        selected = selection.take(source).to(weight.dtype)
    temperature = row_temperatures(temperature, selection, source.device)
    kept_mask = every_column(targets.device)
    if kept_tokens is not None:
        if several:
            raise ValueError(
                "kept_tokens takes one target per row, not targets [..., k]: a set replays the sampler of the row's "
                "one sampled token, and several targets (a teacher's ids) need not lie in it (docs/OPS.md)"
            )
        if out_of_vocab != "error":
            raise ValueError(
                "kept_tokens takes targets inside the vocabulary, each in its row's set (out_of_vocab='error')"
            )
        sets = checked_sets(
            kept_tokens, selection, targets, vocab_shard=vocab_shard, tp_group=tp_group, vocab_size=vocab_size
        )
        kept_mask = resolved.kept_mask(sets, live)
    problem = ShardProblem(selected, weight, selection.target_column, temperature=temperature, kept_mask=kept_mask)
    return options, selection, problem


def fused_linear_logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    backend: Union[str, object] = "torch",
    token_chunk: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    mask: Optional[Tensor] = None,
    max_rows: Optional[int] = None,
    out_of_vocab: str = "error",
    batch_invariant: bool = False,
    kept_tokens: Optional[KeptTokens] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Log-probs (and entropy) of ``targets`` under ``softmax(hidden @ weight.T / temperature)``,
    the vocabulary spread over ``tp_group``, without materializing the logits; the backward
    recomputes them (four GEMMs in all).

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16; the same on every rank of ``tp_group``.
            It is cast to ``weight``'s dtype for the product; its gradient comes back in its own.
        weight: ``[vocab_shard, H]``, this rank's vocabulary rows (padded rows included): rank
            ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``.
        targets: ``[...]`` (``hidden.shape[:-1]``) integer global vocabulary ids, or ``[..., k]``:
            ``k`` ids per row (a teacher's top-k, say; repeats allowed), whose log-probs come back
            ``[..., k]``; the entropy stays ``[...]``. Their logits are read beside the statistics
            (``several_targets``: float32 ``[rows, k, H]`` chunks of 256 MiB; one all-reduce of
            ``[rows, k]`` more under tensor parallelism) and the backward adds each id's term to
            the float32 logits gradient, as for one (``k`` up to a few hundred: each ``k`` compiles
            its own Triton kernel, which adds ``k`` selects per tile); not with
            ``out_of_vocab="max_logit"`` or ``batch_invariant``.
        tp_group: the tensor-parallel group the vocabulary is split over; ``None`` for no split.
        temperature: divides the logits: a positive number, or a float tensor ``[...]``
            (``targets``' shape; 0-dim for every row) giving each row its own, needing no
            gradient, the same on every rank of ``tp_group``; the gradients are exact for each
            row's temperature. A tensor's values are checked without a host synchronization (on
            a GPU, a device-side assertion).
        return_entropy: also return the entropy of the distribution.
        entropy_grad: with ``False`` the entropy is a metric: no graph, no backward term.
        backend: ``"torch"``, ``"triton"``, ``"cute"`` or ``"auto"`` (Triton on CUDA when available;
            otherwise the torch backend, with one logged warning; ``"cute"``: Triton's with the
            forward statistics of a CuTe DSL kernel on Hopper, where the ``cute`` extra is installed,
            else Triton's, with one logged warning), or a backend object
            (``backends.triton.TritonBackend(TritonTuning(...))``: the Triton kernels with launch
            choices of its own).
        token_chunk: rows per chunk, which bounds the ``[token_chunk, vocab_shard]`` working set
            (the Triton forward has none: only its backward chunks); ``None`` picks the backend's
            own rule.
        reduce_hidden_grad: ``True`` (default) gives the full gradient w.r.t. ``hidden`` on every
            rank (one all-reduce, in the gradient's dtype). ``False`` gives this rank's partial,
            for a caller whose own backward sums partials across ranks (a sequence-parallel
            gather's reduce-scatter).
        mask: optional bool ``[...]`` (``targets``' shape): only rows where it is True are
            computed (their hidden rows are gathered before the product, so time and memory follow
            the number selected); the others are 0 with zero gradient, and their targets are not
            read. Under tensor parallelism every rank must pass the same mask. The number of
            selected rows is read on the host (one synchronization) unless ``max_rows`` is given.
        max_rows: with ``mask``, an upper bound on the rows it selects: the computation then
            has the static shape ``[max_rows]`` (no host synchronization, so CUDA graphs can
            capture it and ``torch.compile(fullgraph=True)`` can trace it); time and memory
            follow ``max_rows``. A mask selecting more rows is an error.
        out_of_vocab: what a target id outside ``[0, vocab_shard * tp_size)`` means: ``"error"``
            (the default; leave such rows out with ``mask``), or ``"max_logit"``, the convention of
            Megatron's vocabulary-parallel cross-entropy, which scores a label no rank owns as if
            its logit were the row's largest and gives it no gradient: its log-prob is ``max - lse``
            and its logits' gradient ``-g * softmax`` (the labels path's ``-100`` padding then
            trains as in the stock model).
        batch_invariant: with ``True`` (Triton backend only) a row's gradient w.r.t. ``hidden`` is
            bitwise the same whatever other rows share the call, as its log-prob and entropy always
            are on the Triton backend: the hidden product runs a kernel whose order of summation
            the number of rows does not change, instead of cuBLAS (``docs/DESIGN.md``, "Batch
            invariance"; cost in ``docs/benchmarks/features.md``). ``ValueError`` on the torch backend and
            for tensor-parallel groups of more than two ranks (their sums' order follows the
            message size); ``fused_linear_loss`` also refuses float32 weights.
        kept_tokens: optional ``KeptTokens(offsets=..., token_ids=...)`` (or the pair ``(offsets,
            token_ids)``, or vLLM's ``SamplingMask``: read by name), each row's kept set (the ids a top-k /
            top-p / min-p sampler kept): ``offsets [rows + 1]`` and ``token_ids [nnz]`` integer (int32 or int64) on
            hidden's device, row ``i``'s global ids ``token_ids[offsets[i]:offsets[i + 1]]``, the
            rows those computed, in the order of ``targets`` flattened (with ``mask=``, the selected
            rows; the same on every rank of ``tp_group``). Each row's log-prob and entropy are then
            those of its softmax renormalized over its set, ``z_y - logsumexp_{j in set} z_j``,
            with exact gradients (0 for the ids left out); under tensor parallelism each rank
            reads the ids of its shard. A target outside its row's set, ids outside the
            vocabulary and malformed offsets are errors (checked as the targets are). The sets
            travel as a bitmask of ``ceil(vocab_shard / 32)`` int32 words per row (``kept_tokens``
            module), saved for the backward. Not with several targets per row.
        vocab_size: the true vocabulary (the tokenizer's), global ids ``[0, vocab_size)``; ``None``
            (default): every row of every shard, as the stock head. Megatron pads the head to a
            multiple of ``make_vocab_size_divisible_by x TP`` (the padded ids last, on the last
            ranks), and the padded rows' mass enters the stock log-sum-exp and entropy where vLLM
            and SGLang compute over the tokenizer's vocabulary. With ``vocab_size`` the ids at or
            past it never enter the log-sum-exp, the entropy or a gradient (the padded weight rows
            get 0; the products skip them), and a target there is outside the vocabulary. Every
            rank must hold at least one id below it, and all pass the same.
        softcap: a positive number caps the logits as Gemma-2's head does (its
            ``final_logit_softcapping``), ``softcap * tanh(hidden @ weight.T / softcap)``, before
            the temperature divides them; the gradients are exact (``docs/DESIGN.md``, "The math").
            ``None`` (default): no cap, as Megatron-Core's output layer. The same on every rank.

    Returns:
        ``logprob [...]`` (``[..., k]`` for several targets) float32, or ``(logprob, entropy)`` with
        ``return_entropy=True``.
        Gradients: w.r.t. ``hidden`` in hidden's dtype, w.r.t. ``weight`` (this shard's rows) in
        the weight's dtype. Computed in float32 whatever the autocast context (under
        ``torch.compile`` by the custom operators ``torch.ops.megatron_fused_lm.fused_*``); no host
        synchronization without a mask (or with ``max_rows``): an out-of-range target raises
        ``ValueError`` on the CPU and trips a device-side assertion on a GPU.
    """
    several = _several_targets(targets, hidden.shape[:-1], out_of_vocab, batch_invariant)
    options, selection, problem = _prepare(
        "fused_linear_logprob",
        hidden,
        weight,
        targets,
        mask=mask,
        max_rows=max_rows,
        tp_group=tp_group,
        temperature=temperature,
        kept_tokens=kept_tokens,
        out_of_vocab=out_of_vocab,
        several=several,
        token_chunk=token_chunk,
        backend=backend,
        entropy_grad=entropy_grad,
        reduce_hidden_grad=reduce_hidden_grad,
        batch_invariant=batch_invariant,
        vocab_size=vocab_size,
        softcap=softcap,
    )
    logprob, entropy, _, _ = crossed(*problem, options=options)
    return _results(selection, logprob, entropy if return_entropy else None, options.entropy_grad)


def _several_targets(targets: Tensor, lead_shape: torch.Size, out_of_vocab: str, batch_invariant: bool) -> bool:
    """Whether ``targets`` holds several ids per row (``[*lead_shape, k]``, ``k >= 1``); ``ValueError``
    for the options that take one id per row."""
    several = isinstance(targets, Tensor) and targets.dim() == len(lead_shape) + 1 and targets.shape[:-1] == lead_shape
    if several and targets.shape[-1] == 0:
        raise ValueError("targets [..., k] needs k >= 1 ids per row")
    if several and out_of_vocab != "error":
        raise ValueError("several targets per row take ids inside the vocabulary only (out_of_vocab='error')")
    if several and batch_invariant:
        raise ValueError(
            "batch_invariant=True takes one target per row (the k logits are read by torch, not its kernels)"
        )
    return several


def _results(selection: RowSelection, logprob: Tensor, entropy: Optional[Tensor], entropy_grad: bool):
    """The public ops' return: the selected rows' results in place; an entropy without gradient
    detached, so that none flows back into the operator."""
    logprob = selection.place(logprob)
    if entropy is None:
        return logprob
    return logprob, selection.place(entropy if entropy_grad else entropy.detach())


def logits_logprob(
    logits: Tensor,
    targets: Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    token_chunk: Optional[int] = None,
    mask: Optional[Tensor] = None,
    max_rows: Optional[int] = None,
    kept_tokens: Optional[KeptTokens] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Log-probs (and entropy) of ``targets`` under ``softmax(logits / temperature)``, the
    vocabulary spread over ``tp_group``: the stock (unfused) path.

    Args:
        logits: ``[..., vocab_shard]`` float32, bfloat16 or float16, this rank's vocabulary
            columns: rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``.
        targets: ``[...]`` (``logits.shape[:-1]``) integer global vocabulary ids, or ``[..., k]``
            (as for ``fused_linear_logprob``).
        tp_group, temperature, return_entropy, entropy_grad, kept_tokens, vocab_size, softcap: as for
            ``fused_linear_logprob`` (the logits' columns at or past ``vocab_size`` get no gradient;
            ``softcap`` caps the logits given).
        token_chunk: rows per chunk of the float32 softmax, which bounds its ``[token_chunk,
            vocab_shard]`` working set; ``None`` keeps one chunk's float32 block near 256 MiB.
        mask, max_rows: only rows where ``mask`` is True are computed; the others are 0 with zero
            gradient and their targets are not read (as for ``fused_linear_logprob``).

    Returns:
        ``logprob [...]`` float32, or ``(logprob, entropy)``. The gradient goes to ``logits`` in
        their dtype (this rank's shard only; nothing is reduced across ranks).
    """
    several = _several_targets(targets, logits.shape[:-1], "error", False)
    options, selection, problem = _prepare(
        "logits_logprob",
        logits,
        None,
        targets,
        backend="torch",
        tp_group=tp_group,
        temperature=temperature,
        mask=mask,
        max_rows=max_rows,
        kept_tokens=kept_tokens,
        several=several,
        vocab_size=vocab_size,
        softcap=softcap,
        token_chunk=token_chunk,
        entropy_grad=entropy_grad,
    )
    logprob, entropy, _, _ = Logits.apply(problem.hidden, *problem[2:], options)
    return _results(selection, logprob, entropy if return_entropy else None, options.entropy_grad)


def fused_linear_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    *,
    loss_inputs: Optional[Dict[str, Tensor]] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    mask: Optional[Tensor] = None,
    max_rows: Optional[int] = None,
    backend: Union[str, object] = "torch",
    token_chunk: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    weight_grad_into: Optional[Tensor] = None,
    weight_grad_scale: float = 1.0,
    batch_invariant: bool = False,
    kept_tokens: Optional[KeptTokens] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
) -> FusedLoss:
    """``sum_t loss_fn(logprob_t, entropy_t, inputs_t)`` over the rows of
    ``softmax(hidden @ weight.T / temperature)``, with its gradients computed in the forward
    (three GEMMs): the per-token loss must be known before the step.

    ``loss_fn(logprob, entropy, **inputs) -> losses`` is called on chunks of rows: ``logprob``
    and ``entropy`` are float32 ``[rows]`` (requiring grad; for several targets per row,
    ``targets [..., k]``, ``logprob`` is ``[rows, k]``), ``inputs`` holds the same rows of each
    tensor in ``loss_inputs``. It must return one float loss per row, ``[rows]``, computed from
    that row alone: **the loss is the sum of what it returns over all chunks, so a function that
    reduces or normalizes across rows (a mean, a per-sequence max, a normalizer that depends on
    this step's log-probs) is wrong here**, and refused: the first time a function's code (or a
    callable's class) is used, its rows are checked against its first chunk's two halves
    (``ValueError``). Express normalizations as per-token weights among the inputs instead
    (``losses.token_mean_weights``). Ready-made functions: ``losses.cross_entropy``,
    ``losses.ClippedPolicyLoss``, ``losses.TopkDistillation`` (several targets: a teacher's top-k).

    Args:
        hidden, weight, targets, tp_group, temperature, backend, reduce_hidden_grad,
            batch_invariant, kept_tokens, vocab_size, softcap: as for ``fused_linear_logprob`` (``targets [..., k]``:
            several per row, their logits read beside each chunk's statistics, one all-reduce of
            ``[rows, k]`` per chunk more under tensor parallelism; each target's term of the
            logits' gradient is added in float32, as for one).
        token_chunk: rows per three-GEMM chunk; ``None`` picks one that bounds the working set.
        loss_fn: the per-token loss, as above.
        loss_inputs: per-token inputs of ``loss_fn``: a dict of tensors shaped like the rows,
            ``[...]``, or with trailing dimensions, ``[..., k]`` (old log-probs, advantages,
            weights, a teacher's top-k log-probs, ...), on hidden's device, needing no gradient;
            under tensor parallelism the same on every rank.
        mask: optional bool ``[...]``: only rows where it is True are computed and summed; the
            others have log-prob and entropy 0. The number of selected rows is read on the host
            (one synchronization) unless ``max_rows`` is given.
        max_rows: with ``mask``, an upper bound on the rows it selects (as for
            ``fused_linear_logprob``): a static shape, no host synchronization; the padding rows
            compute a real row whose loss and gradients count for nothing.
        weight_grad_into: optional contiguous float32 ``[vocab_shard, H]`` (Megatron's
            ``main_grad``) into which the forward adds ``weight_grad_scale`` times the weight's
            gradient, never rounded: no weight-sized buffer waits for the backward, and ``weight``
            gets no autograd gradient. Eager mode only; ignored when no weight gradient is needed.
        weight_grad_scale: with ``weight_grad_into``, the upstream gradient the loss will receive
            (``1 / num_microbatches``, a loss scale). The backward checks it on the device and
            adds any difference exactly by a second pass (two GEMMs; the Triton backend decides on
            the device, the torch backend reads the check on the host), with one warning
            (``weight_grad_corrections`` counts them on a GPU).

    Returns:
        ``FusedLoss(loss, logprob, entropy)``: ``loss`` a float32 scalar, differentiable w.r.t.
        ``hidden`` and ``weight`` (gradients in their dtypes, held in float32 until the backward
        scales them and rounds each once; a second backward is an error); ``logprob`` (``[...]``,
        or ``[..., k]``) and ``entropy`` (``[...]``) detached float32 metrics. Nothing flows into
        ``loss_inputs``.
    """
    inputs = check_loss_inputs(loss_fn, loss_inputs, hidden.shape[:-1], hidden.device)
    several = _several_targets(targets, hidden.shape[:-1], "error", batch_invariant)
    check_declared_inputs(loss_fn, targets, inputs=inputs, mask=mask, lead_shape=hidden.shape[:-1])
    entropy_grad = has_entropy_term(loss_fn, inputs, tuple(targets.shape[-1:]) if several else ())
    options, selection, problem = _prepare(
        "fused_linear_loss",
        hidden,
        weight,
        targets,
        mask=mask,
        max_rows=max_rows,
        tp_group=tp_group,
        temperature=temperature,
        kept_tokens=kept_tokens,
        several=several,
        loss_inputs=inputs,
        token_chunk=token_chunk,
        backend=backend,
        entropy_grad=entropy_grad,
        reduce_hidden_grad=reduce_hidden_grad,
        batch_invariant=batch_invariant,
        vocab_size=vocab_size,
        softcap=softcap,
    )
    if selection.row_index is not None:
        inputs = {name: value.index_select(0, selection.row_index) for name, value in inputs.items()}
    sink = _weight_grad_sink(weight, problem, weight_grad_into, weight_grad_scale)
    padding = selection.padding
    gradients = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    valid = None if padding is None else ~padding
    chunk_loss = ChunkLoss(loss_fn, inputs, entropy_grad, gradients=gradients, sink=sink, valid=valid)
    loss, summary = run_held_pass(problem, options=options, sink=sink, loss=chunk_loss)
    return FusedLoss(loss, selection.place(summary.logprob), selection.place(summary.entropy))


def _weight_grad_sink(
    weight: Tensor, problem: ShardProblem, weight_grad_into: Optional[Tensor], weight_grad_scale: float
) -> Optional[WeightGradSink]:
    """Where a three-GEMM op's weight gradient goes: ``None`` where none is needed, the rows of the
    caller's ``weight_grad_into`` (checked against the whole ``weight``) that ``problem``'s weight
    has, where given, else parts of the pass's own."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return None
    if weight_grad_into is None:
        return WeightGradSink()
    if torch.compiler.is_compiling():
        raise NotImplementedError("weight_grad_into runs eagerly only, not under torch.compile")
    check_weight_grad_into(weight_grad_into, weight)
    scale = check_weight_grad_scale(weight_grad_scale)
    return WeightGradSink.into(weight_grad_into, scale, problem.hidden.shape[0], vocab_rows=problem.weight.shape[0])


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    declared_weights: Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    backend: Union[str, object] = "torch",
    token_chunk: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    weight_grad_into: Optional[Tensor] = None,
    weight_grad_scale: float = 1.0,
    out_of_vocab: str = "error",
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Tensor:
    """Per-token cross-entropy ``-logprob [...]`` (float32), its gradients computed in the forward
    (three GEMMs) for an upstream gradient declared up to a scalar: ``c * declared_weights``.

    Megatron's SFT loss, ``sum(losses * loss_mask) * scale``, has this shape with the scale
    unknown in the forward. The forward holds each row's own hidden gradient, exact for any
    upstream gradient, and the weight gradient for the declared weights. The backward fits ``c``
    on the device: proportional to ``declared_weights`` (``backends.contract.
    PROPORTIONAL_TOLERANCE``), the held weight gradient times ``c``; otherwise a second pass (two
    GEMMs, gated on the device on the Triton backend, read on the host on the torch backend) adds
    the weight gradient of the difference, exact by linearity, with one warning
    (``weight_grad_corrections``). Either way the gradients are those of ``fused_linear_logprob``,
    with no host synchronization on the Triton backend.

    Args:
        declared_weights: ``[...]`` (``targets``' shape) float or bool per-token weights, needing
            no gradient, the same on every rank of ``tp_group``.
        weight_grad_into, weight_grad_scale: as for ``fused_linear_loss``, the upstream gradient
            declared as ``weight_grad_scale * declared_weights``.
        out_of_vocab, vocab_size, softcap: as for ``fused_linear_logprob`` (``"max_logit"``: the stock labels
            path's loss, ``lse - max``, for a target id outside the vocabulary).
        the rest: as for ``fused_linear_loss``. There is no ``batch_invariant``; the four-GEMM
            ``fused_linear_logprob(..., batch_invariant=True)`` gives the same loss's gradients.
    """
    options, selection, problem = _prepare(
        "fused_linear_cross_entropy",
        hidden,
        weight,
        targets,
        tp_group=tp_group,
        temperature=temperature,
        out_of_vocab=out_of_vocab,
        loss_inputs={"declared_weights": declared_weights},
        token_chunk=token_chunk,
        backend=backend,
        entropy_grad=False,
        reduce_hidden_grad=reduce_hidden_grad,
        vocab_size=vocab_size,
        softcap=softcap,
    )
    declared = check_per_token("declared_weights", declared_weights, hidden.shape[:-1], hidden.device)
    if not declared.dtype.is_floating_point and declared.dtype != torch.bool:
        raise TypeError(f"declared_weights must be float or bool, got {declared.dtype}")
    sink = _weight_grad_sink(weight, problem, weight_grad_into, weight_grad_scale)
    loss, _ = run_held_pass(problem, options=options, sink=sink, declared=declared.float())
    return selection.place(loss)


def logits_loss(
    logits: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    *,
    loss_inputs: Optional[Dict[str, Tensor]] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    mask: Optional[Tensor] = None,
    max_rows: Optional[int] = None,
    token_chunk: Optional[int] = None,
    kept_tokens: Optional[KeptTokens] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
) -> FusedLoss:
    """``fused_linear_loss`` on a materialized logits shard: the same loss, the same contract for
    ``loss_fn`` and ``loss_inputs`` (``max_rows``, ``vocab_size`` and ``softcap`` as there), the
    gradient (to ``logits``) by the usual backward; with ``mask`` the number of selected rows is
    read on the host."""
    inputs = check_loss_inputs(loss_fn, loss_inputs, logits.shape[:-1], logits.device)
    several = _several_targets(targets, logits.shape[:-1], "error", False)
    options, selection, problem = _prepare(
        "logits_loss",
        logits,
        None,
        targets,
        backend="torch",
        tp_group=tp_group,
        temperature=temperature,
        mask=mask,
        max_rows=max_rows,
        kept_tokens=kept_tokens,
        several=several,
        loss_inputs=inputs,
        vocab_size=vocab_size,
        softcap=softcap,
        token_chunk=token_chunk,
    )
    logprob, entropy = _results(selection, *Logits.apply(problem.hidden, *problem[2:], options)[:2], True)
    check_declared_inputs(loss_fn, targets, inputs=inputs, mask=mask, lead_shape=logits.shape[:-1])
    logprob_rows = logprob.reshape(entropy.numel(), *logprob.shape[entropy.dim() :])  # [rows] or [rows, k]
    entropy_rows = entropy.reshape(-1)
    if mask is not None:
        rows = mask.reshape(-1).nonzero().squeeze(-1)
        logprob_rows, entropy_rows = logprob_rows[rows], entropy_rows[rows]
        inputs = {name: value[rows] for name, value in inputs.items()}
    check_rows_independent(loss_fn, logprob_rows.detach(), entropy_rows.detach(), inputs)  # as the fused path does
    loss = per_token_losses(loss_fn, logprob_rows, entropy_rows, inputs).sum()
    return FusedLoss(loss, logprob.detach(), entropy.detach())
