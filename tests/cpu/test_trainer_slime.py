"""The slime recipe (``megatron_fused_lm/recipes/slime.py``) against slime's own code, imported from the
source checkout ``SLIME_SOURCE`` names (``devkit.slime_source``; skipped when unset):

    SLIME_SOURCE=/path/to/slime python -m pytest tests/cpu/test_trainer_slime.py

On a real GPTModel, TP=2 with sequence parallelism on two gloo ranks, then TP=1, one micro-batch of
four samples packed by slime's own ``get_batch`` (end to end, the concatenation padded at the end),
each case runs slime's own ``loss_function`` (``slime.backends.megatron_utils.loss``) three ways:

1. stock: slime's own ``policy_loss_function`` / ``sft_loss_function`` / ``get_log_probs_and_entropy``
   on the unwrapped model's logits shard;
2. fused: the wrapped model's hidden states, with those three functions of slime's routed to the
   recipe exactly as docs/trainers/slime.md tells users (each first calls the recipe when the head is
   fused). Patching the module attributes here stands for the user's edit of the functions' bodies:
   ``loss_function`` looks them up in its module at each call, as it would find the edited ones
   (``actor.py`` imports ``get_log_probs_and_entropy`` by name, hence the page's edit of the body;
   the log-prob pass here calls the module's);
3. oracle: slime's own functions with ``get_log_probs_and_entropy`` replaced by float64 log-probs and
   entropy of the stock logits (``devkit``'s oracle), placed per sample by the explicit loops below:
   slime's own formulas on exact log-probs.

Compared, fused against stock and against the oracle: the scaled loss and its normalizer, slime's
metrics (their names, in slime's order, and values) and every parameter's gradient; for the
log-prob pass (``get_log_probs_and_entropy`` as ``compute_log_prob`` calls it), the per-sample
log-probs and entropy and the gradients of a weighted sum of them. The cases: ``--loss-type
policy_loss`` with the old log-probs present (slime ran its log-prob pass) and absent (slime's
``can_reuse_log_probs_in_loss``: the on-policy step, with slime's debug capture of the log-probs),
``sft_loss``, at rollout temperatures 0.7 and 1.0, KL (k1, k2, k3) and entropy terms on and off, per-
rollout denominators (``rollout_mask_sums``), ``--calculate-per-token-loss``, rollout top-p replay,
``--recompute-loss-function``, and ``--loss-type custom_loss`` with the recipe's functions by path.
slime's ``compute_policy_loss`` and ``compute_approx_kl`` are ``torch.compile``'d: they run eagerly
here (``torch._dynamo.config.disable``), the same arithmetic without a C++ compiler.

The local attention spec has no THD kernel: the packed micro-batch runs as one row with each sample's
causal mask (``packed_attention_mask`` over slime's ``cu_seqlens``); the head sees the ``[1, T, h]``
rows a THD forward gives it either way. The refusals run through slime's ``loss_function`` too.

``test_the_wrapped_model_on_slime_s_pinned_megatron`` (skipped unless ``SLIME_MEGATRON_SOURCE`` names
slime's pinned Megatron-LM, dev ``1dcf0da`` with slime's ``docker/patch/latest/megatron*.patch``
applied; run in a fresh process with that tree first on ``PYTHONPATH``), at TP=2 with sequence
parallelism and TP=1: GPTModel's ``LinearCrossEntropyModule`` labels path
(``output_cross_entropy_loss=True`` under ``cross_entropy_loss_fusion=True,
cross_entropy_fusion_impl="linear"``) against a float64 oracle, and MTP training as slime calls it
(``labels=None, mtp_kwargs={"mtp_labels": tokens}``) against the stock model and a float64 oracle:
the MTP loss Megatron logs and every parameter's gradient.

The largest differences measured are printed by rank 0 (``-s``).
"""

import contextlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List
from unittest import mock

import pytest
import torch

