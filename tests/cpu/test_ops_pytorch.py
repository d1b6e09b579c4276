"""The ops as PyTorch citizens on the CPU: ``torch.compile(fullgraph=True)``, autocast, no host
reads of tensor data, static-shape row selection, inference mode and ``no_grad``.
(CUDA graphs and the CUDA sync check are in ``tests/gpu/test_cuda_graphs.py``.)"""

import pytest
import torch

from devkit.oracle import make_case, reference, relative_error
from devkit.spawn import run_ranks
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    logits_logprob,
    losses,
)
from megatron_fused_lm.ops.kept_tokens import KeptSets, every_column, torch_kept_mask

HIDDEN, VOCAB, ROWS = 24, 97, 19


def inputs(dtype=torch.float32, seed=0):
    hidden, weight, targets = make_case((ROWS,), HIDDEN, VOCAB, dtype, peaky=True, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    upstream = torch.randn(2, ROWS, generator=generator)
    mask = torch.rand(ROWS, generator=generator) < 0.5
    return hidden, weight, targets, upstream, mask


def fused_loss(hidden, weight, targets, upstream, **options):
    """``(logprob, entropy, loss)``: the loss a weighted sum of both outputs."""
    logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, token_chunk=7, **options)
    return logprob, entropy, (logprob * upstream[0]).sum() + (entropy * upstream[1]).sum()


def logits_loss(logits, targets, upstream, **options):
    logprob, entropy = logits_logprob(logits, targets, return_entropy=True, token_chunk=7, **options)
    return logprob, entropy, (logprob * upstream[0]).sum() + (entropy * upstream[1]).sum()


def with_grads(loss_fn, leaves, *args, **options):
    """``loss_fn``'s outputs followed by the gradients of its loss w.r.t. ``leaves`` (the
    backward runs outside ``loss_fn``, as a compiled training step runs it)."""
    *outputs, loss = loss_fn(*leaves, *args, **options)
    return (*outputs, *torch.autograd.grad(loss, leaves))


def fused_step(hidden, weight, targets, upstream, loss_fn=fused_loss, **options):
    return with_grads(loss_fn, (hidden, weight), targets, upstream, **options)


def logits_step(logits, targets, upstream, loss_fn=logits_loss, **options):
    return with_grads(loss_fn, (logits,), targets, upstream, **options)


