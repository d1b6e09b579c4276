#!/usr/bin/env bash
# Prepare .liger-native/ in the current git checkout: what a GPU host (Python 3.12, x86-64, torch
# 2.11 cu130, no registry) needs to run liger-kernel's NATIVE CUTLASS + NVSHMEM fused linear scaled
# cross-entropy (liger-cute-kernels 0.8.5, Hopper core) on one GPU, for side-by-side benchmarks
# (benchmarks/bench_logprob.py, method "liger_native"). Everything travels as ONE xz archive
# (~25 MB) in .liger-native/, which .git/info/exclude ignores. Run once (downloads ~240 MB, then
# xz takes a few minutes on 2 cores); reuse .liger-native/.
#
# On the GPU host, carry ".liger-native" and start the command with:
#   mkdir -p /tmp/lnat && tar xJf .liger-native/liger-native.tar.xz -C /tmp/lnat \
#     && export PYTHONPATH=/tmp/lnat${PYTHONPATH:+:$PYTHONPATH} \
#        LD_LIBRARY_PATH=/tmp/lnat/cuda12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
#        NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# then check the setup on its own (NVSHMEM for one PE and a small forward+backward against the
# float64 oracle; prints the errors, the NVSHMEM libraries mapped and the settings as JSON):
#   PYTHONPATH=.:$PYTHONPATH python3 benchmarks/liger_native.py
# (if it reports two libnvshmem_host.so.3 mapped and a version mismatch, torch loaded its own first:
# add LD_PRELOAD=/tmp/lnat/liger_cute_kernels/libnvshmem_host.so.3), and run, for example
# (liger_native beside our Triton path and the GEMM floors):
#   PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 python3 benchmarks/bench_logprob.py \
#     --sections rl,forward,sft,rl_loss --temperatures 1.0 \
#     --rl-methods floor,triton,liger_native --forward-methods floor1,triton,liger_native \
#     --sft-methods floor,ours,liger_native --rl-loss-methods floor3,recompute,ours,liger_native \
#     --json $OUT/native.json
# The archive holds liger-kernel 0.8.5 itself, so .whl is not needed for these methods (.whl, 3 MB,
# can travel too). .cute (liger_flsce) and .liger-native together exceed the 64 MiB a call carries:
# run liger_flsce in its own call, or unpack .cute to /tmp in one call and send the next within the
# machine's 30 s warm window (/tmp and carried folders stay while it is held). What the archive
# unpacks to (/tmp/lnat):
#   liger_cute_kernels/           the package's Python files and libliger_cute_kernels_sm90a.so
#                                 (49 MB, CUDA 12.9 build), plus NVSHMEM 3.6.5's cu12 host library
#                                 and UID bootstrap plugin, which its loader looks for in this
#                                 folder first (so no nvidia.* folder shadows torch's own);
#   cuda12/libcudart.so.12        the core's CUDA 12 runtime (torch cu130 has only libcudart.so.13;
#                                 the driver serves both); bench_logprob.py also preloads it from
#                                 here, so LD_LIBRARY_PATH is only needed by other scripts;
#   tvm_ffi/, liger_kernel/       apache-tvm-ffi and liger-kernel 0.8.5 (with their dist-info).
# Left out: the Blackwell core (libliger_cute_kernels_sm100f.so) and liger_moe_sm90_nonrdc.cubin
# (209 MB; the core loads it only for MoE with LIGER_MOE_SM90_NONRDC=1), NVSHMEM's device library,
# headers and IB/UCX/libfabric transports (one GPU needs none: NVSHMEM_REMOTE_TRANSPORT=none).
# NVSHMEM_CU13=1 also writes .liger-native/nvshmem-cu13.tar.xz (~34 MB: CUDA 13 fatbins come
# compressed already), NVSHMEM 3.6.5's cu13 host library and plugin, an untried spare for a host
# where the cu12 ones fail (the wheel's notes say a CUDA 12.9 core wants the cu12 NVSHMEM): carry
# it alone with the archive, unpack it over the cu12 files with
# `tar xJf .liger-native/nvshmem-cu13.tar.xz -C /tmp/lnat/liger_cute_kernels`.
#
# Use on one GPU (what benchmarks/liger_native.py does): NVSHMEM must be initialized even for a
# tensor-parallel group of one, and needs no MPI and no torch.distributed:
#   from liger_cute_kernels import tvm_ffi as lck
#   uid = torch.empty(lck.uniqueid_nbytes(), dtype=torch.uint8); lck.get_uniqueid(uid.data_ptr())
#   lck.init_with_uniqueid(0, 1, uid.data_ptr())       # one PE; NVSHMEM_DISABLE_NVLS=1 first
#   team = lck.team_world()
#   lck.fused_linear_scaled_cross_entropy_configure_backward(max_tokens, max_hidden8, vocab, 1, team)
#   lck.fused_linear_scaled_cross_entropy_configure_forward(max_tokens, vocab, team)
#   from liger_kernel.ops.cute.fused_linear_scaled_cross_entropy_tp import (
#       LigerFusedLinearScaledCrossEntropyNativeTPFunction as F)
#   nll, entropy = F.apply(h, w, y, 0, temperature, -100, 1, True, None)  # vocab_start 0, group None
# (bf16 h [T, H] and w [V, H], int64 y; per-token float32 NLL = -log-prob and entropy of
# softmax(logits / temperature), both differentiable; capacities are fixed by the first
# configuration and cannot grow; liger-kernel's public TPFunction would silently fall back to a
# torch path, so call the native Function directly.)
# Needs glibc >= 2.34 on the host (the core's newest symbol; the wheel is tagged manylinux_2_35).
# Keep NVLink multicast off (NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1): the shared hosts forbid it, and liger_native.py refuses to
# initialize NVSHMEM otherwise. This does not move a group of one onto the direct-peer kernels:
# configure_tp_reduce (liger_cute_kernels/csrc/core/src/detail/tp_reduce.cu in linkedin/Liger-Kernel)
# counts NVLS as available whenever the team has one PE and picks its NVLS backend, handing it the
# rank's own buffers where a larger team gets multicast addresses; direct peer is only the fallback
# for a team of two or more without multicast mappings.
set -euo pipefail
LCK_VERSION=${LCK_VERSION:-0.8.5}
NVSHMEM_VERSION=${NVSHMEM_VERSION:-3.6.5}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-0.1.15.post2}
CUDART_VERSION=${CUDART_VERSION:-12.9.79}
top=$(git rev-parse --show-toplevel)
cd "$top"
mkdir -p .git/info
grep -qx '/.liger-native/' .git/info/exclude 2>/dev/null || echo '/.liger-native/' >> .git/info/exclude
mkdir -p .liger-native
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" "$@"
}
get "liger-cute-kernels==$LCK_VERSION" "liger-kernel==$LCK_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" \
  "nvidia-nvshmem-cu12==$NVSHMEM_VERSION" "nvidia-cuda-runtime-cu12==$CUDART_VERSION"
