"""The NeMo-RL recipe (``megatron_fused_lm/recipes/nemo_rl.py``) against NeMo-RL's own code, imported
from the source checkout ``NEMO_RL_SOURCE`` names (``devkit.nemo_rl_source``; skipped when unset):

    NEMO_RL_SOURCE=/path/to/RL python -m pytest tests/cpu/test_trainer_nemo_rl.py

Every forward runs through NeMo-RL's ``forward_with_post_processing_fn`` (``nemo_rl.models.megatron.
train``), which divides the model's output in place by the sampling temperature and hands it to the
post-processor, on a real GPTModel: TP=2 with sequence parallelism on two gloo ranks, then TP=1
(tied embeddings), at temperatures 0.7 and 1.0, on unpacked micro-batches (right-padded
``input_ids [3, 12]``, three samples of 12, 7 and 10 tokens, one with ``sample_mask`` 0) and on packed
ones built by NeMo-RL's own ``process_microbatch`` (``PackedSeqParams`` as NeMo-RL builds them, each
sequence padded to a multiple of 4). Compared:

1. the loss through NeMo-RL's ``LossPostProcessor`` (``SequencePackingLossWrapper`` when packed) with
   ``NLLLossFn``, ``ClippedPGLossFn`` (its default config: clipping, k3 KL to a reference),
   ``DistillationLossFn`` (its default mixed KL, and reverse KL with ``zero_outside_topk``, which reads
   the student's entropy) and ``NLLLossFn`` with the recipe's ``NLLLossMixin`` (three GEMMs): stock (the
   unwrapped model, NeMo-RL's own ``prepare_loss_input``) against fused (the wrapped model, the
   recipe's ``LossPostProcessorMixin``): the loss and every parameter's gradient;
2. the same loss of a float64 oracle: the stock logits' float64 log-probs (``devkit``'s oracle) at the
   temperature, put into NeMo-RL's layout here and handed to NeMo-RL's loss function, against both;
3. the log-prob pass (``LogprobsPostProcessor``, under ``no_grad`` as NeMo-RL runs it) against the
   recipe's ``LogprobsPostProcessorMixin``, and both against the oracle.

Tolerances as in test_recipes: both sides compute in float32 from the same float32 model and differ
by rounding (values about 1e-6; gradients a few 1e-6 of their largest entry, up to 3e-5 for the
reverse-KL distillation loss, whose gradient is a difference of terms 100 times larger); a temperature
applied twice, a row scored one position off or a sequence-parallel gradient reduced twice is off by
O(1) or tens of percent. The largest differences measured are printed by rank 0.

The refusals (``test_the_recipe_refuses_what_it_cannot_serve``) run NeMo-RL's own classes: each
input type the fused head cannot serve, a loss built for NeMo-RL's own Linear-CE fusion, top-k /
top-p sampling (policy config and post-processors), ``fuse_loss``, a draft model, distillation under
context parallelism and a fused teacher's top-k logits; with the setting off the mixins are NeMo-RL's
classes.

The local attention spec has no THD kernel: ``devkit.cpu_attention.KernelStandIn`` runs a packed
micro-batch as one row with each sequence's causal mask and positions, and the model returns the
``[1, T, ...]`` rows a THD forward returns. NeMo-RL's unpacked micro-batch is built here as ``get_ltor_masks_and_position_ids``
(in ``megatron.training``, not installed) builds it: a causal mask and positions ``0 .. S - 1``.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from devkit import megatron_gpt as harness
from devkit.cpu_attention import KernelStandIn
from devkit.nemo_rl_source import SOURCE_VARIABLE, import_nemo_rl, source_checkout
from devkit.rollouts import MODEL_SHAPE
from megatron_fused_lm import unwrap_model
from megatron_fused_lm.recipes import nemo_rl as recipe

# Values (log-probs, losses relative to max(1, |loss|)): float32 summation order gives about 1e-6; a
# temperature taken twice (0.7 vs 0.49) or a row one position off moves them by O(1).
VALUE_ATOL = 2e-5
# Gradients, relative to the largest entry of the reference's: float32 rounding, measured up to 3e-5 on
# DistillationLossFn's reverse KL with zero_outside_topk (its -100 x remaining-mass term makes the gradient
# a difference of far larger terms; NeMo-RL's own path is 1e-5 off the oracle there), about 4e-6
# elsewhere; a sequence-parallel gradient reduced twice or one missing its 1 / T is off by tens of percent.
GRAD_RTOL = 5e-5
TEMPERATURES = (0.7, 1.0)
LENGTHS, PROMPTS, WIDTH = [12, 7, 10], [4, 3, 5], 12  # input_ids [3, 12], right-padded with 0
SAMPLE_MASK = [1.0, 1.0, 0.0]
TOP_K = 5  # the distillation teacher's top-k
DIVISIBLE_BY = 4  # policy.make_sequence_length_divisible_by: each packed sequence padded to a multiple
SETTINGS = {
    "fused_linear_logprob": True,
    "fused_linear_logprob_backend": "torch",
    "fused_linear_logprob_token_chunk": 5,
}

SOURCE = source_checkout()
needs_source = pytest.mark.skipif(
    SOURCE is None,
    reason=f"{SOURCE_VARIABLE} is unset: set it to a NeMo-RL source checkout (the directory holding nemo_rl/)",
)


class Measured:
    """The largest difference seen per comparison, for rank 0 to print."""

    def __init__(self):
        self.largest = defaultdict(float)

    def value(self, found, expected, label, what):
        error = (found.double() - expected.double()).abs().max().item()
        self.largest[what] = max(self.largest[what], error)
        assert error <= VALUE_ATOL, f"{label}: {what} off by {error:.3g}"

    def loss(self, found, expected, label, what):
        error = abs(found.item() - expected.item()) / max(1.0, abs(expected.item()))
        self.largest[what] = max(self.largest[what], error)
        assert error <= VALUE_ATOL, f"{label}: {what} {found.item()} vs {expected.item()}"

    def grads(self, found, expected, label, what):
        assert found.keys() == expected.keys(), label
        for name, want in expected.items():
            scale = want.abs().max().item()
            assert scale > 0, f"{label}: {name} has an all-zero reference gradient, the comparison would prove nothing"
            error = (found[name] - want).abs().max().item() / scale
            self.largest[what] = max(self.largest[what], error)
            assert error <= GRAD_RTOL, f"{label}: {what}, {name} off by {error:.3g} of its largest entry"


# ----------------------------------------------------------------------------------- micro-batches


def rollouts(nemo, vocab: int, seed: int):
    """NeMo-RL's training batch of the three samples (``BatchedDataDict``, right-padded), with what
    ``ClippedPGLossFn`` and ``DistillationLossFn`` read; the previous / generation / reference
    log-probs are filled in per case (``with_policy_logprobs``)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(LENGTHS), WIDTH, dtype=torch.long)
    token_mask = torch.zeros(len(LENGTHS), WIDTH)
    for row, (length, prompt) in enumerate(zip(LENGTHS, PROMPTS, strict=True)):
        input_ids[row, :length] = torch.randint(1, vocab, (length,), generator=generator)
        token_mask[row, prompt:length] = 1.0
    teacher_ids = torch.rand(len(LENGTHS), WIDTH, vocab, generator=generator).argsort(-1)[..., :TOP_K]
    teacher_logits = (torch.randn(len(LENGTHS), WIDTH, TOP_K, generator=generator) * 2).sort(-1, descending=True)[0]
    return nemo.BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.tensor(LENGTHS),
        token_mask=token_mask,
        sample_mask=torch.tensor(SAMPLE_MASK),
        advantages=torch.randn(len(LENGTHS), WIDTH, generator=generator),
        teacher_topk_indices=teacher_ids,
        teacher_topk_logits=teacher_logits,
    )