@pytest.mark.parametrize("case", ["all rows", "mask with max_rows", "softcap"])
def test_fullgraph_compile_of_forward_and_backward_equals_eager(case):
    hidden, weight, targets, upstream, mask = inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    options = {"all rows": {}, "mask with max_rows": dict(mask=mask, max_rows=ROWS), "softcap": dict(softcap=3.0)}[case]
    eager = fused_step(hidden, weight, targets, upstream, **options)
    compiled_loss = torch.compile(fused_loss, fullgraph=True)
    compiled = fused_step(hidden, weight, targets, upstream, loss_fn=compiled_loss, **options)
    for expected, actual in zip(eager, compiled, strict=True):
        # The ops run whole inside the graph, so the same kernels compute the same numbers; the
        # few fused elementwise ops around them may round differently in the last place.
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_fullgraph_compile_of_the_logits_path_equals_eager():
    hidden, weight, targets, upstream, _ = inputs()
    logits = (hidden @ weight.t()).requires_grad_()
    eager = logits_step(logits, targets, upstream)
    compiled = logits_step(logits, targets, upstream, loss_fn=torch.compile(logits_loss, fullgraph=True))
    for expected, actual in zip(eager, compiled, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_compiled_graph_still_rejects_an_out_of_range_target():
    hidden, weight, targets, upstream, _ = inputs()
    compiled = torch.compile(lambda h, w, y: fused_linear_logprob(h, w, y), fullgraph=True)
    compiled(hidden, weight, targets)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        compiled(hidden, weight, torch.where(targets == targets[3], VOCAB, targets))


@pytest.mark.parametrize("path", ["fused", "logits"])
def test_autocast_gives_the_float32_numbers(path):
    # float32 inputs under bf16 autocast: the ops opt out, so nothing inside runs in bf16.
    hidden, weight, targets, upstream, _ = inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    logits = (hidden @ weight.t()).detach().requires_grad_()

    def step():
        if path == "fused":
            return fused_step(hidden, weight, targets, upstream)
        return logits_step(logits, targets, upstream)

    plain = step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = step()
    for expected, actual in zip(plain, autocast, strict=True):
        assert actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    # And the float32 numbers are the right ones (bf16 reductions would be off by ~1e-3).
    expected = reference(hidden, weight, targets, 1.0, *upstream)
    if path == "fused":
        assert relative_error(autocast[1], expected.entropy) <= 2e-6
        assert relative_error(autocast[2], expected.grad_hidden) <= 2e-5


def test_no_host_read_of_tensor_data_without_a_mask():
    # Meta tensors carry no data: any .item(), .tolist(), bool() or nonzero on the way would
    # raise. So the whole forward and backward is free of host synchronizations on a GPU.
    hidden = torch.randn(ROWS, HIDDEN, device="meta", requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, device="meta", requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS,), device="meta")
    upstream = torch.randn(2, ROWS, device="meta")
    _, _, grad_hidden, grad_weight = fused_step(hidden, weight, targets, upstream)
    assert grad_hidden.shape == hidden.shape and grad_weight.shape == weight.shape
    logits = torch.randn(ROWS, VOCAB, device="meta", requires_grad=True)
    assert logits_step(logits, targets, upstream)[2].shape == logits.shape
    mask = torch.ones(ROWS, dtype=torch.bool, device="meta")
    fused_step(hidden, weight, targets, upstream, mask=mask, max_rows=ROWS // 2)  # static shape: no read
    with pytest.raises(NotImplementedError, match="nonzero"):  # a bare mask reads its row count
        fused_step(hidden, weight, targets, upstream, mask=mask)


def test_max_rows_pads_without_changing_the_results():
    hidden, weight, targets, upstream, mask = inputs(seed=3)
    hidden.requires_grad_()
    weight.requires_grad_()
    targets = torch.where(mask, targets, -100)  # unselected targets are never read
    exact = fused_step(hidden, weight, targets, upstream, mask=mask)
    for max_rows in (int(mask.sum()), int(mask.sum()) + 5, 10 * ROWS):
        padded = fused_step(hidden, weight, targets, upstream, mask=mask, max_rows=max_rows)
        for expected, actual in zip(exact, padded, strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="more than max_rows"):
        fused_linear_logprob(hidden, weight, targets, mask=mask, max_rows=int(mask.sum()) - 1)
    with pytest.raises(ValueError, match="needs a mask"):
        fused_linear_logprob(hidden, weight, targets, max_rows=3)


def test_no_grad_results_carry_no_graph():
    hidden, weight, targets, _, _ = inputs()
    hidden.requires_grad_()
    with torch.no_grad():
        logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True)
    assert logprob.grad_fn is None and not logprob.requires_grad and not entropy.requires_grad


def test_inference_mode_then_training_behaves_like_the_stock_path():
    # Old log-probs under inference mode, then the training forward + backward outside it.
    hidden, weight, targets, upstream, _ = inputs()
    with torch.inference_mode():
        old_fused = fused_linear_logprob(hidden, weight, targets)
        old_stock = logits_logprob(hidden @ weight.t(), targets)
    assert old_fused.is_inference() and old_stock.is_inference()
    torch.testing.assert_close(old_fused, old_stock, rtol=1e-5, atol=1e-5)
    hidden.requires_grad_()
    ratio = (fused_linear_logprob(hidden, weight, targets) - old_fused).exp()
    (ratio * upstream[0]).sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    # Saving an inference tensor for a backward is refused alike, with torch's own message.
    with torch.inference_mode():
        inference_weight = weight.clone()
    for compute in (lambda: fused_linear_logprob(hidden, inference_weight, targets),
                    lambda: logits_logprob(hidden @ inference_weight.t(), targets)):  # fmt: skip
        with pytest.raises(RuntimeError, match="Inference tensors"):
            compute().sum().backward()


