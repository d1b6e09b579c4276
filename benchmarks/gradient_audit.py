"""The gradient audit of ``real_training.py --audit``: on a run's weights and one of its
micro-batches, the head's gradients of the run's loss, with respect to the output layer's input and
its weight, by each path against a float64 reference.

Paths, each through the ops the real runs call (the Triton kernels on a GPU):

- ``stock``: bf16 logits, the loss in float32 from them (SFT: Megatron's
  ``vocab_parallel_cross_entropy``; RL: ``logits_loss``, what a stock head's ``head.loss`` runs),
  the gradients through the bf16 product, the hidden one all-reduced as Megatron's layer does;
- ``three_gemm``: the gradients finished in the forward (SFT ``fused_linear_cross_entropy`` with the
  loss's declared weights, RL ``fused_linear_loss``);
- ``main_grad``: the same with the weight's gradient added into a float32 buffer in the forward;
- ``recompute``: ``fused_linear_logprob`` (log-prob and entropy), the loss by hand, four GEMMs;
- ``bf16_reference``: the reference itself rounded to bf16, the floor of any path whose gradients
  are bf16 tensors (all but the main_grad route's weight gradient).

The reference: float64 logits over the whole vocabulary (the shards gathered), in chunks of rows,
and autograd's gradients of the loss and of its entropy term. ``exact_head_loss`` is the same
reference as an autograd op, the head of the paired replay's ``exact`` path (``paired_replay``).

Per path and part (``hidden``, ``weight``, and ``both`` concatenated), with ``g`` the reference
gradient and ``e`` the path's minus ``g``:

- ``relative_error``: ``|e| / |g|``;
- ``projection``: ``<e, g> / |g|^2``, the error along the true gradient (a change of the step's
  length, ``-0.01`` is a step 1 % short);
- ``entropy_coef_shift``: ``-<e, g_H> / |g_H|^2`` with ``g_H`` the float64 gradient of the
  weighted entropy ``sum_t w_t H_t``: the error's component along it, read as a change of the
  entropy coefficient (the loss's entropy term is ``-coef * sum_t w_t H_t``; an SFT loss has none,
  so there the shift is the bonus the error adds).

``docs/benchmarks/real_training.md`` reads the records.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from devkit.megatron_gpt import masked_loss
from devkit.oracle import logprob_entropy
from megatron_fused_lm import fused_linear_cross_entropy, fused_linear_logprob, fused_linear_loss, logits_loss

PATHS = ("stock", "three_gemm", "main_grad", "recompute")
FLOOR = "bf16_reference"
PARTS = ("hidden", "weight", "both")
REFERENCE_CHUNK_ELEMENTS = 2**26  # float64 logits per reference chunk of rows: 512 MiB


@dataclasses.dataclass
class HeadLoss:
    """A micro-batch's loss at the head: ``sum`` over the rows ``mask [b, s]`` selects of
    ``loss_fn(logprob, entropy, **inputs)``; ``entropy_weight [b, s]`` the weights ``w_t`` of its
    entropy term's ``sum_t w_t H_t`` (the token weights; the term itself may be absent, as in SFT).
    ``declared`` (SFT): the cross-entropy's per-token weights, for the three-GEMM op, else None.
    ``stock_inputs``: the stock path's inputs where a stock run's differ (RL: its old log-probs come
    from bf16 logits too), else None."""

    loss_fn: Callable
    inputs: Dict[str, torch.Tensor]
    mask: Optional[torch.Tensor]
    entropy_weight: torch.Tensor
    declared: Optional[torch.Tensor] = None
    stock_inputs: Optional[Dict[str, torch.Tensor]] = None


def audit_point(
    hidden: torch.Tensor,
    shard: torch.Tensor,
    targets: torch.Tensor,
    loss: HeadLoss,
    tp_group: Optional[dist.ProcessGroup],
    backend: str,
) -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{path: {part: {metric: value}}}`` (the module's docstring) for ``hidden [b, s, H]`` (the
    output layer's input, whole on every rank), ``shard [V / P, H]`` this rank's output weight,
    ``targets [b, s]``; the same on every rank. Its paths are ``PATHS`` and ``FLOOR``."""
    weight = gather_rows(shard, tp_group)
    _, reference, entropy_gradient = float64_gradients(hidden, weight, targets, loss)
    results = {}
    for path in PATHS:
        grad_hidden, grad_shard = path_gradients(path, hidden, shard, targets, loss, tp_group, backend)
        gradient = (grad_hidden.double(), gather_rows(grad_shard.double(), tp_group))
        results[path] = compare(gradient, reference, entropy_gradient)
    rounded = tuple(part.to(torch.bfloat16).double() for part in reference)
    results[FLOOR] = compare(rounded, reference, entropy_gradient)
    return results


