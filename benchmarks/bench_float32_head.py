"""A float32 head (float32 hidden states and weight) on one GPU: the fused ops of the Triton backend,
whose float32 products run by 3xTF32 on tensor cores (``tl.dot``'s "tf32x3"), beside stock's float32
head (cuBLAS's float32 product with TF32 off, then float32 log-softmax): the forward (``no_grad``,
log-prob and entropy), the forward + backward of both (the inputs' random upstream gradients), and
the SFT loss (a token mean; ours the three-GEMM pass). ``--pairs`` alternated (stock, ours)
measurements in one process (each pair's first in turn), each the median of ``--repeats`` calls
after ``--warmup``; the report gives each pair's ratio. ``--errors`` rows of the first shape are
also checked against float64 (log-prob and entropy: largest error; gradients: error norm over the
float64 gradient's norm).
``--tiles`` adds variants of the float32 tiles (``M,N,K,warps,stages``, ``;`` between variants).

    PYTHONPATH=.:benchmarks python benchmarks/bench_float32_head.py --json float32.json
"""

from __future__ import annotations

import statistics

import torch
from harness import make_inputs, parse_shapes, result_row, shape_name, timing_parser, try_measure, write_rows

from devkit.oracle import max_abs_error, reference
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, losses
from megatron_fused_lm.ops.backends.triton import TritonBackend
from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
from megatron_fused_lm.ops.kernels.tiles import Tiles


def stock_steps(inputs):
    """Stock's float32 head: the logits in float32 (TF32 off), float32 log-softmax."""
    hidden, weight, targets = inputs.hidden, inputs.weight, inputs.targets

    def values():
        log_softmax = torch.log_softmax(hidden @ weight.t(), dim=-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        return log_softmax.gather(-1, targets[:, None]).squeeze(-1), entropy

    def forward():
        with torch.no_grad():
            return values()

    def recompute():
        torch.autograd.backward(values(), [inputs.grad_logprob, inputs.grad_entropy])

    def sft():
        torch.nn.functional.cross_entropy(hidden @ weight.t(), targets).backward()

    return {"forward": forward, "recompute": recompute, "sft": sft, "values": values}


def fused_steps(inputs, backend):
    hidden, weight, targets = inputs.hidden, inputs.weight, inputs.targets

    def values():
        return fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend=backend)

    def forward():
        with torch.no_grad():
            return values()

    def recompute():
        torch.autograd.backward(values(), [inputs.grad_logprob, inputs.grad_entropy])

    weights = torch.full_like(inputs.grad_logprob, 1.0 / targets.numel())

    def sft():
        fused_linear_loss(
            hidden, weight, targets, losses.cross_entropy, loss_inputs={"weight": weights}, backend=backend
        ).loss.backward()

    return {"forward": forward, "recompute": recompute, "sft": sft, "values": values}


def errors(steps, inputs, rows):
    """Errors against float64 of the log-prob, entropy and both gradients of the first ``rows``."""
    hidden = inputs.hidden.detach()[:rows].clone().requires_grad_()
    weight = inputs.weight.detach().clone().requires_grad_()
    part = type(inputs)(hidden, weight, inputs.targets[:rows], inputs.grad_logprob[:rows], inputs.grad_entropy[:rows])
    logprob, entropy = steps(part)["values"]()
    torch.autograd.backward([logprob, entropy], [part.grad_logprob, part.grad_entropy])
    exact = reference(hidden.detach(), weight.detach(), part.targets, 1.0, part.grad_logprob, part.grad_entropy)

    def norm_error(actual, expected):
        return float((actual.double() - expected).norm() / expected.norm())

    return dict(
        logprob=max_abs_error(logprob, exact.logprob),
        entropy=max_abs_error(entropy, exact.entropy),
        grad_hidden=norm_error(hidden.grad, exact.grad_hidden),
        grad_weight=norm_error(weight.grad, exact.grad_weight),
    )


def parse_tiles(text):
    variants = {}
    for spec in filter(None, text.split(";")):
        block_m, block_n, block_k, warps, stages = (int(part) for part in spec.split(","))
        tiles = Tiles(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=stages, dot_precision="tf32x3")
        variants[f"triton:{spec}"] = TritonBackend(TritonTuning(forward_tiles=tiles, backward_tiles=tiles))
    return variants


def main():
    parser = timing_parser(__doc__.splitlines()[0], "4096x2048x151936,8192x4096x151936", warmup=1, repeats=5)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--errors", type=int, default=1024)
    parser.add_argument("--tiles", default="")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda"
    backends = dict({"triton": "triton"}, **parse_tiles(args.tiles))
    rows = []
    for index, shape in enumerate(parse_shapes(args.shapes)):
        inputs = make_inputs(*shape, torch.float32, device)
        if index == 0 and args.errors:
            for name, steps in [("stock", stock_steps)] + [
                (label, lambda part, backend=backend: fused_steps(part, backend)) for label, backend in backends.items()
            ]:
                row = dict(
                    shape=shape_name(shape), head=name, errors_of_rows=args.errors, **errors(steps, inputs, args.errors)
                )
                rows.append(row)
                print(row, flush=True)
        for label, backend in backends.items():
            for use in ("forward", "recompute", "sft"):
                ratios, pair_ms = [], []
                heads = [("stock", stock_steps(inputs)), (label, fused_steps(inputs, backend))]
                for pair in range(args.pairs):
                    times = {}
                    for head, steps in heads if pair % 2 == 0 else heads[::-1]:  # each first in turn
                        step = steps[use]
                        measurement, failure = try_measure(lambda step=step: step, inputs, args.warmup, args.repeats)
                        row = result_row(measurement, failure, shape=shape_name(shape), use=use, head=head, pair=pair)
                        rows.append(row)
                        times[head] = row.get("ms")
                    pair_ms.append(times)
                    if None not in times.values():
                        ratios.append(times[label] / times["stock"])
                summary = dict(
                    shape=shape_name(shape), head=label, use=use, ms=pair_ms, ratios=[round(r, 4) for r in ratios]
                )
                if ratios:
                    summary["median_ratio"] = round(statistics.median(ratios), 4)
                rows.append(summary)
                print(summary, flush=True)
        del inputs
    write_rows(args.json, device, rows, torch.float32)


if __name__ == "__main__":
    main()
