"""The Triton kernels under the Triton interpreter (``TRITON_INTERPRET=1``) on the CPU.

Each case runs in a subprocess: the interpreter is chosen when the kernels are first imported, and
setting it in this process would also send other test modules' ``backend="auto"`` calls to it.
Parity is against a float64 oracle written here, through the public ``fused_linear_logprob``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CASE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from megatron_fused_lm import fused_linear_logprob
    from megatron_fused_lm.ops import triton_backend

    case = json.loads(sys.argv[1])
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    tokens, hidden_size, vocab = case["shape"]
    if case.get("block_bytes"):
        triton_backend.BLOCK_BYTES = case["block_bytes"]
    hidden = torch.randn(tokens, hidden_size) * case["hidden_scale"]
    weight = torch.randn(vocab, hidden_size) / hidden_size**0.5
    if case.get("strided"):
        hidden = torch.stack([hidden, torch.randn_like(hidden)], -1)[..., 0]
        weight = weight.t().contiguous().t()
    hidden = hidden.to(dtype).requires_grad_()
    weight = weight.to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    grad_logprob, grad_entropy = torch.randn(tokens), torch.randn(tokens)
    temperature = case["temperature"]
    logprob, entropy = fused_linear_logprob(
        hidden, weight, targets, temperature=temperature, return_entropy=True, backend="triton",
        chunk_size=case.get("chunk_size"), entropy_grad=case["entropy_grad"],
    )
    outputs, grads = [logprob], [grad_logprob]
    if case["entropy_grad"]:
        outputs.append(entropy)
        grads.append(grad_entropy)
    if tokens:
        torch.autograd.backward(outputs, grads)
    else:
        (logprob.sum() + entropy.sum()).backward()

    # Float64 oracle.
    h, w = hidden.detach().double(), weight.detach().double()
    logits = h @ w.t() / temperature
    log_probs = logits.log_softmax(-1)
    probs = log_probs.exp()
    mean_logit = (probs * logits).sum(-1)
    ref_logprob = log_probs.gather(1, targets[:, None]).squeeze(1)
    ref_entropy = torch.logsumexp(logits, -1) - mean_logit
    dz = -grad_logprob.double()[:, None] * probs
    dz.scatter_add_(1, targets[:, None], grad_logprob.double()[:, None])
    if case["entropy_grad"]:
        dz += grad_entropy.double()[:, None] * probs * (mean_logit[:, None] - logits)
    dz /= temperature
    ref_grad_hidden, ref_grad_weight = dz @ w, dz.t() @ h

    def rel(value, ref):
        return ((value.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    print(json.dumps({
        "logprob": (logprob.double() - ref_logprob).abs().max().item() if tokens else 0.0,
        "entropy": (entropy.double() - ref_entropy).abs().max().item() if tokens else 0.0,
        "grad_hidden": rel(hidden.grad, ref_grad_hidden) if tokens else 0.0,
        "grad_weight": rel(weight.grad, ref_grad_weight),
        "grad_weight_zero": not weight.grad.any().item(),
        "grad_dtypes": [str(hidden.grad.dtype), str(weight.grad.dtype)],
    }))
    """
)

TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (2e-3, 3e-3)}  # (log-prob/entropy abs, grads rel)


def run_case(**case):
    case.setdefault("seed", 0)
    case.setdefault("temperature", 1.0)
    case.setdefault("hidden_scale", 1.0)
    case.setdefault("entropy_grad", True)
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", CASE_SCRIPT, json.dumps(case)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(result, dtype):
    value_tol, grad_tol = TOLERANCE[dtype]
    assert result["logprob"] < value_tol * 10 and result["entropy"] < value_tol * 10, result
    assert result["grad_hidden"] < grad_tol and result["grad_weight"] < grad_tol, result


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_odd_sizes_and_temperature(dtype):
    # Prime vocabulary (not a multiple of the tile) and hidden size (not a multiple of BLOCK_K).
    result = run_case(dtype=dtype, shape=[37, 45, 211], temperature=0.7, hidden_scale=2.0)
    check(result, dtype)
    assert result["grad_dtypes"] == [f"torch.{dtype}"] * 2


def test_peaky_logits():
    result = run_case(dtype="float32", shape=[20, 48, 97], hidden_scale=30.0, seed=1)
    check(result, "float32")


def test_backward_blocked_over_tokens_and_vocabulary():
    # 3 token chunks (the last partial) x vocabulary chunks of 256 columns (the last partial).
    result = run_case(dtype="float32", shape=[40, 33, 601], chunk_size=16, block_bytes=16 * 256 * 4, seed=2)
    check(result, "float32")


def test_entropy_grad_false_and_strided_inputs():
    result = run_case(dtype="float16", shape=[24, 40, 131], entropy_grad=False, strided=True, seed=3)
    check(result, "float16")


def test_zero_tokens():
    result = run_case(dtype="float32", shape=[0, 16, 50])
    assert result["grad_weight_zero"]
