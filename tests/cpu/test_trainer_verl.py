"""verl 0.9.1's own Megatron engine (``MegatronEngineWithLMHead.forward_backward_batch``, from PyPI)
with the verl recipe mixed in (``FusedLMHeadEngine``), against the same engine on the same model
unwrapped, on a real GPTModel: TP=2 with sequence parallelism and TP=1 (tied embeddings at TP=2),
packed (``use_remove_padding: true``, verl's THD layout) and padded (BSHD).

The path run is verl's: ``forward_backward_batch`` -> Megatron's no-pipelining schedule -> the
engine's ``forward_step`` -> ``gptmodel_forward_model_engine`` (``preprocess_thd_engine`` /
``preprocess_bshd_engine``, the model, ``_lm_head_logits_processor``, ``postprocess_*_engine``) ->
verl's loss. Its batches are verl's: a padded RL batch turned into verl's no-padding form by verl's
``left_right_2_no_padding``, one sampling temperature per sample (0.7 to 1.2; verl divides the logits
in its processor, the recipe's head takes the temperatures itself). Cases:

1. forward only (``compute_log_prob``: no loss, ``calculate_entropy``): the per-token log-probs and
   entropy, also against the float64 oracle of the stock model's logits;
2. training with verl's ``ppo_loss``: clipped policy loss, k3 KL to a reference, an entropy bonus;
   and with ``entropy_coeff: 0`` and ``calculate_entropy`` on (the entropy a metric: the recipe gives
   it no gradient, where it ran the entropy's backward for nothing);
3. verl's ``sft_loss``;
4. what the recipe refuses: ``use_fused_kernels``, options that need the logits.

The engine is not ``initialize``d (that loads a Hugging Face checkpoint through Megatron-Bridge and
builds an optimizer): an engine object gets the five attributes ``forward_backward_batch`` reads, and
verl's own model builder, ``_build_megatron_module``, is stood in for by one that returns the model
built here, which the recipe's override then wraps. verl asks CUDA for its device id on a CPU machine;
``get_device_id`` answers ``"cpu"``.

Both sides compute in float32 from one model (measured differences about 1e-6): values within 2e-5,
gradients within 5e-5 of the largest entry of the stock one, as in test_integration_parity; a
temperature applied twice or a label one position off is off by O(1).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from devkit import megatron_gpt as harness
from devkit.checkouts import installed_version
from devkit.cpu_attention import KernelStandIn

VERL_VERSION = "0.9.1"

pytestmark = pytest.mark.skipif(
    installed_version("verl") != VERL_VERSION,
    reason=f"verl {VERL_VERSION} is not installed (tests/run_cpu.sh installs it into the trainers' environment)",
)

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
VOCAB = harness.VOCAB_SHARD
PROMPTS, RESPONSES = [5, 3, 7, 4], [6, 2, 4, 5]
TEMPERATURES = [0.8, 1.0, 0.7, 1.2]
SETTINGS = {
    "fused_linear_logprob": True,
    "fused_linear_logprob_backend": "torch",
    "fused_linear_logprob_token_chunk": 5,
}


def engine_classes():
    """verl's engine and the engine with the recipe mixed in first, as docs/trainers/verl.md declares it."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from megatron_fused_lm.recipes import verl

    class FusedEngine(verl.FusedLMHeadEngine, MegatronEngineWithLMHead):
        pass

    return MegatronEngineWithLMHead, FusedEngine


def engine_config(thd: bool, **settings):
    """verl's ``McoreEngineConfig`` with the recipe's keys (a subclass, as the page declares it)."""
    from dataclasses import dataclass

    from verl.workers.config import McoreEngineConfig

    from megatron_fused_lm.recipes import verl

    @dataclass
    class FusedMcoreEngineConfig(McoreEngineConfig, verl.FusedLMSettings):
        pass

    return FusedMcoreEngineConfig(
        use_remove_padding=thd, dtype="bfloat16", use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
        sequence_parallel=harness.tp_size() > 1, tensor_model_parallel_size=harness.tp_size(), **settings,
    )  # fmt: skip


def make_engine(engine_class, model, thd: bool, **settings):
    """An engine object with what ``forward_backward_batch`` reads; the model built through
    ``_build_megatron_module`` (verl's builder stood in for: module docstring)."""
    engine = engine_class.__new__(engine_class)
    engine.engine_config = engine_config(thd, **settings)
    engine.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),  # picks verl's GPT forward
        mtp=SimpleNamespace(enable=False, enable_train=False),
        tokenizer=SimpleNamespace(pad_token_id=0),
    )
    engine.tf_config = model.module.config
    engine.enable_routing_replay = False
    engine.module = engine._build_megatron_module()
    assert getattr(engine, "fused_head", None) is None or engine.fused_head.fused, engine.fused_head.fallback_reason
    return engine