def with_policy_logprobs(data, logprobs: torch.Tensor, seed: int):
    """``data`` with ``prev_logprobs``, ``generation_logprobs`` and ``reference_policy_logprobs``
    ``[B, S]`` (NeMo-RL's leading 0 column): the current policy's ``logprobs [B, S - 1]`` moved by
    noise, so that some ratios are clipped and some are not."""
    generator = torch.Generator().manual_seed(seed)
    current = torch.cat([torch.zeros(len(LENGTHS), 1), logprobs.detach().float()], dim=1)
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        data[key] = current + 0.15 * torch.randn(current.shape, generator=generator)
    return data


def microbatch(nemo, data, packed: bool, tp: int):
    """NeMo-RL's ``ProcessedMicrobatch`` of ``data``: packed by NeMo-RL's ``process_microbatch`` with the
    padding its ``_get_pack_sequence_parameters_for_megatron`` picks, or unpacked."""
    if not packed:
        input_ids = data["input_ids"]
        causal = torch.triu(torch.ones(1, 1, WIDTH, WIDTH, dtype=torch.bool), diagonal=1)
        positions = torch.arange(WIDTH).expand_as(input_ids)
        return nemo.data.ProcessedMicrobatch(
            data_dict=data, input_ids=input_ids, input_ids_cp_sharded=input_ids, attention_mask=causal,
            position_ids=positions, packed_seq_params=None, cu_seqlens_padded=None,
        )  # fmt: skip
    megatron_cfg = {
        "tensor_model_parallel_size": tp, "sequence_parallel": tp > 1, "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
    }  # fmt: skip
    pad_each, pad_packed, pad_to = nemo.data._get_pack_sequence_parameters_for_megatron(
        megatron_cfg, DIVISIBLE_BY, WIDTH
    )
    inputs = nemo.data.process_microbatch(
        data, seq_length_key="input_lengths", pad_individual_seqs_to_multiple_of=pad_each,
        pad_packed_seq_to_multiple_of=pad_packed, pad_full_seq_to=pad_to, pack_sequences=True,
    )  # fmt: skip
    return nemo.data.ProcessedMicrobatch(
        data_dict=data, input_ids=inputs.input_ids, input_ids_cp_sharded=inputs.input_ids_cp_sharded,
        attention_mask=inputs.attention_mask, position_ids=inputs.position_ids,
        packed_seq_params=inputs.packed_seq_params, cu_seqlens_padded=inputs.cu_seqlens_padded,
    )  # fmt: skip


