"""The autograd boundary: how a call crosses into its backend and back.

Eagerly a call goes straight to its backend: the four-GEMM path through an autograd function
(``Recompute``), the three-GEMM pass through ``loss_pass``. Under ``torch.compile`` the same bodies run
inside custom operators (``torch.ops.megatron_fused_lm``; the three-GEMM pass's in ``loss_pass.compiled``),
so that a compiled graph keeps each whole and never traces into a backend: each operator's schema lists its tensors and then every
``HeadOptions`` field (``options.OPTIONS_SCHEMA``), which it rebuilds by name. The unfused path on
materialized logits (``Logits``) is pure torch, which a compiled graph traces. Autocast stays outside
all of them: the statistics are float32 by contract.
"""

from __future__ import annotations

import contextlib
import re

import torch

from .backends import registry
from .backends.contract import Gradients, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from .chunking import blocked_statistics, chunk_logit_grads, chunk_rows, given_logits
from .distributed import all_gather_stacked, all_reduce_sum, group_size, merge_across_group
from .options import OPTIONS_SCHEMA, HeadOptions
from .several_targets import gathered_logits, statistics_column, taken_logits
from .softmax import SoftmaxSummary, summarize

Tensor = torch.Tensor
Statistics = tuple[Tensor, Tensor, Tensor, Tensor]  # logprob, entropy, lse, mean_logit: [n] float32
PROBLEM_SCHEMA = "Tensor hidden, Tensor weight, Tensor target_column, Tensor temperature, Tensor kept_mask"


def autocast_off(device: torch.device):
    # The statistics are float32 by contract: autocast must not turn products or reductions
    # inside the ops into 16-bit ones.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def operator(name: str, tensors: str, returns: str):
    """A custom operator ``megatron_fused_lm::name`` taking ``tensors`` (schema text; ``Tensor(a!)``
    marks one it writes) and every option, its body called with ``HeadOptions`` rebuilt."""

    def define(body):
        schema = f"({tensors}, *, {OPTIONS_SCHEMA}) -> {returns}"
        mutates = re.findall(r"Tensor\([a-z]!\)(?:\[\])? (\w+)", tensors)
        rebuilt = lambda *args, **fields: body(*args, HeadOptions(**fields))  # noqa: E731
        return torch.library.custom_op(f"megatron_fused_lm::{name}", rebuilt, mutates_args=mutates, schema=schema)

    return define


def new_summary(target_column: Tensor) -> SoftmaxSummary:
    """Empty float32 tensors for the summary of rows of ``target_column``: ``[n]`` each, the
    log-probs ``[n, m]`` for several targets."""
    empty = lambda *shape: target_column.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return SoftmaxSummary(empty(*target_column.shape), *(empty(target_column.shape[0]) for _ in range(4)))


def summarize_rows(
    backend, local: Tensor, problem: ShardProblem, options: HeadOptions, out=None, several_logits=gathered_logits
) -> SoftmaxSummary:
    """Rows' shard statistics ``local [k, 4]`` merged over the group and summarized into ``out``
    (``new_summary``'s, returned): by ``backend.summarize`` for one target per row (one all-gather);
    for several, their logits read by ``several_logits(hidden, weight, target_column, temperature,
    softcap)`` and summed over the group first."""
    group, target_column = options.tp_group, problem.target_column
    out = new_summary(target_column) if out is None else out
    if target_column.dim() == 1:
        backend.summarize(
            all_gather_stacked(local, group) if group_size(group) > 1 else local[None], target_column, out
        )
        return out
    target_logits = several_logits(*problem[:4], options.softcap)
    all_reduce_sum(target_logits, group)  # each rank holds its own ids' logits, 0 elsewhere
    summarize(merge_across_group(local, group), statistics_column(target_column), target_logits, out=out)
    return out


# The four-GEMM path: eagerly ``Recompute``, in a compiled graph ``fused_forward`` and its backward
# ``fused_backward``, over the same two bodies.


def recompute_statistics(hidden, weight, target_column, temperature, kept_mask, options: HeadOptions) -> Statistics:
    """Log-prob, entropy and the saved statistics of each row over the whole vocabulary
    (``target_column [n, k]``: log-probs ``[n, k]``)."""
    backend = registry.by_name(options.backend)
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    with autocast_off(hidden.device):
        local = backend.local_statistics(problem._replace(target_column=statistics_column(target_column)), options)
        return tuple(summarize_rows(backend, local, problem=problem, options=options)[:4])


def recompute_gradients(problem, saved, upstream, needed, options: HeadOptions) -> Gradients:
    """The gradients, the hidden one summed over the group when ``reduce_hidden_grad``."""
    with autocast_off(problem.hidden.device):
        grads = registry.by_name(options.backend).local_gradients(
            problem, saved, upstream=upstream, needed=needed, options=options
        )
        if grads.hidden is not None and options.reduce_hidden_grad:
            all_reduce_sum(grads.hidden, options.tp_group)
    return grads


fused_forward = operator("fused_forward", PROBLEM_SCHEMA, "(Tensor, Tensor, Tensor, Tensor)")(recompute_statistics)


@fused_forward.register_fake
def _(hidden, weight, target_column, *tensors, **fields) -> Statistics:
    # The log-prob has the targets' shape ([n] or [n, k]); the rest are [n].
    logprob = target_column.new_empty(target_column.shape, dtype=torch.float32)
    return logprob, *(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))


