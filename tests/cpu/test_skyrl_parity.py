"""The fused head's SkyRL recipe (``megatron_fused_lm/recipes/skyrl.py``), its three-GEMM route, against
SkyRL 0.4.0's own functions, on identical inputs shaped by SkyRL's own code, on a real GPTModel with TP=2 and sequence
parallelism (SkyRL turns it on whenever TP > 1), temperature 0.8:

1. padded rows (``remove_left_padding`` / ``recover_left_padding`` around the forward): SkyRL's
   ``from_parallel_logits_to_logprobs`` and ``vocab_parallel_entropy`` on the stock logits shard,
   against ``action_log_probs`` on the fused model's hidden states: the values and every parameter's
   gradient of one weighted sum of both; then SkyRL's own fused path (``from_parallel_hidden_to_logprobs``
   and ``_fused_vocab_parallel_entropy_from_hidden``) on the same hidden states and weight shard;
2. packed rows (``preprocess_packed_seqs``): ``from_parallel_logits_to_logprobs_packed_sequences`` and
   ``vocab_parallel_entropy_packed_sequences`` (its masked entropy mean) against ``packed_layout``
   with ``action_log_probs``, values and gradients.

3. packed rows under context parallelism (CP = 2, TP = 1): each rank holds the rows SkyRL's own
   ``preprocess_packed_seqs`` gives it; ``from_parallel_logits_to_logprobs_packed_sequences`` and
   ``vocab_parallel_entropy_packed_sequences`` with SkyRL's CP group on this rank's logits, against
   ``packed_layout(..., cp_group=...)`` with ``action_log_probs`` on this rank's hidden states:
   the values, and the gradients of the rank's hidden states and of the weight. A CP model cannot
   run on CPU, so both sides take the same random hidden states and weight, and the recipe's head
   is the fused op on them.

Both sides compute in float32 from the same float32 model; they differ by summation order only
(measured: about 1e-6, printed by rank 0), so values must agree to 2e-5 and gradients to 5e-5 of the
largest entry of SkyRL's, as in test_integration_parity. A row scored one position off, a temperature
applied twice or a sequence-parallel gradient reduced twice is off by O(1) or tens of percent.

What is imported from SkyRL: ``skyrl.backends.skyrl_train.distributed.megatron`` (``model_utils`` and
``megatron_utils``) through ``devkit.skyrl_release``, which says what it stands in for. SkyRL's entropy
compiles a two-line product-sum with ``torch.compile``; the comparison runs it eagerly
(``torch._dynamo.config.disable``): the same arithmetic, no C++ compiler needed on the CI machine. The
rows are SkyRL's (each sample one left-padded block, ``devkit.rollouts.skyrl_batches``), and SkyRL
divides the model's output by the temperature in place before either side sees it.
"""

import pytest
import torch
from megatron.core import parallel_state

from devkit import megatron_gpt as harness
from devkit.checkouts import installed_version
from devkit.oracle import max_abs_error, policy_loss_inputs, relative_error
from devkit.rollouts import (
    ACTIONS,
    MODEL_SHAPE,
    OpsHead,
    pack,
    run_model,
    sample_tokens,
    skyrl_algorithm,
    skyrl_batches,
    skyrl_loss_mask,
    skyrl_policy_oracle,
    weighted,
)
from devkit.skyrl_release import SKYRL_VERSION, skyrl_module
from megatron_fused_lm import FusedLMConfig, unwrap_model
from megatron_fused_lm.recipes import skyrl

pytestmark = pytest.mark.skipif(
    installed_version("skyrl") != SKYRL_VERSION,
    reason=f"SkyRL {SKYRL_VERSION} is not installed (tests/run_cpu.sh installs it into the trainers' environment)",
)

TEMPERATURE = 0.8
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
CONFIG = FusedLMConfig(enabled=True, token_chunk=5)


def skyrl_megatron_helpers():
    """SkyRL's ``megatron_utils`` and ``model_utils`` modules."""
    return (
        skyrl_module("backends.skyrl_train.distributed.megatron.megatron_utils"),
        skyrl_module("backends.skyrl_train.distributed.megatron.model_utils"),
    )


