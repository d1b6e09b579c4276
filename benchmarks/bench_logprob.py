"""Side-by-side forward+backward benchmarks of the LM-head losses on one GPU; writes JSON and plots.

Every method runs in one process on identical inputs (bf16 by default, logits with standard
deviation about 4). Sections (``--sections``):

- ``rl``: per-token log-prob + entropy with random upstream gradients, at each ``--temperatures``:
  ``stock`` (materialized bf16 logits, float32 softmax), our ``torch``, ``triton`` and ``cute``
  backends (``cute``: Triton's with its forward statistics by the CuTe DSL kernel, Hopper only),
  ``liger_flsce`` (liger-kernel's CuTe fused linear scaled cross-entropy, SM90; see
  ``../shared/tools/gpu-cutedsl.sh`` for what a GPU host needs), ``liger_native`` (the same op by
  liger-kernel's native CUTLASS + NVSHMEM kernels, liger-cute-kernels' Hopper core, as a
  tensor-parallel group of one; ``devkit/gpu-liger-native.sh`` packs it, ``liger_native.py`` sets
  it up and records its workspace, which PyTorch's allocator does not see, as
  ``native_workspace_bytes``) and ``floor`` (the four cuBLAS GEMMs of any exact recompute method);
- ``forward``: the same without gradients (old and reference log-probs): ``triton``, ``cute``,
  ``liger_flsce``, ``liger_native`` and ``floor1`` (the logits GEMM);
- ``sft``: mean cross-entropy: ``stock``, ``ours`` (``fused_linear_loss`` with
  ``losses.cross_entropy``: the gradients finished in the forward, three GEMMs), ``recompute`` (the
  mean of ``-fused_linear_logprob``, as the labels path computes it: four GEMMs), ``liger``
  (liger-kernel's fused linear cross-entropy), ``cce`` (Apple's cut-cross-entropy), ``torch_lce``
  (PyTorch's ``linear_cross_entropy``), ``quack`` and ``quack_basic`` (quack's chunked linear
  cross-entropy, its scaled-exponential route where it takes it and its basic one; a mean only),
  ``liger_native`` (the mean of its per-token NLL) and ``floor`` (three GEMMs); a missing package
  (or a peer that cannot run on this device) gives a ``missing`` row with the reason, never a number;
- ``rl_loss``: a policy loss known in the forward (``losses.ClippedPolicyLoss``, clip 0.2 / 0.28,
  entropy bonus ``--entropy-coef`` (0.01), token mean; ``--kl-coef`` adds a k3 KL penalty) at temperature 1: ``stock``
  (bf16 logits, ``logits_loss``), ``recompute`` (the loss on ``fused_linear_logprob``'s log-prob and
  entropy: four GEMMs), ``ours`` (``fused_linear_loss``: three), ``liger_flsce`` and ``liger_native``
  (the loss on the peer's log-prob and entropy, as ``recompute``) and ``floor3`` (three GEMMs);
- ``scaling``: hidden x vocabulary ``--scaling-shape``, tokens doubling from ``--scaling-start``
  until each method runs out of memory or ``--scaling-max-tokens`` is reached (a cap that keeps
  the run short);
- ``fractions``: log-prob + entropy of only the response positions (``mask=``) of packed
  sequences of ``--sequence-length`` tokens, at each response ``--fractions``.

Each row records the median time, the peak extra memory and the max |log-prob error| against a
float64 oracle on ``--sample`` tokens (harness.py says how). The ``sft`` and ``rl_loss`` rows also
record the error of the hidden states' gradient on those tokens (``grad_hidden_error``: the
largest |error| over the largest |gradient|; a token's hidden gradient needs only its own logits,
while the weight's gradient needs every token and is not checked), and the ``rl_loss`` rows the
entropy error and the summed loss. The JSON is rewritten after every shape, so an interrupted run
keeps what it measured; ``--plots DIR`` draws the PNGs (report.py).

    PYTHONPATH=. python3 benchmarks/bench_logprob.py --json results.json --plots plots/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
from harness import (
    GIB,
    REFERENCE_SHAPES,
    make_inputs,
    oracle,
    parse_shapes,
    result_row,
    sample_error,
    sample_rows,
    shape_name,
    try_measure,
)
from methods import (
    ENTROPY_COEF,
    FORWARD_METHODS,
    FUSED_BACKEND,
    OLD_LOGPROB_NOISE,
    RL_LOSS_METHODS,
    RL_METHODS,
    SFT_METHODS,
    floor_step,
    forward_step,
    import_competitors,
    policy_loss,
    policy_loss_inputs,
    rl_loss_step,
    rl_step,
    sft_logprob,
    sft_mean_loss,
    sft_step,
    sft_weights,
)

from devkit.measure import environment, release_memory
from devkit.oracle import logprob_entropy, relative_error
from megatron_fused_lm import losses, response_mask

SECTIONS = ("rl", "forward", "sft", "rl_loss", "scaling", "fractions")
# Each section's floor: the row its others are divided by (``vs_floor``).
FLOORS = {"rl": "floor", "forward": "floor1", "sft": "floor", "rl_loss": "floor3"}
# (use, method) pairs of the scaling section: every SFT method that can run out of memory, and
# the RL stock path next to our Triton backend.
SCALING_SERIES = (
    ("sft", "stock"),
    ("sft", "ours"),
    ("sft", "liger"),
    ("sft", "cce"),
    ("rl", "stock"),
    ("rl", "triton"),
)
FRACTION_METHODS = ("stock", "triton")


def response_fraction_mask(tokens, fraction, sequence_length, device):
    """Response mask of packed sequences of ``sequence_length`` tokens, the last ``fraction`` of
    each being response. Position t scores token t + 1, so a sequence of L tokens has at most
    L - 1 response log-probs: fraction 1 selects (L - 1) / L of the tokens."""
    starts = torch.arange(0, tokens, sequence_length, device=device)
    cu_seqlens = torch.cat([starts, torch.tensor([tokens], device=device)])
    lengths = cu_seqlens.diff()
    response_lengths = ((lengths - 1) * fraction).round().long()
    return response_mask(cu_seqlens, lengths - response_lengths, response_lengths)


def loss_oracle(inputs, sample, loss_fn, loss_inputs):
    """Float64 ``(logprob, entropy, grad_hidden)`` of the rows ``sample`` (temperature 1), the
    gradient that of ``sum_t loss_fn(logprob_t, entropy_t, **inputs_t)``. A row's hidden gradient
    depends on its own logits and loss alone, so these rows give it exactly; the weight's gradient
    sums over every row and is not checked."""
    hidden = inputs.hidden.detach()[sample].double().requires_grad_()
    with torch.enable_grad():
        logprob, entropy = logprob_entropy(hidden @ inputs.weight.detach().double().t(), inputs.targets[sample])
        rows = {name: value[sample].double() for name, value in loss_inputs.items()}
        (grad_hidden,) = torch.autograd.grad(loss_fn(logprob, entropy, **rows).sum(), hidden)
    return logprob.detach(), entropy.detach(), grad_hidden


def mean_loss_oracle(inputs, rows_per_chunk=1024):
    """The float64 mean cross-entropy over every row (temperature 1), the logits a chunk of rows at
    a time."""
    hidden, weight, targets = inputs.hidden.detach(), inputs.weight.detach().double(), inputs.targets
    total = 0.0
    for start in range(0, hidden.shape[0], rows_per_chunk):
        logits = hidden[start : start + rows_per_chunk].double() @ weight.t()
        chosen = logits.gather(1, targets[start : start + rows_per_chunk, None]).squeeze(1)
        total += float((torch.logsumexp(logits, dim=1) - chosen).sum())
    return total / hidden.shape[0]


def grad_error(grad, sample, reference):
    """Largest |error| of the gradient's rows ``sample`` over the largest |reference gradient|."""
    return relative_error(grad[sample], reference)


