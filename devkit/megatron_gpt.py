"""Real Megatron-Core GPTModels for the tests and the multi-GPU scripts: one builder, the CPU
patches that let a GPTModel run on gloo ranks, batches, losses and gradient comparisons.

One spawned process costs seconds (torch + megatron imports), so a CPU test spawns its ranks once
with ``spawn`` and runs many cases inside; ``tensor_parallel(size)`` re-initializes Megatron's
groups between cases (TP=1 cases run on every rank of a two-rank world, each rank on its own).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple
from unittest import mock

import torch

from devkit.oracle import logprob_entropy, max_abs_error
from devkit.spawn import run_ranks
from megatron_fused_lm.integration.cpu import patch_megatron_for_cpu

VOCAB_SHARD = 53  # a prime, so shards are not tile multiples
SEQ, BATCH = 12, 2  # SEQ divisible by 2 for sequence parallelism
HIDDEN, HEADS, LAYERS = 32, 4, 2
# Megatron-LM pads the vocabulary to a multiple of this times the tensor-parallel size.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
# Initial weights of a ``peaky`` bf16 model: the embedding / output weights are scaled so that the
# logits' standard deviation is about LOGIT_STD (the final norm's output has unit scale), giving
# peaky next-token distributions, where log-prob and entropy errors show; the layers' weights have
# standard deviation PEAKY_INIT_STD so that the layers' outputs, not the input token's embedding,
# dominate the residual stream (else a tied model predicts its input token with certainty).
LOGIT_STD = 6.0
PEAKY_INIT_STD = 0.2


@dataclass(frozen=True)
class GPTShape:
    """Sizes of a test GPTModel and of its micro-batches."""

    hidden: int
    heads: int
    layers: int
    vocab: int  # before any padding
    seq: int
    micro_batch: int


# The CPU tests' model: tiny, float32, a prime vocabulary shard per rank.
CPU_TEST_SHAPE = GPTShape(hidden=HIDDEN, heads=HEADS, layers=LAYERS, vocab=VOCAB_SHARD, seq=SEQ, micro_batch=BATCH)


def spawn(worker: Callable, world_size: int, *args) -> None:
    """Run ``worker(*args)`` on ``world_size`` fresh gloo ranks set up for Megatron on CPU; a failure
    on any rank fails the caller. ``worker`` must be importable by name (a module-level function)."""
    run_ranks(_megatron_rank, world_size, worker, args)


def _megatron_rank(rank: int, world_size: int, worker: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    try:
        worker(*args)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def tensor_parallel(size: int) -> None:
    """(Re-)initialize Megatron's process groups with tensor-parallel size ``size``."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(size, 1)