from devkit import megatron_gpt as harness
from devkit.oracle import logprob_entropy, policy_loss_inputs
from devkit.rollouts import MODEL_SHAPE, run_model, slime_args, slime_top_p_sets
from devkit.slime_source import MEGATRON_VARIABLE, SOURCE_VARIABLE, import_slime, megatron_checkout, source_checkout
from megatron_fused_lm import unwrap_model
from megatron_fused_lm.recipes import slime as recipe

# Values (log-probs, losses and metrics relative to max(1, |value|)): float32 summation order gives
# about 1e-6; a temperature taken twice (0.7 vs 0.49) or a row one position off moves them by O(1).
VALUE_ATOL = 2e-5
# Gradients, relative to the largest entry of the reference's: the same float32 rounding; a
# sequence-parallel gradient reduced twice or a token weighted by the wrong denominator is off by
# tens of percent.
GRAD_RTOL = 5e-5
TEMPERATURES = (0.7, 1.0)
# Four samples (prompt + response), 29 tokens: slime pads the concatenation to a multiple of
# TP x DATA_PAD (32 at TP=1 and 2), so the last rows are padding. Sample 3's response is one token.
TOTALS, RESPONSES = [9, 6, 9, 5], [4, 2, 5, 1]
DATA_PAD = 16  # slime's --data-pad-size-multiplier (default 128): 16 keeps the micro-batch small
NUM_MICROBATCHES, STEP_GLOBAL_BATCH_SIZE = 1, len(TOTALS)

SOURCE, MEGATRON = source_checkout(), megatron_checkout()
needs_source = pytest.mark.skipif(
    SOURCE is None,
    reason=f"{SOURCE_VARIABLE} is unset: set it to a slime source checkout (the directory holding slime/)",
)
needs_megatron = pytest.mark.skipif(
    MEGATRON is None,
    reason=f"{MEGATRON_VARIABLE} is unset: set it to slime's pinned Megatron-LM with slime's patches applied",
)


def routed(loss_module):
    """slime's three functions routed to the recipe as docs/trainers/slime.md shows the edit: each
    calls the recipe first when this process's head is fused, else runs slime's own code. Patched
    into slime's module for the duration (standing for the user's edit of slime's source)."""
    own_log_probs = loss_module.get_log_probs_and_entropy
    own_policy, own_sft = loss_module.policy_loss_function, loss_module.sft_loss_function

    def get_log_probs_and_entropy(logits, **kwargs):
        if recipe.fused_head() is not None:
            return recipe.log_probs_and_entropy(logits, **kwargs)
        return own_log_probs(logits, **kwargs)

    def policy_loss_function(args, batch, logits, sum_of_sample_mean):
        if recipe.fused_head() is not None:
            capture = loss_module._maybe_capture_log_probs
            return recipe.policy_loss(args, batch, logits, sum_of_sample_mean, capture_log_probs=capture)
        return own_policy(args, batch, logits, sum_of_sample_mean)

    def sft_loss_function(args, batch, logits, sum_of_sample_mean):
        if recipe.fused_head() is not None:
            return recipe.sft_loss(args, batch, logits, sum_of_sample_mean)
        return own_sft(args, batch, logits, sum_of_sample_mean)

    return mock.patch.multiple(
        loss_module,
        get_log_probs_and_entropy=get_log_probs_and_entropy,
        policy_loss_function=policy_loss_function,
        sft_loss_function=sft_loss_function,
    )