def policy_cfg(tp: int, packed: bool, temperature: float, **settings):
    """The ``policy`` section as NeMo-RL's post-processors and the recipe read it."""
    return {
        **settings,
        "logprob_chunk_size": None,
        "make_sequence_length_divisible_by": DIVISIBLE_BY,
        "sequence_packing": {"enabled": packed, "fuse_loss": False},
        "generation": {"temperature": temperature, "top_k": None, "top_p": 1.0},
        "megatron_cfg": {
            "tensor_model_parallel_size": tp, "sequence_parallel": tp > 1, "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1, "use_fused_linear_logprobs": False,
        },
    }  # fmt: skip


# ------------------------------------------------------------------------------------------ oracle


def oracle_log_softmax(model, batch, temperature: float) -> torch.Tensor:
    """Float64 ``log_softmax(logits / T)`` ``[B, S, V]`` of the stock model on ``batch`` in NeMo-RL's
    unpacked layout (a packed sequence's rows at its row, 0 past its padded length), with a graph to
    the parameters."""
    logits = model(
        batch.input_ids_cp_sharded, batch.position_ids, batch.attention_mask, packed_seq_params=batch.packed_seq_params
    )
    log_probs = torch.log_softmax(harness.gather_vocabulary(logits).double() / temperature, dim=-1)
    if batch.packed_seq_params is None:
        return log_probs
    unpacked = log_probs.new_zeros(len(LENGTHS), WIDTH, log_probs.shape[-1])
    boundaries = batch.cu_seqlens_padded.tolist()
    for row, (start, end) in enumerate(zip(boundaries[:-1], boundaries[1:], strict=True)):
        rows = min(end - start, WIDTH)  # NeMo-RL's wrapper slices the data to the padded length
        unpacked[row, :rows] = log_probs[0, start : start + rows]
    return unpacked