def tensor_parallel_cases() -> Iterator[Tuple[bool, bool, str]]:
    """``(sequence_parallel, tied, label)`` for TP=2 with sequence parallelism off and on, then
    TP=1, each with untied and tied embeddings; Megatron's groups set up for each TP size."""
    for size in (2, 1):
        tensor_parallel(size)
        for sequence_parallel, tied in itertools.product((False, True) if size > 1 else (False,), (False, True)):
            yield sequence_parallel, tied, f"TP={size} sequence_parallel={sequence_parallel} tied={tied}"


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def padded_vocab_size(vocab: int, tensor_parallel: int) -> int:
    """The vocabulary size Megatron-LM trains with (``_vocab_size_with_padding``)."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tensor_parallel
    return -(-vocab // multiple) * multiple


def seed_all(seed: int) -> None:
    """Seed torch and, on CUDA, Megatron's model-parallel RNG tracker (weight init on the GPU)."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def build_gpt(
    shape: GPTShape = CPU_TEST_SHAPE,
    *,
    vocab_size: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
    sequence_parallel: bool = False,
    tied: bool = False,
    seed: int = 1234,
    init_method_std: float = 0.7,
    logit_std: Optional[float] = None,
    config_overrides: Optional[Dict] = None,
    mtp_num_layers: Optional[int] = None,
    model_class: Optional[type] = None,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
):
    """A GPTModel of the local spec (no TransformerEngine) in ``dtype`` on ``device``: rotary
    positions, no dropout, Megatron's groups as initialized. The same ``seed`` gives the same
    weights on every rank. Under a virtual pipeline, ``vp_stage`` says which of this stage's
    chunks to build.

    ``vocab_size`` defaults to ``shape.vocab`` rows per tensor-parallel rank (the CPU tests' prime
    shards). The CPU tests' default ``init_method_std=0.7`` makes the next-token distributions
    peaky, where log-prob and entropy errors show; ``logit_std`` instead scales the embedding and
    output weights so that the logits' standard deviation is about that (the multi-GPU scripts).
    ``device`` defaults to the CPU.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    device = device or torch.device("cpu")
    size = tp_size()
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        tensor_model_parallel_size=size,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        sequence_parallel=sequence_parallel and size > 1,
        use_cpu_initialization=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=init_method_std,
        mtp_num_layers=mtp_num_layers,
        mtp_loss_scaling_factor=0.1 if mtp_num_layers else None,  # megatron-core < 0.14 has no default
        # gloo has no batched point-to-point sends (the CPU dry run of the pipeline schedule).
        batch_p2p_comm=device.type == "cuda",
        **(config_overrides or {}),
    )
    layer_spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False) if mtp_num_layers else None
    seed_all(seed)
    model = (model_class or GPTModel)(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size or shape.vocab * size,
        max_sequence_length=shape.seq,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        mtp_block_spec=mtp_spec,
        pre_process=pre_process,
        post_process=post_process,
        # Passed only under a virtual pipeline: megatron-core 0.13 builds without it.
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    # One dtype throughout, as Float16Module makes it (the local spec's torch norms start in float32).
    model = model.to(device=device, dtype=dtype)
    if logit_std is not None:
        head_weight_scale = logit_std / (init_method_std * shape.hidden**0.5)  # the final norm has unit scale
        with torch.no_grad():
            # Every copy of a tied weight is scaled alike, so the copies stay identical.
            if pre_process:
                model.embedding.word_embeddings.weight.mul_(head_weight_scale)
            if post_process and model.output_layer.weight is not None:
                model.output_layer.weight.mul_(head_weight_scale)
    return model


def build_hybrid(
    *, sequence_parallel: bool = False, tied: bool = False, pattern: str = "*-*-", seed: int = 1234
) -> torch.nn.Module:
    """Megatron's hybrid language model (``HybridModel`` from megatron-core 0.19, ``MambaModel``
    before) with attention (``*``) and MLP (``-``) layers of the local spec, ``CPU_TEST_SHAPE``'s
    sizes, float32 on the CPU. Mamba layers need CUDA kernels, so the pattern has none; the stack's
    final norm is TransformerEngine's in every release, so Megatron's local norm takes its place."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    try:
        from megatron.core.models.hybrid import hybrid_block as stack_module
        from megatron.core.models.hybrid.hybrid_model import HybridModel as model_class

        stack_class, submodules_class = stack_module.HybridStack, stack_module.HybridStackSubmodules
        arguments = {"hybrid_layer_pattern": pattern}
    except ImportError:
        from megatron.core.models.mamba.mamba_model import MambaModel as model_class
        from megatron.core.ssm import mamba_block as stack_module

        stack_class, submodules_class = stack_module.MambaStack, stack_module.MambaStackSubmodules
        arguments = {"hybrid_override_pattern": pattern}
    stack_module.TENorm = WrappedTorchNorm
    local = get_gpt_layer_local_spec().submodules
    attention = TransformerLayerSubmodules(
        input_layernorm=local.input_layernorm, self_attention=local.self_attention, self_attn_bda=local.self_attn_bda
    )
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda)
    stack = ModuleSpec(
        module=stack_class,
        submodules=submodules_class(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )
    size = tp_size()
    config = TransformerConfig(
        num_layers=len(pattern),
        hidden_size=CPU_TEST_SHAPE.hidden,
        num_attention_heads=CPU_TEST_SHAPE.heads,
        tensor_model_parallel_size=size,
        sequence_parallel=sequence_parallel and size > 1,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.7,
    )
    seed_all(seed)
    stack_argument = "hybrid_stack_spec" if "hybrid_layer_pattern" in arguments else "mamba_stack_spec"
    model = model_class(
        config=config,
        vocab_size=CPU_TEST_SHAPE.vocab * size,
        max_sequence_length=CPU_TEST_SHAPE.seq,
        share_embeddings_and_output_weights=tied,
        # The hybrid models' default; MambaModel's rotary path fails in megatron-core 0.13.1.
        position_embedding_type="none",
        **{stack_argument: stack},
        **arguments,
    )
    return model.float()


def stock_reference(model, batch, temperature: float, with_backward: bool = True) -> Dict:
    """What the stock ``model`` gives on ``batch``: its logits, the float64 oracle's log-probs and
    entropy, and (``with_backward``) the gradients of ``head_loss`` of those, its labels-path loss
    and that loss's gradients."""
    targets = batch[3]
    logits = forward(model, batch)
    logprob, entropy = oracle_logprob_entropy(logits, targets, temperature)
    reference = dict(logits=logits.detach(), logprob=logprob.detach(), entropy=entropy.detach())
    if with_backward:
        head_loss(logprob, entropy).backward()
        reference["grads"] = parameter_grads(model)
        loss = forward(model, batch, labels=targets)
        labels_loss(loss).backward()
        reference["loss"], reference["loss_grads"] = loss.detach(), parameter_grads(model)
    return reference


def check_head(
    model, head, batch, reference: Dict, label: str, *, temperature: float, value_atol: float, grad_rtol: float,
    with_backward: bool = True,
) -> None:  # fmt: skip
    """``head``'s log-probs and entropy from the wrapped model's output match ``reference``
    (``stock_reference``), and so do the gradients; the labels path gives the stock loss and its
    gradients."""
    targets = batch[3]
    logprob, entropy = head.logprobs(forward(model, batch), targets, temperature=temperature, return_entropy=True)
    assert_max_error(logprob, reference["logprob"], value_atol, f"{label} logprob")
    assert_max_error(entropy, reference["entropy"], value_atol, f"{label} entropy")
    if not with_backward:
        return
    head_loss(logprob, entropy).backward()
    assert_grads_close(parameter_grads(model), reference["grads"], grad_rtol, f"{label} head grads")
    loss = forward(model, batch, labels=targets)
    assert_max_error(loss, reference["loss"], value_atol, f"{label} labels loss")
    labels_loss(loss).backward()
    assert_grads_close(parameter_grads(model), reference["loss_grads"], grad_rtol, f"{label} labels grads")


class RecordedWarnings(logging.Handler):
    """The package logger's warnings (or, with ``level=logging.INFO``, its INFO lines too) while in
    ``with RecordedWarnings() as recorded:``, as ``recorded.messages`` (spawned ranks have no pytest
    capture). Entering forgets what the package logged before, as tests/cpu/conftest.py does for
    each test: a log-once message is recorded in every block whose code logs it, whatever the rank
    ran before."""

    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.messages: List[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self) -> "RecordedWarnings":
        from megatron_fused_lm import _logging

        _logging._already_warned.clear()
        logger = logging.getLogger("megatron_fused_lm")
        self.previous_level = logger.level
        logger.setLevel(min(self.level, logger.getEffectiveLevel()))
        logger.addHandler(self)
        return self

    def __exit__(self, *exception) -> None:
        logger = logging.getLogger("megatron_fused_lm")
        logger.removeHandler(self)
        logger.setLevel(self.previous_level)


def policy_inputs(oracle_logprob: torch.Tensor, response: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The inputs of a clipped policy loss with a KL term: old and reference log-probs near the
    current ``oracle_logprob`` (the KL estimator is exp-sensitive), advantages, and token-mean
    weights over ``response``; the same on every rank."""
    from megatron_fused_lm import losses

    device = oracle_logprob.device
    noise = random_weights(2, *oracle_logprob.shape, seed=21, device=device) * 0.3
    return {
        "old_logprob": (oracle_logprob + noise[0]).float(),
        "ref_logprob": (oracle_logprob + noise[1]).float(),
        "advantages": random_weights(*oracle_logprob.shape, seed=22, device=device),
        "weight": losses.token_mean_weights(response),
    }


def masked_loss(loss_fn: Callable, logprob, entropy, inputs: Dict[str, torch.Tensor], mask) -> torch.Tensor:
    """``loss_fn`` summed over the rows ``mask`` selects (all without one) of ``[b, s]`` log-probs,
    entropies and per-token inputs: a loss computed by hand from the log-probs."""
    mask = torch.ones_like(entropy, dtype=torch.bool) if mask is None else mask
    return loss_fn(logprob[mask], entropy[mask], **{name: value[mask] for name, value in inputs.items()}).sum()


def build_bf16_gpt(
    shape: GPTShape,
    device: torch.device,
    *,
    tied: bool,
    sequence_parallel: bool,
    seed: int,
    peaky: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
):
    """The multi-GPU scripts' model: ``build_gpt`` in bf16 on ``device``, the vocabulary padded as
    Megatron-LM pads it, Megatron's default initialization or, with ``peaky``, one that gives
    peaky next-token distributions."""
    return build_gpt(
        shape,
        vocab_size=padded_vocab_size(shape.vocab, tp_size()),
        dtype=torch.bfloat16,
        device=device,
        tied=tied,
        sequence_parallel=sequence_parallel,
        seed=seed,
        init_method_std=PEAKY_INIT_STD if peaky else 0.02,
        logit_std=LOGIT_STD if peaky else None,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )


def causal_batch(shape: GPTShape, vocab: int, seed: int, device: Optional[torch.device] = None):
    """``(input_ids, position_ids, attention_mask, targets)`` on ``device`` (default the CPU), the
    same on every rank: ids and targets ``[micro_batch, seq]`` int64 over ``vocab``, positions
    ``[micro_batch, seq]``, a causal mask ``[1, 1, seq, seq]`` bool (True = masked)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (shape.micro_batch, shape.seq), generator=generator)
    targets = torch.randint(0, vocab, (shape.micro_batch, shape.seq), generator=generator)
    position_ids = torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch, shape.seq)
    mask = torch.triu(torch.ones(1, 1, shape.seq, shape.seq, dtype=torch.bool), diagonal=1)
    return tuple(tensor.to(device or torch.device("cpu")) for tensor in (input_ids, position_ids, mask, targets))