def rl_batch(seed: int):
    """verl's padded RL batch (left-padded prompts, right-padded responses) in its no-padding form,
    by its own ``left_right_2_no_padding``; the samples' tokens for the oracle."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    generator = torch.Generator().manual_seed(seed)
    batch, prompt_width, response_width = len(PROMPTS), max(PROMPTS), max(RESPONSES)
    prompts = torch.zeros(batch, prompt_width, dtype=torch.long)
    responses = torch.zeros(batch, response_width, dtype=torch.long)
    attention_mask = torch.zeros(batch, prompt_width + response_width, dtype=torch.long)
    samples = []
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        tokens = torch.randint(1, VOCAB * harness.tp_size(), (prompt + response,), generator=generator)
        prompts[row, prompt_width - prompt :] = tokens[:prompt]
        responses[row, :response] = tokens[prompt:]
        attention_mask[row, prompt_width - prompt : prompt_width + response] = 1
        samples.append(tokens)
    data = TensorDict(
        {
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": attention_mask[:, prompt_width:].clone(), "temperature": torch.tensor(TEMPERATURES),
        },
        batch_size=[batch],
    )  # fmt: skip
    return left_right_2_no_padding(data), samples


def assign(data, **values):
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, **values)
    return data


def oracle_rows(model, samples):
    """Float64 log-probs of each sample's next tokens and its entropies (its last position's left
    out: nothing follows it), from the stock model's logits."""
    return [
        harness.sample_logprob_entropy(model, tokens, temperature)
        for tokens, temperature in zip(samples, TEMPERATURES, strict=True)
    ]


def actor_config(**overrides):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    values = dict(
        strategy="megatron", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1, use_kl_loss=True,
        kl_loss_type="low_var_kl", kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio_low=0.2, clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )  # fmt: skip
    values.update(overrides)
    return ActorConfig(**values)


def training_batch(seed: int, current):
    data, samples = rl_batch(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    mask = data["response_mask"].float()
    start = [prompt - 1 for prompt in PROMPTS]
    on_policy = torch.zeros(mask.shape)
    for row, (logprob, _) in enumerate(current):
        on_policy[row, : RESPONSES[row]] = logprob[start[row] : start[row] + RESPONSES[row]].float()
    data["old_log_probs"] = (on_policy + 0.3 * torch.randn(mask.shape, generator=generator)) * mask
    data["ref_log_prob"] = (on_policy + 0.3 * torch.randn(mask.shape, generator=generator)) * mask
    data["advantages"] = torch.randn(mask.shape, generator=generator) * mask
    return data, samples


def sft_batch(seed: int):
    from tensordict import TensorDict

    generator = torch.Generator().manual_seed(seed)
    lengths, prompts = [7, 5, 9, 6], [3, 2, 4, 3]
    tokens = [torch.randint(1, VOCAB * harness.tp_size(), (n,), generator=generator) for n in lengths]
    masks = [(torch.arange(n) >= p).long() for n, p in zip(lengths, prompts, strict=True)]
    data = TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor(tokens, layout=torch.jagged),
            "loss_mask": torch.nested.as_nested_tensor(masks, layout=torch.jagged),
            "position_ids": torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged),
        },
        batch_size=[len(tokens)],
    )
    return assign(data, temperature=1.0, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, global_batch_size=4)