def oracle_loss(nemo, loss_fn, log_probs: torch.Tensor, data, counts) -> torch.Tensor:
    """NeMo-RL's ``loss_fn`` on the oracle's inputs in float64, as its ``prepare_loss_input`` would
    build them from exact logits (written out here from its definitions)."""
    kind = loss_fn.input_type.name
    if kind == "LOGPROB":
        next_token = log_probs[:, :-1].gather(-1, data["input_ids"][:, 1:, None])[..., 0]
        return loss_fn(next_token_logprobs=next_token, data=data, **counts)[0]
    assert kind == "DISTILLATION", kind
    ids = data["teacher_topk_indices"][:, :-1]
    at_ids = log_probs[:, :-1].gather(-1, ids)
    # zero_outside_topk: the student's log-probs over the whole vocabulary; else renormalized over the
    # k ids (the log_softmax of its logits there); H_all = sum p log p over the vocabulary.
    student = at_ids if loss_fn.zero_outside_topk else torch.log_softmax(at_ids, dim=-1)
    h_all = (log_probs.exp() * log_probs).sum(-1)[:, :-1]
    teacher = torch.log_softmax(data["teacher_topk_logits"].double(), dim=-1)[:, :-1]
    return loss_fn(student, teacher, h_all, data=data, **counts)[0]


# --------------------------------------------------------------------------------------- the cases


def nemo_rl_losses(nemo, fused_nll_class):
    """NeMo-RL's losses as its algorithms build them (default configs), by label."""
    functions = nemo.loss_functions
    return {
        "NLLLossFn": functions.NLLLossFn(),
        "ClippedPGLossFn": functions.ClippedPGLossFn(functions.ClippedPGLossConfig()),
        "NLLLossFn + NLLLossMixin (three GEMMs)": fused_nll_class(),
        "DistillationLossFn (mixed KL)": functions.DistillationLossFn(functions.DistillationLossConfig()),
        "DistillationLossFn (reverse KL, zero_outside_topk)": functions.DistillationLossFn(
            functions.DistillationLossConfig(kl_type="reverse", zero_outside_topk=True)
        ),
    }


def fused_classes(nemo):
    """The recipe's mixins combined with NeMo-RL's classes, as a user writes them."""

    class FusedLossPostProcessor(recipe.LossPostProcessorMixin, nemo.train.LossPostProcessor):
        pass

    class FusedLogprobsPostProcessor(recipe.LogprobsPostProcessorMixin, nemo.train.LogprobsPostProcessor):
        pass

    class FusedTopkLogitsPostProcessor(recipe.TopkLogitsPostProcessorMixin, nemo.train.TopkLogitsPostProcessor):
        pass

    class FusedNLLLossFn(recipe.NLLLossMixin, nemo.loss_functions.NLLLossFn):
        pass

    return SimpleNamespace(
        loss=FusedLossPostProcessor, logprobs=FusedLogprobsPostProcessor, topk=FusedTopkLogitsPostProcessor,
        nll=FusedNLLLossFn,
    )  # fmt: skip


def forward_step(nemo, model, batch, processor, sampling, counts=None):
    """NeMo-RL's forward step on one micro-batch, then its post-processing: ``(loss, metrics)``."""
    output, finish = nemo.train.forward_with_post_processing_fn(
        iter([batch]), model, processor, sampling_params=sampling, **(counts or {})
    )
    return finish(output)


