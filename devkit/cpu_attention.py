"""What a GPU's attention kernels take that Megatron's local attention spec, the one that runs on a
CPU, does not: a stand-in module for the trainer tests that hold a GPTModel as ``.module`` (as DDP and
Float16Module do, so the trainers and ``wrap_model`` reach the model through it).

- Packed (THD) micro-batches: the local ``DotProductAttention`` asserts on ``packed_seq_params``.
  The stand-in runs the packed ``[1, T]`` row with a block-diagonal causal mask and each segment's
  positions restarting at 0: the attention and rotary positions a THD kernel computes with
  ``cu_seqlens_q_padded``.
- Padding masks: the local softmax takes a given mask *instead of* the causal one, where
  TransformerEngine's takes both. The stand-in adds the causal mask to a ``[b, 1, 1, s]`` padding
  mask (True = padding, SkyRL's ``to_te_attention_mask``) and to a ``[b, s]`` keep-mask (True = a
  real token, verl's BSHD layout).
"""

from __future__ import annotations

import torch

from devkit.megatron_gpt import packed_attention_mask


def segment_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 ``[1, T]``: each packed position's offset within its segment."""
    positions = torch.arange(int(cu_seqlens[-1]))
    segment = torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)
    return (positions - cu_seqlens.long()[segment]).unsqueeze(0)


class KernelStandIn(torch.nn.Module):
    """Holds ``module`` (a GPTModel) as ``.module`` and calls it with what its local attention can
    run; other attributes read through to it (verl's ``unwrap_model`` stops at known wrappers and
    then reads ``.config`` and friends)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward(self, input_ids, position_ids=None, attention_mask=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded.cpu()
            positions = segment_positions(cu_seqlens).to(input_ids.device)
            return self.module(input_ids, positions, packed_attention_mask(cu_seqlens).to(input_ids.device), **kwargs)
        length = input_ids.shape[1]
        causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool, device=input_ids.device), diagonal=1)
        if attention_mask is None:
            mask = causal
        elif attention_mask.dim() == 2:  # True = a real token
            mask = (~attention_mask.bool())[:, None, None, :] | causal
        else:  # True = padding
            mask = attention_mask.bool() | causal
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand_as(input_ids)
        return self.module(input_ids, position_ids, mask, **kwargs)
