"""liger-kernel's native CUTLASS + NVSHMEM fused linear scaled cross-entropy (``liger-cute-kernels``
0.8.5, its Hopper core) on one GPU, as a tensor-parallel group of one: the ``liger_native`` method
of bench_logprob.py. ``devkit/gpu-liger-native.sh`` packs what a GPU host needs and says how to
unpack it.

Setup, once per process (``NativeScaledCrossEntropy``): the core wants NVSHMEM initialized even for
one rank; this does it with a unique id for one PE (no MPI, no torch.distributed), after forcing
NVLink multicast off (``NVSHMEM_DISABLE_NVLS=1``: the shared GPU hosts forbid it). That does not
change the core's reduction kernels for a group of one: ``configure_tp_reduce`` in liger's
``liger_cute_kernels/csrc/core/src/detail/tp_reduce.cu`` counts NVLS as available when the team has
one PE and picks its NVLS backend on the rank's own buffers (no multicast object); its direct-peer
backend is the fallback for larger teams without multicast. Its workspace capacities (tokens,
hidden, vocabulary) are fixed by the first configuration and cannot grow, so they are reserved up
front for the largest shape the run will measure, as liger's notes ask; a larger shape later
clears the pools and configures again. The workspace lives outside PyTorch's caching allocator
(NVSHMEM's symmetric heap and the core's own allocations), so a row's ``peak_extra_bytes`` misses
it: each row records it as ``native_workspace_bytes`` (the core's conservative estimate for that
shape, before configuration).

The op is liger-kernel's own autograd Function for this core,
``LigerFusedLinearScaledCrossEntropyNativeTPFunction``, called directly: the public
``LigerFusedLinearScaledCrossEntropyTPFunction`` would quietly take a torch fallback where the
native core cannot run, and a benchmark must say so instead (``NativeUnavailable``)."""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from devkit.oracle import reference, relative_error

# NVLink multicast must stay off on the shared hosts (a program using it can take the host's GPUs
# out of service): forced, and setup refuses if the environment asks for it.
MULTICAST_OFF = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# One PE on one host needs no network transport, no NCCL and no multi-node NVLink; the UID
# bootstrap's socket stays on the loopback interface. Each can be overridden from the environment.
NVSHMEM_DEFAULTS = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NCCL": "1",
    "NVSHMEM_DISABLE_MNNVL": "1",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
}
HIDDEN_ALIGNMENT = 8  # the liger frontend pads the hidden size to a multiple of 8 (16-byte TMA rows)
HEAP_MARGIN = 512 * 2**20  # added to the core's workspace estimate for NVSHMEM's symmetric heap
HEAP_MINIMUM = 2**30  # NVSHMEM's own default size
IGNORE_INDEX = -100
PROBE_SHAPE = (512, 1024, 8192)  # tokens x hidden x vocab of the probe's check
PROBE_TIMEOUT_S = 300
PROBE_TOLERANCE = 0.05  # log-prob / entropy |error| and gradients' relative error, bf16 inputs


class NativeUnavailable(RuntimeError):
    """The native core cannot run here; the message says why (the benchmark's ``missing`` row)."""


