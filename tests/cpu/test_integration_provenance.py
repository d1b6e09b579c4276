"""The fused head computes each output with the forward that made it, whatever ran since, against
the stock Megatron-Core GPTModel running the same trainer calls: TP=1 and TP=2, sequence parallel
on and off, tied and untied embeddings.

Each scenario is a sequence of calls a trainer makes; it runs once on the stock model (log-probs
of its logits by the float64 oracle, with autograd into the model) and once on the wrapped model
(``head.logprobs`` / ``head.loss`` on its hidden states), and every value and every parameter's
gradient must agree:

1. a forward, another forward under ``no_grad`` (the next micro-batch's old log-probs), then the
   first output's log-probs and a three-GEMM loss, and one backward;
2. a pipeline schedule's order: two forwards, then the first one's loss and backward, then the
   second's;
3. two outputs alive at once, used together in one backward;
4. what trainers derive from an output with gradients on (slices, a transpose, a copy, a reshape,
   a split of the packed rows), after another forward;
5. the same under ``no_grad``, where storage ties views and ``.detach()`` to the forward and a
   copy falls to the one live forward;
6. a frozen body under a trained head (the output has a graph only through the weight);
7. the first scenario through ``torch.compile`` of the wrapped model (TP=1).

Then what the head refuses, each with an error that says why: another wrapped model's output
(with and without gradients), a copy whose origin nothing establishes while two models' outputs
are alive, and a tensor no live forward could have made; the stock logits handed to the fused
head are named as logits. What the forward returns instead of hidden states is refused by where it
comes from, on a model whose sequence length and vocabulary equal its hidden size (so the shape
cannot tell): the labels path's per-token loss, what derives from it, the same under ``no_grad``,
and the stock logits. Once outputs are freed the head keeps nothing of their forwards, and a
model dropped with its head is freed at the next collection, an output of it kept or not.

Tolerances as in test_integration_parity (float32 on both sides, measured errors about 2e-6): 2e-5
absolute on per-token values and 5e-5 of the largest entry of each stock gradient. A forward
looked up wrongly (the last one instead of the output's) drops the weight gradient or computes
another batch's log-probs: errors of O(1).
"""

import dataclasses
import datetime
import gc
import time
import weakref

import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm import losses
from megatron_fused_lm.integration import FusedLMConfig, provenance, unwrap_model, wrap_model

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
TEMPERATURE = 0.8
FUSED = FusedLMConfig(enabled=True, token_chunk=5)


class Stock:
    """The stock model's side: log-probs and the loss of its logits by the float64 oracle."""

    def __init__(self, model):
        self.model = model

    def logprobs(self, logits, targets):
        return harness.oracle_logprob_entropy(logits, targets, TEMPERATURE)

    def loss(self, logits, targets, weights):
        logprob, _ = self.logprobs(logits, targets)
        return (-weights.double() * logprob).sum()


class Fused:
    """The wrapped model's side: the same calls through its head."""

    def __init__(self, head):
        self.head = head

    def logprobs(self, hidden, targets):
        return self.head.logprobs(hidden, targets, temperature=TEMPERATURE, return_entropy=True)

    def loss(self, hidden, targets, weights):
        return self.head.loss(
            hidden, targets, losses.cross_entropy, loss_inputs={"weight": weights}, temperature=TEMPERATURE
        ).loss


def weights_like(targets, seed):
    return harness.random_weights(*targets.shape, seed=seed)


def interleaved_no_grad(model, side, batches):
    a, b = batches
    output = harness.forward(model, a)
    with torch.no_grad():
        harness.forward(model, b)
    logprob, entropy = side.logprobs(output, a[3])
    total = harness.head_loss(logprob, entropy) + side.loss(output, a[3], weights_like(a[3], 31))
    total.backward()
    return [logprob, entropy]


def pipeline_order(model, side, batches):
    a, b = batches
    outputs = [harness.forward(model, batch) for batch in (a, b)]
    values = []
    for output, batch, seed in zip(outputs, (a, b), (32, 33), strict=True):
        loss = side.loss(output, batch[3], weights_like(batch[3], seed))
        loss.backward()
        values.append(loss.detach())
    return values