def compare(errors, name, ours, theirs, atol=VALUE_ATOL):
    """Record and check the largest difference of one quantity."""
    errors[name] = max_abs_error(ours, theirs)
    assert errors[name] <= atol, f"{name}: max error {errors[name]:.3g} > {atol:.3g}"


def compare_grads(errors, name, ours, theirs):
    """Record and check the largest gradient difference over all parameters, relative to the largest
    entry of SkyRL's gradient of that parameter."""
    errors[name] = max(relative_error(ours[key], theirs[key]) for key in theirs)
    harness.assert_grads_close(ours, theirs, GRAD_RTOL, name)


def check_padded(megatron_utils, model_utils, model, errors) -> None:
    tokens = sample_tokens(seed=21)
    sequences, attention_mask, _, _ = skyrl_batches(tokens)
    positions = torch.arange(sequences.shape[1]).expand_as(sequences)
    unpadded, unpadded_mask, unpadded_positions = megatron_utils.remove_left_padding(
        sequences, attention_mask, positions
    )

    def forward():
        output = run_model(model, unpadded, position_ids=unpadded_positions)
        return megatron_utils.recover_left_padding(output, unpadded_mask, attention_mask, sequences.shape[1])

    group = parallel_state.get_tensor_model_parallel_group()
    logits = forward() / TEMPERATURE  # SkyRL divides in place (logits.div_): the same values
    start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    theirs = (
        model_utils.from_parallel_logits_to_logprobs(
            logits, sequences, start, start + logits.shape[-1], group, inference_only=False, cp_group=None, chunk_size=4
        )[:, -ACTIONS:],
        model_utils.vocab_parallel_entropy(logits[:, -ACTIONS - 1 : -1]),
    )
    weighted(theirs, seed=40).backward()
    their_grads = harness.finalized_parameter_grads(model)

    head = skyrl.wrap_actor_module([model], FusedLMConfigSection())
    layout = skyrl.padded_layout(sequences, ACTIONS)
    ours = skyrl.action_log_probs(head, forward().div_(TEMPERATURE), layout, with_entropy=True)
    compare(errors, "padded log-prob vs from_parallel_logits_to_logprobs", ours[0], theirs[0])
    compare(errors, "padded entropy vs vocab_parallel_entropy", ours[1], theirs[1])
    weighted(ours, seed=40).backward()
    compare_grads(errors, "padded gradients", harness.finalized_parameter_grads(model), their_grads)

    with torch.no_grad():
        hidden = forward()
        weight = model.output_layer.weight
        their_fused = (
            model_utils.from_parallel_hidden_to_logprobs(
                hidden, weight, sequences, start, start + weight.shape[0], group, inference_only=True, cp_group=None,
                chunk_size=4, temperature=TEMPERATURE,
            )[:, -ACTIONS:],
            model_utils._fused_vocab_parallel_entropy_from_hidden(
                hidden[:, -ACTIONS - 1 : -1], weight, group, chunk_size=4, temperature=TEMPERATURE
            ),
        )  # fmt: skip
    compare(errors, "padded log-prob vs SkyRL's fused from_parallel_hidden_to_logprobs", ours[0], their_fused[0])
    compare(errors, "padded entropy vs SkyRL's fused entropy", ours[1], their_fused[1])
    unwrap_model(model)