class Benchmark:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.competitors, self.missing = import_competitors(native_shapes(args), self.device)
        self.rows = []

    def measure_row(self, make_step, inputs, timing=None, record=None, **fields):
        """Measure one method into a new row. ``record(row, outputs)``, if given, reads what the
        step returned (a gradient, say) into the row; the outputs are dropped after it, so that
        no method's memory holds the previous one's."""
        warmup, repeats = timing or (self.args.warmup, self.args.repeats)
        measurement, failure = try_measure(make_step, inputs, warmup, repeats)
        row = result_row(measurement, failure, **fields)
        if fields.get("method") == "liger_native" and "shape" in fields:
            row.update(self.competitors["liger_native"].row_fields(parse_shapes(fields["shape"])[0]))
        self.rows.append(row)
        if record is not None and measurement is not None:
            outputs, measurement.outputs = measurement.outputs, None
            record(row, outputs)
            del outputs
            release_memory()
        return row, measurement

    def missing_row(self, method, **fields):
        self.rows.append(dict(fields, method=method, status="missing", note=self.missing[method]))

    def rl(self, shape, inputs, sample):
        name = shape_name(shape)
        first = len(self.rows)
        if "floor" in self.args.rl_methods:
            self.measure_row(
                lambda: floor_step(inputs, recompute=True), inputs, section="rl", shape=name, method="floor"
            )
        for temperature in self.args.temperatures:
            ref_logprob, ref_entropy = oracle(inputs, sample, temperature)
            for method in self.args.rl_methods:
                if method == "floor":
                    continue
                if method in self.missing:
                    self.missing_row(method, section="rl", shape=name, temperature=temperature)
                    continue
                row, measurement = self.measure_row(
                    lambda: rl_step(method, inputs, temperature, competitors=self.competitors),
                    inputs,
                    section="rl",
                    shape=name,
                    method=method,
                    temperature=temperature,
                )
                if measurement is not None:
                    record_errors(row, measurement.outputs, sample, (ref_logprob, ref_entropy))
        add_floor_ratios(self.rows[first:], FLOORS["rl"])

    def forward(self, shape, inputs, sample):
        """Log-prob + entropy without gradients against the logits GEMM alone (``floor1``)."""
        name = shape_name(shape)
        first = len(self.rows)
        ref_logprob, ref_entropy = oracle(inputs, sample)
        for method in self.args.forward_methods:
            if method in self.missing:
                self.missing_row(method, section="forward", shape=name)
                continue
            row, measurement = self.measure_row(
                lambda: forward_step(method, inputs, self.competitors),
                inputs,
                section="forward",
                shape=name,
                method=method,
            )
            if measurement is not None and method != "floor1":
                record_errors(row, measurement.outputs, sample, (ref_logprob, ref_entropy))
        add_floor_ratios(self.rows[first:], FLOORS["forward"])

    def sft(self, shape, inputs, sample):
        name = shape_name(shape)
        first = len(self.rows)
        reference = self.sft_oracle(inputs, sample)
        for method in self.args.sft_methods:
            if method in self.missing:
                self.missing_row(method, section="sft", shape=name)
            elif method == "floor":
                self.measure_row(
                    lambda: floor_step(inputs, recompute=False), inputs, section="sft", shape=name, method="floor"
                )
            else:
                self.measure_row(
                    lambda: sft_step(method, self.competitors, inputs, self.args.loss_token_chunk),
                    inputs,
                    record=lambda row, grad: self.record_sft_error(row, method, inputs, sample, reference, grad),
                    section="sft",
                    shape=name,
                    method=method,
                )
        add_floor_ratios(self.rows[first:], FLOORS["sft"])

    def sft_oracle(self, inputs, sample):
        """Float64 log-prob and hidden gradient of the mean cross-entropy on the rows ``sample``,
        and the mean cross-entropy over every row."""
        logprob, _, grad_hidden = loss_oracle(inputs, sample, losses.cross_entropy, {"weight": sft_weights(inputs)})
        return logprob, grad_hidden, mean_loss_oracle(inputs)

    def record_sft_error(self, row, method, inputs, sample, reference, grad):
        """The hidden gradient's error (``grad``: what the timed step left), the error of the mean
        loss the method returns, then the log-prob error of its per-token forward."""
        ref_logprob, ref_grad, ref_loss = reference
        try:
            row["grad_hidden_error"] = grad_error(grad, sample, ref_grad)
            del grad
            row["mean_loss_error"] = abs(float(sft_mean_loss(method, self.competitors, inputs)) - ref_loss)
            logprob = sft_logprob(method, self.competitors, inputs)  # after: a peer may return no per-token loss
            row["logprob_max_error"] = sample_error(logprob, sample, ref_logprob)
        except Exception as error:  # keep the timing; say why the error check is absent
            row["note"] = f"error check failed: {type(error).__name__}: {error}"
        release_memory()

    def rl_loss(self, shape, inputs, sample):
        """The policy loss known in the forward: three GEMMs (``ours``) against the stock path, the
        per-token op plus autograd (``recompute``) and the three-GEMM floor (``floor3``)."""
        name = shape_name(shape)
        first = len(self.rows)
        loss_fn = policy_loss(self.args.kl_coef, self.args.entropy_coef)
        loss_inputs = policy_loss_inputs(inputs, self.args.kl_coef)
        reference = loss_oracle(inputs, sample, loss_fn, loss_inputs)
        for method in self.args.rl_loss_methods:
            fields = dict(section="rl_loss", shape=name, method=method)
            if method in self.missing:
                self.missing_row(method, section="rl_loss", shape=name)
            elif method == "floor3":
                self.measure_row(lambda: floor_step(inputs, recompute=False), inputs, **fields)
            else:
                self.measure_row(
                    lambda: rl_loss_step(
                        method, inputs, loss_fn, loss_inputs, self.args.loss_token_chunk, self.competitors
                    ),
                    inputs,
                    record=lambda row, outputs: record_loss_errors(row, outputs, sample, reference),
                    **fields,
                )
        add_floor_ratios(self.rows[first:], FLOORS["rl_loss"])

    def fractions(self, shape, inputs):
        for fraction in self.args.fractions:
            mask = response_fraction_mask(shape[0], fraction, self.args.sequence_length, self.device)
            sample = sample_rows(mask.nonzero().squeeze(1), self.args.sample)
            ref_logprob, ref_entropy = oracle(inputs, sample)
            for method in FRACTION_METHODS:
                row, measurement = self.measure_row(
                    lambda: rl_step(method, inputs, 1.0, mask=mask),
                    inputs,
                    section="fractions",
                    shape=shape_name(shape),
                    method=method,
                    fraction=fraction,
                    selected_tokens=int(mask.sum()),
                )
                if measurement is not None:
                    record_errors(row, measurement.outputs, sample, (ref_logprob, ref_entropy))

    def scaling(self):
        hidden_size, vocab = self.args.scaling_shape
        timing = (self.args.scaling_warmup, self.args.scaling_repeats)
        stopped = {series for series in SCALING_SERIES if series[1] in self.missing}
        for use, method in sorted(stopped):
            self.missing_row(method, section="scaling", use=use)
        tokens = self.args.scaling_start
        while tokens <= self.args.scaling_max_tokens and len(stopped) < len(SCALING_SERIES):
            shape = (tokens, hidden_size, vocab)
            inputs = make_inputs(*shape, self.dtype, self.device)
            sample = sample_rows(torch.arange(tokens, device=self.device), self.args.sample)
            reference = self.sft_oracle(inputs, sample)
            for use, method in SCALING_SERIES:
                if (use, method) in stopped:
                    continue
                fields = dict(section="scaling", shape=shape_name(shape), tokens=tokens, use=use, method=method)
                if use == "rl":
                    row, measurement = self.measure_row(lambda: rl_step(method, inputs, 1.0), inputs, timing, **fields)
                    if measurement is not None:
                        row["logprob_max_error"] = sample_error(measurement.outputs[0], sample, reference[0])
                else:
                    row, measurement = self.measure_row(
                        lambda: sft_step(method, self.competitors, inputs),
                        inputs,
                        timing,
                        record=lambda row, grad: self.record_sft_error(row, method, inputs, sample, reference, grad),
                        **fields,
                    )
                if measurement is None:
                    stopped.add((use, method))
            del inputs
            release_memory()
            print_table(self.rows_of(shape))
            tokens *= 2

    def rows_of(self, shape):
        return [row for row in self.rows if row.get("shape") == shape_name(shape)]

    def run(self):
        args = self.args
        sections = set(args.sections)
        shapes = args.shapes if sections & {"rl", "forward", "sft", "rl_loss"} else []
        fraction_shapes = args.fraction_shapes if "fractions" in sections else []
        meta = environment(self.device, self.dtype)
        # The settings, less where this run's files went and the device kind (meta names the device).
        meta.update(
            {key: value for key, value in vars(args).items() if key not in ("json", "plots", "device")},
            missing=self.missing,
            fused_backend=FUSED_BACKEND,
            liger_native=native_meta(self.competitors.get("liger_native")),
            rl_loss={
                "loss_fn": dataclasses.asdict(policy_loss(args.kl_coef, args.entropy_coef)),
                "old_logprob_noise": OLD_LOGPROB_NOISE,
            },
        )
        for shape in dict.fromkeys(shapes + fraction_shapes):  # each shape's inputs made once
            inputs = make_inputs(*shape, self.dtype, self.device)
            sample = sample_rows(torch.arange(shape[0], device=self.device), args.sample)
            if shape in shapes and "rl" in sections:
                self.rl(shape, inputs, sample)
            if shape in shapes and "forward" in sections:
                self.forward(shape, inputs, sample)
            if shape in shapes and "sft" in sections:
                self.sft(shape, inputs, sample)
            if shape in shapes and "rl_loss" in sections:
                self.rl_loss(shape, inputs, sample)
            if shape in fraction_shapes:
                self.fractions(shape, inputs)
            del inputs
            release_memory()
            print_table(self.rows_of(shape))
            write_json(args.json, meta, self.rows)
        if "scaling" in sections:
            self.scaling()
            write_json(args.json, meta, self.rows)
        print(json.dumps({key: meta[key] for key in ("device", "date", "versions")}))
        print_table(self.rows)
        return {"meta": meta, "rows": self.rows}


