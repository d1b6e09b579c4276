"""Quickstart: the fused LM head on a real Megatron-Core GPTModel, tensor parallel over two ranks.

    python examples/quickstart.py

On CPU it spawns two gloo ranks (TP=2); with CUDA GPUs, one NCCL rank per GPU (up to two) and
``backend="auto"`` (Triton when available). It prints

1. one batch through the stock and the fused head: log-prob and entropy error against a float64
   oracle, the largest parameter-gradient difference, the logits tensor the fused path never
   allocated, and the time of each path;
2. a short SFT run through ``model(..., labels=labels)`` with the fused head off and on, from the
   same seed: the two loss curves fall together.

The integration itself is three lines (see ``run``): a config, ``wrap_model``, ``head.logprobs``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import warnings

# On CPU, Megatron warns that GPU extensions (Apex, TransformerEngine) are missing; quiet them.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_fused_lm.integration import FusedLMConfig, wrap_model

VOCAB, HIDDEN, LAYERS, HEADS = 32000, 64, 2, 4
BATCH, SEQ = 4, 128
TEMPERATURE = 0.8
SFT_STEPS, LEARNING_RATE = 30, 1e-2
TOY_TOKENS = 512


def main() -> None:
    use_cuda = torch.cuda.is_available()
    world_size = min(torch.cuda.device_count(), 2) if use_cuda else 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(run, args=(world_size, port, use_cuda), nprocs=world_size, join=True)


def run(rank: int, world_size: int, port: int, use_cuda: bool) -> None:
    from megatron.core import parallel_state, tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if use_cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
        run_megatron_on_cpu()
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(world_size, 1)
    if use_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    # What a trainer config would hold (see examples/trainer_config.yaml).
    trainer_config = {"fused_linear_logprob": True, "fused_linear_logprob_backend": "auto" if use_cuda else "torch"}
    fused_config = FusedLMConfig.from_trainer_config(trainer_config)
    try:
        compare_one_batch(fused_config, device, rank)
        compare_training(fused_config, device, rank)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_megatron_on_cpu() -> None:
    """Megatron's GPTModel forward assumes a GPU in two places that matter nowhere else."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.cuda.current_device = lambda: "cpu"  # the attention scratch buffer's device
    CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()  # no dropout here


def build_model(device: torch.device, seed: int = 0):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.1,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    return model.to(device)


def make_batch(device: torch.device, step: int):
    """A learnable toy language over the first TOY_TOKENS ids: each token determines the next
    (``next = 5 * token + 1 mod TOY_TOKENS``), sequences start at random. Returns ``input_ids,
    position_ids, mask, labels``, all ``[BATCH, SEQ]`` but the causal mask ``[1, 1, SEQ, SEQ]``;
    the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, TOY_TOKENS, (BATCH,), generator=generator)
    for position in range(SEQ):
        tokens[:, position + 1] = (5 * tokens[:, position] + 1) % TOY_TOKENS
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tuple(t.to(device) for t in (tokens[:, :-1], position_ids, mask, tokens[:, 1:]))


def oracle(logits_shard: torch.Tensor, targets: torch.Tensor):
    """Float64 log-probs and entropy from the stock logits, the vocabulary shards gathered."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits_shard.detach())
    log_probs = torch.log_softmax(full.double() / TEMPERATURE, dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


def timed_step(model, head, batch, weights, device):
    """One RL-style step: forward, log-probs and entropy from the head, backward of a weighted sum.
    Returns (logprob, entropy, model output, seconds, parameter gradients)."""
    input_ids, position_ids, mask, targets = batch
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = model(input_ids, position_ids, mask)
    logprob, entropy = head.logprobs(output, targets, temperature=TEMPERATURE, return_entropy=True)
    (weights[0] * logprob + weights[1] * entropy).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logprob.detach(), entropy.detach(), output.detach(), seconds, grads


def compare_one_batch(fused_config: FusedLMConfig, device: torch.device, rank: int) -> None:
    model = build_model(device)
    batch = make_batch(device, step=10_000)
    weights = torch.rand(2, BATCH, SEQ, generator=torch.Generator().manual_seed(1)).to(device)
    stock_head = wrap_model(model, FusedLMConfig(enabled=False))
    timed_step(model, stock_head, batch, weights, device)  # warm-up
    stock = timed_step(model, stock_head, batch, weights, device)
    fused_head = wrap_model(model, fused_config)
    timed_step(model, fused_head, batch, weights, device)  # warm-up
    fused = timed_step(model, fused_head, batch, weights, device)
    want_logprob, want_entropy = oracle(stock[2], batch[3])

    def error(got, want):
        return (got.double() - want).abs().max().item()

    grad_difference = max((fused[4][name] - grad).abs().max().item() for name, grad in stock[4].items())
    largest_grad = max(grad.abs().max().item() for grad in stock[4].values())
    logits = stock[2]
    logits_mib = logits.numel() * logits.element_size() / 2**20
    if rank != 0:
        return
    size = dist.get_world_size()
    print(
        f"\nOne batch: {BATCH}x{SEQ} tokens, vocabulary {VOCAB} over TP={size} ({device.type}), temperature {TEMPERATURE}"
    )
    print(f"{'':38}{'stock':>14}{'fused':>14}")
    rows = [
        (
            "log-prob max error vs float64",
            f"{error(stock[0], want_logprob):.2e}",
            f"{error(fused[0], want_logprob):.2e}",
        ),
        (
            "entropy max error vs float64",
            f"{error(stock[1], want_entropy):.2e}",
            f"{error(fused[1], want_entropy):.2e}",
        ),
        ("largest param-grad difference", "-", f"{grad_difference:.2e}"),
        ("  (largest gradient entry)", f"{largest_grad:.2e}", ""),
        ("logits tensor per rank", f"{logits_mib:.1f} MiB", "never built"),
        ("  shape", "x".join(map(str, logits.shape)), ""),
        ("forward + backward time", f"{stock[3] * 1e3:.0f} ms", f"{fused[3] * 1e3:.0f} ms"),
    ]
    for name, stock_value, fused_value in rows:
        print(f"{name:38}{stock_value:>14}{fused_value:>14}")


def sft_losses(config: FusedLMConfig, device: torch.device):
    """Mean SFT loss per step, training from seed 0 through the labels path."""
    model = build_model(device, seed=0)
    wrap_model(model, config)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(SFT_STEPS):
        input_ids, position_ids, mask, labels = make_batch(device, step)
        loss = model(input_ids, position_ids, mask, labels=labels).mean()  # per-token loss [b, s]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def compare_training(fused_config: FusedLMConfig, device: torch.device, rank: int) -> None:
    stock = sft_losses(FusedLMConfig(enabled=False), device)
    fused = sft_losses(fused_config, device)
    if rank != 0:
        return
    print(f"\nSFT through model(..., labels=labels), Adam lr {LEARNING_RATE}, same seed")
    print(f"{'step':>6}{'stock loss':>14}{'fused loss':>14}{'difference':>14}")
    for step in list(range(0, SFT_STEPS, 5)) + [SFT_STEPS - 1]:
        print(f"{step:>6}{stock[step]:>14.4f}{fused[step]:>14.4f}{fused[step] - stock[step]:>14.2e}")


if __name__ == "__main__":
    main()
