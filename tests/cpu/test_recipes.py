"""The trainer recipes of docs/INTEGRATIONS.md (``megatron_fused_lm.recipes``) on a real Megatron-Core
GPTModel, TP=2 with sequence parallelism (the layout SkyRL and verl default to), each fed a
micro-batch laid out as its trainer lays it out: SkyRL's padded rows and packed rows with their
action window, verl's packed rows with shifted labels and per-row temperatures, slime's samples end to
end with tail padding, NeMo-RL's right-padded rows, packed rows and per-sequence slices.

The oracle: the stock model (unwrapped, the same weights) on the same input, its logits' float64
log-probs and entropy per row (``devkit``'s oracle), placed into the trainer's layout by the explicit
loops below; the trainer's loss formulas are written here in float64 from the cited sources. Each
recipe's values must match (2e-5 absolute, relative to the loss's size for losses) and so must
every parameter's gradient of a random weighted sum of them, or of the loss (5e-5 of the largest
entry of the stock gradient). Float32 on both sides, as in test_integration_parity: the measured
errors are about 1e-6; a row read one position off, a missing temperature or a weight on the wrong
token moves values by O(1).

A packed micro-batch runs through the local attention spec with ``packed_attention_mask`` (it has no
packed kernel); the head sees the ``[1, T, h]`` rows a THD forward gives it either way.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from devkit import megatron_gpt as harness
from devkit.oracle import policy_loss_inputs
from devkit.rollouts import (
    ACTIONS,
    MODEL_SHAPE,
    PROMPTS,
    RESPONSES,
    pack,
    padded_cu_seqlens,
    run_model,
    sample_tokens,
    skyrl_algorithm,
    skyrl_batches,
    skyrl_loss_mask,
    skyrl_policy_oracle,
    slime_args,
    slime_policy_oracle,
    slime_sample_mean,
    slime_top_p_rows,
    slime_top_p_sets,
    stock_rows,
    weighted,
)
from megatron_fused_lm import FusedLMConfig, unwrap_model
from megatron_fused_lm.recipes import nemo_rl, skyrl, slime, verl

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
TEMPERATURE = 0.8
SETTINGS = {
    "fused_linear_logprob": True,
    "fused_linear_logprob_backend": "torch",
    "fused_linear_logprob_token_chunk": 5,
}


def assert_loss_close(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """A loss within VALUE_ATOL of the oracle's, relative to the loss's size (float32 sums)."""
    error = abs(actual.item() - expected.item())
    assert error <= VALUE_ATOL * max(1.0, abs(expected.item())), f"{label}: {actual.item()} vs {expected.item()}"


def check_values_and_grads(model, expected, actual, grads, label: str, seed: int = 30) -> None:
    """``actual`` (the recipe's outputs) equals ``expected`` (the oracle's), and the gradients of the
    same weighted sum of them equal ``grads`` (the stock ones, taken before)."""
    for want, got in zip(expected, actual, strict=True):
        harness.assert_max_error(got, want, VALUE_ATOL, label)
    weighted(actual, seed).backward()
    harness.assert_grads_close(harness.finalized_parameter_grads(model), grads, GRAD_RTOL, label)


def stock_grads(model, loss: torch.Tensor):
    loss.backward()
    return harness.finalized_parameter_grads(model)


# ---------------------------------------------------------------------------------------- SkyRL


@dataclass
class SkyRLTrainerSection:
    """The fields of SkyRL 0.4.0's ``TrainerConfig`` (``skyrl.train.config``) that the recipe reads,
    with SkyRL's defaults, and its nesting under the top-level config's ``trainer``."""

    strategy: str = "megatron"
    logprobs_chunk_size: Optional[int] = 1024
    fused_lm_head_logprob: bool = False
    policy: dict = field(default_factory=lambda: {"megatron_config": {"tensor_model_parallel_size": 2}})


@dataclass
class FusedSkyRLTrainerSection(SkyRLTrainerSection, skyrl.FusedLMSettings):
    """What a SkyRL user declares: the trainer section with the settings mixed in."""


def check_skyrl(tied: bool) -> None:
    tokens = sample_tokens(seed=1)
    sequences, attention_mask, packed, cu_seqlens = skyrl_batches(tokens)
    model = harness.build_gpt(MODEL_SHAPE, sequence_parallel=True, tied=tied)
    config = FusedSkyRLTrainerSection(**SETTINGS)
    head = skyrl.wrap_actor_module([model], config)
    assert head.fused and head.config == FusedLMConfig(enabled=True, token_chunk=5), head.fallback_reason
    unwrap_model(model)
    packed_mask = harness.packed_attention_mask(cu_seqlens)
    starts = cu_seqlens[:-1].tolist()

    def padded_oracle():
        logprob, entropy = stock_rows(model, sequences, temperature=TEMPERATURE)
        window = slice(-ACTIONS - 1, -1)  # position t scores token t + 1
        return logprob[:, window], entropy[:, window]

    def packed_oracle():
        # SkyRL's packed mapping, written out: a row's k-th real token, unless its last, scores the next
        # one in the action slot of its own column, for columns from S - 1 - A on.
        logprob, entropy = stock_rows(model, packed, packed_mask, TEMPERATURE)
        actions = [torch.zeros(len(tokens), ACTIONS, dtype=torch.float64) for _ in range(2)]
        first_slot_column = sequences.shape[1] - 1 - ACTIONS
        for row, start in enumerate(starts):
            columns = attention_mask[row].nonzero().squeeze(-1).tolist()
            for k, column in enumerate(columns[:-1]):
                if column >= first_slot_column:
                    for values, found in zip(actions, (logprob, entropy), strict=True):
                        values[row, column - first_slot_column] = found[0, start + k]
        return tuple(values.clone() for values in actions)  # [B, A], 0 in slots of no token

    # SkyRL divides the model's output by the temperature in place before the recipe sees it.
    layouts = {
        "padded": (
            padded_oracle,
            lambda: run_model(model, sequences).div_(TEMPERATURE),
            skyrl.padded_layout(sequences, ACTIONS),
        ),
        "packed": (
            packed_oracle,
            lambda: run_model(model, packed, packed_mask).div_(TEMPERATURE),
            skyrl.packed_layout(packed, cu_seqlens, attention_mask, ACTIONS),
        ),
    }
    loss_mask = skyrl_loss_mask()
    algorithm = skyrl_algorithm()
    correction, scale = 4.0, 1.5  # num_microbatches * dp_size, num_microbatches / num_real_microbatches
    for name, (oracle, forward, layout) in layouts.items():
        label = f"SkyRL {name} tied={tied}"
        unwrap_model(model)
        expected = oracle()
        grads = stock_grads(model, weighted(expected, seed=30))
        expected_logprob = expected[0].detach()
        inputs = policy_loss_inputs(expected_logprob, loss_mask, torch.Generator().manual_seed(2))
        inputs["advantages"] = inputs["advantages"] / loss_mask.sum()  # SkyRL's token_mean scaling
        sft_mask = loss_mask / loss_mask.sum()  # SkyRL pre-scales the SFT mask for a token mean
        sft_expected = -(oracle()[0] * sft_mask.double()).sum() * correction
        sft_grads = stock_grads(model, sft_expected)
        policy_expected = skyrl_policy_oracle(*oracle(), inputs, loss_mask, algorithm, correction, scale)
        policy_grads = stock_grads(model, policy_expected)

        head = skyrl.wrap_actor_module([model], config)
        actual = skyrl.action_log_probs(head, forward(), layout, with_entropy=True)
        assert actual[0].shape == (len(tokens), ACTIONS), label
        check_values_and_grads(model, expected, actual, grads, f"{label} action_log_probs")

        result = skyrl.cross_entropy_loss(head, forward(), layout, sft_mask, correction)
        assert_loss_close(result.loss, sft_expected, f"{label} cross_entropy_loss")
        harness.assert_max_error(layout.to_actions(result.logprob), expected_logprob, VALUE_ATOL, label)
        result.loss.backward()
        harness.assert_grads_close(
            harness.finalized_parameter_grads(model), sft_grads, GRAD_RTOL, f"{label} cross_entropy_loss"
        )

        result = skyrl.policy_loss(
            head, forward(), layout, old_log_probs=inputs["old_logprob"], advantages=inputs["advantages"],
            loss_mask=loss_mask, base_log_probs=inputs["ref_logprob"], rollout_log_probs=None, algorithm=algorithm,
            grad_sum_correction_factor=correction, kl_entropy_microbatch_scale=scale,
        )  # fmt: skip
        assert_loss_close(result.loss, policy_expected, f"{label} policy_loss")
        result.loss.backward()
        harness.assert_grads_close(
            harness.finalized_parameter_grads(model), policy_grads, GRAD_RTOL, f"{label} policy_loss"
        )

        # What the recipe refuses, rather than computing something else than SkyRL would.
        for refused in (
            dict(algorithm=skyrl_algorithm(policy_loss_type="gspo"), rollout_log_probs=None),
            dict(
                algorithm=skyrl_algorithm(off_policy_correction=SimpleNamespace(
                    **{**dict.fromkeys(skyrl.OFF_POLICY_CORRECTION_OPTIONS), "tis_ratio_type": "token"}
                )),
                rollout_log_probs=inputs["old_logprob"],
            ),
        ):  # fmt: skip
            with pytest.raises(NotImplementedError):
                skyrl.policy_loss(
                    head, forward(), layout, old_log_probs=inputs["old_logprob"], advantages=inputs["advantages"],
                    loss_mask=loss_mask, base_log_probs=inputs["ref_logprob"], grad_sum_correction_factor=correction,
                    kl_entropy_microbatch_scale=scale, **refused,
                )  # fmt: skip
    with pytest.raises(NotImplementedError, match="install_fused_heads"):
        skyrl.packed_layout(packed, cu_seqlens, attention_mask, ACTIONS, sub_seq_lengths=[[5, 4]])
    with pytest.raises(ValueError, match="not both"):
        skyrl.wrap_actor_module([model], FusedSkyRLTrainerSection(**SETTINGS, fused_lm_head_logprob=True))
    # SkyRL divides the hidden states by the temperature before the head: a cap would see u / T.
    with pytest.raises(ValueError, match="commutes with the product but not with the cap"):
        skyrl.wrap_actor_module([model], FusedSkyRLTrainerSection(**SETTINGS, fused_linear_logprob_softcap=30.0))
    unwrap_model(model)


# ----------------------------------------------------------------------------------------- verl


class VerlEngineStandIn:
    """verl's ``MegatronEngineWithLMHead`` as far as the mixin reaches: ``engine_config``, the model
    builder and the stock processor (which must not be called once the head is fused)."""

    def __init__(self, module, engine_config):
        self.module_to_build = module
        self.engine_config = engine_config

    def _build_megatron_module(self):
        return self.module_to_build

    def _lm_head_logits_processor(self, logits, label, temperature, **options):
        return {"stock processor": logits}


class VerlEngine(verl.FusedLMHeadEngine, VerlEngineStandIn):
    pass


def verl_engine_config(**overrides):
    """The engine's config section (``actor_rollout_ref.actor.megatron``, attribute access as verl's
    ``BaseConfig`` gives it) with the settings declared."""
    return SimpleNamespace(**{"use_fused_kernels": False, "sequence_parallel": True, **SETTINGS, **overrides})


def check_verl(tied: bool) -> None:
    tokens = sample_tokens(seed=3)
    lengths = [sample.numel() for sample in tokens]
    cu_seqlens = padded_cu_seqlens(lengths)
    packed = pack(tokens, cu_seqlens)
    label = packed.roll(-1, dims=1)  # preprocess_thd_engine(need_roll=True) at CP = 1
    temperature = torch.zeros(packed.shape)  # verl's per-token temperatures, 0 on padding rows
    for index, (start, length) in enumerate(zip(cu_seqlens.tolist(), lengths, strict=False)):
        temperature[0, start : start + length] = TEMPERATURE * (1 + 0.5 * index)  # each sample its own
    mask = harness.packed_attention_mask(cu_seqlens)
    model = harness.build_gpt(MODEL_SHAPE, sequence_parallel=True, tied=tied)
    scored = torch.zeros(packed.shape, dtype=torch.bool)  # the rows postprocess_thd_engine keeps and the loss reads
    for start, length in zip(cu_seqlens.tolist(), lengths, strict=False):
        scored[0, start : start + length - 1] = True
    on_rows = torch.where(temperature > 0, temperature, 1.0)
    expected = tuple(value[scored] for value in stock_rows(model, packed, mask, on_rows))
    grads = stock_grads(model, weighted(expected, seed=30))

    options = dict(
        calculate_sum_pi_squared=False, calculate_entropy=True, distillation_use_topk=False,
        distillation_only=False, logits_processor_func=None, batch=None, data_format="thd",
    )  # fmt: skip
    engine = VerlEngine([model], verl_engine_config())
    assert engine._build_megatron_module() == [model] and engine.fused_head.fused
    found = engine._lm_head_logits_processor(
        run_model(model, packed, mask), label=label, temperature=temperature, **options
    )
    assert set(found) == {"log_probs", "entropy"} and found["log_probs"].shape == packed.shape
    actual = (found["log_probs"][scored], found["entropy"][scored])
    check_values_and_grads(model, expected, actual, grads, f"verl tied={tied} logits processor")
    without_entropy = {**options, "calculate_entropy": False}
    found = engine._lm_head_logits_processor(run_model(model, packed, mask), label, temperature, **without_entropy)
    assert set(found) == {"log_probs"}
    harness.assert_max_error(found["log_probs"][scored], expected[0], VALUE_ATOL, f"verl tied={tied} log-probs only")
    for option in verl.LOGITS_ONLY_OPTIONS:
        with pytest.raises(NotImplementedError, match=option):
            engine._lm_head_logits_processor(
                run_model(model, packed, mask), label, temperature, **{**options, option: True}
            )
    with pytest.raises(ValueError, match="use_fused_kernels"):
        VerlEngine([model], verl_engine_config(use_fused_kernels=True))._build_megatron_module()
    stock = VerlEngine([model], verl_engine_config(fused_linear_logprob=False))
    stock._build_megatron_module()
    logits = run_model(model, packed, mask)
    assert stock._lm_head_logits_processor(logits, label, temperature, **options)["stock processor"] is logits


# ---------------------------------------------------------------------------------------- slime


def check_slime(tied: bool) -> None:
    tokens = sample_tokens(seed=4)
    lengths = [sample.numel() for sample in tokens]
    rows = 32  # slime pads the concatenated samples at the end to a multiple of TP x 128; here of 16
    packed = torch.zeros(1, rows, dtype=torch.long)
    packed[0, : sum(lengths)] = torch.cat(tokens)
    mask = harness.packed_attention_mask(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), rows]))
    model = harness.build_gpt(MODEL_SHAPE, sequence_parallel=True, tied=tied)
    args = slime_args(TEMPERATURE, "--fused-linear-logprob", "--fused-linear-logprob-token-chunk", "5")
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]

    def oracle():
        logprob, entropy = stock_rows(model, packed, mask, TEMPERATURE)
        spans = [
            slice(offset + prompt - 1, offset + length - 1)
            for offset, prompt, length in zip(offsets, PROMPTS, lengths, strict=False)
        ]
        return torch.cat([logprob[0, span] for span in spans]), torch.cat([entropy[0, span] for span in spans])

    generator = torch.Generator().manual_seed(5)
    loss_masks = [(torch.rand(response, generator=generator) > 0.2).float() for response in RESPONSES]
    expected = oracle()
    grads = stock_grads(model, weighted(expected, seed=30))
    inputs = policy_loss_inputs(expected[0].detach(), torch.cat(loss_masks), generator)
    batch = {
        "unconcat_tokens": tokens, "total_lengths": lengths, "response_lengths": RESPONSES, "loss_masks": loss_masks,
        **{key: list(inputs[name].split(RESPONSES)) for key, name in (
            ("log_probs", "old_logprob"), ("ref_log_probs", "ref_logprob"), ("advantages", "advantages"))},
    }  # fmt: skip
    reduce = slime_sample_mean(loss_masks, [mask.sum() for mask in loss_masks])
    sft_expected = -reduce(oracle()[0])
    sft_grads = stock_grads(model, sft_expected)
    policy_expected = slime_policy_oracle(*oracle(), inputs, args, reduce)
    policy_grads = stock_grads(model, policy_expected)
    # On-policy (slime skipped its log-prob pass: no old log-probs): the current ones, detached.
    logprob, entropy = oracle()
    on_policy_expected = slime_policy_oracle(logprob, entropy, dict(inputs, old_logprob=logprob.detach()), args, reduce)
    on_policy_grads = stock_grads(model, on_policy_expected)

    head = slime.wrap_slime_model([model], args)
    assert head.fused and slime.fused_head() is head and head.config.token_chunk == 5
    label = f"slime tied={tied}"
    empty, found = slime.log_probs_and_entropy(
        run_model(model, packed, mask), args=args, unconcat_tokens=tokens, total_lengths=lengths,
        response_lengths=RESPONSES, with_entropy=True,
    )  # fmt: skip
    assert empty.numel() == 0 and [piece.shape[0] for piece in found["log_probs"]] == RESPONSES, label
    actual = (torch.cat(found["log_probs"]), torch.cat(found["entropy"]))
    check_values_and_grads(model, expected, actual, grads, f"{label} log_probs_and_entropy")

    loss, metrics = slime.sft_loss(args, batch, run_model(model, packed, mask), reduce)
    assert_loss_close(loss, sft_expected, f"{label} sft_loss")
    loss.backward()
    harness.assert_grads_close(harness.finalized_parameter_grads(model), sft_grads, GRAD_RTOL, f"{label} sft_loss")

    loss, metrics = slime.policy_loss(args, batch, run_model(model, packed, mask), reduce)
    assert_loss_close(loss, policy_expected, f"{label} policy_loss")
    entropy_metric = reduce(expected[1].detach())
    assert abs(metrics["entropy_loss"].item() - entropy_metric.item()) <= VALUE_ATOL, label
    assert {"pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss"} <= set(metrics), label
    loss.backward()
    harness.assert_grads_close(
        harness.finalized_parameter_grads(model), policy_grads, GRAD_RTOL, f"{label} policy_loss"
    )
    on_policy = {key: value for key, value in batch.items() if key != "log_probs"}
    loss, metrics = slime.policy_loss(args, on_policy, run_model(model, packed, mask), reduce)
    assert_loss_close(loss, on_policy_expected, f"{label} on-policy policy_loss")
    assert metrics["ppo_kl"] == 0 and metrics["pg_clipfrac"] == 0, f"{label} on-policy: ratio 1"
    assert list(metrics)[:5] == ["loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"], label  # slime's order
    loss.backward()
    harness.assert_grads_close(
        harness.finalized_parameter_grads(model), on_policy_grads, GRAD_RTOL, f"{label} on-policy policy_loss"
    )
    with pytest.raises(ValueError, match="rollout_log_probs"):  # --use-rollout-logprobs without them
        rollout_old = SimpleNamespace(**{**vars(args), "use_rollout_logprobs": True})
        slime.policy_loss(rollout_old, batch, run_model(model, packed, mask), reduce)
    for setting in ({"advantage_estimator": "gspo"}, {"use_tis": True}, {"kl_loss_type": "low_var_kl"}):
        refused = slime_args(TEMPERATURE, "--fused-linear-logprob")
        refused.__dict__.update(setting)
        with pytest.raises(NotImplementedError):
            slime.policy_loss(refused, batch, run_model(model, packed, mask), reduce)
    assert slime.wrap_slime_model([model], slime_args(TEMPERATURE)).fused is False and slime.fused_head() is None
    check_slime_top_p(model, packed, mask, tokens, lengths, offsets, batch, reduce, label)


def check_slime_top_p(model, packed, mask, tokens, lengths, offsets, batch, reduce, label) -> None:
    """Rollout top-p replay against slime's dense-mask computation as ``slime_top_p_rows`` rewrites it
    (on the stock ``model``): the log-probs over each response token's set and itself, the entropy over the
    whole vocabulary; the policy loss without an entropy term (the one slime setting it takes) and
    its entropy metric."""
    label = f"{label} top-p replay"
    spans = [
        slice(offset + prompt - 1, offset + length - 1)
        for offset, prompt, length in zip(offsets, PROMPTS, lengths, strict=False)
    ]
    responses = [sample[prompt:] for sample, prompt in zip(tokens, PROMPTS, strict=True)]
    ids, set_offsets = slime_top_p_sets(responses, harness.VOCAB_SHARD * harness.tp_size(), seed=31)
    args = slime_args(TEMPERATURE, "--fused-linear-logprob", "--fused-linear-logprob-token-chunk", "5")
    args.rollout_top_p, args.entropy_coef = 0.9, 0.0

    def oracle():
        logprob, entropy = slime_top_p_rows(model, packed, mask, TEMPERATURE, spans, ids, set_offsets)
        return torch.cat([logprob[0, span] for span in spans]), torch.cat([entropy[0, span] for span in spans])

    expected = oracle()
    whole = torch.cat([row[0, span] for span in spans for row in stock_rows(model, packed, mask, TEMPERATURE)[:1]])
    assert (expected[0] - whole).abs().max() > 0.1, label  # the sets matter
    grads = stock_grads(model, weighted(expected[:1], seed=30))
    inputs = policy_loss_inputs(expected[0].detach(), torch.ones(sum(RESPONSES)), torch.Generator().manual_seed(32))
    policy_expected = slime_policy_oracle(*oracle(), inputs, args, reduce)
    policy_grads = stock_grads(model, policy_expected)
    assert slime.wrap_slime_model([model], args).fused
    empty, found = slime.log_probs_and_entropy(
        run_model(model, packed, mask), args=args, unconcat_tokens=tokens, total_lengths=lengths,
        response_lengths=RESPONSES, with_entropy=True, top_p_token_ids=ids, top_p_token_offsets=set_offsets,
    )  # fmt: skip
    harness.assert_max_error(torch.cat(found["entropy"]), expected[1], VALUE_ATOL, label)
    check_values_and_grads(model, expected[:1], (torch.cat(found["log_probs"]),), grads, label)

    batch = dict(
        batch, rollout_top_p_token_ids=ids, rollout_top_p_token_offsets=set_offsets,
        **{key: list(inputs[name].split(RESPONSES)) for key, name in (
            ("log_probs", "old_logprob"), ("ref_log_probs", "ref_logprob"), ("advantages", "advantages"))},
    )  # fmt: skip
    loss, metrics = slime.policy_loss(args, batch, run_model(model, packed, mask), reduce)
    assert_loss_close(loss, policy_expected, label)
    assert abs(metrics["entropy_loss"].item() - reduce(expected[1].detach()).item()) <= VALUE_ATOL, label
    loss.backward()
    harness.assert_grads_close(harness.finalized_parameter_grads(model), policy_grads, GRAD_RTOL, label)
    args.entropy_coef = 0.01
    with pytest.raises(NotImplementedError, match="rollout-top-p"):
        slime.policy_loss(args, batch, run_model(model, packed, mask), reduce)
    # Every span empty (tool tokens): each token alone is kept, log-prob 0; a sample with a span
    # fewer than its response tokens would shift every later sample's sets: refused.
    lengths_of = dict(unconcat_tokens=tokens, total_lengths=lengths, response_lengths=RESPONSES)
    empty = (
        [torch.zeros(0, dtype=torch.int32) for _ in RESPONSES],
        [torch.zeros(r + 1, dtype=torch.int32) for r in RESPONSES],
    )
    _, found = slime.log_probs_and_entropy(
        run_model(model, packed, mask), args=args, **lengths_of, top_p_token_ids=empty[0], top_p_token_offsets=empty[1]
    )
    assert all(bool((piece == 0).all()) for piece in found["log_probs"]), label
    with pytest.raises(ValueError, match="one span per response token"):
        slime.log_probs_and_entropy(
            run_model(model, packed, mask), args=args, **lengths_of, top_p_token_ids=ids,
            top_p_token_offsets=[offsets[:-1] for offsets in set_offsets],
        )  # fmt: skip
    unwrap_model(model)


# -------------------------------------------------------------------------------------- NeMo-RL


# What prepare_loss_input reads of a LOGPROB loss (NeMo-RL's NLLLossFn): its input_type by name.
# tests/cpu/test_trainer_nemo_rl.py runs NeMo-RL's own classes.
NEMO_RL_LOGPROB_LOSS = SimpleNamespace(input_type=SimpleNamespace(name="LOGPROB"))


def check_nemo_rl(tied: bool) -> None:
    tokens = sample_tokens(seed=6)
    lengths = [sample.numel() for sample in tokens]
    width = 12  # NeMo-RL's right-padded rows, S even for sequence parallelism
    input_ids = torch.zeros(len(tokens), width, dtype=torch.long)
    for row, sample in enumerate(tokens):
        input_ids[row, : sample.numel()] = sample
    cu_seqlens_padded = padded_cu_seqlens(lengths)
    packed = pack(tokens, cu_seqlens_padded)
    mask = harness.packed_attention_mask(cu_seqlens_padded)
    model = harness.build_gpt(MODEL_SHAPE, sequence_parallel=True, tied=tied)
    policy_cfg = {**SETTINGS, "logprob_chunk_size": None, "megatron_cfg": {"use_fused_linear_logprobs": False}}
    token_mask = torch.zeros_like(input_ids, dtype=torch.float)
    for row, (prompt, length) in enumerate(zip(PROMPTS, lengths, strict=True)):
        token_mask[row, prompt:length] = 1.0
    data = {"input_ids": input_ids, "token_mask": token_mask, "sample_mask": torch.tensor([1.0, 1.0, 0.0])}
    global_valid_toks = torch.tensor(20.0)  # the tokens of the whole step, across micro-batches and ranks

    def packed_oracle():
        logprob, _ = stock_rows(model, packed, mask)
        unpacked = torch.zeros(len(tokens), width - 1, dtype=torch.float64)
        for row, (start, length) in enumerate(zip(cu_seqlens_padded.tolist(), lengths, strict=False)):
            unpacked[row, : length - 1] = logprob[0, start : start + length - 1]
        return unpacked

    expected = stock_rows(model, input_ids)[0][:, :-1]
    grads = stock_grads(model, weighted([expected], seed=30))
    packed_expected = packed_oracle()
    packed_grads = stock_grads(model, weighted([packed_expected], seed=31))
    nll_mask = (token_mask[:, 1:] * data["sample_mask"][:, None]).double()
    nll_expected = -(stock_rows(model, input_ids)[0][:, :-1] * nll_mask).sum() / (global_valid_toks + 1e-8)
    nll_grads = stock_grads(model, nll_expected)

    head = nemo_rl.wrap_policy_model(model, policy_cfg)
    assert head.fused and head.config.token_chunk == 5
    label = f"NeMo-RL tied={tied}"
    found, same_data = nemo_rl.prepare_loss_input(run_model(model, input_ids), data, NEMO_RL_LOGPROB_LOSS, head=head)
    assert same_data is data and found["next_token_logprobs"].shape == (len(tokens), width - 1), label
    check_values_and_grads(model, [expected], [found["next_token_logprobs"]], grads, f"{label} prepare_loss_input")

    actual = nemo_rl.packed_next_token_logprobs(
        head, run_model(model, packed, mask), packed, torch.tensor(lengths), cu_seqlens_padded, width
    )
    check_values_and_grads(model, [packed_expected], [actual], packed_grads, f"{label} packed", seed=31)

    # SequencePackingLossWrapper: prepare_fn on each sequence's slice of the packed output.
    hidden = run_model(model, packed, mask)
    slices = []
    for start, end, length in zip(
        cu_seqlens_padded[:-1].tolist(), cu_seqlens_padded[1:].tolist(), lengths, strict=True
    ):
        sequence = {"input_ids": packed[:, start : start + length]}
        found, _ = nemo_rl.prepare_loss_input(hidden[:, start:end], sequence, NEMO_RL_LOGPROB_LOSS, head=head)
        slices.append(torch.nn.functional.pad(found["next_token_logprobs"], (0, width - length)))
    check_values_and_grads(
        model, [packed_expected], [torch.cat(slices)], packed_grads, f"{label} per sequence", seed=31
    )

    loss, metrics = nemo_rl.nll_loss(head, run_model(model, input_ids), data, global_valid_toks)
    assert_loss_close(loss, nll_expected, f"{label} nll_loss")
    assert metrics["num_unmasked_tokens"] == nll_mask.sum().item() and metrics["num_valid_samples"] == 2
    loss.backward()
    harness.assert_grads_close(harness.finalized_parameter_grads(model), nll_grads, GRAD_RTOL, f"{label} nll_loss")

    with pytest.raises(ValueError, match="use_fused_linear_logprobs"):
        nemo_rl.wrap_policy_model(model, {**policy_cfg, "megatron_cfg": {"use_fused_linear_logprobs": True}})


def recipes_worker() -> None:
    harness.tensor_parallel(2)
    for check, tied in ((check_skyrl, False), (check_verl, True), (check_slime, False), (check_nemo_rl, True)):
        check(tied)


def test_every_recipe_matches_the_stock_model_in_its_trainers_layout():
    harness.spawn(recipes_worker, 2)


def test_skyrl_reads_its_trainer_section():
    config = FusedSkyRLTrainerSection(fused_linear_logprob=True)
    # SkyRL's logprobs_chunk_size (default 1024) sizes SkyRL's own logits loop: the head keeps its
    # own chunking (the Triton path's tuned one), unless the fused head's own key sets one.
    assert config.logprobs_chunk_size == 1024
    assert FusedLMConfig.from_trainer_config(config) == FusedLMConfig(enabled=True)
    assert FusedLMConfig.from_trainer_config(SimpleNamespace(trainer=config)) == FusedLMConfig(enabled=True)
    assert FusedLMConfig.from_trainer_config(FusedSkyRLTrainerSection()) == FusedLMConfig()
    tuned = FusedSkyRLTrainerSection(fused_linear_logprob=True, fused_linear_logprob_token_chunk=4096)
    assert FusedLMConfig.from_trainer_config(tuned) == FusedLMConfig(enabled=True, token_chunk=4096)