def cases(model, thd: bool, current):
    """``(name, run(engine_class) -> results)`` for each case of the module docstring."""
    from verl.workers.utils.losses import ppo_loss, sft_loss

    def forward_only(engine_class):
        data, _ = rl_batch(21)
        assign(data, calculate_entropy=True, compute_loss=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
        engine = make_engine(engine_class, model, thd, **SETTINGS)
        with torch.no_grad():
            output = engine.forward_backward_batch(data, loss_function=None, forward_only=True)["model_output"]
        return {name: output[name] for name in ("log_probs", "entropy")}

    def train(engine_class, **overrides):
        data, _ = training_batch(22, current)
        assign(data, calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, global_batch_size=4,
               mini_batch_size=4)  # fmt: skip
        engine = make_engine(engine_class, model, thd, **SETTINGS)
        output = engine.forward_backward_batch(data, loss_function=partial(ppo_loss, config=actor_config(**overrides)))
        return {"loss": torch.as_tensor(output["loss"]), "grads": harness.parameter_grads(model)}

    def sft(engine_class):
        engine = make_engine(engine_class, model, thd, **SETTINGS)
        loss_fn = partial(sft_loss, actor_config())
        output = engine.forward_backward_batch(sft_batch(23), loss_function=lambda **kw: loss_fn(**kw))
        return {"loss": torch.as_tensor(output["loss"]), "grads": harness.parameter_grads(model)}

    return [
        ("forward only", forward_only),
        ("ppo_loss", train),
        ("ppo_loss entropy a metric", partial(train, entropy_coeff=0.0)),
        ("sft_loss", sft),
    ]


def check_verl(sequence_parallel: bool, tied: bool, label: str) -> None:
    from megatron_fused_lm import unwrap_model
    from megatron_fused_lm.recipes import verl

    gpt = harness.build_gpt(vocab_size=VOCAB * harness.tp_size(), sequence_parallel=sequence_parallel, tied=tied)
    model = KernelStandIn(gpt)
    stock_class, fused_class = engine_classes()
    # verl's builder, stood in for: the model built above (module docstring).
    stock_class._build_megatron_module = lambda self: [model]
    _, samples = rl_batch(21)
    oracle = oracle_rows(gpt, samples)
    for thd in (True, False):
        for name, run in cases(model, thd, oracle):
            where = f"{label} {'THD' if thd else 'BSHD'} {name}"
            stock = run(stock_class)
            ours = run(fused_class)
            for key, expected in stock.items():
                if key == "grads":
                    harness.assert_grads_close(ours[key], expected, GRAD_RTOL, where)
                elif expected.is_nested:
                    for got, want in zip(ours[key].unbind(), expected.unbind(), strict=True):
                        harness.assert_max_error(got[:-1], want[:-1], VALUE_ATOL, f"{where} {key}")  # no next token
                else:
                    harness.assert_max_error(
                        ours[key], expected, VALUE_ATOL * max(1.0, float(expected.abs().max())), where
                    )
            if name == "forward only":
                # The oracle runs each sample alone through the stock model; a packed (THD) forward's
                # own float32 differences reach the logits too, so the bound is also 1.5x the stock
                # path's own error on the same forward.
                for key, outputs in (("log_probs", 0), ("entropy", 1)):
                    for got, baseline, want in zip(ours[key].unbind(), stock[key].unbind(), oracle, strict=True):
                        stock_error = float((baseline[:-1].double() - want[outputs]).abs().max())
                        bound = max(VALUE_ATOL, 1.5 * stock_error)
                        harness.assert_max_error(got[:-1], want[outputs], bound, f"{where} {key} vs float64")
            unwrap_model(model)
    from verl.workers.utils.losses import ppo_loss

    # verl's own loss, as its worker binds it: the entropy a loss term unless its coefficient is 0,
    # where the processor gives it no gradient (the log-probs keep theirs).
    engine = make_engine(fused_class, model, True, **SETTINGS)
    data, _ = rl_batch(24)
    output = model(data["input_ids"].values()[None], None, None)  # one packed row; any rows will do
    label, temperature = data["input_ids"].values()[None], torch.ones(1, output.shape[1])
    for coefficient, entropy_grad in ((0.0, False), (0.01, True)):
        loss = partial(ppo_loss, config=actor_config(entropy_coeff=coefficient))
        found = engine._lm_head_logits_processor(
            output, label, temperature, calculate_entropy=True, logits_processor_func=loss
        )  # fmt: skip
        assert found["entropy"].requires_grad == entropy_grad and found["log_probs"].requires_grad, coefficient
    assert verl.entropy_is_a_loss_term(None)
    for option in verl.LOGITS_ONLY_OPTIONS:
        with pytest.raises(NotImplementedError, match=option):
            engine._lm_head_logits_processor(
                torch.zeros(1, 2, harness.HIDDEN), torch.zeros(1, 2, dtype=torch.long),
                torch.ones(1, 2), calculate_entropy=False, **{option: True},
            )  # fmt: skip
    unwrap_model(model)
    with pytest.raises(ValueError, match="use_fused_kernels"):
        make_engine(fused_class, model, True, use_fused_kernels=True, **SETTINGS)
    unwrap_model(model)


def verl_worker() -> None:
    from verl.workers.engine.megatron import transformer_impl

    transformer_impl.get_device_id = lambda: "cpu"  # verl's platform asks CUDA on a CPU machine
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        if sequence_parallel or harness.tp_size() == 1:  # verl runs TP > 1 with sequence parallelism
            check_verl(sequence_parallel, tied, label)


def test_verl_own_megatron_engine_with_the_recipe_matches_it_on_the_stock_model():
    harness.spawn(verl_worker, 2)
