"""SkyRL 0.4.0's own Megatron code (``MegatronModelWrapper.forward`` and ``forward_backward_mini_batch``,
from PyPI) with the SkyRL recipe in place (``wrap_actor_module`` and ``install_fused_heads``), against the
same code on the same model unwrapped, on a real GPTModel: TP=2 with sequence parallelism (SkyRL turns
it on whenever TP > 1) and TP=1, tied embeddings at TP=2.

Every micro-batch is laid out by SkyRL's own code: RL rows by ``convert_prompts_responses_to_batch_tensors``
(each row one left-padded prompt-and-response block, the response-level tensors right-aligned, short
rows whose whole block lies in the action window included), unpacked (``remove_microbatch_padding:
false``: SkyRL's ``remove_left_padding`` / ``recover_left_padding``) and packed (``preprocess_packed_seqs``
in the wrapper); SFT rows as SkyRL's SFT collators lay them out, one row of several sequences with
``sub_seq_lengths`` included. Sampling temperatures 0.7 and 1.0 (SkyRL divides the model's output in
place; the fused cores must not divide again). Cases:

1. ``forward`` (the old / reference log-prob pass, under ``no_grad`` as SkyRL's worker runs it):
   the ``[B, A]`` log-probs, also against the float64 oracle of the stock model's logits;
2. ``forward_backward_mini_batch`` with SkyRL's ``regular`` policy loss, its k3 KL term and an entropy
   loss term (with gradient), and ``dual_clip`` without them: each micro-batch's metrics and every
   parameter's gradient;
3. SFT (``loss_fn="cross_entropy"``), rows and one packed row of several sequences;
4. sample-support replay (``enable_sample_support_replay``): the recorded supports as the kept-token
   sets, forward and with the entropy loss term;
5. the recipe's refusals: SkyRL's own fused path on as well, a model with MTP heads.

Both sides compute in float32 from one model; they differ by summation order only (measured: about
1e-6), so values must agree to 2e-5 and gradients to 5e-5 of the largest entry of the stock one (as
in test_integration_parity); the log-probs to 2e-5 of the float64 oracle. A row read one position
off, a temperature applied twice or a support set misplaced is off by O(1). The metrics are SkyRL's
floats (its losses already reduced), compared to 2e-5 relative to their size.
"""

# No `from __future__ import annotations`: SkyRL finds a config's nested sections from its fields'
# types, which that import would turn into strings (docs/trainers/skyrl.md).
import pytest
import torch

from devkit import megatron_gpt as harness
from devkit.checkouts import installed_version
from devkit.cpu_attention import KernelStandIn
from devkit.skyrl_release import SKYRL_VERSION, skyrl_module
from megatron_fused_lm import FusedLMConfig, unwrap_model

pytestmark = pytest.mark.skipif(
    installed_version("skyrl") != SKYRL_VERSION,
    reason=f"SkyRL {SKYRL_VERSION} is not installed (tests/run_cpu.sh installs it into the trainers' environment)",
)

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
METRIC_RTOL = 2e-5
VOCAB = harness.VOCAB_SHARD
PROMPTS, RESPONSES = [5, 3, 7, 2], [6, 2, 4, 7]  # row 3's whole block lies in the action window
SETTINGS = {
    "fused_linear_logprob": True,
    "fused_linear_logprob_backend": "torch",
    "fused_linear_logprob_token_chunk": 5,
}


def trainer_config(packed: bool, **algorithm):
    """SkyRL's ``TrainerConfig`` with the recipe's keys (a subclass, as the page declares it)."""
    from dataclasses import dataclass

    from megatron_fused_lm.recipes import skyrl

    config_module = skyrl_module("train.config")

    @dataclass
    class FusedTrainerConfig(config_module.TrainerConfig, skyrl.FusedLMSettings):
        pass

    config = FusedTrainerConfig(**SETTINGS)
    config.strategy = "megatron"
    config.remove_microbatch_padding = packed
    config.logprobs_chunk_size = 4  # SkyRL's chunked logits path on the stock side
    for key, value in algorithm.items():
        setattr(config.algorithm, key, value)
    return config