def padded_hidden(hidden_size):
    return -(-hidden_size // HIDDEN_ALIGNMENT) * HIDDEN_ALIGNMENT


def check_device(device):
    """``NativeUnavailable`` unless ``device`` is a CUDA device of compute capability 9.0."""
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
        raise NativeUnavailable("no CUDA device")
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        raise NativeUnavailable(
            f"compute capability {capability[0]}.{capability[1]}: only the Hopper (SM90a) core is packed "
            "(devkit/gpu-liger-native.sh leaves out the Blackwell one)"
        )


def force_multicast_off():
    for name, value in MULTICAST_OFF.items():
        if os.environ.get(name, value) != value:
            raise NativeUnavailable(f"{name}={os.environ[name]}: NVLink multicast must stay off ({name}={value})")
        os.environ[name] = value
    for name, value in NVSHMEM_DEFAULTS.items():
        os.environ.setdefault(name, value)


def preload_cuda12_runtime(package_dir):
    """The core links ``libcudart.so.12``, which a CUDA 13 torch does not ship: load it globally
    from the library path, or else from the bundle's ``cuda12/`` beside the package folder."""
    candidates = ["libcudart.so.12", package_dir / "libcudart.so.12", package_dir.parent / "cuda12" / "libcudart.so.12"]
    errors = []
    for candidate in candidates:
        if isinstance(candidate, Path) and not candidate.is_file():
            continue
        try:
            return ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            errors.append(str(error))
    raise NativeUnavailable(
        "libcudart.so.12 not found (put /tmp/lnat/cuda12 on LD_LIBRARY_PATH, see devkit/gpu-liger-native.sh): "
        + "; ".join(errors)
    )


def nvshmem_libraries():
    """The NVSHMEM host libraries mapped into this process (two means torch's own is loaded too)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libnvshmem_host" in line})
    except OSError:
        return []


class NativeScaledCrossEntropy:
    """``(hidden, weight, targets, temperature, return_entropy=True) -> (logprob, entropy)`` through
    the native core (``entropy`` is ``None`` without ``return_entropy``), differentiable in hidden
    and weight. ``shapes``: the ``(tokens, hidden, vocab)`` the run will measure, reserved up front.
    Raises ``NativeUnavailable`` (with the reason) where the core cannot run. With ``probe``, a
    child process first initializes NVSHMEM and checks a small forward+backward (``run_probe``):
    NVSHMEM ends the whole process on some setup failures, which must not take the benchmark's
    other methods with it."""

    def __init__(self, shapes=(), device=None, probe=True):
        device = torch.device(device if device is not None else "cuda")
        check_device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        force_multicast_off()
        try:
            import liger_cute_kernels
        except ImportError as error:
            raise NativeUnavailable(
                f"liger-cute-kernels is not installed ({error}; see devkit/gpu-liger-native.sh)"
            ) from error
        package_dir = Path(liger_cute_kernels.__file__).resolve().parent
        self.cudart = preload_cuda12_runtime(package_dir)
        from liger_cute_kernels import tvm_ffi as lck

        try:
            with torch.cuda.device(device):
                lck._load_module()
        except (ImportError, OSError, RuntimeError) as error:
            raise NativeUnavailable(
                f"the native core does not load ({type(error).__name__}: {error}; glibc "
                f"{platform.libc_ver()[1] or '?'} here, the core needs 2.34)"
            ) from error
        from liger_kernel.ops.cute import fused_linear_scaled_cross_entropy_tp as native_tp

        if not native_tp.is_available():
            raise NativeUnavailable("liger_kernel.ops.cute reports the native scaled cross-entropy unavailable")
        self.probe_result = None
        if probe and os.environ.get("LIGER_NATIVE_PROBE", "1") != "0":
            self.probe_result = run_probe()
        self.lck, self.function = lck, native_tp.LigerFusedLinearScaledCrossEntropyNativeTPFunction
        # The core's estimate of each shape's workspace (symmetric + device-private), before
        # configuration: afterwards it answers only for the configured capacity.
        self.estimates = {}
        for shape in dict.fromkeys(shapes):
            self.estimates[shape] = self.workspace_estimate(shape)
        self.capacity = None
        with torch.cuda.device(device):
            try:
                self.team = self.init_nvshmem()
            except NativeUnavailable:
                raise
            except Exception as error:
                raise NativeUnavailable(
                    f"NVSHMEM setup failed ({type(error).__name__}: {error}); NVSHMEM host libraries mapped: "
                    f"{nvshmem_libraries()} (with torch's own among them, try "
                    "LD_PRELOAD=<bundle>/liger_cute_kernels/libnvshmem_host.so.3)"
                ) from error
            if shapes:
                self.configure(tuple(max(values) for values in zip(*shapes, strict=True)))
        self.libraries = nvshmem_libraries()

    def workspace_estimate(self, shape):
        tokens, hidden_size, vocab = shape
        with torch.cuda.device(self.device):
            forward = self.lck.fused_linear_scaled_cross_entropy_forward_workspace_bytes(tokens, vocab)
            backward = self.lck.fused_linear_scaled_cross_entropy_backward_workspace_bytes(
                tokens, padded_hidden(hidden_size), vocab, 1
            )
        return forward + backward

    def init_nvshmem(self):
        """NVSHMEM for one PE from a unique id (what ``nvshmem.init_from_pg`` does for a group,
        without torch.distributed); returns the world team, the tensor-parallel group of one."""
        lck = self.lck
        if lck.nvshmem_is_initialized():
            raise NativeUnavailable("NVSHMEM is already initialized in this process by another owner")
        if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ and self.estimates:
            heap = max(HEAP_MINIMUM, max(self.estimates.values()) + HEAP_MARGIN)
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
        torch.cuda.synchronize(self.device)
        unique_id = torch.empty(lck.uniqueid_nbytes(), dtype=torch.uint8)
        lck.get_uniqueid(unique_id.data_ptr())
        lck.init_with_uniqueid(0, 1, unique_id.data_ptr())
        if os.environ.get("LIGER_NATIVE_FINALIZE", "1") != "0":
            atexit.register(self.finalize)
        return lck.team_world()

    def configure(self, capacity):
        """Reserve the workspace for ``capacity`` = ``(tokens, hidden, vocab)`` (the hidden size
        padded as the frontend pads it), clearing an earlier, smaller reservation first."""
        tokens, hidden_size, vocab = capacity
        capacity = (tokens, padded_hidden(hidden_size), vocab)
        if self.capacity is not None:
            torch.cuda.synchronize(self.device)
            self.lck.pool_clear_all()
        self.lck.fused_linear_scaled_cross_entropy_configure_backward(tokens, capacity[1], vocab, 1, self.team)
        self.lck.fused_linear_scaled_cross_entropy_configure_forward(tokens, vocab, self.team)
        self.capacity = capacity

    def fits(self, shape):
        tokens, hidden_size, vocab = shape
        return self.capacity is not None and all(
            value <= limit
            for value, limit in zip((tokens, padded_hidden(hidden_size), vocab), self.capacity, strict=True)
        )

    def row_fields(self, shape):
        """What a benchmark row records about the native path at ``shape``."""
        fields = {"native_capacity": "x".join(map(str, self.capacity)) if self.capacity else None}
        if shape in self.estimates:
            fields["native_workspace_bytes"] = self.estimates[shape]
        return fields

    def __call__(self, hidden, weight, targets, temperature=1.0, return_entropy=True):
        shape = (hidden.shape[0], hidden.shape[1], weight.shape[0])
        if not self.fits(shape):
            with torch.cuda.device(self.device):
                grown = shape if self.capacity is None else tuple(map(max, zip(shape, self.capacity, strict=True)))
                self.configure(grown)
        outputs = self.function.apply(
            hidden, weight, targets, 0, float(temperature), IGNORE_INDEX, 1, return_entropy, None
        )
        if return_entropy:
            nll, entropy = outputs
            return -nll, entropy
        return -outputs, None

    def finalize(self):
        try:
            torch.cuda.synchronize(self.device)
            self.lck.finalize()
        except Exception:  # at exit, after the results are written: nothing left to save
            pass


def run_probe():
    """``python3 liger_native.py --probe`` in a child process: what it printed (a dict), or
    ``NativeUnavailable`` with the end of its output unless it passes."""
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--probe"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise NativeUnavailable(
            f"the probe (NVSHMEM setup and a small forward+backward) ran past {PROBE_TIMEOUT_S} s"
        ) from None
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-6:])
        raise NativeUnavailable(f"the probe failed (exit status {done.returncode}): {tail}")
    try:
        return json.loads(done.stdout[done.stdout.index("{") :])
    except ValueError:
        return {"output": done.stdout[-2000:]}


def probe(shape=PROBE_SHAPE, temperature=0.7):
    """Set up in this process, run one forward+backward at ``shape`` against the float64 oracle and
    print what was found as JSON; exit status 1 if an error passes ``PROBE_TOLERANCE``."""
    op = NativeScaledCrossEntropy([shape], probe=False)
    tokens, hidden_size, vocab = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 4 / hidden_size**0.5).bfloat16()
    weight.requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    grad_logprob, grad_entropy = torch.randn(2, tokens, device="cuda", generator=gen)
    logprob, entropy = op(hidden, weight, targets, temperature)
    torch.autograd.backward([logprob, entropy], [grad_logprob, grad_entropy])
    torch.cuda.synchronize()
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy)
    errors = {
        "logprob_max_error": (logprob.double() - expected.logprob).abs().max().item(),
        "entropy_max_error": (entropy.double() - expected.entropy).abs().max().item(),
        "grad_hidden_error": relative_error(hidden.grad, expected.grad_hidden),
        "grad_weight_error": relative_error(weight.grad, expected.grad_weight),
    }
    import liger_cute_kernels

    print(
        json.dumps(
            dict(
                errors,
                shape="x".join(map(str, shape)),
                temperature=temperature,
                device=torch.cuda.get_device_name(),
                torch=torch.__version__,
                package=str(Path(liger_cute_kernels.__file__).parent),
                nvshmem_libraries=op.libraries,
                workspace_bytes=op.estimates[shape],
                environment={name: os.environ.get(name) for name in (*MULTICAST_OFF, *NVSHMEM_DEFAULTS)},
            ),
            indent=1,
        )
    )
    failed = [name for name, value in errors.items() if not value <= PROBE_TOLERANCE]
    if failed:
        print(f"probe: {', '.join(failed)} above {PROBE_TOLERANCE}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    try:
        probe()
    except NativeUnavailable as error:
        print(f"probe: {error}", file=sys.stderr)
        sys.exit(2)