def check_case(nemo, classes, model, tp: int, temperature: float, packed: bool, measured: Measured) -> None:
    label = f"TP={tp} T={temperature} {'packed' if packed else 'unpacked'}"
    vocab = harness.VOCAB_SHARD * tp
    sampling = nemo.TrainingSamplingParams(top_k=None, top_p=1.0, temperature=temperature)
    cfg = policy_cfg(tp, packed, temperature, **SETTINGS)
    data = rollouts(nemo, vocab, seed=5)
    batch = microbatch(nemo, data, packed, tp)
    with torch.no_grad():
        current = oracle_log_softmax(model, batch, temperature)[:, :-1].gather(-1, data["input_ids"][:, 1:, None])
    data = with_policy_logprobs(data, current[..., 0], seed=6)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    counts = {"global_valid_seqs": data["sample_mask"].sum(), "global_valid_toks": mask.sum()}
    loss_fns = nemo_rl_losses(nemo, classes.nll)

    # The oracle and NeMo-RL's stock path, on the unwrapped model.
    expected, stock = {}, {}
    for name, loss_fn in loss_fns.items():
        loss = oracle_loss(nemo, loss_fn, oracle_log_softmax(model, batch, temperature), data, counts)
        loss.backward()
        expected[name] = loss.detach(), harness.finalized_parameter_grads(model)
        processor = nemo.train.LossPostProcessor(loss_fn=loss_fn, cfg=cfg, num_microbatches=1, sampling_params=sampling)
        loss, metrics = forward_step(nemo, model, batch, processor, sampling, counts)
        loss.backward()
        stock[name] = loss.detach(), metrics, harness.finalized_parameter_grads(model)
    with torch.no_grad():
        oracle_logprobs = oracle_log_softmax(model, batch, temperature)[:, :-1].gather(
            -1, data["input_ids"][:, 1:, None]
        )
        processor = nemo.train.LogprobsPostProcessor(cfg=cfg, sampling_params=sampling)
        stock_logprobs = forward_step(nemo, model, batch, processor, sampling)[1]["logprobs"]

    # The recipe: the worker wraps ModelAndOptimizerState.model and builds the fused post-processors.
    head = recipe.wrap_policy_model(model, cfg)
    assert head.fused, label
    for name, loss_fn in loss_fns.items():
        processor = classes.loss(loss_fn=loss_fn, cfg=cfg, num_microbatches=1, sampling_params=sampling, head=head)
        loss, metrics = forward_step(nemo, model, batch, processor, sampling, counts)
        loss.backward()
        grads = harness.finalized_parameter_grads(model)
        case = f"{label} {name}"
        measured.loss(loss, expected[name][0], case, f"{name}: loss vs float64 oracle")
        measured.loss(loss, stock[name][0], case, f"{name}: loss vs NeMo-RL stock")
        measured.grads(grads, expected[name][1], case, f"{name}: gradients vs float64 oracle")
        measured.grads(grads, stock[name][2], case, f"{name}: gradients vs NeMo-RL stock")
        # The oracle itself: NeMo-RL's stock path on the same float32 model agrees with it.
        measured.loss(stock[name][0], expected[name][0], case, f"{name}: NeMo-RL stock loss vs float64 oracle")
        measured.grads(stock[name][2], expected[name][1], case, f"{name}: NeMo-RL stock gradients vs float64 oracle")
        if "num_unmasked_tokens" in metrics:
            assert metrics["num_unmasked_tokens"] == stock[name][1]["num_unmasked_tokens"], case
    with torch.no_grad():
        processor = classes.logprobs(cfg=cfg, sampling_params=sampling, head=head)
        found = forward_step(nemo, model, batch, processor, sampling)[1]["logprobs"]
    unwrap_model(model)

    assert found.shape == stock_logprobs.shape == (len(LENGTHS), WIDTH) and not found[:, 0].any(), label
    scored = torch.zeros(len(LENGTHS), WIDTH - 1, dtype=torch.bool)  # the positions of each sequence's next tokens
    for row, length in enumerate(LENGTHS):
        scored[row, : length - 1] = True
    if packed:  # past a sequence's end: 0 where NeMo-RL's packed function leaves the padding's log-probs
        assert not found[:, 1:][~scored].any(), label
    else:  # every position, padding included, as NeMo-RL's
        scored[:] = True
    measured.value(found[:, 1:][scored], oracle_logprobs[..., 0][scored], label, "log-prob pass vs float64 oracle")
    measured.value(found[:, 1:][scored], stock_logprobs[:, 1:][scored], label, "log-prob pass vs NeMo-RL stock")