def opcheck_cases():
    """``(operator, args, kwargs)`` for each custom operator: inputs that need gradients for the
    forward operators (their registered autograd is checked), plain ones for the others; the loss
    path's phases on a pass's own state after its first chunk's statistics."""
    from megatron_fused_lm.ops.backends.contract import NeededGrads, ShardProblem
    from megatron_fused_lm.ops.backends.registry import TorchBackend
    from megatron_fused_lm.ops.options import HeadOptions
    from megatron_fused_lm.ops.softmax import summarize

    hidden, weight, targets, upstream, _ = inputs()
    options = HeadOptions(token_chunk=7).fields()
    temperature = torch.rand(ROWS) + 1.0  # one per row, at least 1: the random lse must not overflow exp(z - lse)
    lse, mean_logit = torch.randn(ROWS), torch.randn(ROWS)
    ops = torch.ops.megatron_fused_lm
    hidden, weight = hidden.detach(), weight.detach()
    several = torch.stack([targets, targets.flip(0), targets], dim=-1)  # three ids per row, one repeated
    every = every_column(hidden.device)
    # Each row keeps its target and a few ids more (kept_tokens), as the torch backend's bitmask.
    kept_row = torch.cat([torch.arange(ROWS), torch.randint(0, ROWS, (3 * ROWS,))])
    kept_ids = torch.cat([targets, torch.randint(0, VOCAB, (3 * ROWS,))])[kept_row.argsort(stable=True)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(kept_row, minlength=ROWS).cumsum(0)])
    kept = torch_kept_mask(KeptSets(offsets, kept_ids, targets, ROWS, 0, VOCAB), VOCAB)
    problem = ShardProblem(hidden, weight, targets, temperature, every)
    backend = TorchBackend()
    head_options = HeadOptions(token_chunk=7)
    state = backend.allocate(problem, NeededGrads(True, True), head_options)
    local = backend.chunk_statistics(problem, state, slice(0, 7), head_options)
    summary = list(summarize(local, targets[:7]))
    chunk_problem = (hidden[:7], weight, targets[:7], temperature[:7], kept[:7])
    held_weight = [torch.randn(VOCAB // 2, HIDDEN), torch.randn(VOCAB - VOCAB // 2, HIDDEN)]
    held = [torch.randn(ROWS, HIDDEN), *held_weight]
    spec = dict(has_weight_grad_into=False, weight_grad_scale=1.0, parts=2, dtype=torch.bfloat16, **options)
    # The summary a correcting pass reads: an lse far above the logits, so exp(z - lse) stays small.
    correction = [hidden, weight, targets, temperature, kept, -lse.abs(), lse.abs(), lse.abs() + 10, mean_logit, lse]
    gradients = (upstream[0][:7], upstream[1][:7], None, 0, 7, False)
    return {
        "loss_allocate": (ops.loss_allocate, (*problem, True, True), options),
        "loss_statistics": (ops.loss_statistics, (*chunk_problem, state.block, state.reference), options),
        "loss_summary": (ops.loss_summary, (local, *chunk_problem), options),
        "loss_gradients": (ops.loss_gradients, (*problem, *state[:5], summary, *gradients), options),
        "loss_chosen_rows": (ops.loss_chosen_rows, (held_weight, targets, torch.randn(ROWS), hidden), options),
        "held_backward": (
            ops.held_backward, (torch.tensor(0.37), held), dict(spec, per_token=False, correctable=False)
        ),
        "held_backward_per_token": (
            ops.held_backward,
            (upstream[0] * 0.0 + 0.5, [*held, *correction, torch.empty(0), torch.ones(ROWS), torch.empty(0)]),
            dict(spec, per_token=True, correctable=True),
        ),
        "fused_forward": (
            ops.fused_forward,
            (hidden.detach().requires_grad_(), weight.detach().requires_grad_(), targets, temperature, every),
            options,
        ),
        "fused_forward_kept": (
            ops.fused_forward,
            (hidden.detach().requires_grad_(), weight.detach().requires_grad_(), targets, temperature, kept),
            options,
        ),
        "fused_backward": (
            ops.fused_backward,
            (hidden, weight, targets, temperature, kept, lse, mean_logit, upstream[0], upstream[1], True, True),
            options,
        ),
        "fused_forward_several": (
            ops.fused_forward,
            (hidden.detach().requires_grad_(), weight.detach().requires_grad_(), several, temperature, every),
            options,
        ),
        "fused_backward_several": (
            ops.fused_backward,
            (hidden, weight, several, temperature, every, lse, mean_logit, upstream[0][:, None].repeat(1, 3),
             upstream[1], True, True),
            options,
        ),  # fmt: skip
    }  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "fused_forward",
        "fused_forward_kept",
        "fused_backward",
        "fused_forward_several",
        "fused_backward_several",
        "loss_allocate",
        "loss_statistics",
        "loss_summary",
        "loss_gradients",
        "loss_chosen_rows",
        "held_backward",
        "held_backward_per_token",
    ],
)
def test_custom_operators_pass_opcheck(name):
    # Schema, fake implementation, autograd registration and an AOT-compiled run with dynamic
    # shapes against eager: what torch.compile and export rely on. The allocation returns memory
    # the pass then writes, so its values are not compared, only its shapes, dtypes and strides.
    operator, args, kwargs = opcheck_cases()[name]
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(operator, args, kwargs, **({"test_utils": checks} if name == "loss_allocate" else {}))