def oracle_log_probs_and_entropy(
    logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False, non_loss_data=True,
    top_p_token_ids=None, top_p_token_offsets=None,
):  # fmt: skip
    """``get_log_probs_and_entropy``'s results in float64 from the stock logits shard ``[1, T, V/TP]``
    (gathered): row ``t`` of a sample scores its token ``t + 1``; sample ``i``'s response rows are the
    ``RESPONSES[i]`` rows before its last. With top-p sets, each response row keeps its set and its own
    token for the log-prob; the entropy stays the whole vocabulary's, as slime documents."""
    logits = harness.gather_vocabulary(logits)
    rows, vocab = logits.shape[1], logits.shape[2]
    targets = torch.zeros(1, rows, dtype=torch.long)
    kept = None if top_p_token_ids is None else torch.ones(1, rows, vocab, dtype=torch.bool)
    spans, start = [], 0
    for index, (tokens, total, response) in enumerate(
        zip(unconcat_tokens, total_lengths, response_lengths, strict=True)
    ):
        for position in range(total - 1):
            targets[0, start + position] = tokens[position + 1]
        first = start + total - response - 1
        spans.append(slice(first, first + response))
        if kept is not None:
            ids, offsets = top_p_token_ids[index].long(), top_p_token_offsets[index].long()
            for entry, row in enumerate(range(first, first + response)):
                kept[0, row] = False
                kept[0, row, ids[offsets[entry] : offsets[entry + 1]]] = True
                kept[0, row, targets[0, row]] = True
        start += total
    temperature = getattr(args, "rollout_temperature", 1.0)
    logprob, entropy = logprob_entropy(logits, targets, temperature)
    if kept is not None:
        logprob = logprob_entropy(logits, targets, temperature, kept=kept)[0]
    found = {"log_probs": [logprob[0, span] for span in spans]}
    if with_entropy:
        found["entropy"] = [entropy[0, span] for span in spans]
    return torch.empty((0,)), found


