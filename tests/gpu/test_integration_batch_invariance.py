"""``fused_linear_logprob_batch_invariant`` through the integration on one GPU: a bf16 GPTModel
wrapped with ``batch_invariant=True`` sends its labels path to the op with the option on. The
transformer body's own products depend on the batch, so the check is on the head alone: the hidden
gradient the labels path hands the final norm's output is, bit for bit, the op's with
``batch_invariant=True`` on those same hidden states in another row order (a row's gradient does
not depend on the rows beside it), and not the default op's."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
megatron = pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def one_rank():
    """This process as a torchrun job of one GPU, with Megatron's groups (TP = 1)."""
    import torch.distributed as dist

    from devkit import distributed
    from devkit.spawn import rank_environment, rendezvous_store

    store = rendezvous_store()  # held until the module's tests end
    # The environment goes back afterwards: a later init in this process must not look for this store.
    with mock.patch.dict(os.environ, rank_environment(0, 1, store.port)):
        device = distributed.init_distributed(1)
        yield device
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_the_labels_path_runs_the_batch_invariant_op(one_rank):
    from devkit import megatron_gpt
    from megatron_fused_lm import fused_linear_logprob
    from megatron_fused_lm.integration import FusedLMConfig, wrap_model

    shape = megatron_gpt.GPTShape(hidden=256, heads=4, layers=2, vocab=32000, seq=128, micro_batch=4)
    model = megatron_gpt.build_bf16_gpt(shape, one_rank, tied=False, sequence_parallel=False, seed=3, peaky=True)
    batch = megatron_gpt.causal_batch(shape, model.vocab_size, seed=7, device=one_rank)
    targets = batch[3]
    wrap_model(model, FusedLMConfig(enabled=True, backend="triton", batch_invariant=True))
    captured = {}

    def keep_output(module, inputs, output):
        output.retain_grad()
        captured["hidden"] = output

    handle = model.decoder.final_layernorm.register_forward_hook(keep_output)
    loss = megatron_gpt.forward(model, batch, labels=targets)  # [b, s]
    handle.remove()
    upstream = megatron_gpt.random_weights(*loss.shape, seed=12, device=one_rank)
    (upstream * loss).sum().backward()
    hidden = captured["hidden"]  # [s, b, h]
    assert hidden.grad is not None and hidden.grad.abs().max() > 0

    def op_grad(batch_invariant):
        # Rows in [b, s] order, the labels path's are [s, b]: another order of the same rows.
        leaf = hidden.detach().transpose(0, 1).contiguous().requires_grad_()
        logprob = fused_linear_logprob(
            leaf, model.output_layer.weight.detach(), targets, backend="triton", batch_invariant=batch_invariant
        )
        (-upstream * logprob).sum().backward()
        return leaf.grad.transpose(0, 1)

    assert torch.equal(hidden.grad, op_grad(True))
    assert not torch.equal(hidden.grad, op_grad(False))  # the option changes the bits: the check has teeth
