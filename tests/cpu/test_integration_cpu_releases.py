"""``megatron_on_cpu`` alone runs Megatron's DistributedDataParallel on every megatron-core release
the integration tests run on (tests/run_cpu.sh: 0.13 to 0.19): two gloo ranks, data parallel,
each with its own batch, a GPTModel of the local spec wrapped in DDP (float32 gradient buffers),
with the reduction synchronous and overlapped with the backward, by all-reduce and by the
distributed optimizer's reduce-scatter.

On each, per step: the stock head (Megatron's own backward through the logits), the fused head's
``head.logprobs`` (its weight gradient through autograd into DDP's hook) and its
``head.loss(..., main_grad_scale=...)`` (added into ``main_grad`` in the forward), then the
reduction finished: by ``finish_grad_sync`` on the first step, by ``finalize_model_grads`` (what a
training step calls) on the second; overlapped, the first batch launches the reduction from
``finish_grad_sync``, later ones from the backward's hooks. The output weight's ``main_grad`` of
each fused route equals the stock one, and, where the whole buffer is all-reduced, the stock one
equals the float64 gradient of the two ranks' batches, averaged (the reduction did run).

The tolerance is float32 rounding of the sums being compared, elementwise: ``ROUNDINGS`` units of
float32 rounding of ``sum_t |c_tv| (1 + L_t) |h_td|`` over every token ``t`` of both ranks, where
``c_tv`` is the weight gradient's coefficient of logit ``v`` (``w_t (onehot - p)``, ``|w_t| (onehot
+ p)`` taken), ``h_t`` the hidden state and ``L_t`` the largest absolute sum behind one of its
float32 logits, through which the softmax's rounding enters.

And inside ``megatron_on_cpu`` Megatron's advice on GPU features (its own default CUDA-graph scope
"deprecated" from 0.16 on, CUDA_DEVICE_MAX_CONNECTIONS for tensor parallelism) is not shown, with
every warning shown (``-W always``); after it, the same advice and any other warning show again.
"""

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from devkit.spawn import rank_environment, rendezvous_store

VOCAB, HIDDEN, HEADS, SEQ, BATCH = 211, 32, 4, 12, 2  # a prime vocabulary: no tile multiples
WORLD_SIZE = 2
# A few roundings per term on each side; a sum of n terms may round up to n times (here n = 48
# tokens), but does not come near that on random data. A missing or doubled reduction, a wrong
# scale or a wrong token would be off by about the gradient itself, thousands of these units.
ROUNDINGS = 8
DDP_SETTINGS = [
    {"overlap_grad_reduce": overlap, "use_distributed_optimizer": distributed}
    for overlap in (False, True)
    for distributed in (False, True)
]
STEPS = 2


def build_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.3,  # logits of a few units: peaky next-token distributions
    )
    torch.manual_seed(0)  # the same weights on both ranks
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ
    )