def rollout_data(vocab: int, seed: int):
    """The samples as slime's rollout hands them to the actor (tokens, lengths, int loss masks with
    some tokens masked, top-p sets, the debug dump's ``partition``, one micro-batch of all four), and
    the generator ``per_temperature_inputs`` draws on."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(1, vocab, (total,), generator=generator) for total in TOTALS]
    loss_masks = [(torch.rand(response, generator=generator) > 0.25).int() for response in RESPONSES]
    loss_masks[0][0], loss_masks[3][0] = 0, 1
    ids, offsets = slime_top_p_sets(
        [sample[-r:] for sample, r in zip(tokens, RESPONSES, strict=True)], vocab, seed=seed + 1
    )
    data = {
        "tokens": tokens, "total_lengths": TOTALS, "response_lengths": RESPONSES, "loss_masks": loss_masks,
        "rollout_top_p_token_ids": ids, "rollout_top_p_token_offsets": offsets, "partition": [7, 3, 0, 5],
        "micro_batch_indices": [[0, 1, 2, 3]],
    }  # fmt: skip
    return data, generator


def per_temperature_inputs(logprob: torch.Tensor, loss_masks, generator) -> Dict[str, List[torch.Tensor]]:
    """Old, reference and rollout log-probs and advantages of the concatenated response tokens whose
    float64 log-probs are ``logprob``, split per sample as slime keeps them (float32): the old ones a
    step well inside one branch of the clip away (``policy_loss_inputs``), the rollout ones within
    about 0.02 (an inference engine's)."""
    inputs = policy_loss_inputs(logprob, torch.cat(loss_masks).float(), generator)
    rollout = (logprob + 0.02 * torch.randn(logprob.shape, generator=generator)).float()
    values = {
        "log_probs": inputs["old_logprob"], "ref_log_probs": inputs["ref_logprob"],
        "advantages": inputs["advantages"], "rollout_log_probs": rollout,
    }  # fmt: skip
    return {key: list(value.split(RESPONSES)) for key, value in values.items()}


def cases():
    """``(label, args settings, batch changes)`` of every loss case."""
    for temperature, old, terms in itertools.product(TEMPERATURES, (True, False), (True, False)):
        settings = dict(rollout_temperature=temperature, loss_type="policy_loss", use_kl_loss=terms)
        settings.update(
            entropy_coef=0.01 if terms else 0.0, kl_loss_type="k3" if temperature == 0.7 else "k2",
            eps_clip_c=3.0 if terms else None, kl_loss_coef=0.05 if terms else 0.0,
        )  # fmt: skip
        # The reuse case: slime skipped its log-prob pass, the batch has no old log-probs.
        changes = {} if old else {"log_probs": None}
        if not old and terms:  # per-rollout denominators (slime's rollout_mask_sums)
            changes["rollout_mask_sums"] = [torch.tensor(n) for n in (5, 5, 9, 9)]
        label = (
            f"policy_loss T={temperature} old={'present' if old else 'absent'} kl+entropy={'on' if terms else 'off'}"
        )
        yield label, settings, changes
    for temperature in TEMPERATURES:
        per_token = temperature == 1.0  # slime's SFT scripts set --calculate-per-token-loss
        settings = dict(rollout_temperature=temperature, loss_type="sft_loss", calculate_per_token_loss=per_token)
        yield f"sft_loss T={temperature} per-token={per_token}", settings, {}
    yield (
        "policy_loss per-token k1",
        dict(loss_type="policy_loss", calculate_per_token_loss=True, kl_loss_type="k1"),
        {},
    )
    yield "policy_loss top-p replay", dict(loss_type="policy_loss", rollout_top_p=0.9, entropy_coef=0.0), {}
    yield "policy_loss --recompute-loss-function", dict(loss_type="policy_loss", recompute_loss_function=True), {}
    for name in ("policy_loss", "sft_loss"):
        path = f"megatron_fused_lm.recipes.slime.{name}"
        # custom_loss loads the recipe's function by path; the stock and oracle runs take slime's own.
        yield f"custom_loss {name}", dict(loss_type="custom_loss", custom_loss_function_path=path, own=name), {}


class Layout:
    """One TP layout's model, slime's packed micro-batch and the runs of every case on it."""

    def __init__(self, slime, sequence_parallel: bool, label: str):
        self.slime, self.label = slime, label
        self.model = harness.build_gpt(MODEL_SHAPE, sequence_parallel=sequence_parallel)
        self.vocab = harness.VOCAB_SHARD * harness.tp_size()
        self.data, generator = rollout_data(self.vocab, seed=41)
        batch = self.batch({})
        cu_seqlens = batch["packed_seq_params"].cu_seqlens_q
        assert int(cu_seqlens[-1]) == batch["tokens"].shape[1] > sum(TOTALS), "slime's padding at the end"
        self.mask = harness.packed_attention_mask(cu_seqlens.long())
        # Per temperature, inputs near the float64 log-probs there.
        for temperature in TEMPERATURES:
            with (
                torch.no_grad(),
                mock.patch.object(slime.loss, "get_log_probs_and_entropy", oracle_log_probs_and_entropy),
            ):
                _, found = slime.loss.get_log_probs_and_entropy(
                    self.forward(batch), args=slime_args(temperature), unconcat_tokens=batch["unconcat_tokens"],
                    total_lengths=TOTALS, response_lengths=RESPONSES,
                )  # fmt: skip
            self.data[temperature] = per_temperature_inputs(
                torch.cat(found["log_probs"]), self.data["loss_masks"], generator
            )

    def batch(self, changes: Dict, temperature: float = 0.7) -> Dict:
        """The micro-batch by slime's own ``get_batch`` (``DataIterator`` over the rollout data), with
        ``changes`` to its keys; ``None`` drops a key, as ``get_batch`` gives a missing one."""
        data = {**self.data, **self.data.get(temperature, {}), **changes}
        keys = [
            "tokens", "total_lengths", "response_lengths", "loss_masks", "log_probs", "ref_log_probs", "advantages",
            "rollout_log_probs", "rollout_mask_sums", "partition", "rollout_top_p_token_ids",
            "rollout_top_p_token_offsets",
        ]  # fmt: skip
        iterator = self.slime.data.DataIterator(data, data["micro_batch_indices"])
        return self.slime.data.get_batch(iterator, keys, DATA_PAD, False)

    def forward(self, batch: Dict) -> torch.Tensor:
        return run_model(self.model, batch["tokens"], self.mask)

    def route(self, route: str):
        """What ``route`` changes in slime's loss module while it runs."""
        if route == "fused":
            return routed(self.slime.loss)
        if route == "oracle":
            return mock.patch.object(self.slime.loss, "get_log_probs_and_entropy", oracle_log_probs_and_entropy)
        return contextlib.nullcontext()

    def args(self, settings: Dict) -> SimpleNamespace:
        args = slime_args(0.7, "--fused-linear-logprob", "--fused-linear-logprob-token-chunk", "5")
        args.__dict__.update({name: value for name, value in settings.items() if name != "own"})
        return args

    def loss_case(self, route: str, label: str, settings: Dict, changes: Dict):
        """slime's ``loss_function`` on this route: ``(scaled loss, normalizer, metric names, metric
        values, gradients, captured log-probs)``."""
        loss_module, args = self.slime.loss, self.args(settings)
        batch = self.batch(changes, args.rollout_temperature)
        if route != "fused" and args.loss_type == "custom_loss":  # slime's own loss on those routes
            args.loss_type = settings["own"]
        patch = self.route(route)
        loss_module.enable_log_prob_capture()
        with patch:  # through the backward: --recompute-loss-function runs the loss again there
            loss, normalizer, log = loss_module.loss_function(
                args, batch, NUM_MICROBATCHES, STEP_GLOBAL_BATCH_SIZE, self.forward(batch)
            )
            captured = loss_module.drain_captured_log_probs()
            loss.backward()
        grads = harness.finalized_parameter_grads(self.model)
        values = [float(value) for value in log["values"]]
        return SimpleNamespace(
            loss=loss.detach().double(), normalizer=float(normalizer), keys=log["keys"], values=values, grads=grads,
            captured=captured,
        )  # fmt: skip

    def log_prob_pass(self, route: str, temperature: float, top_p: bool):
        """``get_log_probs_and_entropy`` as ``compute_log_prob`` calls it (with the entropy and, under
        top-p replay, the sets): the per-sample values and the gradients of one weighted sum."""
        loss_module = self.slime.loss
        args = self.args(dict(rollout_temperature=temperature, rollout_top_p=0.9 if top_p else 1.0))
        batch = self.batch({}, temperature)
        top_p_kwargs = loss_module.get_rollout_top_p_logprob_kwargs(args, batch)
        patch = self.route(route)
        with patch:
            empty, found = loss_module.get_log_probs_and_entropy(
                self.forward(batch), args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=TOTALS,
                response_lengths=RESPONSES, with_entropy=True, **top_p_kwargs,
            )  # fmt: skip
        assert empty.numel() == 0 and [piece.shape[0] for piece in found["log_probs"]] == RESPONSES, self.label
        values = [torch.cat(found[name]) for name in ("log_probs", "entropy")]
        sum(
            (harness.random_weights(*value.shape, seed=50 + i) * value).sum() for i, value in enumerate(values)
        ).backward()
        return SimpleNamespace(
            values=[value.detach().double() for value in values], grads=harness.finalized_parameter_grads(self.model)
        )


def compare(fused, reference, label: str, errors: Dict[str, float], captures: bool = True) -> None:
    """``fused`` against ``reference`` (a loss case's or a log-prob pass's results), within
    ``VALUE_ATOL`` and ``GRAD_RTOL``, the largest differences kept in ``errors``. ``captures``: the
    loss captures the log-probs as slime's ``policy_loss_function`` does (not a custom loss, which
    slime runs only after its log-prob pass, when it captures nothing)."""
    if hasattr(reference, "loss"):
        # The scaled loss as Megatron's schedule receives it, and its normalizer (per-token: the tokens).
        error = abs(fused.loss.item() - reference.loss.item())
        assert error <= VALUE_ATOL * max(1.0, abs(reference.loss.item())), (
            f"{label}: loss {fused.loss} vs {reference.loss}"
        )
        assert fused.normalizer == reference.normalizer, (
            f"{label}: normalizer {fused.normalizer} vs {reference.normalizer}"
        )
        # slime's metrics: the same names in slime's order (its logging pairs them by position), then
        # values (ppo_kl and pg_clipfrac 0 in the reuse case, the rollout difference as slime takes it).
        assert fused.keys == reference.keys, f"{label}: metrics {fused.keys} vs {reference.keys}"
        for name, got, want in zip(["count", *fused.keys], fused.values, reference.values, strict=True):
            assert abs(got - want) <= VALUE_ATOL * max(1.0, abs(want)), f"{label}: {name} {got} vs {want}"
            errors["metrics"] = max(errors["metrics"], abs(got - want))
        errors["loss"] = max(errors["loss"], error)
        # slime's debug capture of the loss pass's log-probs (the reuse case dumps these as log_probs).
        if captures:
            assert fused.captured.keys() == reference.captured.keys(), f"{label}: captured {sorted(fused.captured)}"
            for position, values in reference.captured.items():
                harness.assert_max_error(fused.captured[position], values, VALUE_ATOL, f"{label} captured {position}")
    else:
        # The log-prob pass: log-probs and entropy per response token, in slime's order.
        for got, want, name in zip(fused.values, reference.values, ("log-probs", "entropy"), strict=True):
            harness.assert_max_error(got, want, VALUE_ATOL, f"{label} {name}")
            errors["log-probs"] = max(errors["log-probs"], (got - want).abs().max().item())
    # Every parameter's gradient, relative to the reference's largest entry.
    harness.assert_grads_close(fused.grads, reference.grads, GRAD_RTOL, label)
    errors["gradients"] = max(
        errors["gradients"],
        max(
            (fused.grads[name] - want).abs().max().item() / want.abs().max().item()
            for name, want in reference.grads.items()
        ),
    )


def check_layout(slime, sequence_parallel: bool, label: str) -> Dict[str, float]:
    layout = Layout(slime, sequence_parallel, label)
    runs = {}
    for route in ("stock", "oracle"):
        for temperature, top_p in ((0.7, False), (1.0, False), (0.7, True)):
            runs[route, "pass", temperature, top_p] = layout.log_prob_pass(route, temperature, top_p)
        for case, settings, changes in cases():
            runs[route, case] = layout.loss_case(route, case, settings, changes)
    head = recipe.wrap_slime_model([layout.model], layout.args({}))
    assert head.fused and recipe.fused_head() is head, label
    errors = dict.fromkeys(("loss", "metrics", "log-probs", "gradients"), 0.0)
    for temperature, top_p in ((0.7, False), (1.0, False), (0.7, True)):
        fused = layout.log_prob_pass("fused", temperature, top_p)
        for route in ("stock", "oracle"):
            case = f"{label} log-prob pass T={temperature} top-p={top_p} vs {route}"
            compare(fused, runs[route, "pass", temperature, top_p], case, errors)
    for case, settings, changes in cases():
        fused = layout.loss_case("fused", case, settings, changes)
        for route in ("stock", "oracle"):
            compare(fused, runs[route, case], f"{label} {case} vs {route}", errors, "custom_loss" not in case)
        if "old=absent" in case:  # on-policy: ratio 1, as slime's own reuse gives it
            metrics = dict(zip(fused.keys, fused.values[1:], strict=True))
            assert metrics["ppo_kl"] == 0 and metrics["pg_clipfrac"] == 0, f"{label} {case}: {metrics}"
            assert "train_rollout_logprob_abs_diff" in metrics and fused.captured, f"{label} {case}"
    check_refusals(layout, label)
    unwrap_model(layout.model)
    return errors


def check_refusals(layout: Layout, label: str) -> None:
    """Through slime's ``loss_function``, routed: each slime setting the recipe does not express is
    refused by name (slime's own function serves it, keeping the fused log-probs)."""
    for settings, named in (
        (dict(advantage_estimator="gspo"), "gspo"),
        (dict(advantage_estimator="cispo"), "cispo"),
        (dict(use_tis=True), "--use-tis"),
        (dict(use_opsm=True), "--use-opsm"),
        (dict(use_unbiased_kl=True), "--use-unbiased-kl"),
        (dict(kl_loss_type="low_var_kl"), "low_var_kl"),
        (dict(custom_pg_loss_reducer_function_path="x.y"), "reducer"),
        (dict(rollout_top_p=0.9, entropy_coef=0.01), "rollout-top-p"),
    ):
        with pytest.raises(NotImplementedError, match=named):
            layout.loss_case("fused", f"{label} refused {named}", dict(loss_type="policy_loss", **settings), {})
    with pytest.raises(ValueError, match="use-rollout-logprobs"):
        layout.loss_case("fused", label, dict(use_rollout_logprobs=True), {"rollout_log_probs": None})


def worker(source: str) -> None:
    torch._dynamo.config.disable = True  # slime's compiled loss helpers, eagerly (the same numbers)
    slime = import_slime(source)
    for size, sequence_parallel in ((2, True), (1, False)):
        harness.tensor_parallel(size)
        label = f"TP={size} sequence_parallel={sequence_parallel}"
        errors = check_layout(slime, sequence_parallel, label)
        if torch.distributed.get_rank() == 0:
            print(f"slime {label}: largest differences {errors}", flush=True)


@needs_source
def test_the_recipe_matches_slime_s_own_functions():
    harness.spawn(worker, 2, SOURCE)


# ---------------------------------------------------- slime's pinned Megatron-LM (MTP, linear CE)

# GPTModel's fused linear cross-entropy (LinearCrossEntropyModule's output_cross_entropy_loss=True).
FUSED_CE = {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "linear"}


def present_grads(model) -> Dict[str, torch.Tensor]:
    """The gradients the backward reached (an MTP block without mtp_kwargs gets none), summed over the
    tensor-parallel group where sequence parallel, by name; zeroes them."""
    grads = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            grads[name], parameter.grad = parameter.grad.detach().clone(), None
    return harness.sum_sequence_parallel(grads, model)


def float64_cross_entropy(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``compute_language_model_loss`` in float64: ``logits [s, b, V/TP]``, ``labels [b, s]`` ->
    ``[b, s]``, the oracle's per-token loss."""
    return -harness.oracle_logprob_entropy(logits.transpose(0, 1), labels, 1.0)[0]


def check_pinned_megatron(sequence_parallel: bool, label: str, errors: Dict[str, float]) -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_fused_lm import FusedLMConfig, wrap_model

    config = FusedLMConfig(enabled=True, backend="torch", token_chunk=5)
    input_ids, positions, mask, targets = harness.make_batch()
    # 1. The labels path through LinearCrossEntropyModule (output_cross_entropy_loss=True), whose
    # own kernels are CUDA's: against the stock logits' float64 cross-entropy, value and gradients.
    fused, stock = (harness.build_gpt(sequence_parallel=sequence_parallel, config_overrides=FUSED_CE) for _ in "ab")
    assert type(fused.output_layer).__name__ == "LinearCrossEntropyModule", "not slime's Megatron-LM"
    oracle = float64_cross_entropy(targets, stock(input_ids, positions, mask).transpose(0, 1))
    harness.labels_loss(oracle).backward()
    oracle_grads = present_grads(stock)
    assert wrap_model(fused, config).fused, label
    loss = fused(input_ids, positions, mask, labels=targets)
    harness.assert_max_error(loss, oracle, VALUE_ATOL, f"{label} linear cross-entropy")
    errors["labels loss"] = max(errors["labels loss"], (loss.double() - oracle).abs().max().item())
    harness.labels_loss(loss).backward()
    harness.assert_grads_close(present_grads(fused), oracle_grads, GRAD_RTOL, f"{label} linear cross-entropy")

    # 2. MTP training as slime runs it (labels=None, mtp_kwargs={"mtp_labels": tokens}): the MTP loss
    # through the fused labels path inside the forward, the model's output the hidden states. Against
    # the stock model (fusion off: compute_language_model_loss) and a float64 oracle (that loss in
    # float64): the MTP loss Megatron logs and every parameter's gradient of it plus a log-prob sum.
    weights = harness.random_weights(*targets.shape, seed=13)
    fused = harness.build_gpt(sequence_parallel=sequence_parallel, config_overrides=FUSED_CE, mtp_num_layers=1)
    references = {}
    for route in ("stock", "oracle"):
        model = harness.build_gpt(sequence_parallel=sequence_parallel, mtp_num_layers=1)
        if route == "oracle":
            model.compute_language_model_loss = float64_cross_entropy
        MTPLossLoggingHelper.tracker.clear()
        MTPLossLoggingHelper.tracker["values"] = torch.zeros(1)  # Megatron makes it on CUDA
        output = model(input_ids, positions, mask, labels=None, mtp_kwargs={"mtp_labels": input_ids})
        (weights * harness.oracle_logprob_entropy(output, targets, 1.0)[0]).sum().backward()
        references[route] = MTPLossLoggingHelper.tracker["values"].clone(), present_grads(model)
    head = wrap_model(fused, config)
    calls = []
    patched = fused.output_layer.forward
    fused.output_layer.forward = lambda *args, **kwargs: (calls.append(sorted(kwargs)), patched(*args, **kwargs))[1]
    MTPLossLoggingHelper.tracker.clear()
    MTPLossLoggingHelper.tracker["values"] = torch.zeros(1)
    output = fused(input_ids, positions, mask, labels=None, mtp_kwargs={"mtp_labels": input_ids})
    assert output.shape[-1] == harness.HIDDEN and any("output_cross_entropy_loss" in call for call in calls), calls
    (weights * head.logprobs(output, targets)).sum().backward()
    mtp_loss, grads = MTPLossLoggingHelper.tracker["values"].clone(), present_grads(fused)
    assert any(name.startswith("mtp.") for name in grads), sorted(grads)
    for route, (want_loss, want_grads) in references.items():
        harness.assert_max_error(mtp_loss, want_loss, VALUE_ATOL, f"{label} MTP loss vs {route}")
        errors["MTP loss"] = max(errors["MTP loss"], (mtp_loss - want_loss).abs().max().item())
        harness.assert_grads_close(grads, want_grads, GRAD_RTOL, f"{label} MTP gradients vs {route}")
        errors["MTP gradients"] = max(
            errors["MTP gradients"],
            max((grads[name] - want).abs().max().item() / want.abs().max().item() for name, want in want_grads.items()),
        )


def pinned_megatron_worker(tree: str) -> None:
    import megatron.core

    assert megatron.core.__file__.startswith(tree), f"megatron.core from {megatron.core.__file__}, not {tree}"
    errors = dict.fromkeys(("labels loss", "MTP loss", "MTP gradients"), 0.0)
    for size, sequence_parallel in ((2, True), (1, False)):
        harness.tensor_parallel(size)
        check_pinned_megatron(sequence_parallel, f"TP={size} sequence_parallel={sequence_parallel}", errors)
    if torch.distributed.get_rank() == 0:
        print(f"slime's Megatron-LM: largest differences {errors}", flush=True)


@needs_megatron
def test_the_wrapped_model_on_slime_s_pinned_megatron():
    """In a fresh process with the pinned tree first on ``PYTHONPATH`` (this one has imported
    megatron-core already)."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([MEGATRON, str(root), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    code = f"from devkit import megatron_gpt; import {Path(__file__).stem} as t; megatron_gpt.spawn(t.pinned_megatron_worker, 2, {MEGATRON!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