unpack() { mkdir -p "$work/$1" && python3 -m zipfile -e "$work"/wheels/$2 "$work/$1"; }
unpack lck 'liger_cute_kernels-*.whl'
unpack nvshmem12 'nvidia_nvshmem_cu12-*.whl'
unpack cudart 'nvidia_cuda_runtime_cu12-*.whl'
root="$work/root"
unpack root 'apache_tvm_ffi-*.whl'
unpack root 'liger_kernel-*.whl'
mkdir -p "$root/liger_cute_kernels" "$root/cuda12" "$root/licenses"
cp "$work"/lck/liger_cute_kernels/*.py "$work/lck/liger_cute_kernels/libliger_cute_kernels_sm90a.so" \
  "$root/liger_cute_kernels/"
cp -r "$work"/lck/liger_cute_kernels-*.dist-info "$root/"
cp "$work"/nvshmem12/nvidia/nvshmem/lib/{libnvshmem_host.so.3,nvshmem_bootstrap_uid.so.3} "$root/liger_cute_kernels/"
cp "$work/cudart/nvidia/cuda_runtime/lib/libcudart.so.12" "$root/cuda12/"
cp "$work"/nvshmem12/nvidia_nvshmem_cu12-*.dist-info/licenses/License.txt "$root/licenses/nvshmem-License.txt"
cp "$work"/cudart/nvidia_cuda_runtime_cu12-*.dist-info/licenses/License.txt "$root/licenses/cuda-runtime-License.txt"
cat > "$root/VERSIONS.txt" <<EOF
liger-cute-kernels $LCK_VERSION (sm90a core only), liger-kernel $LCK_VERSION, apache-tvm-ffi $TVM_FFI_VERSION,
nvidia-nvshmem-cu12 $NVSHMEM_VERSION (host library and UID plugin, in liger_cute_kernels/),
nvidia-cuda-runtime-cu12 $CUDART_VERSION (cuda12/); made by devkit/gpu-liger-native.sh on $(date -u +%F)
EOF
rm -f .liger-native/liger-native.tar.xz .liger-native/nvshmem-cu13.tar.xz
tar cf - -C "$root" --owner=0 --group=0 . | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 > .liger-native/liger-native.tar.xz
if [ "${NVSHMEM_CU13:-0}" = 1 ]; then
  get "nvidia-nvshmem-cu13==$NVSHMEM_VERSION"
  unpack nvshmem13 'nvidia_nvshmem_cu13-*.whl'
  tar cf - -C "$work/nvshmem13/nvidia/nvshmem/lib" --owner=0 --group=0 libnvshmem_host.so.3 nvshmem_bootstrap_uid.so.3 \
    | xz --x86 --lzma2=preset=9e,dict=64MiB -T1 > .liger-native/nvshmem-cu13.tar.xz
fi
du -sh --apparent-size "$root"
ls -la .liger-native
du -sh --apparent-size .liger-native