def make_batch(seed: int = 7):
    """The CPU tests' ``causal_batch``: ``[BATCH, SEQ]`` on the CPU, targets over the whole
    vocabulary of ``build_gpt``'s default model (VOCAB_SHARD rows per tensor-parallel rank)."""
    return causal_batch(CPU_TEST_SHAPE, VOCAB_SHARD * tp_size(), seed)


def packed_attention_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The attention of a packed (THD) forward as a mask for the local spec's attention, which has no
    packed kernel: bool ``[1, 1, T, T]`` (True = masked) where each position sees the positions up to
    itself in its own sequence only. ``cu_seqlens``: integer ``[S + 1]`` from 0 to ``T`` (the padded
    boundaries, as the packed ``input_ids [1, T]`` lay the sequences out)."""
    positions = torch.arange(int(cu_seqlens[-1]))
    sequence = torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)
    visible = (sequence[:, None] == sequence[None, :]) & (positions[None, :] <= positions[:, None])
    return ~visible[None, None]


def split_for_this_cp_rank(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This context-parallel rank's part of ``batch`` (tensors ``[b, s, ...]``) by Megatron's own
    ``get_batch_on_this_cp_rank``: 0.18 on asks whether CP is hybrid (it is not here); 0.13.1 builds
    its chunk index in pinned CUDA memory, which a CPU lacks, so there that index stays on the CPU."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {name: value.clone() for name, value in batch.items()}
    options = (
        {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    )
    make_tensor = torch.tensor

    def cpu_tensor(*args, pin_memory=False, **kwargs):
        return make_tensor(*args, **kwargs)

    with mock.patch("torch.tensor", cpu_tensor), mock.patch.object(torch.Tensor, "cuda", lambda self, **_: self):
        return get_batch_on_this_cp_rank(batch, **options)


def random_weights(*shape, seed: int, device=None) -> torch.Tensor:
    """Float32 weights in [-1, 1), the same on every rank (drawn on the CPU, then moved)."""
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1).to(device)


def forward(model, batch, **kwargs):
    """The model on ``make_batch``'s inputs (``labels=`` etc. pass through)."""
    input_ids, position_ids, mask, _ = batch
    return model(input_ids, position_ids, mask, **kwargs)


