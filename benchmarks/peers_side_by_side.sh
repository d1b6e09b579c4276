#!/usr/bin/env bash
# The peers' calibration and the side-by-side record of docs/benchmarks/cute.md, on one Hopper GPU:
#   1. liger's own native forward benchmark (LIGER_SCRIPT: its
#      benchmark/scripts/benchmark_fused_scaled_linear_cross_entropy_tp.py, not part of this
#      repository) at its shapes and ours, as a torchrun job of one GPU;
#   2. its core without the Python wrapper, against the cuBLAS products (calibrate_liger_native.py);
#   3. bench_logprob.py's forward and RL sections, twice: cuBLAS floors, our Triton and CuTe
#      backends, liger's CuTe kernel and its native op, on identical inputs in one process.
# Needs the cutlass-dsl bundle unpacked into /tmp/cute (../shared/tools/gpu-cutedsl.sh says how)
# and the native bundle into /tmp/lnat (devkit/gpu-liger-native.sh).
#   LIGER_SCRIPT=... benchmarks/peers_side_by_side.sh OUT_DIR
set -uo pipefail
out=${1:?usage: peers_side_by_side.sh OUT_DIR}
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/cute:/tmp/cute/nvidia_cutlass_dsl/dsl_packages:/tmp/lnat:.:benchmarks
export LD_LIBRARY_PATH=/tmp/lnat/cuda12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# NVLink multicast stays off (the shared hosts forbid it); one PE needs no network transport.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NCCL=1 NVSHMEM_DISABLE_MNNVL=1 \
  NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > "$out/gpu.csv"
if [ -n "${LIGER_SCRIPT:-}" ]; then
  for shape in 4096:4096:131072 8192:4096:131072 8192:4096:151936 16384:3072:262144; do
    IFS=: read -r tokens hidden vocab <<< "$shape"
    timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node=1 "$LIGER_SCRIPT" --provider native \
      --tokens "$tokens" --hidden "$hidden" --global-vocab "$vocab" >> "$out/liger_script.log" 2>&1
  done
fi
timeout 90 python3 benchmarks/calibrate_liger_native.py --json "$out/calibration.json" > "$out/calibration.log" 2>&1
methods=floor,triton,cute,liger_flsce,liger_native
for run in 1 2; do
  timeout "${SIDE_BY_SIDE_TIMEOUT:-130}" python3 benchmarks/bench_logprob.py --sections forward,rl --temperatures 1.0 \
    --shapes 4096x2048x151936,8192x4096x151936,16384x5120x152064,16384x3072x262144 \
    --rl-methods "$methods" --forward-methods "floor1,${methods#floor,}" \
    --json "$out/side_by_side_run$run.json" > "$out/side_by_side_run$run.log" 2>&1
done
exit 0
