"""Several targets per row (``targets [..., k]``) on the four-GEMM path, against the float64 oracle:
``fused_linear_logprob`` (torch backend here; the Triton backend's part is its forward with no
target, which test_triton_interpreter.py covers, and tests/gpu/test_triton_parity.py runs it whole)
and ``logits_logprob``, with entropy, masks, ``max_rows``, a temperature per row, repeated ids in
a row, peaked rows, tensor parallelism over two gloo ranks; and the refusals.

The oracle is ``log_softmax`` of the float64 logits gathered at the ids, with autograd through it.
Tolerances: float32 inputs within ``FLOAT32_TOL`` (the one-target tests' bound); a dropped term
(the ``-sum_j g_j softmax`` part, or the gathered rows' own) is off by O(1).
"""

import pytest
import torch
import torch.distributed as dist

from devkit.oracle import make_case, relative_error
from devkit.spawn import run_ranks
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    logits_logprob,
)

H, V, LEAD, K = 24, 97, (3, 10), 5
FLOAT32_TOL = 2e-5


def oracle(hidden, weight, ids, temperature, grad_logprob, grad_entropy):
    """Float64 ``(logprob [..., k], entropy [...], grad_hidden, grad_weight)``."""
    leaves = [tensor.detach().double().requires_grad_() for tensor in (hidden, weight)]
    scale = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    log_probs = torch.log_softmax(leaves[0] @ leaves[1].t() / scale, dim=-1)
    logprob = log_probs.gather(-1, ids)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    loss = (logprob * grad_logprob.double()).sum() + (entropy * grad_entropy.double()).sum()
    return (logprob.detach(), entropy.detach(), *torch.autograd.grad(loss, leaves))


def ids_of(seed, shape=(*LEAD, K)):
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    ids[..., 1] = ids[..., 0]  # an id twice in one row: both entries, both gradients
    return ids


def leaves(*tensors):
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "peaky"])
@pytest.mark.parametrize("temperature", ["one", "per_row"])
@pytest.mark.parametrize("token_chunk", [None, 7])
def test_fused_against_the_oracle(peaky, temperature, token_chunk):
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=peaky, seed=1)
    ids = ids_of(2)
    if temperature == "one":
        temperature = 0.8
    else:
        temperature = torch.rand(LEAD, generator=torch.Generator().manual_seed(3)) * 1.5 + 0.5
    grad_logprob, grad_entropy = torch.randn(*LEAD, K), torch.randn(LEAD)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        leaf_hidden, leaf_weight, ids, temperature=temperature, return_entropy=True, token_chunk=token_chunk
    )
    assert logprob.shape == (*LEAD, K) and entropy.shape == LEAD and logprob.dtype == torch.float32
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    expected = oracle(hidden, weight, ids, temperature, grad_logprob, grad_entropy)
    for actual, exact in zip((logprob, entropy, leaf_hidden.grad, leaf_weight.grad), expected, strict=True):
        assert relative_error(actual, exact) <= FLOAT32_TOL


@pytest.mark.parametrize("max_rows", [None, 20])
def test_masked_rows(max_rows):
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=True, seed=4)
    ids = ids_of(5)
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(6)) < 0.5
    mask[-1, -1] = False  # max_rows pads with the last row: its ids must not be read either
    ids[~mask] = V + 7  # unselected rows' ids are not read
    grad_logprob = torch.randn(*LEAD, K) * mask.unsqueeze(-1)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob = fused_linear_logprob(leaf_hidden, leaf_weight, ids, mask=mask, max_rows=max_rows)
    (logprob * grad_logprob).sum().backward()
    assert torch.count_nonzero(logprob[~mask]) == 0
    expected = oracle(hidden, weight, ids.clamp(max=V - 1), 1.0, grad_logprob, torch.zeros(LEAD))
    assert relative_error(logprob[mask], expected[0][mask]) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected[2]) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected[3]) <= FLOAT32_TOL


