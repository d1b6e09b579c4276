#!/usr/bin/env bash
# Every figure of docs/BENCHMARKS.md from one command on one GPU host:
#
#   benchmarks/reproduce_all.sh [OUTPUT_DIR]
#
# 1. the side-by-side comparison (docs/benchmarks/scaling.md): JSON, plots and Markdown tables;
# 2. a longer RL-only run (temperature 1, more repeats) against the four-GEMM floor;
# 3. with 2 or more GPUs, the multi-GPU section (tests/gpu/run_multi_gpu.sh: TP=2 parity and
#    benchmark; with 4, the TP=2 x PP=2 training run too).
# Needs the `bench` extras (matplotlib, liger-kernel, cut-cross-entropy; missing ones give
# 'missing' rows) and, for part 3, megatron-core. Exit status non-zero if any part failed.
set -u -o pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-${OUT:-benchmark_results}}")
mkdir -p "$out"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$repo" || exit 1

status=0
python3 benchmarks/bench_logprob.py --json "$out/bench_results.json" --plots "$out" 2>&1 | tee "$out/comparison.log" || status=1
python3 benchmarks/report.py "$out/bench_results.json" --markdown > "$out/tables.md" || status=1
python3 benchmarks/bench_logprob.py --sections rl --temperatures 1.0 --warmup 3 --repeats 10 \
    --json "$out/floor_results.json" 2>&1 | tee "$out/floor.log" || status=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())') || exit 1
if [ "$gpus" -ge 4 ]; then
    tests/gpu/run_multi_gpu.sh "$out/multi_gpu" tp_parity tp_bench pipeline_training || status=1
elif [ "$gpus" -ge 2 ]; then
    tests/gpu/run_multi_gpu.sh "$out/multi_gpu" tp_parity tp_bench || status=1
else
    echo "== multi-GPU section: needs 2 GPUs (4 for the pipeline run), $gpus visible: not run" >&2
fi
exit $status