def megatron_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in Megatron's DistributedDataParallel as bf16 training runs it: float32 gradient
    buffers (``main_grad``), the reduction overlapped with the backward, small buckets. Later
    releases' reduction asks for the current CUDA stream: call
    ``devkit.distributed.run_cuda_placements_on_cpu()`` once in the worker first."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=4096)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def ddp_main_grads(ddp: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter's ``main_grad`` after the gradient reduction, cloned, by name."""
    ddp.finish_grad_sync()
    return {name: parameter.main_grad.clone() for name, parameter in ddp.module.named_parameters()}


def head_loss(logprob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A random weighted sum of both head outputs, the same on every rank."""
    weights = random_weights(2, *logprob.shape, seed=11, device=logprob.device)
    return (weights[0] * logprob + weights[1] * entropy).sum()


def labels_loss(loss: torch.Tensor) -> torch.Tensor:
    """A random weighted sum of the per-token labels-path loss."""
    return (random_weights(*loss.shape, seed=12, device=loss.device) * loss).sum()


def gather_vocabulary(shard: torch.Tensor) -> torch.Tensor:
    """``[..., vocab/TP]`` -> ``[..., vocab]``, the tensor-parallel ranks' shards side by side in
    rank order, with autograd (the backward hands each rank its own slice); ``shard`` itself when
    TP=1."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    if tp_size() == 1:
        return shard
    group = parallel_state.get_tensor_model_parallel_group()
    return gather_from_tensor_model_parallel_region(shard.contiguous(), group=group)


def oracle_logprob_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, temperature):
    """Float64 log-probs and entropy ``[b, s]`` of ``targets [b, s]`` from a logits shard
    ``[b, s, vocab/TP]``, gathered across the TP group first (``gather_vocabulary``)."""
    return logprob_entropy(gather_vocabulary(logits_shard), targets, temperature)