POLICY = losses.ClippedPolicyLoss(clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)


def user_policy_loss(logprob, entropy, *, old_logprob, advantages):
    """A loss written by a user, of ordinary tensor operations and with no declared attributes."""
    ratio = (logprob - old_logprob).exp()
    return -torch.minimum(advantages * ratio, advantages * ratio.clamp(0.8, 1.2)) - 0.01 * entropy


@pytest.mark.parametrize(
    "loss_fn, softcap", [(POLICY, None), (user_policy_loss, None), (POLICY, 3.0)], ids=["ready-made", "user", "softcap"]
)
def test_fullgraph_compile_of_the_loss_path_equals_eager(loss_fn, softcap):
    hidden, weight, targets, upstream, _ = inputs()
    with torch.no_grad():
        current = fused_linear_logprob(hidden, weight, targets)
    loss_inputs = dict(old_logprob=current + 0.1 * upstream[0], advantages=upstream[1])
    if loss_fn is POLICY:
        loss_inputs.update(ref_logprob=current - 0.1 * upstream[0], weight=torch.full((ROWS,), 1.0 / ROWS))

    def loss_of(hidden, weight):
        result = fused_linear_loss(
            hidden, weight, targets, loss_fn, loss_inputs=loss_inputs, token_chunk=7, softcap=softcap
        )
        return result.logprob, result.entropy, 0.37 * result.loss

    def declared_of(hidden, weight):
        per_token = fused_linear_cross_entropy(
            hidden, weight, targets, loss_inputs["advantages"].abs(), token_chunk=7, softcap=softcap
        )
        return per_token, 0.37 * (per_token * loss_inputs["advantages"].abs()).sum()

    def declared_other_of(hidden, weight):
        # An upstream gradient not proportional to the declared weights: the second pass runs inside
        # the compiled backward's custom operator.
        per_token = fused_linear_cross_entropy(hidden, weight, targets, loss_inputs["advantages"].abs(), token_chunk=7)
        return per_token, (per_token**2).sum()

    for function in (loss_of, declared_of, declared_other_of):
        results = {}
        for name, run in (("eager", function), ("compiled", torch.compile(function, fullgraph=True))):
            leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            *outputs, loss = run(*leaves)
            loss.backward()
            results[name] = (*outputs, loss, *(leaf.grad for leaf in leaves))
        for expected, actual in zip(results["eager"], results["compiled"], strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def compiled_with_a_group(rank, world_size):
    """Each rank's shard of one weight: the compiled ops equal the eager ones under a tp_group (the
    operators' bodies look the group up by name while the compiled graph runs)."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    hidden, weight, targets = make_case((ROWS,), 16, 2 * 23, torch.float32, peaky=True, seed=4)
    shard = weight[rank * 23 : (rank + 1) * 23]
    advantages = torch.linspace(-1, 1, ROWS)

    def step(hidden, shard):
        logprob, entropy = fused_linear_logprob(hidden, shard, targets, tp_group=group, return_entropy=True)
        result = fused_linear_loss(
            hidden, shard, targets, user_policy_loss, tp_group=group, token_chunk=7,
            loss_inputs=dict(old_logprob=logprob.detach() + 0.1, advantages=advantages),
        )  # fmt: skip
        return logprob, result.loss + entropy.sum()

    results = {}
    # Compiled first: no eager call has named the group to the ops before.
    for name, run in (("compiled", torch.compile(step, fullgraph=True)), ("eager", step)):
        leaves = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        logprob, loss = run(*leaves)
        loss.backward()
        results[name] = (logprob, loss, *(leaf.grad for leaf in leaves))
    for expected, actual in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_fullgraph_compile_under_a_tensor_parallel_group_equals_eager():
    run_ranks(compiled_with_a_group, 2)
