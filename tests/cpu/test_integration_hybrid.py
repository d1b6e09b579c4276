"""wrap_model beyond GPTModel: Megatron's hybrid language model (``HybridModel`` on megatron-core
0.19, ``MambaModel`` before; attention and MLP layers, since Mamba layers need CUDA kernels) at
TP=2 with and without sequence parallelism, tied and untied, and a multimodal model's language
model found through ``.language_model``. Against the stock model itself: the float64 oracle on its
gathered logits, its labels-path loss and every parameter's gradient; after ``unwrap_model`` the
stock logits bitwise. The hybrid model has no ``output_processor`` hook in any release, and the
processor says so.

Tolerances as in test_integration_parity (float32 models; measured errors about 2e-6).
"""

import itertools

import pytest
import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm.integration import FusedLMConfig, FusedOutputProcessor, unwrap_model, wrap_model

TEMPERATURE = 0.7
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
FUSED = FusedLMConfig(enabled=True, token_chunk=7)


class VisionLanguage(torch.nn.Module):
    """A multimodal model's layout as far as the head sees it: the language model is held as
    ``.language_model`` and does the text forward (Megatron's LLaVAModel and MIMO hold it so; their
    vision encoders need TransformerEngine to build)."""

    def __init__(self, language_model: torch.nn.Module):
        super().__init__()
        self.language_model = language_model

    def forward(self, input_ids, position_ids, attention_mask, **kwargs):
        return self.language_model(input_ids, position_ids, attention_mask, **kwargs)


def check_wrapped(model, language_model, label):
    batch = harness.make_batch()
    reference = harness.stock_reference(model, batch, TEMPERATURE)
    head = wrap_model(model, FUSED)
    assert head.fused and head.fallback_reason is None, (label, head.fallback_reason)
    assert "forward" in vars(language_model.output_layer), f"{label}: the language model's head was not patched"
    harness.check_head(
        model, head, batch, reference, label, temperature=TEMPERATURE, value_atol=VALUE_ATOL, grad_rtol=GRAD_RTOL
    )
    unwrap_model(model)
    assert torch.equal(harness.forward(model, batch), reference["logits"]), f"{label}: not stock after unwrap"


def worker() -> None:
    harness.tensor_parallel(2)
    for sequence_parallel, tied in itertools.product((False, True), (False, True)):
        label = f"hybrid sequence_parallel={sequence_parallel} tied={tied}"
        model = harness.build_hybrid(sequence_parallel=sequence_parallel, tied=tied)
        # Every release names it in Megatron's model classes; 0.19 renamed MambaModel to HybridModel.
        assert type(model).__name__ in ("HybridModel", "MambaModel"), label
        check_wrapped(model, model, label)
        # harness.ModuleWrapper stands for DDP / Float16Module around it.
        check_wrapped(harness.ModuleWrapper(model), model, f"{label} wrapped")
    with pytest.raises(RuntimeError, match="takes no output_processor"):
        FusedOutputProcessor(harness.build_hybrid(), FUSED)
    for tied in (False, True):
        language_model = harness.build_gpt(sequence_parallel=True, tied=tied)
        check_wrapped(VisionLanguage(language_model), language_model, f"multimodal tied={tied}")


def test_hybrid_and_multimodal_language_models():
    harness.spawn(worker, 2)