def native_shapes(args):
    """The shapes ``liger_native`` reserves its workspace for, ``None`` where no selected section
    runs it (then it is not set up: no NVSHMEM in the process)."""
    methods = {
        "rl": args.rl_methods,
        "forward": args.forward_methods,
        "sft": args.sft_methods,
        "rl_loss": args.rl_loss_methods,
    }
    if any("liger_native" in methods[section] for section in methods if section in args.sections):
        return list(args.shapes)
    return None


def native_meta(native):
    """How ``liger_native`` ran: its reserved capacity, the NVSHMEM libraries mapped into the
    process and the NVSHMEM settings; ``None`` where it did not run."""
    if native is None:
        return None
    import liger_native

    names = (*liger_native.MULTICAST_OFF, *liger_native.NVSHMEM_DEFAULTS, "NVSHMEM_SYMMETRIC_SIZE")
    return {
        "capacity": native.row_fields(None)["native_capacity"],
        "nvshmem_libraries": native.libraries,
        "environment": {name: os.environ.get(name) for name in names},
        "probe": native.probe_result,
    }


def record_errors(row, outputs, sample, reference):
    """The log-prob and entropy errors on the rows ``sample`` of a step's ``(logprob, entropy)``
    against the float64 ``reference`` (``oracle``)."""
    for name, values, expected in zip(("logprob", "entropy"), outputs, reference, strict=True):
        row[f"{name}_max_error"] = sample_error(values, sample, expected)