def check_packed(megatron_utils, model_utils, model, errors) -> None:
    tokens = sample_tokens(seed=22)
    sequences, attention_mask, _, _ = skyrl_batches(tokens)
    packed, packed_seq_params = megatron_utils.preprocess_packed_seqs(sequences, attention_mask, pre_process=True)
    cu_seqlens = packed_seq_params.cu_seqlens_q_padded
    packed_targets = pack(tokens, cu_seqlens)  # what SkyRL's _build_packed_targets lays out
    assert torch.equal(packed, packed_targets), "SkyRL packs the tokens where the recipe expects them"
    mask = harness.packed_attention_mask(cu_seqlens)
    loss_mask = skyrl_loss_mask()

    group = parallel_state.get_tensor_model_parallel_group()
    logits = run_model(model, packed, mask) / TEMPERATURE
    start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    their_logprob = model_utils.from_parallel_logits_to_logprobs_packed_sequences(
        logits, packed_targets, cu_seqlens, sequences.shape[1], start, start + logits.shape[-1], group,
        inference_only=False, cp_group=None, chunk_size=None, attention_mask=attention_mask,
    )[:, -ACTIONS:]  # fmt: skip
    # (metric, term for the loss): the metric is detached, the loss takes the second.
    their_entropy, their_entropy_for_loss = model_utils.vocab_parallel_entropy_packed_sequences(
        logits, cu_seqlens, sequences.shape[1], ACTIONS, attention_mask, loss_mask, cp_group=None
    )
    (weighted([their_logprob * loss_mask], seed=41) + their_entropy_for_loss).backward()
    their_grads = harness.finalized_parameter_grads(model)

    head = skyrl.wrap_actor_module([model], FusedLMConfigSection())
    layout = skyrl.packed_layout(packed_targets, cu_seqlens, attention_mask, ACTIONS)
    logprob, entropy = skyrl.action_log_probs(
        head, run_model(model, packed, mask).div_(TEMPERATURE), layout, with_entropy=True
    )
    entropy_mean = (entropy * loss_mask).sum() / loss_mask.sum().clamp(min=1)  # SkyRL's masked_mean
    compare(
        errors,
        "packed log-prob vs from_parallel_logits_to_logprobs_packed_sequences",
        logprob * loss_mask,
        their_logprob * loss_mask,
    )
    compare(errors, "packed entropy mean vs vocab_parallel_entropy_packed_sequences", entropy_mean, their_entropy)
    (weighted([logprob * loss_mask], seed=41) + entropy_mean).backward()
    compare_grads(errors, "packed gradients", harness.finalized_parameter_grads(model), their_grads)
    unwrap_model(model)


class FusedLMConfigSection(skyrl.FusedLMSettings):
    """A SkyRL trainer section with the fused head on, chunks of 5 tokens."""

    def __init__(self):
        super().__init__(fused_linear_logprob=True, fused_linear_logprob_token_chunk=CONFIG.token_chunk)


def parity_worker() -> None:
    torch._dynamo.config.disable = True
    megatron_utils, model_utils = skyrl_megatron_helpers()
    harness.tensor_parallel(2)
    errors = {}
    for check, tied in ((check_padded, False), (check_packed, True)):
        model = harness.build_gpt(MODEL_SHAPE, sequence_parallel=True, tied=tied)
        check(megatron_utils, model_utils, model, errors)
    if torch.distributed.get_rank() == 0:
        for name, error in errors.items():
            print(f"SkyRL {SKYRL_VERSION} parity, {name}: {error:.2e}", flush=True)