def together(model, side, batches):
    a, b = batches
    outputs = [harness.forward(model, batch) for batch in (a, b)]
    results = [side.logprobs(output, batch[3]) for output, batch in zip(outputs, (a, b), strict=True)]
    sum(harness.head_loss(*result) for result in results).backward()
    return [value for result in results for value in result]


def derived(output, targets):
    """``(tensor, its targets)`` pairs a trainer derives from an output ``[b, s, h]``."""
    hidden = output.shape[-1]
    rows = output.reshape(-1, hidden)
    first, second = torch.split(rows, [5, rows.shape[0] - 5])
    flat_targets = targets.reshape(-1)
    return [
        (output[:, 1:], targets[:, 1:]),
        (output.transpose(0, 1), targets.t()),
        (output.transpose(0, 1).contiguous(), targets.t()),
        (output.clone(), targets),
        (rows[3:11], flat_targets[3:11]),
        (first, flat_targets[:5]),
        (second, flat_targets[5:]),
    ]


def derived_with_grad(model, side, batches):
    a, b = batches
    pieces = derived(harness.forward(model, a), a[3])
    with torch.no_grad():
        harness.forward(model, b)
    results = [side.logprobs(piece, targets) for piece, targets in pieces]
    sum(harness.head_loss(*result) for result in results).backward()
    return [value for result in results for value in result]


def derived_without_grad(model, side, batches):
    a, b = batches
    with torch.no_grad():
        output = harness.forward(model, a)
        harness.forward(model, b)  # freed at once: only the first output is alive
        pieces = derived(output, a[3]) + [(output.detach(), a[3])]
    results = [side.logprobs(piece, targets) for piece, targets in pieces]
    assert not any(value.requires_grad for result in results for value in result), "no_grad outputs have no graph"
    return [value for result in results for value in result]


def frozen_body(model, side, batches):
    a, _ = batches
    trained = {name for name, parameter in model.named_parameters() if name == "output_layer.weight"}
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trained)
    try:
        logprob, entropy = side.logprobs(harness.forward(model, a), a[3])
        harness.head_loss(logprob, entropy).backward()
    finally:
        for parameter in model.parameters():
            parameter.requires_grad_(True)
    return [logprob, entropy]


SCENARIOS = (interleaved_no_grad, pipeline_order, together, derived_with_grad, derived_without_grad)


def grads_of(model):
    """Every parameter's gradient by name (those that got one), cleared afterwards."""
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def check_scenarios(model, batches, tied, label):
    scenarios = SCENARIOS if tied else (*SCENARIOS, frozen_body)
    for scenario in scenarios:
        case = f"{label} {scenario.__name__}"
        unwrap_model(model)
        stock_values = scenario(model, Stock(model), batches)
        stock_grads = grads_of(model)
        fused_values = scenario(model, Fused(wrap_model(model, FUSED)), batches)
        fused_grads = grads_of(model)
        for index, (got, want) in enumerate(zip(fused_values, stock_values, strict=True)):
            harness.assert_max_error(got, want, VALUE_ATOL, f"{case} value {index}")
        differ = sorted(fused_grads.keys() ^ stock_grads.keys())
        assert not differ, f"{case}: only one side has a gradient for {differ}"
        if stock_grads:
            harness.assert_grads_close(fused_grads, stock_grads, GRAD_RTOL, case)
        else:
            assert scenario is derived_without_grad, case
    unwrap_model(model)


