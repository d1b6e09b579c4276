#!/usr/bin/env bash
# The multi-GPU tests and the tensor-parallel benchmark on one host, one process per GPU (torchrun).
#
#   tests/gpu/run_multi_gpu.sh [OUTPUT_DIR] [PART ...]
#
# PARTs (default: every one that the visible GPUs allow), each run on the first GPUs it needs:
#   tp_parity          2 GPUs: TP=2 + sequence parallel, bf16 GPTModel, every fused path vs stock and float64
#                      (tests/gpu/tp_parity.py)
#   tp4_parity         4 GPUs: the same at TP=4
#   tp_bench           2 GPUs: per-rank time and memory, TP=1 vs TP=2, stock vs fused (benchmarks/bench_tensor_parallel.py;
#                      extra arguments in TP_BENCH_ARGS, e.g. TP_BENCH_ARGS="--shapes 4096x2048x151936")
#   pipeline_training  4 GPUs: layout tp2_pp2, TP=2 x PP=2, 1F1B + DDP + distributed optimizer
#   tp2_dp2            4 GPUs: TP=2 x DP=2, sequence parallel, both overlaps, distributed optimizer
#   pp2_tied           2 GPUs: PP=2, 1F1B, tied embeddings
#   pp2_vpp2_tied      2 GPUs: PP=2 x 2 virtual chunks, interleaved schedule, tied embeddings
#   dp2_overlap        2 GPUs: DP=2, overlap_grad_reduce, distributed optimizer + overlap_param_gather
#   tp2_pp2_dp2        8 GPUs: TP=2 x PP=2 x DP=2, sequence parallel, tied, both overlaps
# The last six are tests/gpu/pipeline_training.py --layout NAME (its docstring has the details);
# extra arguments in PIPELINE_ARGS, e.g. PIPELINE_ARGS="--loss-path three-gemm --backend triton".
# Each part writes OUTPUT_DIR/PART.json and OUTPUT_DIR/PART.log (OUTPUT_DIR defaults to $OUT, else
# multi_gpu_results). The exit status is non-zero when any part failed or could not run.
set -u -o pipefail

# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM on shared hosts (each script sets them
# again before NCCL starts, in case this script is bypassed).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
repo=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

out=${1:-${OUT:-multi_gpu_results}}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$out"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())') || exit 1
visible=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}

# Sets needed (GPUs) and command (script and arguments) for part $1; fails for an unknown part.
describe() {
    case $1 in
        tp_parity) needed=2; command=(tests/gpu/tp_parity.py) ;;
        tp4_parity) needed=4; command=(tests/gpu/tp_parity.py) ;;
        tp_bench) needed=2; command=(benchmarks/bench_tensor_parallel.py ${TP_BENCH_ARGS:-}) ;;
        pipeline_training) needed=4; command=(tests/gpu/pipeline_training.py --layout tp2_pp2 ${PIPELINE_ARGS:-}) ;;
        pp2_tied | pp2_vpp2_tied | dp2_overlap)
            needed=2; command=(tests/gpu/pipeline_training.py --layout "$1" ${PIPELINE_ARGS:-}) ;;
        tp2_dp2) needed=4; command=(tests/gpu/pipeline_training.py --layout tp2_dp2 ${PIPELINE_ARGS:-}) ;;
        tp2_pp2_dp2) needed=8; command=(tests/gpu/pipeline_training.py --layout tp2_pp2_dp2 ${PIPELINE_ARGS:-}) ;;
        *) return 1 ;;
    esac
}

parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
    for part in tp_parity tp4_parity tp_bench pp2_tied pp2_vpp2_tied dp2_overlap pipeline_training tp2_dp2 tp2_pp2_dp2; do
        describe "$part" && [ "$gpus" -ge "$needed" ] && parts+=("$part")
    done
    [ ${#parts[@]} -gt 0 ] || { echo "no part runs on $gpus GPUs" >&2; exit 1; }
fi

status=0
for part in "${parts[@]}"; do
    if ! describe "$part"; then
        echo "unknown part: $part" >&2; status=1; continue
    fi
    if [ "$gpus" -lt "$needed" ]; then
        echo "== $part: needs $needed GPUs, $gpus visible: not run" >&2
        status=1
        continue
    fi
    devices=$(echo "$visible" | cut -d, -f1-"$needed")
    echo "== $part on GPUs $devices"
    started=$SECONDS
    (cd "$repo" && CUDA_VISIBLE_DEVICES=$devices \
        python3 -m torch.distributed.run --standalone --nproc-per-node "$needed" "${command[@]}" --json "$(realpath "$out")/$part.json") \
        2>&1 | tee "$out/$part.log"
    result=$?
    echo "== $part: exit $result after $((SECONDS - started)) s"
    [ $result -eq 0 ] || status=1
done
exit $status