def context_parallel_worker() -> None:
    torch._dynamo.config.disable = True
    megatron_utils, model_utils = skyrl_megatron_helpers()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
    cp_group = parallel_state.get_context_parallel_group()
    tokens = sample_tokens(seed=23)
    sequences, attention_mask, _, _ = skyrl_batches(tokens)
    local_packed, packed_seq_params = megatron_utils.preprocess_packed_seqs(sequences, attention_mask)
    cu_seqlens = packed_seq_params.cu_seqlens_q_padded
    packed_targets = pack(tokens, cu_seqlens)
    loss_mask = skyrl_loss_mask()
    # The rows this rank holds, by SkyRL's own index function (the recipe computes its own).
    total = packed_targets.shape[1]
    _, _, sequence, offset, lengths = model_utils._packed_sequence_indices(cu_seqlens, total, "cpu")
    rank_for_row, local_index = model_utils._packed_cp_rank_and_local_indices(cu_seqlens, sequence, offset, lengths, 2)
    mine = rank_for_row == parallel_state.get_context_parallel_rank()
    rows = torch.empty(total // 2, dtype=torch.long)
    rows[local_index[mine]] = torch.arange(total)[mine]
    assert torch.equal(packed_targets[0, rows], local_packed.reshape(-1)), (packed_targets[0, rows], local_packed)

    hidden = harness.random_weights(1, total, MODEL_SHAPE.hidden, seed=31)
    weight = harness.random_weights(MODEL_SHAPE.vocab, MODEL_SHAPE.hidden, seed=32) * 0.7
    errors, grads = {}, {}
    for side in ("theirs", "ours"):
        leaves = [hidden[:, rows].clone().requires_grad_(), weight.clone().requires_grad_()]
        if side == "theirs":
            logits = leaves[0] @ leaves[1].t() / TEMPERATURE
            vocab = logits.shape[-1]
            logprob = model_utils.from_parallel_logits_to_logprobs_packed_sequences(
                logits, packed_targets, cu_seqlens, sequences.shape[1], 0, vocab,
                parallel_state.get_tensor_model_parallel_group(), inference_only=False, cp_group=cp_group,
                chunk_size=None, attention_mask=attention_mask,
            )[:, -ACTIONS:]  # fmt: skip
            entropy_mean, entropy_for_loss = model_utils.vocab_parallel_entropy_packed_sequences(
                logits, cu_seqlens, sequences.shape[1], ACTIONS, attention_mask, loss_mask, cp_group=cp_group
            )
        else:
            layout = skyrl.packed_layout(packed_targets, cu_seqlens, attention_mask, ACTIONS, cp_group=cp_group)
            assert torch.equal(layout.rank_rows, rows), "the recipe's rows are SkyRL's"
            logprob, entropy = skyrl.action_log_probs(
                OpsHead(leaves[1], CONFIG.token_chunk), leaves[0] / TEMPERATURE, layout, with_entropy=True
            )
            entropy_mean = entropy_for_loss = (entropy * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        (weighted([logprob * loss_mask], seed=43) + entropy_for_loss).backward()
        grads[side] = {"hidden": leaves[0].grad, "weight": leaves[1].grad}
        grads[side]["values"] = (logprob * loss_mask).detach(), entropy_mean.detach()
    compare(errors, "CP=2 log-prob", grads["ours"]["values"][0], grads["theirs"]["values"][0])
    compare(errors, "CP=2 entropy mean", grads["ours"]["values"][1], grads["theirs"]["values"][1])
    compare_grads(
        errors, "CP=2 gradients", *({k: g[k] for k in ("hidden", "weight")} for g in (grads["ours"], grads["theirs"]))
    )
    check_context_parallel_losses(model_utils, hidden, weight, rows, packed_targets, cu_seqlens, sequences,
                                  attention_mask, cp_group, errors)  # fmt: skip
    if torch.distributed.get_rank() == 0:
        for name, error in errors.items():
            print(f"SkyRL {SKYRL_VERSION} CP parity, {name}: {error:.2e}", flush=True)


def check_context_parallel_losses(
    model_utils, hidden, weight, rows, packed_targets, cu_seqlens, sequences, attention_mask, cp_group, errors
) -> None:
    """The recipe's losses in the forward under CP against SkyRL's SFT and policy losses on SkyRL's
    gathered log-probs: each rank's value (the whole batch's) and its hidden rows' and weight's
    gradients. The policy loss has no entropy term here: SkyRL's packed entropy gives only a masked
    mean, not the per-action values its loss takes."""
    loss_mask = skyrl_loss_mask()
    correction, scale = 4.0, 1.5  # num_microbatches * dp_size, num_microbatches / num_real_microbatches
    algorithm = skyrl_algorithm(entropy_loss_coef=0.0)
    sft_mask = loss_mask / loss_mask.sum()

    def their_logprob(local_hidden, local_weight):
        logits = local_hidden @ local_weight.t() / TEMPERATURE
        return model_utils.from_parallel_logits_to_logprobs_packed_sequences(
            logits, packed_targets, cu_seqlens, sequences.shape[1], 0, logits.shape[-1],
            parallel_state.get_tensor_model_parallel_group(), inference_only=False, cp_group=cp_group,
            chunk_size=None, attention_mask=attention_mask,
        )[:, -ACTIONS:]  # fmt: skip

    with torch.no_grad():
        current = their_logprob(hidden[:, rows], weight)
    inputs = policy_loss_inputs(current.double(), loss_mask, torch.Generator().manual_seed(3))
    inputs["advantages"] = inputs["advantages"] / loss_mask.sum()  # SkyRL's token_mean scaling
    layout = skyrl.packed_layout(packed_targets, cu_seqlens, attention_mask, ACTIONS, cp_group=cp_group)
    for name in ("cross_entropy_loss", "policy_loss"):
        results = {}
        for side in ("theirs", "ours"):
            leaves = [hidden[:, rows].clone().requires_grad_(), weight.clone().requires_grad_()]
            if side == "theirs":
                logprob = their_logprob(*leaves)
                if name == "cross_entropy_loss":
                    loss = -(logprob * sft_mask).sum() * correction
                else:
                    loss = skyrl_policy_oracle(
                        logprob, torch.zeros_like(logprob), inputs, loss_mask, algorithm, correction, scale
                    )
            elif name == "cross_entropy_loss":
                loss = skyrl.cross_entropy_loss(
                    OpsHead(leaves[1], CONFIG.token_chunk), leaves[0] / TEMPERATURE, layout, sft_mask, correction
                ).loss
            else:
                loss = skyrl.policy_loss(
                    OpsHead(leaves[1], CONFIG.token_chunk), leaves[0] / TEMPERATURE, layout,
                    old_log_probs=inputs["old_logprob"], advantages=inputs["advantages"], loss_mask=loss_mask,
                    base_log_probs=inputs["ref_logprob"], rollout_log_probs=None, algorithm=algorithm,
                    grad_sum_correction_factor=correction, kl_entropy_microbatch_scale=scale,
                ).loss  # fmt: skip
            loss.backward()
            results[side] = loss.detach().float(), {"hidden": leaves[0].grad, "weight": leaves[1].grad}
        compare(errors, f"CP=2 {name} value", results["ours"][0], results["theirs"][0])
        compare_grads(errors, f"CP=2 {name} gradients", results["ours"][1], results["theirs"][1])


def test_recipe_under_context_parallelism_matches_skyrls_own():
    harness.spawn(context_parallel_worker, 2)


def test_recipe_matches_skyrls_own_logprob_and_entropy():
    harness.spawn(parity_worker, 2)


def test_the_k3_term_clamps_as_skyrls_compute_approx_kl():
    # SkyRL clamps the k3 log-ratio to +-20 and the estimate to [-10, 10]; log-ratios past both bounds,
    # and within them, give SkyRL's values and gradients exactly (one float32 formula each side).
    ppo_utils = skyrl_module("backends.skyrl_train.utils.ppo_utils")
    from megatron_fused_lm import losses

    logprob = torch.tensor([-40.0, -25.0, -5.0, -1.0, 0.0, -3.0, -30.0, -2.0], requires_grad=True)
    reference = torch.tensor([-1.0, -2.0, -30.0, -1.2, -25.0, -3.5, -2.0, -2.0])
    log_ratio = reference - logprob.detach()
    assert (log_ratio.abs() > 20).any() and ((log_ratio.clamp(-20, 20).exp() - log_ratio - 1) > 10).any()
    theirs = ppo_utils.compute_approx_kl(logprob, reference, kl_estimator_type="k3")
    (their_grad,) = torch.autograd.grad(theirs.sum(), logprob)
    zeros = torch.zeros_like(logprob)
    loss_fn = skyrl.SkyRLPolicyLoss(losses.ClippedPolicyLoss(), kl_estimator="k3")
    ours = loss_fn(
        logprob, zeros, old_logprob=logprob.detach(), advantages=zeros, pg_weight=zeros, ref_logprob=reference,
        kl_weight=torch.ones_like(logprob), entropy_weight=zeros,
    )  # fmt: skip
    (our_grad,) = torch.autograd.grad(ours.sum(), logprob)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=0)