def expect_error(error_type, match, function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except error_type as error:
        assert all(part in str(error) for part in match), f"{match} not in: {error}"
    else:
        raise AssertionError(f"no {error_type.__name__} for {match}")


def check_refusals(model, batches, label):
    a, b = batches
    policy_head = wrap_model(model, FUSED)
    reference = harness.build_gpt(seed=99)
    reference_head = wrap_model(reference, FUSED)
    names = (policy_head.name, reference_head.name)
    assert names[0] != names[1], label
    targets = a[3]

    policy_output = harness.forward(model, a)
    with torch.no_grad():
        reference_output = harness.forward(reference, a)
    # The policy's head given the reference model's output, with and without gradients.
    expect_error(RuntimeError, names, policy_head.logprobs, reference_output, targets)
    expect_error(RuntimeError, names, reference_head.logprobs, policy_output, targets)
    # A copy without gradients ties to no forward, and both models' outputs could have made it.
    with torch.no_grad():
        copied = reference_output.clone()
    expect_error(RuntimeError, ("nothing links", "could have made it"), reference_head.logprobs, copied, targets)
    # The stock logits handed to the fused head.
    with policy_head.stock_logits():
        logits = harness.forward(model, b)
    expect_error(ValueError, ("stock logits", "logits_logprob"), policy_head.logprobs, logits, targets)

    # Freed outputs leave nothing behind: a model dropped with its head is gone at the next
    # collection, with no other forward run since, even while an output of its no_grad forward is
    # kept (which then belongs to no live head); once that is freed too, nothing could have made a
    # tensor.
    reference_alive = weakref.ref(reference)
    kept = reference_output
    del policy_output, reference_output, copied, logits, reference, reference_head
    gc.collect()
    assert reference_alive() is None, f"{label}: a dropped model stayed alive behind its head's forwards"
    expect_error(RuntimeError, ("whose head is gone", names[1]), policy_head.logprobs, kept, targets)
    # A copy of that output while a policy output is alive too: nothing links it, and the dropped
    # model's forward could have made it as well as the policy's (not computed with the policy's
    # weights).
    with torch.no_grad():
        copied, policy_alive = kept.clone(), harness.forward(model, a)
    expect_error(RuntimeError, ("nothing links", "could have made it"), policy_head.logprobs, copied, targets)
    del kept, copied, policy_alive
    # A collective's pending work (a gloo worker thread) can hold the last sequence-parallel gather's
    # output a moment longer, on either rank; the registry's entries are read here without pruning.
    deadline = time.monotonic() + 30
    while any(not entry.storage.expired() for entry in list(provenance._entries)) and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    # The collection itself forgets the expired entries (their calls hold the output weights).
    assert not provenance._entries, (label, len(provenance._entries))
    stray = torch.randn(harness.BATCH, harness.SEQ, harness.HIDDEN)
    expect_error(RuntimeError, ("nothing links", "no forward's output is alive"), policy_head.logprobs, stray, targets)
    unwrap_model(model)


def check_compiled_model(batches, label):
    """``torch.compile`` of the wrapped model (dynamo, autograd traced ahead of time): the hooks
    and the output layer's marker run between its graphs, and the interleaved scenario still gets
    the stock values and gradients, the output weight's included. One layer: dynamo's tracing of
    each layer is most of this check's time, and a second layer adds nothing the head sees."""
    model = harness.build_gpt(dataclasses.replace(harness.CPU_TEST_SHAPE, layers=1))
    stock_values = interleaved_no_grad(model, Stock(model), batches)
    stock_grads = grads_of(model)
    head = wrap_model(model, FUSED)
    fused_values = interleaved_no_grad(torch.compile(model, backend="aot_eager"), Fused(head), batches)
    for index, (got, want) in enumerate(zip(fused_values, stock_values, strict=True)):
        harness.assert_max_error(got, want, VALUE_ATOL, f"{label} compiled value {index}")
    harness.assert_grads_close(grads_of(model), stock_grads, GRAD_RTOL, f"{label} compiled")
    unwrap_model(model)


def provenance_worker() -> None:
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
        batches = (harness.make_batch(seed=7), harness.make_batch(seed=8))
        check_scenarios(model, batches, tied, label)
        check_refusals(model, batches, label)
    if torch.distributed.get_rank() == 0:  # at TP=1 the other rank would compile the same again
        check_compiled_model(batches, "TP=1")


def test_the_head_computes_each_output_with_its_own_forward():
    harness.spawn(provenance_worker, 2)


def ranks_decide_together_worker() -> None:
    """A tensor nothing links, while the ranks of the group hold different live outputs: what a
    gloo worker thread or NCCL's watchdog does for a moment with the memory of a freed output that
    a collective wrote (a sequence-parallel gather's). Here the ranks keep different outputs on
    purpose. Every rank must raise: a rank that computed while another raised would wait in the
    op's collectives, so each check ends at a barrier that fails after a minute, not at gloo's
    30-minute timeout."""
    harness.tensor_parallel(2)
    rank = torch.distributed.get_rank()
    model, other = harness.build_gpt(), harness.build_gpt(seed=99)
    head, other_head = wrap_model(model, FUSED), wrap_model(other, FUSED)
    batch = harness.make_batch(seed=7)
    targets = batch[3]
    stray = torch.randn(harness.BATCH, harness.SEQ, harness.HIDDEN)

    def every_rank_raises(*match):
        gc.collect()
        expect_error(RuntimeError, match, head.logprobs, stray, targets)
        torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=60))

    with torch.no_grad():  # every forward runs on both ranks: it is collective under TP
        held = harness.forward(model, batch)
    if rank == 0:
        del held
    every_rank_raises("nothing links", "no forward's output is alive on some ranks of the tensor-parallel group")
    # This head's output on rank 0, both models' on rank 1.
    with torch.no_grad():
        held, held_other = harness.forward(model, batch), harness.forward(other, batch)
    if rank == 0:
        del held_other
    several = ("another rank", "several forwards") if rank == 0 else (head.name, other_head.name)
    every_rank_raises("nothing links", "could have made it", *several)
    # The other model's output on rank 0, this head's on rank 1.
    with torch.no_grad():
        fresh = harness.forward(other, batch)
    if rank == 0:
        held = fresh  # in place of this head's
    else:
        del held_other
    del fresh
    other_model = ("another wrapped model", other_head.name)
    every_rank_raises(*(other_model if rank == 0 else ("nothing links", f"not {head.name}'s")))
    # The other model's output alone on both: each names it.
    with torch.no_grad():
        held = harness.forward(other, batch)
    every_rank_raises(*other_model)
    unwrap_model(model)
    unwrap_model(other)