def rank_batch(rank: int, step: int):
    """Tokens, positions, causal mask, next tokens and per-token loss weights: each rank and step
    its own."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    weights = torch.rand(BATCH, SEQ, generator=generator) * 2 - 1
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tokens[:, :-1], positions, mask, tokens[:, 1:], weights


# What a schedule of two micro-batches multiplies each micro-batch's loss by.
SCALE = 0.5
ROUTES = ("stock", "head.logprobs", "head.loss main_grad")


def output_main_grad(ddp, route: str, batch, step: int) -> torch.Tensor:
    """Zero DDP's buffers, one forward and backward of ``SCALE * sum_t w_t logprob_t`` through
    ``route``, the reduction finished (DDP's own ``finish_grad_sync`` on the first step, later ones
    through ``finalize_model_grads``, as a training step does); the output weight's ``main_grad``,
    cloned."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_fused_lm import losses
    from megatron_fused_lm.integration import FusedLMConfig, wrap_model

    tokens, positions, mask, targets, weights = batch
    ddp.zero_grad_buffer()
    head = wrap_model(ddp, FusedLMConfig(enabled=route != "stock", backend="torch", token_chunk=5))
    output = ddp(tokens, positions, mask)
    if route == "stock":  # the logits, Megatron's own backward
        logprob = torch.log_softmax(output.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        (SCALE * (weights * logprob).sum()).backward()
    elif route == "head.logprobs":  # the weight gradient through autograd into DDP's hook
        (SCALE * (weights * head.logprobs(output, targets)).sum()).backward()
    else:  # added into main_grad in the forward; cross_entropy is -w_t logprob_t
        loss = head.loss(output, targets, losses.cross_entropy, loss_inputs={"weight": -weights}, main_grad_scale=SCALE)
        (SCALE * loss.loss).backward()
        assert head.main_grad_outstanding() == []
    if step == 0:
        ddp.finish_grad_sync()
    else:
        finalize_model_grads([ddp])
    return ddp.module.output_layer.weight.main_grad.clone()


def float64_oracle(hidden, weight, targets, weights):
    """Over both ranks' tokens, averaged: the float64 gradient of ``sum_t w_t logprob_t`` with
    respect to the output weight, and the sum of its terms' absolute values (see the module's
    docstring)."""
    import torch.distributed as dist

    h, w = hidden.detach().double().reshape(-1, HIDDEN), weight.detach().double()
    probabilities = torch.softmax(h @ w.t(), dim=-1)
    onehot = torch.nn.functional.one_hot(targets.reshape(-1), VOCAB).double()
    token_weights = weights.reshape(-1, 1).double()
    logit_sums = (h.abs() @ w.abs().t()).amax(dim=-1, keepdim=True)
    gradient = (token_weights * (onehot - probabilities)).t() @ h
    magnitude = (token_weights.abs() * (onehot + probabilities) * (1 + logit_sums)).t() @ h.abs()
    both = torch.stack([gradient, magnitude])
    dist.all_reduce(both)
    return both[0] / WORLD_SIZE, both[1] / WORLD_SIZE


def check_release(settings: dict) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_fused_lm.integration import FusedLMConfig, wrap_model

    rank = torch.distributed.get_rank()
    model = build_model()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=4096, **settings)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    for step in range(STEPS):
        batch = rank_batch(rank, step)
        main_grads = {route: output_main_grad(ddp, route, batch, step) for route in ROUTES}
        wrap_model(ddp, FusedLMConfig(enabled=True, backend="torch"))
        with torch.no_grad():
            hidden = ddp(*batch[:3])  # [b, s, h]: what the output layer takes
        oracle, magnitude = float64_oracle(hidden, model.output_layer.weight, *batch[3:])
        tolerance = ROUNDINGS * torch.finfo(torch.float32).eps * SCALE * magnitude
        label = f"{settings} step {step} rank {rank}"
        stock = main_grads.pop("stock").double()
        if not settings["use_distributed_optimizer"]:  # else each rank holds its own shard reduced
            error = (stock - SCALE * oracle).abs()
            assert bool((error <= tolerance).all()), f"{label}: stock vs float64 {(error / tolerance).max():.2f}"
        for route, main_grad in main_grads.items():
            error = (main_grad.double() - stock).abs()
            assert bool((error <= tolerance).all()), f"{label} {route}: {(error / tolerance).max():.2f} of tolerance"


def rank_entry(rank: int, port: int) -> None:
    os.environ.update(rank_environment(rank, WORLD_SIZE, port))
    torch.set_num_threads(1)
    from megatron_fused_lm.integration.cpu import megatron_on_cpu

    with megatron_on_cpu():
        for settings in DDP_SETTINGS:
            check_release(settings)


def test_megatron_ddp_finishes_its_reduction_on_the_cpu_and_the_fused_main_grad_matches_stock():
    store = rendezvous_store()
    # Forked from a server that imported these once (as devkit.spawn's ranks are).
    multiprocessing.set_forkserver_preload(["torch", "megatron.core", "megatron_fused_lm.integration"])
    mp.start_processes(rank_entry, args=(store.port,), nprocs=WORLD_SIZE, join=True, start_method="forkserver")


QUIET = """
import inspect, sys, warnings
import torch
from megatron_fused_lm.integration.cpu import megatron_on_cpu
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as linear
from megatron.core.transformer.transformer_config import TransformerConfig

def config():
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)

with megatron_on_cpu():
    print("<inside megatron_on_cpu>", file=sys.stderr, flush=True)
    config()
    # What the tensor-parallel linear layers call; it warns once, then marks itself warned.
    linear(torch.randn(3, 1, 8), torch.randn(4, 8), None, gradient_accumulation_fusion=False,
           allreduce_dgrad=True, sequence_parallel=False)
print("<outside megatron_on_cpu>", file=sys.stderr, flush=True)
config()
warnings.warn("another warning", UserWarning)
print("advised", bool(getattr(linear, "warned", False)))
print("announces", "full scope is deprecated" in inspect.getsource(TransformerConfig))
"""


def test_megatron_on_cpu_hides_megatrons_gpu_advice_and_nothing_else():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_DEVICE_MAX_CONNECTIONS"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", QUIET], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "<inside megatron_on_cpu>" in done.stderr, done.stderr[-3000:]
    inside, outside = done.stderr.split("<inside megatron_on_cpu>", 1)[1].split("<outside megatron_on_cpu>", 1)
    assert "full scope is deprecated" not in inside and "CUDA_DEVICE_MAX_CONNECTIONS" not in inside, inside
    answers = dict(line.split() for line in done.stdout.splitlines())
    # The advice was given, and hidden: Megatron marks itself warned after its warnings.warn.
    assert answers["advised"] == "True", done.stdout
    # After the context, the same notice (megatron-core 0.16 on) and any other warning show again.
    announces = answers["announces"] == "True"
    assert ("full scope is deprecated" in outside) == announces and "another warning" in outside, outside