def path_gradients(path, hidden, shard, targets, loss: HeadLoss, tp_group, backend):
    """``path``'s ``(grad_hidden [b, s, H], grad_shard [V / P, H])`` of ``loss``."""
    leaf_hidden = hidden.detach().requires_grad_()
    leaf_shard = shard.detach().requires_grad_()
    into = {}
    if path == "main_grad":  # Megatron's float32 main_grad, which the forward adds into
        into = dict(weight_grad_into=torch.zeros(shard.shape, dtype=torch.float32, device=shard.device),
                    weight_grad_scale=1.0)  # fmt: skip
    common = dict(tp_group=tp_group, backend=backend)
    if path == "stock" and loss.declared is not None:
        value = stock_sft_loss(leaf_hidden, leaf_shard, targets, loss.declared)
    elif path == "stock":
        inputs = loss.inputs if loss.stock_inputs is None else loss.stock_inputs
        value = logits_loss(leaf_hidden @ leaf_shard.t(), targets, loss.loss_fn, loss_inputs=inputs, mask=loss.mask,
                            tp_group=tp_group).loss  # fmt: skip
    elif path == "recompute":
        logprob, entropy = fused_linear_logprob(
            leaf_hidden, leaf_shard, targets, return_entropy=True, mask=loss.mask, entropy_grad=True, **common
        )
        value = masked_loss(loss.loss_fn, logprob, entropy, loss.inputs, loss.mask)
    elif loss.declared is not None:
        value = fused_sft_loss(leaf_hidden, leaf_shard, targets, loss.declared, **common, **into)
    else:
        value = fused_linear_loss(
            leaf_hidden, leaf_shard, targets, loss.loss_fn, loss_inputs=loss.inputs, mask=loss.mask, **common, **into
        ).loss
    value.backward()
    grad_hidden = leaf_hidden.grad
    if path == "stock" and tp_group is not None:  # each rank's product holds its shard's part
        dist.all_reduce(grad_hidden, group=tp_group)
    grad_shard = into["weight_grad_into"] if into else leaf_shard.grad
    return grad_hidden, grad_shard


