"""The CuTe kernel's file cache (``cute_kernels.file_cache``): a second process loads the kernel the
first compiled, without compiling, and a cache entry follows what decides the binary. Where the
CuTe DSL is installed (the ``cute`` extra): it compiles for ``sm_90a`` without a GPU, so this runs on
a CPU machine too; the kernel's results through a loaded entry are the GPU suite's
(``tests/gpu/test_cute_backend.py``)."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from megatron_fused_lm.ops.cute_kernels import file_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# One process: the statistics kernel of one configuration through the cache, and how it came.
PROCESS = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from pathlib import Path
    from megatron_fused_lm.ops.cute_kernels import file_cache, statistics_kernel as sk

    compiled = []

    def compile_kernel():
        compiled.append(1)
        return sk._compile(sk.StatisticsKernel(2, 6, 6, True), torch.bfloat16)

    start = time.perf_counter()
    kernel = file_cache.cached_kernel(Path(sk.__file__), ("torch.bfloat16", 2, 6, 6, True), compile_kernel)
    print(json.dumps(dict(compiled=len(compiled), seconds=time.perf_counter() - start, kind=type(kernel).__name__)))
    """
)


def run_process(cache: Path) -> dict:
    import json

    environment = dict(os.environ, CUTE_DSL_ARCH="sm_90a", MEGATRON_FUSED_LM_CUTE_CACHE=str(cache))
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", PROCESS], env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    first = run_process(tmp_path)
    assert first["compiled"] == 1
    assert len(list(tmp_path.glob("statistics_kernel_*.o"))) == 1 and not list(tmp_path.glob("*.tmp"))
    second = run_process(tmp_path)
    assert second["compiled"] == 0 and second["kind"] == "Function"  # TVM-FFI's, loaded from the entry
    # The bound for a load (the DSL's import aside), against the 3 to 9 s of a compilation.
    assert second["seconds"] < 1.0, second


class Compiled:
    """A stand-in for a compiled kernel: exports fixed bytes, counts its compilations."""

    count = 0

    def __init__(self):
        Compiled.count += 1

    def export_to_c(self, path, function_name):
        Path(path).write_bytes(b"not an object file")


def test_entries_follow_what_decides_the_binary(tmp_path, monkeypatch, caplog):
    from cutlass.cutlass_dsl import CuTeDSL

    settings = CuTeDSL._get_dsl().envar
    monkeypatch.setattr(settings, "arch", "sm_90a")
    source = tmp_path / "kernel.py"
    source.write_text("first")
    name = file_cache.entry_name(source, ("torch.bfloat16", 2))
    assert name == file_cache.entry_name(source, ("torch.bfloat16", 2))
    assert name != file_cache.entry_name(source, ("torch.float16", 2))
    monkeypatch.setattr(settings, "arch", "sm_100a")
    assert name != file_cache.entry_name(source, ("torch.bfloat16", 2))
    monkeypatch.setattr(settings, "arch", "sm_90a")
    monkeypatch.setattr(settings, "lineinfo", True)  # CUTE_DSL_LINEINFO: a larger binary, same source
    assert name != file_cache.entry_name(source, ("torch.bfloat16", 2))
    monkeypatch.setattr(settings, "lineinfo", False)
    source.write_text("second")  # an edited kernel
    assert name != file_cache.entry_name(source, ("torch.bfloat16", 2))

    cache = tmp_path / "cache"
    monkeypatch.setenv(file_cache.CACHE_VARIABLE, str(cache))
    Compiled.count = 0
    kernel = file_cache.cached_kernel(source, (1,), Compiled)
    assert isinstance(kernel, Compiled) and Compiled.count == 1
    (entry,) = cache.glob("*.o")
    # An entry whose bytes match its name but that the loader refuses: compiled again, a warning.
    with caplog.at_level(logging.WARNING, logger="megatron_fused_lm"):
        assert isinstance(file_cache.cached_kernel(source, (1,), Compiled), Compiled)
    assert Compiled.count == 2 and "could not be loaded" in caplog.text
    # An entry damaged on disk, its size kept (it could load and run other code): never loaded,
    # removed, compiled again and stored under its new bytes' name.
    entry.write_bytes(b"not an object filf")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_fused_lm"):
        assert isinstance(file_cache.cached_kernel(source, (1,), Compiled), Compiled)
    assert Compiled.count == 3 and "is damaged" in caplog.text and "could not be loaded" not in caplog.text
    (replaced,) = cache.glob("*.o")
    assert replaced.read_bytes() == b"not an object file" and not list(cache.glob("*.tmp"))

    # Turned off: every process compiles, nothing is written.
    monkeypatch.setenv(file_cache.CACHE_VARIABLE, "off")
    assert file_cache.cache_folder() is None
    file_cache.cached_kernel(source, (2,), Compiled)
    assert Compiled.count == 4 and len(list(cache.glob("*.o"))) == 1

    # A folder that cannot be made: the compiled kernel, one warning.
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    monkeypatch.setenv(file_cache.CACHE_VARIABLE, str(blocked / "cache"))
    with caplog.at_level(logging.WARNING, logger="megatron_fused_lm"):
        assert isinstance(file_cache.cached_kernel(source, (3,), Compiled), Compiled)
    assert "cannot store" in caplog.text
