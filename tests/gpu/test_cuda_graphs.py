"""The ops as PyTorch citizens on CUDA: CUDA-graph capture (forward only, and forward + backward)
with replays bitwise equal to eager, ``torch.compile(fullgraph=True)``, no host synchronization
under ``torch.cuda.set_sync_debug_mode``, autocast, and an out-of-range target caught on the device.
The paths: the log-prob op (``path="logprob"``), the loss op with its gradients finished in the
forward (``path="loss"``, a clipped policy loss with an entropy bonus), and the labels path's
declared cross-entropy (``path="labels"``: an upstream gradient as declared; ``"labels-other"``: one
that is not, which the Triton backend corrects behind a gate on the device)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    losses,
    weight_grad_corrections,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ("triton", "torch")
PATHS = ("logprob", "loss")
TOKENS, HIDDEN, VOCAB = 1024, 1024, 32003
POLICY = losses.ClippedPolicyLoss(clip_high=0.28, entropy_coef=0.01)


def make_inputs(seed, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (4 / HIDDEN**0.5)).to(dtype)
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    upstream = torch.randn(2, TOKENS, device="cuda", generator=gen)
    mask = torch.rand(TOKENS, device="cuda", generator=gen) < 0.3
    return hidden, weight, targets, upstream, mask


def forward(hidden, weight, targets, upstream, backend, path="logprob", **options):
    """``(logprob, entropy, loss)``: the loss the weighted sum of both (``path="logprob"``), the
    policy loss on them (``path="loss"``, its inputs made from ``upstream``), or the labels path's
    per-token cross-entropy twice and its loss (``"labels"``: declared as 0.37 times a mask;
    ``"labels-other"``: the losses weighted by ``upstream[0]`` instead)."""
    if path.startswith("labels"):
        declared = (upstream[1] > 0).float()
        per_token = fused_linear_cross_entropy(hidden, weight, targets, declared, backend=backend, **options)
        weights = 0.37 * declared if path == "labels" else upstream[0]
        return per_token, per_token, (per_token * weights).sum()
    if path == "loss":
        weights = torch.full_like(upstream[0], 1e-3)
        loss_inputs = dict(old_logprob=upstream[0] - 10.0, advantages=upstream[1], weight=weights)
        result = fused_linear_loss(hidden, weight, targets, POLICY, loss_inputs=loss_inputs, backend=backend, **options)
        return result.logprob, result.entropy, 0.37 * result.loss
    logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend=backend, **options)
    return logprob, entropy, (logprob * upstream[0]).sum() + (entropy * upstream[1]).sum()


def step(hidden, weight, targets, upstream, backend, backward=True, path="logprob", **options):
    """Log-prob and entropy, then (``backward``) the loss's gradients into ``hidden.grad`` and
    ``weight.grad``."""
    logprob, entropy, loss = forward(hidden, weight, targets, upstream, backend, path, **options)
    if backward:
        loss.backward()
    return logprob, entropy


def eager_results(inputs, backend, backward, path="logprob", **options):
    hidden, weight, targets, upstream, _ = inputs
    hidden, weight = hidden.clone().requires_grad_(backward), weight.clone().requires_grad_(backward)
    outputs = step(hidden, weight, targets, upstream, backend, backward, path, **options)
    return [*outputs, hidden.grad, weight.grad] if backward else list(outputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("backward", [False, True], ids=["forward only", "forward and backward"])
@pytest.mark.parametrize(
    "path, masked",
    [("logprob", False), ("logprob", True), ("loss", False), ("loss", True), ("labels", False)],
    ids=["all rows", "mask with max_rows", "loss", "loss with mask and max_rows", "labels"],
)
def test_cuda_graph_replay_equals_eager(backend, backward, path, masked):
    first, second = make_inputs(0), make_inputs(1)
    options = dict(mask=first[4], max_rows=TOKENS // 2) if masked else {}
    static = [tensor.clone() for tensor in first[:4]]
    static_hidden, static_weight = static[0].requires_grad_(backward), static[1].requires_grad_(backward)
    if masked:
        options["mask"] = first[4].clone()  # a static input too
    context = contextlib.nullcontext() if backward else torch.no_grad()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), context:
        for _ in range(2):  # warm up (Triton compiles) outside the capture
            step(*static, backend, backward, path, **options)
    torch.cuda.current_stream().wait_stream(side)
    static_hidden.grad = static_weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), context:
        outputs = step(*static, backend, backward, path, **options)
    for inputs in (first, second):  # replay on new data copied into the captured inputs
        with torch.no_grad():
            for target, source in zip(static, inputs[:4], strict=True):
                target.copy_(source)
            if masked:
                options["mask"].copy_(inputs[4])
        graph.replay()
        torch.cuda.synchronize()
        replayed = [*outputs, static_hidden.grad, static_weight.grad] if backward else list(outputs)
        eager_options = dict(options, mask=inputs[4]) if masked else {}
        expected = eager_results(inputs, backend, backward, path, **eager_options)
        for got, want in zip(replayed, expected, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("path, corrections", [("labels", 0), ("labels-other", 1)])
def test_corrections_are_counted_in_every_replay(path, corrections):
    # The correcting pass's gate and its counter live on the device: each replay of a captured
    # backward that needed the pass counts once, one that did not counts nothing.
    inputs = make_inputs(3)
    hidden, weight = inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(hidden, weight, *inputs[2:4], "triton", True, path)
    torch.cuda.current_stream().wait_stream(side)
    hidden.grad = weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(hidden, weight, *inputs[2:4], "triton", True, path)
    weight_grad_corrections()  # the warm-up's
    for _ in range(3):
        graph.replay()
    assert weight_grad_corrections() == 3 * corrections
    assert weight_grad_corrections() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_synchronization(backend):
    # Every path through the Triton backend, the labels path's check of its upstream gradient and
    # its correction included; the torch backend reads that check on the host, as documented.
    inputs = make_inputs(2)
    masked = dict(mask=inputs[4], max_rows=TOKENS // 2)
    cases = [("logprob", {}), ("logprob", masked), ("loss", {}), ("loss", masked)]
    if backend == "triton":
        cases += [("labels", {}), ("labels-other", {})]
    weight_grad_corrections()  # what earlier tests left
    for path, options in cases:
        eager_results(inputs, backend, True, path, **options)  # warm up: Triton compiles, cuBLAS loads
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager_results(inputs, backend, True, path, **options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if backend == "triton":  # labels-other's correction, warm-up and checked run, counted on the device
        assert weight_grad_corrections() == 2
        assert weight_grad_corrections() == 0
    # A bare mask reads its row count on the host, as documented.
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            eager_results(inputs, backend, True, mask=inputs[4])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_loss_functions_first_use_reads_nothing_on_the_host():
    # The check that a loss_fn treats its rows alone runs on the device, at its first use.
    inputs = make_inputs(5)
    eager_results(inputs, "triton", True, "loss")  # warm up
    torch.cuda.synchronize()

    def first_used_here(logprob, entropy, *, weight):
        return -weight * logprob + 0.01 * entropy

    hidden, weight, targets, _, _ = inputs
    leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_inputs = {"weight": torch.full((TOKENS,), 1e-3, device="cuda")}
        fused_linear_loss(*leaves, targets, first_used_here, loss_inputs=loss_inputs, backend="triton").loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", PATHS)
def test_fullgraph_compile_equals_eager(backend, path):
    hidden, weight, targets, upstream, _ = make_inputs(3)

    def function(hidden, weight):
        return forward(hidden, weight, targets, upstream, backend, path)

    results = {}
    for name, run in (("eager", function), ("compiled", torch.compile(function, fullgraph=True))):
        leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprob, entropy, loss = run(*leaves)
        loss.backward()
        results[name] = (logprob, entropy, *(leaf.grad for leaf in leaves))
    for got, want in zip(results["compiled"], results["eager"], strict=True):
        # The ops run whole in the graph; only the small sums around them may be fused differently.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_gives_the_float32_numbers(backend):
    inputs = make_inputs(4, dtype=torch.float32)
    plain = eager_results(inputs, backend, True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        autocast = eager_results(inputs, backend, True)
    for got, want in zip(autocast, plain, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


DEVICE_ASSERT_SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_fused_lm import fused_linear_logprob
    hidden = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, 1000, (64,), device="cuda")
    targets[5] = 1000
    logprob = fused_linear_logprob(hidden, weight, targets, backend="{backend}")
    torch.cuda.synchronize()
    print("NOT CAUGHT", logprob[5].item())
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_trips_a_device_assertion(backend):
    # A device-side assertion ends the CUDA context, so the call runs in its own process.
    done = subprocess.run(
        [sys.executable, "-c", DEVICE_ASSERT_SCRIPT.format(backend=backend)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "NOT CAUGHT" not in done.stdout, (done.stdout, done.stderr[-2000:])
    # The assertion kernel reports itself; which later call then fails (a synchronization saying
    # "device-side assert", or cuBLAS creating its handle in the broken context) is a race.
    assert "_assert_async_cuda_kernel" in done.stderr or "device-side assert" in done.stderr, done.stderr[-2000:]