def stock_sft_loss(hidden, shard, targets, declared) -> torch.Tensor:
    """Megatron's SFT loss ``sum(declared * loss)`` on the stock logits (bf16, as the output layer
    returns them) of ``hidden [b, s, H]`` and ``shard [V / P, H]``."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return (vocab_parallel_cross_entropy((hidden @ shard.t()).float(), targets) * declared).sum()


def fused_sft_loss(hidden, shard, targets, declared, **options) -> torch.Tensor:
    """The same by the labels path's op, ``declared`` the loss's weights (three GEMMs); ``options``
    for ``fused_linear_cross_entropy``."""
    return (fused_linear_cross_entropy(hidden, shard, targets, declared, **options) * declared).sum()


def reference_chunks(hidden, weight, targets, loss: HeadLoss) -> Iterator[tuple]:
    """Per chunk of rows of ``hidden [..., H]`` against the whole ``weight [V, H]``: ``(rows,
    leaf_hidden, leaf_weight, value, entropy_sum)``, the chunk's rows, its float64 leaves (one
    weight leaf for all chunks), the loss summed over its selected rows and ``sum_t w_t H_t``
    there, from float64 logits."""
    rows_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat = {name: value.reshape(rows_hidden.shape[0], *value.shape[hidden.dim() - 1 :]) for name, value in
            loss.inputs.items()}  # fmt: skip
    selected = torch.ones(rows_hidden.shape[0], dtype=torch.bool, device=hidden.device)
    if loss.mask is not None:
        selected = loss.mask.reshape(-1).bool()
    leaf_weight = weight.detach().double().requires_grad_()
    step = max(1, REFERENCE_CHUNK_ELEMENTS // weight.shape[0])
    for start in range(0, rows_hidden.shape[0], step):
        rows = slice(start, start + step)
        chosen = selected[rows]
        leaf_hidden = rows_hidden[rows].detach().double().requires_grad_()
        logprob, entropy = logprob_entropy(leaf_hidden @ leaf_weight.t(), targets.reshape(-1)[rows])
        inputs = {name: value[rows][chosen].double() for name, value in flat.items()}
        value = loss.loss_fn(logprob[chosen], entropy[chosen], **inputs).sum()
        entropy_sum = (loss.entropy_weight.reshape(-1)[rows][chosen].double() * entropy[chosen]).sum()
        yield rows, leaf_hidden, leaf_weight, value, entropy_sum


def float64_gradients(hidden, weight, targets, loss: HeadLoss, entropy: bool = True):
    """``(value, (grad_hidden, grad_weight), entropy_gradients)``: the float64 loss over the
    selected rows of ``hidden [..., H]`` and ``weight [V, H]`` (the whole vocabulary), its
    gradients, and those of ``sum_t w_t H_t`` (``None`` unless ``entropy``)."""
    grads = [torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device).reshape(-1, hidden.shape[-1]),
             torch.zeros(weight.shape, dtype=torch.float64, device=weight.device)]  # fmt: skip
    entropy_grads = [torch.zeros_like(grads[0]), torch.zeros_like(grads[1])] if entropy else None
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for rows, leaf_hidden, leaf_weight, value, entropy_sum in reference_chunks(hidden, weight, targets, loss):
        total += value.detach()
        terms = ((grads, value), (entropy_grads, entropy_sum)) if entropy else ((grads, value),)
        for into, term in terms:
            chunk_hidden, chunk_weight = torch.autograd.grad(term, (leaf_hidden, leaf_weight), retain_graph=True)
            into[0][rows] += chunk_hidden
            into[1] += chunk_weight
    unflat = lambda pair: (pair[0].reshape(hidden.shape), pair[1])  # noqa: E731
    return total, unflat(grads), unflat(entropy_grads) if entropy else None


@torch.no_grad()
def float64_value(hidden, weight, targets, loss: HeadLoss) -> float:
    """The float64 loss alone, as ``float64_gradients`` sums it."""
    return float(sum(chunk[3] for chunk in reference_chunks(hidden, weight, targets, loss)))


class ExactHead(torch.autograd.Function):
    """``exact_head_loss``: the gradients computed with the loss, in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, loss):
        with torch.enable_grad():
            value, (grad_hidden, grad_weight), _ = float64_gradients(hidden, weight, targets, loss, entropy=False)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return value.float()

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output.double()
        return (grad_hidden * scale).to(ctx.dtypes[0]), (grad_weight * scale).to(ctx.dtypes[1]), None, None


def exact_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, loss: HeadLoss) -> torch.Tensor:
    """``loss`` (a float32 scalar) of ``hidden [b, s, H]`` and the whole ``weight [V, H]`` from
    float64 logits, its gradients float64 rounded once to the inputs' dtypes (bf16 in a run): the
    exact head a bf16 model can have. One rank only (TP=1)."""
    return ExactHead.apply(hidden, weight, targets, loss)


def compare(gradient, reference, entropy_gradient) -> Dict[str, Dict[str, float]]:
    """The metrics of the module's docstring, per part."""
    out = {}
    for index, part in enumerate(PARTS):
        if part == "both":
            got, want, entropy = (torch.cat([pair[0].flatten(), pair[1].flatten()]) for pair in
                                  (gradient, reference, entropy_gradient))  # fmt: skip
        else:
            got, want, entropy = (pair[index].flatten() for pair in (gradient, reference, entropy_gradient))
        error = got - want
        out[part] = {
            "relative_error": float(error.norm() / want.norm()),
            "projection": float(error @ want / (want @ want)),
            "entropy_coef_shift": float(-(error @ entropy) / (entropy @ entropy)),
        }
    return out


def gather_rows(shard: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The rank's rows ``[V / P, ...]`` gathered over ``tp_group`` in rank order, ``[V, ...]``."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    return torch.cat(parts)