def rl_rows(seed: int, supports: bool = False):
    """SkyRL's RL micro-batch tensors for ``PROMPTS`` / ``RESPONSES``, by its own preprocessing; with
    ``supports``, a recorded sampler support per response token (the sampled token, four others, a
    padding ``-1``), as SkyRL's rollouts record them."""
    import numpy as np

    preprocess = skyrl_module("train.dataset.preprocess")
    generator = torch.Generator().manual_seed(seed)
    prompts, responses, support = [], [], []
    for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
        tokens = torch.randint(0, VOCAB * harness.tp_size(), (prompt + response,), generator=generator).tolist()
        prompts.append(tokens[:prompt])
        responses.append(tokens[prompt:])
        rows = []
        for token in tokens[prompt:]:
            others = [other for other in torch.randperm(VOCAB, generator=generator).tolist() if other != token][:4]
            rows.append([token, *others, -1])
        support.append(np.asarray(rows, dtype=np.int32))
    sequences, attention_mask, response_mask, _, loss_mask, _, _, packed_support = (
        preprocess.convert_prompts_responses_to_batch_tensors(
            0, prompts, responses, [[0.0] * len(r) for r in responses], [[1] * len(r) for r in responses],
            rollout_sample_support=support if supports else None,
        )
    )  # fmt: skip
    return dict(
        sequences=sequences, attention_mask=attention_mask, response_mask=response_mask, loss_mask=loss_mask.float(),
        num_actions=loss_mask.shape[1], support=packed_support, tokens=[torch.tensor(p + r) for p, r in zip(prompts, responses, strict=True)],
    )  # fmt: skip


def micro_batches(rows, slices, **per_row):
    """The micro-batch dicts SkyRL's worker hands the wrapper (``megatron_worker``), one per slice of
    rows; ``per_row`` tensors ``[B, ...]`` are sliced alike."""
    batches = []
    for part in slices:
        mask = rows["attention_mask"][part]
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0) * mask
        batch = {
            "sequences": rows["sequences"][part], "attention_mask": mask, "position_ids": positions,
            "num_actions": rows["num_actions"], "rollout_expert_indices": None, "router_padding_mask": None,
            "rollout_sample_support": None, "sub_seq_lengths": None, "loss_mask": rows["loss_mask"][part],
            "response_mask": rows["response_mask"][part], "num_microbatches": len(slices),
            "num_real_microbatches": len(slices),
        }  # fmt: skip
        batch.update({name: None if value is None else value[part] for name, value in per_row.items()})
        batches.append(batch)
    return batches


def oracle_action_logprobs(model, rows, temperature: float) -> torch.Tensor:
    """Float64 ``[B, A]`` log-probs of each row's last ``A`` tokens from the stock model's logits of the
    row's own tokens (0 where a slot holds no token with one before it)."""
    actions = rows["num_actions"]
    expected = torch.zeros(len(rows["tokens"]), actions, dtype=torch.float64)
    for row, tokens in enumerate(rows["tokens"]):
        logprob, _ = harness.sample_logprob_entropy(model, tokens, temperature)
        scored = min(actions, tokens.shape[0] - 1)
        expected[row, actions - scored :] = logprob[-scored:]
    return expected


def run(wrapper, model, batches, temperature, **options):
    """``forward_backward_mini_batch`` over ``batches``: SkyRL's metrics and every parameter's gradient."""
    metrics = wrapper.forward_backward_mini_batch(
        batches, seq_len=batches[0]["sequences"].shape[1], micro_batch_size=batches[0]["sequences"].shape[0],
        temperature=temperature, **options,
    )  # fmt: skip
    return metrics, harness.parameter_grads(model)


def results(run_output) -> dict:
    metrics, grads = run_output
    return {"metrics": metrics, "grads": grads}


