"""Quickstart: the fused LM head on a real Megatron-Core GPTModel, tensor parallel over two ranks.

    python examples/quickstart.py

On CPU it spawns two gloo ranks (TP=2) and takes about half a minute; with CUDA GPUs, one NCCL
rank per GPU (up to two) and ``backend="auto"`` (Triton when available). It announces each phase
as it starts and prints

1. one batch through the stock and the fused head: log-prob and entropy error against a float64
   oracle, the largest parameter-gradient difference, and the logits tensor the fused path never
   allocated;
2. a short SFT run through ``model(..., labels=labels)``, a stock and a fused copy of the model
   trained side by side from the same seed, one line per step: the two loss curves fall together.

The model is far too small to time; docs/BENCHMARKS.md has the speed and memory figures.
The integration itself is three lines (see ``run``): a config, ``wrap_model``, ``head.logprobs``.
"""

from __future__ import annotations

import contextlib
import os
import warnings

# torch.distributed's notices about its own API's future: nothing to act on in an example.
# (megatron_on_cpu itself hides Megatron's advice on GPU features.) Every other warning shows.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_fused_lm.integration import FusedLMConfig, wrap_model
from megatron_fused_lm.integration.cpu import megatron_on_cpu

VOCAB, HIDDEN, LAYERS, HEADS = 32000, 64, 2, 4
BATCH, SEQ = 4, 128
TEMPERATURE = 0.8
SFT_STEPS, LEARNING_RATE = 30, 1e-2
TOY_TOKENS = 512


def say(text: str = "") -> None:
    """Print from the first rank only (or the launching process), at once: on a CPU the phases
    between two lines take seconds."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def main() -> None:
    use_cuda = torch.cuda.is_available()
    world_size = min(torch.cuda.device_count(), 2) if use_cuda else 2
    transport = f"NCCL on {world_size} GPU(s)" if use_cuda else "gloo on the CPU, about 30 s in all"
    say(f"Starting {world_size} tensor-parallel rank(s) ({transport})...")
    # The ranks' rendezvous, as torchrun's agent holds it: listening from the start on a port the
    # OS picked, so no other process can take that port before the ranks come.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(run, args=(world_size, store.port, use_cuda), nprocs=world_size, join=True)


def run(rank: int, world_size: int, port: int, use_cuda: bool) -> None:
    # What torchrun would set; megatron_on_cpu and megatron_on_gpus read it. Every rank joins the
    # launcher's store as a client.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )  # fmt: skip
    # What a trainer config would hold (see examples/trainer_config.yaml).
    trainer_config = {"fused_linear_logprob": True, "fused_linear_logprob_backend": "auto" if use_cuda else "torch"}
    fused_config = FusedLMConfig.from_trainer_config(trainer_config)
    if not use_cuda:
        torch.set_num_threads(1)  # the ranks share the machine's cores
    with megatron_on_gpus(world_size) if use_cuda else megatron_on_cpu(tensor_parallel_size=world_size) as device:
        compare_one_batch(fused_config, device)
        compare_training(fused_config, device)
        say("\nSpeed and memory at real sizes: docs/BENCHMARKS.md (this model is too small to time).")


@contextlib.contextmanager
def megatron_on_gpus(tensor_parallel_size: int):
    """This rank's GPU (``RANK``) over NCCL and Megatron's process groups; yields the device."""
    from megatron.core import parallel_state, tensor_parallel

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(tensor_parallel_size, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        yield torch.device("cuda", rank)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def single_process_megatron():
    """One process of Megatron-Core (TP=1) on the first GPU, or on the CPU over gloo; yields
    ``(device, backend)``, the backend being ``"auto"`` on a GPU (Triton when available)."""
    if not torch.cuda.is_available():
        with megatron_on_cpu() as device:
            yield device, "torch"
        return
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # held while Megatron runs
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        RANK="0",
        WORLD_SIZE="1",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    with megatron_on_gpus(1) as device:
        yield device, "auto"


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


def rl_step(model, head, batch, weights):
    """One RL-style step: forward, log-probs and entropy from the head, backward of a weighted sum.
    Returns (logprob, entropy, model output, parameter gradients)."""
    input_ids, position_ids, mask, targets = batch
    model.zero_grad(set_to_none=True)
    output = model(input_ids, position_ids, mask)
    logprob, entropy = head.logprobs(output, targets, temperature=TEMPERATURE, return_entropy=True)
    (weights[0] * logprob + weights[1] * entropy).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logprob.detach(), entropy.detach(), output.detach(), grads


def compare_one_batch(fused_config: FusedLMConfig, device: torch.device) -> None:
    """One RL-style step through the stock head, then the fused head, on one model and batch;
    prints both against a float64 oracle and the gradient difference."""
    say(f"Building a {LAYERS}-layer GPTModel (hidden {HIDDEN}, vocabulary {VOCAB})...")
    model = build_model(device)
    batch = make_batch(device, step=10_000)
    weights = torch.rand(2, BATCH, SEQ, generator=torch.Generator().manual_seed(1)).to(device)
    say("One batch through the stock head (the model returns logits)...")
    stock = rl_step(model, wrap_model(model, FusedLMConfig(enabled=False)), batch, weights)
    say("The same batch through the fused head (the model returns hidden states)...")
    fused = rl_step(model, wrap_model(model, fused_config), batch, weights)
    want_logprob, want_entropy = oracle(stock[2], batch[3])

    def error(got, want):
        return (got.double() - want).abs().max().item()

    grad_difference = max((fused[3][name] - grad).abs().max().item() for name, grad in stock[3].items())
    largest_grad = max(grad.abs().max().item() for grad in stock[3].values())
    logits = stock[2]
    logits_mib = logits.numel() * logits.element_size() / 2**20
    size = dist.get_world_size()
    say(
        f"\nOne batch: {BATCH}x{SEQ} tokens, vocabulary {VOCAB} over TP={size} ({device.type}), temperature {TEMPERATURE}"
    )
    say(f"{'':38}{'stock':>14}{'fused':>14}")
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
    ]
    for name, stock_value, fused_value in rows:
        say(f"{name:38}{stock_value:>14}{fused_value:>14}")


def sft_trainee(config: FusedLMConfig, device: torch.device):
    """A model from seed 0 wrapped with ``config``, and its optimizer."""
    model = build_model(device, seed=0)
    wrap_model(model, config)
    return model, torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)


def sft_step(model, optimizer, batch) -> float:
    """One SFT step through the labels path; returns the mean loss."""
    input_ids, position_ids, mask, labels = batch
    loss = model(input_ids, position_ids, mask, labels=labels).mean()  # per-token loss [b, s]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def compare_training(fused_config: FusedLMConfig, device: torch.device) -> None:
    """Train a stock and a fused copy side by side from one seed; prints both losses each step."""
    say(f"\nSFT through model(..., labels=labels): a stock and a fused copy from one seed, Adam lr {LEARNING_RATE}")
    stock, fused = sft_trainee(FusedLMConfig(enabled=False), device), sft_trainee(fused_config, device)
    say(f"{'step':>6}{'stock loss':>14}{'fused loss':>14}{'difference':>14}")
    for step in range(SFT_STEPS):
        batch = make_batch(device, step)
        stock_loss, fused_loss = sft_step(*stock, batch), sft_step(*fused, batch)
        say(f"{step:>6}{stock_loss:>14.4f}{fused_loss:>14.4f}{fused_loss - stock_loss:>14.2e}")


if __name__ == "__main__":
    main()