def sample_logprob_entropy(model, tokens: torch.Tensor, temperature: float):
    """Float64 ``(logprob, entropy)`` ``[L - 1]`` of one sample ``tokens [L]``: each position's next
    token and entropy under the stock ``model``'s logits of the sample alone (causal, positions from
    0), run padded to a multiple of the tensor-parallel size for sequence parallelism (the padding,
    after the sample, changes none of its rows)."""
    length = tokens.shape[0]
    padded = -(-length // tp_size()) * tp_size()
    mask = torch.triu(torch.ones(1, 1, padded, padded, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(torch.nn.functional.pad(tokens, (0, padded - length))[None], torch.arange(padded)[None], mask)
    return logprob_entropy(gather_vocabulary(logits)[0, : length - 1], tokens[1:], temperature)


def assert_topk_matches(logprobs, ids, logits_shard, k: int, temperature, atol: float, label: str) -> None:
    """``(logprobs, ids) [b, s, k]`` are the top ``k`` of the float64 log-probs of the stock logits
    shard ``[b, s, vocab/TP]`` (gathered): distinct ids scoring what the oracle gives them, in
    descending order, none missing that the oracle ranks clearly above the last."""
    if isinstance(temperature, torch.Tensor):  # one per position
        temperature = temperature.double().unsqueeze(-1)
    oracle = torch.log_softmax(gather_vocabulary(logits_shard).detach().double() / temperature, dim=-1)
    assert logprobs.shape == ids.shape == (*oracle.shape[:-1], k), f"{label}: {tuple(logprobs.shape)}"
    assert logprobs.dtype == torch.float32 and ids.dtype == torch.int64 and not logprobs.requires_grad, label
    flat_ids = ids.reshape(-1, k)
    assert all(len(set(row.tolist())) == k for row in flat_ids), f"{label}: repeated ids"
    assert_max_error(logprobs, oracle.gather(-1, ids), atol, f"{label} top-k log-probs")
    assert bool((logprobs[..., :-1] >= logprobs[..., 1:]).all()), f"{label}: not descending"
    kth = oracle.topk(k, dim=-1).values[..., -1]
    assert bool((logprobs[..., -1].double() >= kth - atol).all()), f"{label}: a larger log-prob was missed"


def parameter_grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient (cloned), by name; zeroes them afterwards."""
    grads = {}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name} got no gradient"
        grads[name] = parameter.grad.detach().clone()
        parameter.grad = None
    return grads


def finalized_parameter_grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``parameter_grads`` as Megatron's ``finalize_model_grads`` leaves them under sequence
    parallelism: a sequence-parallel parameter (norm weights, row-parallel biases) saw only this
    rank's part of the sequence, so its gradients are summed over the tensor-parallel group. A loss
    on some positions only (a response) leaves such a partial gradient all zero on a rank whose part
    holds none of them."""
    return sum_sequence_parallel(parameter_grads(model), model)


def sum_sequence_parallel(grads: Dict[str, torch.Tensor], model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``grads`` (by parameter name) with each sequence-parallel parameter's summed over the
    tensor-parallel group in place, as ``finalize_model_grads`` does."""
    from megatron.core import parallel_state

    for name, parameter in model.named_parameters():
        if getattr(parameter, "sequence_parallel", False) and tp_size() > 1:
            torch.distributed.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return grads


def assert_grads_close(
    actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], rtol: float, label: str
) -> None:
    """Each gradient within ``rtol`` of the largest entry of the stock one (elementwise relative
    tolerances are meaningless for entries near zero)."""
    assert actual.keys() == expected.keys(), label
    for name, want in expected.items():
        scale = want.abs().max().item()
        error = (actual[name] - want).abs().max().item()
        assert scale > 0, f"{label}: {name} has an all-zero stock gradient, the comparison would prove nothing"
        assert error <= rtol * scale, f"{label}: {name} gradient differs by {error:.3g} (largest entry {scale:.3g})"


def assert_max_error(actual: torch.Tensor, expected: torch.Tensor, atol: float, label: str) -> None:
    """The largest absolute difference is at most ``atol``."""
    error = max_abs_error(actual, expected)
    assert error <= atol, f"{label}: max error {error:.3g} > {atol:.3g}"


class ModuleWrapper(torch.nn.Module):
    """Holds a model as ``.module`` and forwards to it, as DDP and Float16Module do."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