def compare_metrics(ours, theirs, label):
    for mine, stock in zip(ours, theirs, strict=True):
        for name, value in stock.items():
            if isinstance(value, float):
                assert abs(mine[name] - value) <= METRIC_RTOL * max(1.0, abs(value)), f"{label}: {name}"
            elif name == "loss_fn_outputs":  # per-sequence log-probs for Tinker's consumers
                for got, want in zip(mine[name], value, strict=True):
                    torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"]),
                                               rtol=0, atol=VALUE_ATOL, msg=f"{label}: loss_fn_outputs")  # fmt: skip


def skyrl_cases(model, packed: bool, label: str):
    """Each case of the module docstring as ``(name, run(wrapper) -> results)``, run once on the stock
    model and once with the recipe; ``results`` a dict of tensors and SkyRL's metric dicts."""
    wrapper_module = skyrl_module("backends.skyrl_train.workers.megatron.megatron_model_wrapper")
    ppo_utils = skyrl_module("backends.skyrl_train.utils.ppo_utils")
    training_batch = skyrl_module("backends.skyrl_train.training_batch")

    def wrapper_for(**algorithm):
        config = trainer_config(packed, **algorithm)
        loss = ppo_utils.PolicyLossRegistry.get(config.algorithm.policy_loss_type)
        return wrapper_module.MegatronModelWrapper(config, [model], policy_loss_fn=loss)

    rows = rl_rows(seed=11)
    slices = [[0, 1], [2, 3]]
    loss_mask = rows["loss_mask"]
    generator = torch.Generator().manual_seed(5)
    current = oracle_action_logprobs(model.module, rows, 1.0).float()
    old = (current + 0.3 * torch.randn(current.shape, generator=generator)) * loss_mask
    base = (current + 0.3 * torch.randn(current.shape, generator=generator)) * loss_mask
    advantages = torch.randn(current.shape, generator=generator) * loss_mask / loss_mask.sum()  # token mean
    rl = dict(old_action_log_probs=old, base_action_log_probs=base, advantages=advantages, rollout_action_logprobs=None)
    cases = []
    for temperature in (0.7, 1.0):

        def log_probs(temperature=temperature):
            wrapper = wrapper_for()
            wrapper.eval()
            with torch.no_grad():  # as SkyRL's worker runs its log-prob pass
                values = wrapper.forward(micro_batches(rows, slices), rows["sequences"].shape[1], 2, temperature)
            return {"log_probs": values}

        def regular(temperature=temperature):
            wrapper = wrapper_for(use_kl_loss=True, kl_loss_coef=0.1, kl_estimator_type="k3", use_entropy_loss=True,
                                  entropy_loss_coef=0.01, eps_clip_low=0.2, eps_clip_high=0.28)  # fmt: skip
            return results(run(wrapper, model, micro_batches(rows, slices, **rl), temperature))

        cases += [(f"forward T={temperature}", log_probs), (f"regular+kl+entropy T={temperature}", regular)]

    def dual_clip():
        wrapper = wrapper_for(policy_loss_type="dual_clip", clip_ratio_c=1.05, use_kl_loss=False)
        return results(run(wrapper, model, micro_batches(rows, slices, **rl), 0.7))

    def sft():
        wrapper = wrapper_for(use_kl_loss=False)
        sft_mask = loss_mask / loss_mask.sum()  # SkyRL's SFT collator pre-scales the mask
        batches = micro_batches({**rows, "loss_mask": sft_mask}, slices, **{k: None for k in rl})
        return results(run(wrapper, model, batches, 1.0, loss_fn="cross_entropy"))

    supported = rl_rows(seed=12, supports=True)
    support_slices = [[0, 1, 2, 3]]

    def support_batches(**per_row):
        batches = micro_batches(supported, support_slices, **per_row)
        batches[0]["rollout_sample_support"] = supported["support"]
        return batches

    def support_forward():
        wrapper = wrapper_for(enable_sample_support_replay=True)
        wrapper.eval()
        with torch.no_grad():
            values = wrapper.forward(support_batches(), supported["sequences"].shape[1], 4, 0.7)
        return {"log_probs": values}

    def support_loss():
        wrapper = wrapper_for(enable_sample_support_replay=True, use_kl_loss=False, use_entropy_loss=True,
                              entropy_loss_coef=0.05)  # fmt: skip
        mask = supported["loss_mask"]
        per_row = dict(old_action_log_probs=torch.zeros_like(mask), base_action_log_probs=None,
                       advantages=torch.linspace(-1, 1, mask.numel()).view(mask.shape) * mask / mask.sum(),
                       rollout_action_logprobs=None)  # fmt: skip
        return results(run(wrapper, model, support_batches(**per_row), 0.7))

    cases += [
        ("dual_clip", dual_clip),
        ("sft", sft),
        ("support forward", support_forward),
        ("support loss", support_loss),
    ]
    if packed:
        cases.append(
            (
                "sft sequence packing",
                lambda: sft_sequence_packing(wrapper_for(use_kl_loss=False), model, training_batch),
            )
        )
    return cases, rows