def parity_worker(source: str) -> None:
    nemo = import_nemo_rl(source)
    classes = fused_classes(nemo)
    measured = Measured()
    for tp in (2, 1):
        harness.tensor_parallel(tp)
        model = KernelStandIn(harness.build_gpt(MODEL_SHAPE, sequence_parallel=tp > 1, tied=tp == 1))
        for temperature in TEMPERATURES:
            for packed in (False, True):
                check_case(nemo, classes, model, tp, temperature, packed, measured)
    if torch.distributed.get_rank() == 0:
        for what, error in sorted(measured.largest.items()):
            print(f"NeMo-RL ({source}) largest difference, {what}: {error:.2e}", flush=True)


@needs_source
def test_the_recipe_matches_nemo_rl_s_own_functions():
    harness.spawn(parity_worker, 2, SOURCE)


# --------------------------------------------------------------------------------------- refusals


def refusals_worker(source: str) -> None:
    nemo = import_nemo_rl(source)
    classes = fused_classes(nemo)
    functions = nemo.loss_functions
    harness.tensor_parallel(1)
    model = KernelStandIn(harness.build_gpt(MODEL_SHAPE))
    cfg = policy_cfg(1, False, 1.0, **SETTINGS)
    head = recipe.wrap_policy_model(model, cfg)
    data = rollouts(nemo, harness.VOCAB_SHARD, seed=5)
    batch = microbatch(nemo, data, False, 1)
    output = model(batch.input_ids, batch.position_ids, batch.attention_mask)

    # Losses of input types the fused head cannot serve, named with the loss class.
    cross_tokenizer = object.__new__(functions.CrossTokenizerDistillationLossFn)  # its __init__ loads projections
    refused = {
        "LOGIT": [functions.PreferenceLossFn(), functions.MseValueLossFn(functions.MseValueLossConfig())],
        "DISTILLATION_CROSS_TOKENIZER": [cross_tokenizer],
        "DRAFT": [functions.DraftCrossEntropyLossFn()],
    }
    for kind, loss_fns in refused.items():
        for loss_fn in loss_fns:
            message = f"{type(loss_fn).__name__} takes input type {kind}"
            with pytest.raises(NotImplementedError, match=message):
                recipe.prepare_loss_input(output, data, loss_fn, head=head)
            with pytest.raises(NotImplementedError, match=message):
                classes.loss(loss_fn=loss_fn, cfg=cfg, head=head)
    with pytest.raises(NotImplementedError, match=r"NLLLossFn\(use_fused_linear_logprobs=True\)"):
        recipe.prepare_loss_input(output, data, functions.NLLLossFn(use_fused_linear_logprobs=True), head=head)
    distillation = functions.DistillationLossFn(functions.DistillationLossConfig())
    with pytest.raises(NotImplementedError, match="DISTILLATION losses under context parallelism"):
        # Two ranks standing for a context-parallel group: it refuses before any collective.
        recipe.prepare_loss_input(output, data, distillation, context_parallel_group=torch.distributed.group.WORLD,
                                  head=head)  # fmt: skip
    with pytest.raises(NotImplementedError, match="SFT only"):
        classes.nll()(data=data, global_valid_toks=torch.tensor(1.0), dpo_loss=True,
                      fused_lm_input=recipe.FusedLMInput(output, head))  # fmt: skip

    # Top-k / top-p sampling: at wrap time from the policy's generation config, and the
    # post-processors' own sampling_params.
    for options, named in (({"top_k": 8}, "top_k = 8"), ({"top_p": 0.9}, "top_p = 0.9")):
        generation = {**cfg["generation"], **options}
        with pytest.raises(NotImplementedError, match=f"policy.generation.{named}"):
            recipe.wrap_policy_model(model, {**cfg, "generation": generation})
        sampling = nemo.TrainingSamplingParams(**generation)
        with pytest.raises(NotImplementedError, match=f"FusedLossPostProcessor.sampling_params.{named}"):
            classes.loss(loss_fn=functions.NLLLossFn(), cfg=cfg, sampling_params=sampling, head=head)
        with pytest.raises(NotImplementedError, match=f"FusedLogprobsPostProcessor.sampling_params.{named}"):
            classes.logprobs(cfg=cfg, sampling_params=sampling, head=head)
    # top_k -1 and top_p 1.0 are NeMo-RL's "no filtering".
    recipe.wrap_policy_model(model, {**cfg, "generation": {"temperature": 1.0, "top_k": -1, "top_p": 1.0}})
    # A softcap: NeMo-RL divides the hidden states by the temperature first, which the cap does not
    # commute with; at temperature 1 it is served.
    capped = {**cfg, "fused_linear_logprob_softcap": 30.0}
    with pytest.raises(NotImplementedError, match="not with the cap"):
        recipe.wrap_policy_model(model, {**capped, "generation": {**cfg["generation"], "temperature": 0.7}})
    recipe.wrap_policy_model(model, {**capped, "generation": {**cfg["generation"], "temperature": 1.0}})
    head = recipe.wrap_policy_model(model, cfg)

    # The packed fused-loss wrapper, NeMo-RL's own Linear-CE fusion, a prepare_fn of the caller's, a draft model.
    fuse_loss = {**cfg, "sequence_packing": {"enabled": True, "fuse_loss": True}}
    with pytest.raises(NotImplementedError, match="fuse_loss"):
        recipe.wrap_policy_model(model, fuse_loss)
    with pytest.raises(NotImplementedError, match="fuse_loss"):
        classes.loss(loss_fn=functions.NLLLossFn(), cfg=fuse_loss, head=head)
    own_fusion = {**cfg, "megatron_cfg": {**cfg["megatron_cfg"], "use_fused_linear_logprobs": True}}
    with pytest.raises(ValueError, match="use_fused_linear_logprobs"):
        recipe.wrap_policy_model(model, own_fusion)
    with pytest.raises(ValueError, match="use_fused_linear_logprobs"):
        classes.logprobs(cfg=cfg, use_fused_linear_logprobs=True, head=head)
    with pytest.raises(ValueError, match="pass no prepare_fn"):
        classes.loss(loss_fn=functions.NLLLossFn(), cfg=cfg, prepare_fn=nemo.loss_utils.prepare_loss_input, head=head)
    with pytest.raises(NotImplementedError, match="DRAFT"):
        classes.loss(loss_fn=functions.NLLLossFn(), cfg=cfg, draft_model=SimpleNamespace(eagle_module=None), head=head)

    # A teacher wrapped with the fused head would return top-k log-probs as its top-k logits.
    with pytest.raises(NotImplementedError, match="FusedTopkLogitsPostProcessor: the teacher's top-k logits"):
        classes.topk(cfg=cfg, k=TOP_K, head=head)
    unwrap_model(model)

    # With the setting off the mixins are NeMo-RL's classes, the teacher's top-k included.
    stock_head = recipe.wrap_policy_model(model, policy_cfg(1, False, 1.0))
    assert not stock_head.fused
    assert classes.loss(loss_fn=functions.NLLLossFn(), cfg=cfg, head=stock_head).prepare_fn is None
    with torch.no_grad():
        found = forward_step(nemo, model, batch, classes.topk(cfg=cfg, k=TOP_K, head=stock_head), None)[1]
        expected = forward_step(nemo, model, batch, nemo.train.TopkLogitsPostProcessor(cfg=cfg, k=TOP_K), None)[1]
    assert all(torch.equal(found[key], expected[key]) for key in ("topk_logits", "topk_indices"))


@needs_source
def test_the_recipe_refuses_what_it_cannot_serve():
    harness.spawn(refusals_worker, 2, SOURCE)