def test_logits_logprob_against_the_oracle():
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=True, seed=7)
    ids = ids_of(8)
    temperature = torch.rand(LEAD, generator=torch.Generator().manual_seed(9)) * 1.5 + 0.5
    grad_logprob, grad_entropy = torch.randn(*LEAD, K), torch.randn(LEAD)
    logits = (hidden @ weight.t()).detach().requires_grad_()
    logprob, entropy = logits_logprob(logits, ids, temperature=temperature, return_entropy=True, token_chunk=4)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    leaf = logits.detach().double().requires_grad_()
    log_probs = torch.log_softmax(leaf / temperature.double().unsqueeze(-1), -1)
    exact = log_probs.gather(-1, ids)
    (
        (exact * grad_logprob.double()).sum() - ((log_probs.exp() * log_probs).sum(-1) * grad_entropy.double()).sum()
    ).backward()
    assert relative_error(logprob, exact.detach()) <= FLOAT32_TOL
    assert relative_error(logits.grad, leaf.grad) <= FLOAT32_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_confident_rows_keep_the_one_target_paths_precision(dtype):
    # Rows whose id takes almost all the mass (p near 1), given twice: the ids' +g and the shared
    # -sum(g) p nearly cancel, so they must meet in float32 before any rounding, as one target's
    # do. The same loss as one target with the summed upstream, so the one-target call's error
    # against the float64 oracle is the bound (a first version that added the ids' terms apart
    # from the shared one was off by O(1) here).
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=17)
    direction = weight[targets]
    hidden = (hidden + 6.0 * H**0.5 * direction / direction.norm(dim=-1, keepdim=True)).to(dtype)
    weight = weight.to(dtype)
    ids = torch.stack([targets, targets], dim=-1)
    grad_logprob = torch.rand(*LEAD, 2, generator=torch.Generator().manual_seed(19))
    expected = oracle(hidden, weight, ids, 1.0, grad_logprob, torch.zeros(LEAD))
    assert expected[0][..., 0].exp().median() > 0.999
    several_hidden, several_weight = leaves(hidden, weight)
    (fused_linear_logprob(several_hidden, several_weight, ids) * grad_logprob).sum().backward()
    single_hidden, single_weight = leaves(hidden, weight)
    (fused_linear_logprob(single_hidden, single_weight, targets) * grad_logprob.sum(-1)).sum().backward()
    for several, single, exact in (
        (several_hidden, single_hidden, expected[2]),
        (several_weight, single_weight, expected[3]),
    ):
        assert relative_error(several.grad, exact) <= 1.1 * relative_error(single.grad, exact)


def test_one_id_per_row_as_k_1_equals_the_one_target_call():
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=10)
    one = fused_linear_logprob(hidden, weight, targets)
    as_k = fused_linear_logprob(hidden, weight, targets.unsqueeze(-1))
    torch.testing.assert_close(as_k.squeeze(-1), one, rtol=0, atol=FLOAT32_TOL)


def test_refusals():
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=False, seed=11)
    ids = ids_of(12)
    with pytest.raises(ValueError, match="k >= 1"):
        fused_linear_logprob(hidden, weight, ids[..., :0])
    with pytest.raises(ValueError, match="out_of_vocab='error'"):
        fused_linear_logprob(hidden, weight, ids, out_of_vocab="max_logit")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused_linear_logprob(hidden, weight, ids.index_fill(-1, torch.tensor([2]), V))
    with pytest.raises(ValueError, match="must equal the leading shape"):  # its declared weights are per row
        fused_linear_cross_entropy(hidden, weight, ids, torch.ones(LEAD))
    # The messages name the real mistake: a mask shaped like the ids, not like the rows; kept sets,
    # which replay the sampling of one token per row.
    with pytest.raises(ValueError, match=r"must equal the rows' shape \(3, 10\).*one flag per row"):
        fused_linear_logprob(hidden, weight, ids, mask=torch.ones(ids.shape, dtype=torch.bool))
    with pytest.raises(ValueError, match="kept_tokens takes one target per row.*sampled token"):
        fused_linear_logprob(hidden, weight, ids, kept_tokens=(torch.arange(31) * K, ids.reshape(-1)))


def tensor_parallel_case(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    hidden, weight, _ = make_case(LEAD, H, 2 * V, torch.float32, peaky=True, seed=13)
    ids = torch.randint(0, 2 * V, (*LEAD, K), generator=torch.Generator().manual_seed(14))
    temperature = torch.rand(LEAD, generator=torch.Generator().manual_seed(15)) * 1.5 + 0.5
    gen = torch.Generator().manual_seed(16)
    grad_logprob, grad_entropy = torch.randn(*LEAD, K, generator=gen), torch.randn(LEAD, generator=gen)
    shard = weight[rank * V : (rank + 1) * V]
    leaf_hidden, leaf_shard = leaves(hidden, shard)
    logprob, entropy = fused_linear_logprob(
        leaf_hidden, leaf_shard, ids, tp_group=group, temperature=temperature, return_entropy=True, token_chunk=7
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    expected = oracle(hidden, weight, ids, temperature, grad_logprob, grad_entropy)
    assert relative_error(logprob, expected[0]) <= FLOAT32_TOL
    assert relative_error(entropy, expected[1]) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected[2]) <= FLOAT32_TOL
    assert relative_error(leaf_shard.grad, expected[3][rank * V : (rank + 1) * V]) <= FLOAT32_TOL
    logits = (hidden @ shard.t()).detach().requires_grad_()
    unfused = logits_logprob(logits, ids, tp_group=group, temperature=temperature)
    assert relative_error(unfused, expected[0]) <= FLOAT32_TOL


def test_two_ranks():
    run_ranks(tensor_parallel_case, 2)