@operator(
    "fused_backward",
    f"{PROBLEM_SCHEMA}, Tensor lse, Tensor mean_logit, Tensor? grad_logprob, Tensor? grad_entropy, "
    "bool need_hidden, bool need_weight",
    "(Tensor, Tensor)",
)
def fused_backward(
    hidden,
    weight,
    target_column,
    temperature,
    kept_mask,
    lse,
    mean_logit,
    grad_logprob,
    grad_entropy,
    need_hidden,
    need_weight,
    options,
) -> tuple[Tensor, Tensor]:
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    upstream, needed = UpstreamGrads(grad_logprob, grad_entropy), NeededGrads(need_hidden, need_weight)
    grads = recompute_gradients(
        problem, SavedStatistics(lse, mean_logit), upstream=upstream, needed=needed, options=options
    )
    # A custom operator returns tensors, never None: an unneeded gradient is an empty tensor.
    return tuple(
        like.new_empty(0) if grad is None else grad for grad, like in zip(grads, (hidden, weight), strict=True)
    )


@fused_backward.register_fake
def _(hidden, weight, *statistics_and_upstream, **fields) -> tuple[Tensor, Tensor]:
    needed = statistics_and_upstream[-2:]
    return tuple(
        torch.empty_like(like) if need else like.new_empty(0)
        for like, need in zip((hidden, weight), needed, strict=True)
    )


class Recompute(torch.autograd.Function):
    """The four-GEMM path eagerly: ``recompute_statistics``, its backward ``recompute_gradients``."""

    forward = staticmethod(recompute_statistics)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_statistics(ctx, inputs[:5], inputs[5], output)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
        return (*_recompute_backward(ctx, grad_logprob, grad_entropy, recompute_gradients), None)


def _operator_backward(problem, saved, upstream, needed, options) -> Gradients:
    grads = fused_backward(*problem, *saved, *upstream, *needed, **options.fields())
    return Gradients(*(grad if need else None for grad, need in zip(grads, needed, strict=True)))


fused_forward.register_autograd(
    lambda ctx, grad_logprob, grad_entropy, *_: _recompute_backward(
        ctx, grad_logprob, grad_entropy, _operator_backward
    ),
    setup_context=lambda ctx, inputs, keyword_only_inputs, output: _save_statistics(
        ctx, inputs, HeadOptions(**keyword_only_inputs), output
    ),
)


def _recompute_backward(ctx, grad_logprob, grad_entropy, run) -> tuple:
    upstream = UpstreamGrads.from_autograd(grad_logprob, grad_entropy)
    if upstream is None:
        return None, None, None, None, None
    *problem, lse, mean_logit = ctx.saved_tensors
    needed = NeededGrads(*ctx.needs_input_grad[:2])
    grads = run(
        ShardProblem(*problem), SavedStatistics(lse, mean_logit), upstream=upstream, needed=needed, options=ctx.options
    )
    return grads.hidden, grads.weight, None, None, None


def crossed(*tensors, options: HeadOptions) -> Statistics:
    """The four-GEMM path: ``Recompute`` eagerly, the custom operator in a compiled graph."""
    if torch.compiler.is_compiling():
        return fused_forward(*tensors, **options.fields())
    return Recompute.apply(*tensors, options)


class Logits(torch.autograd.Function):
    """The unfused path on a materialized logits shard ``[n, vocab_shard]``: the float32 softmax
    one chunk of rows at a time, in the forward and again in the backward (the saved logits never
    modified), the gradient in the logits' dtype. Pure torch, so a compiled graph traces it."""

    @staticmethod
    def forward(logits, target_column, temperature, kept_mask, options: HeadOptions) -> Statistics:
        with autocast_off(logits.device):
            rows_per_chunk = chunk_rows(options.token_chunk, logits.shape[-1])
            block_logits = given_logits(logits, temperature, options.softcap)
            stats = blocked_statistics(block_logits, statistics_column(target_column), kept_mask, rows_per_chunk)
            several = lambda logits, _, *column_temperature_softcap: taken_logits(logits, *column_temperature_softcap)  # noqa: E731
            problem = ShardProblem(logits, None, target_column, temperature=temperature, kept_mask=kept_mask)
            summary = summarize_rows(
                registry.by_name("torch"), stats, problem=problem, options=options, several_logits=several
            )
            return tuple(summary[:4])

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_statistics(ctx, inputs[:4], inputs[4], output)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
        upstream = UpstreamGrads.from_autograd(grad_logprob, grad_entropy)
        if upstream is None:
            return None, None, None, None, None
        logits, target_column, temperature, kept_mask, lse, mean_logit = ctx.saved_tensors
        problem = ShardProblem(logits, None, target_column, temperature=temperature, kept_mask=kept_mask)
        grad_logits, softcap = torch.empty_like(logits), ctx.options.softcap
        with autocast_off(logits.device):
            rows_per_chunk = chunk_rows(ctx.options.token_chunk, logits.shape[-1])
            saved = SavedStatistics(lse, mean_logit)
            block_logits = given_logits(logits, temperature, softcap)
            chunks = chunk_logit_grads(
                block_logits, problem, saved=saved, upstream=upstream, token_chunk=rows_per_chunk, softcap=softcap
            )
            for chunk, grad in chunks:
                grad_logits[chunk] = grad
        return grad_logits, None, None, None, None


def _save_statistics(ctx, inputs: tuple, options: HeadOptions, output: Statistics) -> None:
    # The entropy of a call without entropy_grad is detached by the public op, so its upstream
    # gradient arrives as None.
    _, _, lse, mean_logit = output
    ctx.save_for_backward(*inputs, lse, mean_logit)
    ctx.options = options
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, mean_logit)