def test_the_ranks_decide_together_on_a_tensor_nothing_links():
    harness.spawn(ranks_decide_together_worker, 2)


SQUARE = harness.GPTShape(hidden=16, heads=4, layers=1, vocab=16, seq=16, micro_batch=2)


def not_hidden_states_worker() -> None:
    harness.tensor_parallel(1)
    model = harness.build_gpt(SQUARE)
    head = wrap_model(model, FUSED)
    batch = harness.causal_batch(SQUARE, SQUARE.vocab, seed=3)
    targets = batch[3]
    loss = harness.forward(model, batch, labels=targets)
    assert loss.shape[-1] == SQUARE.hidden  # the shape alone would pass for hidden states
    named = ("per-token loss", "labels=")
    expect_error(ValueError, named, head.logprobs, loss, targets)
    # Named by where it comes from whatever its shape, not told that its last dimension is off.
    expect_error(ValueError, named, head.logprobs, loss[:, :5], targets[:, :5])
    expect_error(
        ValueError, named, head.loss, 2 * loss, targets, losses.cross_entropy, loss_inputs={"weight": loss.detach()}
    )
    with torch.no_grad():  # no graph: the storage tells, views and .detach() included
        quiet = harness.forward(model, batch, labels=targets)
    expect_error(ValueError, named, head.logprobs, quiet, targets)
    expect_error(ValueError, named, head.logprobs, quiet.detach()[:1], targets[:1])
    expect_error(ValueError, named, head.logprobs, quiet[:, :5], targets[:, :5])
    with head.stock_logits():
        logits = harness.forward(model, batch)
    assert logits.shape[-1] == SQUARE.hidden
    expect_error(ValueError, ("stock logits", "head.stock_logits()"), head.logprobs, logits.detach(), targets)
    # The hidden states of the same model are still taken.
    assert head.logprobs(harness.forward(model, batch), targets).shape == targets.shape
    unwrap_model(model)


def test_what_the_forward_returns_instead_of_hidden_states_is_refused_by_where_it_comes_from():
    harness.spawn(not_hidden_states_worker, 1)