def record_loss_errors(row, outputs, sample, reference):
    """The summed loss, and the log-prob, entropy and hidden-gradient errors on the rows ``sample``
    against the float64 ``reference`` (``loss_oracle``), of an ``rl_loss_step``'s outputs."""
    loss, logprob, entropy, grad = outputs
    ref_logprob, ref_entropy, ref_grad = reference
    try:
        row["loss"] = float(loss)
        row["logprob_max_error"] = sample_error(logprob, sample, ref_logprob)
        row["entropy_max_error"] = sample_error(entropy, sample, ref_entropy)
        row["grad_hidden_error"] = grad_error(grad, sample, ref_grad)
    except Exception as error:  # keep the timing; say why the error check is absent
        row["note"] = f"error check failed: {type(error).__name__}: {error}"


def add_floor_ratios(rows, floor_method="floor"):
    """Each timed row's time over its section's floor (``floor_method``), for the same shape."""
    floor = next((row for row in rows if row["method"] == floor_method and row["status"] == "ok"), None)
    for row in rows:
        if floor is not None and row["status"] == "ok":
            row["vs_floor"] = row["ms"] / floor["ms"]


def write_json(path, meta, rows):
    with open(path, "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)


def print_table(rows):
    print(
        f"{'section':>9} {'shape':>22} {'detail':>8} {'method':>12} {'ms':>9} {'x floor':>8} "
        f"{'peak GiB':>9} {'lp err':>9} {'grad err':>9}  note"
    )
    for row in rows:
        detail = next((f"{key[0]}={row[key]}" for key in ("temperature", "fraction", "use") if key in row), "")
        ms = f"{row['ms']:9.2f}" if "ms" in row else f"{row['status']:>9}"
        ratio = f"{row['vs_floor']:.3f}" if "vs_floor" in row else ""
        peak = f"{row['peak_extra_bytes'] / GIB:9.3f}" if row.get("peak_extra_bytes") is not None else ""
        error = f"{row['logprob_max_error']:.2e}" if "logprob_max_error" in row else ""
        grad = f"{row['grad_hidden_error']:.2e}" if "grad_hidden_error" in row else ""
        print(
            f"{row['section']:>9} {row.get('shape', ''):>22} {detail:>8} {row['method']:>12} {ms} "
            f"{ratio:>8} {peak:>9} {error:>9} {grad:>9}  {row.get('note', '')[:60]}"
        )


def comma_list(kind):
    return lambda text: [kind(item) for item in text.split(",") if item]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", type=comma_list(str), default=",".join(SECTIONS))
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=REFERENCE_SHAPES,
        help="comma-separated TOKENSxHIDDENxVOCAB of the rl, forward, sft and rl_loss sections",
    )
    parser.add_argument("--temperatures", type=comma_list(float), default="1.0,0.7")
    parser.add_argument("--rl-methods", type=comma_list(str), default=",".join(RL_METHODS))
    parser.add_argument("--forward-methods", type=comma_list(str), default=",".join(FORWARD_METHODS))
    parser.add_argument("--sft-methods", type=comma_list(str), default=",".join(SFT_METHODS))
    parser.add_argument("--rl-loss-methods", type=comma_list(str), default=",".join(RL_LOSS_METHODS))
    parser.add_argument(
        "--kl-coef", type=float, default=0.0, help="rl_loss: weight of a k3 KL penalty against a reference policy"
    )
    parser.add_argument(
        "--entropy-coef", type=float, default=ENTROPY_COEF, help="rl_loss: weight of the entropy bonus (0: none)"
    )
    parser.add_argument(
        "--scaling-shape",
        type=lambda text: tuple(map(int, text.split("x"))),
        default="4096x151936",
        help="HIDDENxVOCAB",
    )
    parser.add_argument("--scaling-start", type=int, default=2048)
    parser.add_argument("--scaling-max-tokens", type=int, default=131072)
    parser.add_argument("--scaling-warmup", type=int, default=1)
    parser.add_argument("--scaling-repeats", type=int, default=3)
    parser.add_argument("--fraction-shapes", type=parse_shapes, default="32768x4096x151936,16384x3072x262144")
    parser.add_argument("--fractions", type=comma_list(float), default="1,0.5,0.25")
    parser.add_argument(
        "--sequence-length", type=int, default=4096, help="tokens per packed sequence in the fractions section"
    )
    parser.add_argument(
        "--loss-token-chunk",
        type=int,
        default=None,
        help="sft and rl_loss: rows per chunk of ours (fused_linear_loss's token_chunk; default its rule)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the logic on tiny shapes")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sample", type=int, default=256, help="tokens checked against the float64 oracle")
    parser.add_argument("--json", default="bench_results.json")
    parser.add_argument("--plots", default=None, help="folder for the PNG plots (needs matplotlib)")
    args = parser.parse_args()
    for option, chosen, known in (
        ("--sections", args.sections, SECTIONS),
        ("--rl-methods", args.rl_methods, RL_METHODS),
        ("--forward-methods", args.forward_methods, FORWARD_METHODS),
        ("--sft-methods", args.sft_methods, SFT_METHODS),
        ("--rl-loss-methods", args.rl_loss_methods, RL_LOSS_METHODS),
    ):
        unknown = [name for name in chosen if name not in known]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def main():
    args = parse_args()
    results = Benchmark(args).run()
    if args.plots:
        import report  # matplotlib is a benchmark extra: needed only when plots are asked for

        for path in report.write_plots(results, args.plots):
            print("wrote", path)


if __name__ == "__main__":
    main()
