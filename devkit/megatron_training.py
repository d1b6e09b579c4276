"""Training a bf16 GPTModel with Megatron-Core's own machinery, for the multi-GPU scripts and the
real-text training run: Float16Module and DistributedDataParallel around each model chunk,
Megatron's Adam, the schedule's config hooks, the SFT loss, the noise reference's perturbation, and
a counter of the fused head's recompute warnings."""

from __future__ import annotations

import contextlib
import logging
import zlib
from typing import Sequence

import torch

from devkit import distributed


def megatron_training(
    gpts: Sequence[torch.nn.Module],
    device: torch.device,
    learning_rate: float,
    *,
    overlap_grad_reduce: bool = False,
    distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
):
    """``(chunks, optimizer)``: each GPTModel chunk in Float16Module and Megatron-Core's
    DistributedDataParallel (Megatron-LM's settings: fp32 gradient reduction, buckets on the first
    chunk only), Megatron's Adam over them (gradients clipped to norm 1 on a GPU; Megatron's
    clipping asserts CUDA gradients), and the first chunk's config given the schedule's hooks
    (``finalize_model_grads``, the no-sync and grad-sync functions), as Megatron-LM sets them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    on_gpu = device.type == "cuda"
    hidden = gpts[0].config.hidden_size
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
        # A tiny CPU model would fit one bucket: several, as a GPU model has, so that an overlapped
        # reduction starts bucket by bucket during the backward.
        bucket_size=None if on_gpu else 8 * hidden**2,
    )
    chunks = [
        DistributedDataParallel(
            config=gpt.config, ddp_config=ddp_config, module=Float16Module(gpt.config, gpt), disable_bucketing=index > 0
        )
        for index, gpt in enumerate(gpts)
    ]
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=learning_rate,
        weight_decay=0.0,
        adam_beta2=0.95,
        clip_grad=1.0 if on_gpu else 0.0,
        bf16=True,
        use_distributed_optimizer=distributed_optimizer,
    )
    with contextlib.nullcontext() if on_gpu else distributed.cpu_tensors_named_cuda():
        optimizer = get_megatron_optimizer(optimizer_config, chunks)
    config = gpts[0].config
    config.finalize_model_grads_func = finalize_model_grads
    virtual = len(chunks) > 1
    sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = sync if virtual else sync[0]
    if overlap_grad_reduce:
        grad_sync = [chunk.start_grad_sync for chunk in chunks]
        config.grad_sync_func = grad_sync if virtual else grad_sync[0]
    return chunks, optimizer


def set_learning_rate(optimizer, learning_rate: float) -> None:
    """As Megatron's learning-rate scheduler sets it: on every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate


def sft_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Megatron's SFT loss of a micro-batch, the masked sum over the token count (the schedule
    divides by the micro-batch count): the mean token loss."""
    loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum()
    # A copy: the schedule divides the returned loss in place by the number of micro-batches.
    return loss, {"loss": loss.detach().clone()}


def move_by_one_rounding(model: torch.nn.Module) -> None:
    """Multiply every weight entry by 1 + s 2^-7, s in {-1, 0, 1} (about one bf16 spacing, so the
    stored value moves by a rounding or two), with a sign pattern seeded by the weight's shape:
    TP-replicated weights and the two stages' tied copies move alike."""
    with torch.no_grad():
        for parameter in model.parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(str(tuple(parameter.shape)).encode()))
            sign = torch.randint(-1, 2, parameter.shape, generator=generator).to(parameter.device)
            parameter.mul_(1 + sign.to(parameter.dtype) * 2.0**-7)


class RecomputeCounter(logging.Handler):
    """Counts the package's warnings that a backward recomputed the logits or corrected a weight
    gradient added into ``main_grad`` by a second pass (the upstream gradient was not the declared
    one); each warning is logged once per process."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0
        self.messages = []  # every warning of the package, whatever it says
        logging.getLogger("megatron_fused_lm").addHandler(self)

    def emit(self, record):
        message = record.getMessage()
        self.messages.append(message)
        self.count += "recomputed" in message or "second pass" in message