def sft_sequence_packing(wrapper, model, training_batch):
    """One row of three sequences, as SkyRL's SFT packing collator lays it out: each sequence at an
    offset rounded up to the packed alignment (the tensor-parallel size), ``loss_mask [1, L - 1]``
    marking each response token's scoring column, ``sub_seq_lengths`` the sequences' lengths."""
    lengths, prompts, align = [7, 5, 9], [3, 2, 4], harness.tp_size()
    generator = torch.Generator().manual_seed(17)
    starts = torch.tensor([0, *[-(-n // align) * align for n in lengths]]).cumsum(0)
    width = int(starts[-1])
    sequences = torch.zeros(1, width, dtype=torch.long)
    attention_mask = torch.zeros(1, width, dtype=torch.long)
    loss_mask = torch.zeros(1, width - 1)
    for start, length, prompt in zip(starts.tolist(), lengths, prompts, strict=False):
        sequences[0, start : start + length] = torch.randint(
            0, VOCAB * harness.tp_size(), (length,), generator=generator
        )
        attention_mask[0, start : start + length] = 1
        loss_mask[0, start + prompt - 1 : start + length - 1] = 1
    loss_mask = loss_mask / loss_mask.sum()
    positions = torch.cat([torch.arange(n) for n in lengths]).new_zeros(1, width)
    for start, length in zip(starts.tolist(), lengths, strict=False):
        positions[0, start : start + length] = torch.arange(length)
    batch = {
        "sequences": sequences, "attention_mask": attention_mask, "position_ids": positions, "num_actions": width - 1,
        "rollout_expert_indices": None, "router_padding_mask": None, "rollout_sample_support": None,
        "sub_seq_lengths": training_batch.TensorList([torch.tensor(lengths)]), "loss_mask": loss_mask,
        "response_mask": None, "num_microbatches": 1, "num_real_microbatches": 1, "old_action_log_probs": None,
        "base_action_log_probs": None, "advantages": None, "rollout_action_logprobs": None,
    }  # fmt: skip
    return results(run(wrapper, model, [batch], 1.0, loss_fn="cross_entropy"))


def check_skyrl(sequence_parallel: bool, tied: bool, label: str) -> None:
    from megatron_fused_lm.recipes import skyrl

    model = KernelStandIn(harness.build_gpt(vocab_size=VOCAB * harness.tp_size(), sequence_parallel=sequence_parallel,
                                            tied=tied))  # fmt: skip
    for packed in (False, True):
        cases, rows = skyrl_cases(model, packed, label)
        stock = {name: case() for name, case in cases}
        oracles = {temperature: oracle_action_logprobs(model.module, rows, temperature) for temperature in (0.7, 1.0)}
        head = skyrl.wrap_actor_module([model], trainer_config(packed))
        assert head.fused, f"{label}: {head.fallback_reason}"
        for name, case in cases:
            where = f"{label} packed={packed} {name}"
            ours = case()
            if "log_probs" in ours:
                masked = rows["loss_mask"] if "support" not in name else torch.ones_like(ours["log_probs"])
                harness.assert_max_error(
                    ours["log_probs"] * masked, stock[name]["log_probs"] * masked, VALUE_ATOL, where
                )
                if name.startswith("forward"):
                    oracle = oracles[float(name.split("=")[1])]
                    harness.assert_max_error(ours["log_probs"] * rows["loss_mask"], oracle * rows["loss_mask"],
                                             VALUE_ATOL, f"{where} vs float64")  # fmt: skip
            else:
                compare_metrics(ours["metrics"], stock[name]["metrics"], where)
                harness.assert_grads_close(ours["grads"], stock[name]["grads"], GRAD_RTOL, where)
        unwrap_model(model)


def check_refusals() -> None:
    from megatron_fused_lm.recipes import skyrl

    model = KernelStandIn(harness.build_gpt(vocab_size=VOCAB * harness.tp_size()))
    config = trainer_config(packed=True)
    config.fused_lm_head_logprob = True
    with pytest.raises(ValueError, match="not both"):
        skyrl.wrap_actor_module([model], config)
    mtp = harness.build_gpt(vocab_size=VOCAB * harness.tp_size(), mtp_num_layers=1)
    with pytest.raises(ValueError, match="multi-token-prediction heads"):
        skyrl.wrap_actor_module([mtp], trainer_config(packed=True))
    assert "forward" not in vars(mtp.output_layer), "the refused model stays wrapped"
    assert FusedLMConfig.from_trainer_config(trainer_config(packed=True)).enabled


def skyrl_worker() -> None:
    import torch._dynamo

    from megatron_fused_lm.recipes import skyrl

    torch._dynamo.config.disable = True  # SkyRL compiles a two-line product-sum: run it eagerly
    skyrl_module("backends.skyrl_train.workers.megatron.megatron_model_wrapper")  # with the stand-ins first
    skyrl.install_fused_heads()
    skyrl.install_fused_heads()  # a second install changes nothing
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        if sequence_parallel or harness.tp_size() == 1:  # SkyRL runs TP > 1 with sequence parallelism
            check_skyrl(sequence_parallel, tied, label)
    check_refusals()


def test_skyrl_own_megatron_code_with_the_recipe_matches_it_on_the_stock_model():
    harness.spawn(skyrl_worker, 2)


def test_the_settings_reach_skyrls_workers_from_its_rl_and_sft_configs(caplog):
    """The page's configs, on SkyRL's own classes: the RL config parsed from the command line as
    SkyRL's entrypoint parses it, and SFT's config built by SkyRL's ``build_skyrl_config_for_sft``
    with the trainer section put in the subclass; each reads as the fused head on, with no warning
    (SkyRL's own ``fused_lm_head_logprob`` keys are not taken for misspellings)."""
    import logging
    from dataclasses import dataclass, field, fields

    from megatron_fused_lm.recipes import skyrl

    config_module = skyrl_module("train.config")
    sft_module = skyrl_module("train.config.sft_config")

    @dataclass
    class FusedTrainerConfig(config_module.TrainerConfig, skyrl.FusedLMSettings):
        pass

    @dataclass
    class FusedSkyRLTrainConfig(config_module.SkyRLTrainConfig):
        trainer: FusedTrainerConfig = field(default_factory=FusedTrainerConfig)

    expected = FusedLMConfig(enabled=True, backend="auto")
    with caplog.at_level(logging.WARNING, logger="megatron_fused_lm"):
        rl = FusedSkyRLTrainConfig.from_cli_overrides(
            ["trainer.fused_linear_logprob=true", "trainer.fused_linear_logprob_backend=auto"]
        )
        assert FusedLMConfig.from_trainer_config(rl.trainer) == expected
        skyrl_cfg = sft_module.build_skyrl_config_for_sft(sft_module.SFTConfig(strategy="megatron"))
        inherited = {item.name: getattr(skyrl_cfg.trainer, item.name) for item in fields(config_module.TrainerConfig)}
        skyrl_cfg.trainer = FusedTrainerConfig(
            **inherited, fused_linear_logprob=True, fused_linear_logprob_backend="auto"
        )
        assert FusedLMConfig.from_trainer_config(skyrl_cfg.trainer) == expected
    assert not [record.getMessage() for record in caplog.records if record.name == "megatron_fused_lm"]
