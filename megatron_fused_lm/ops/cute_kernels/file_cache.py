"""A file cache of compiled CuTe kernels, so that a new process loads a kernel (milliseconds) where
it would compile it (3 to 9 s): each configuration is exported once as an object file (the DSL's
``export_to_c``) and loaded through TVM-FFI (``cutlass.runtime.load_module``).

The folder is ``$MEGATRON_FUSED_LM_CUTE_CACHE``, else ``~/.cache/megatron_fused_lm/cute``; the value
``off`` keeps every kernel in its process. An entry's name digests the kernel module's source, its
configuration, TVM-FFI's version and what the DSL's own cache keys on (its version and files, and
the settings that change a binary: the architecture, ``CUTE_DSL_LINEINFO``, ...), so a change of any
of them compiles anew; deleting the folder clears the cache. Entries are written whole (a temporary
file renamed into place), so the ranks of a host may compile one entry at once, and each file's name
ends in a digest of its bytes, checked before it loads: a damaged entry is compiled again, never run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from ..._logging import warn_once

CACHE_VARIABLE = "MEGATRON_FUSED_LM_CUTE_CACHE"


def cache_folder() -> Optional[Path]:
    """The cache's folder (``None``: turned off)."""
    chosen = os.environ.get(CACHE_VARIABLE)
    if chosen == "off":
        return None
    return Path(chosen) if chosen else Path.home() / ".cache" / "megatron_fused_lm" / "cute"


def entry_name(source: Path, configuration: tuple) -> str:
    """The cache entry's name (also the exported function's): a digest of what decides the binary."""
    import tvm_ffi
    from cutlass.cutlass_dsl import CuTeDSL

    dsl = CuTeDSL._get_dsl()  # the DSL's own cache key: its files' digest and compile settings
    digest = hashlib.sha256(source.read_bytes())
    digest.update(repr((dsl.get_version().hexdigest(), dsl.envar.cache_key_str(), tvm_ffi.__version__)).encode())
    digest.update(repr(configuration).encode())
    return f"{source.stem}_{digest.hexdigest()[:24]}"


def cached_kernel(source: Path, configuration: tuple, compile_kernel: Callable[[], Any]):
    """The kernel of ``configuration`` (a tuple of plain values) from ``source``'s module: loaded from
    the cache where an entry exists, else compiled by ``compile_kernel()`` and stored. Either is
    called with the kernel's arguments, the stream aside (TVM-FFI's current stream). A cache that
    cannot be found, read or written costs a compilation and a logged warning, never the call."""
    try:
        folder = cache_folder()
        name = None if folder is None else entry_name(source, configuration)
    except Exception as error:  # no home folder, say
        warn_once(f"the CuTe kernel cache is not available ({error}); each process compiles its kernels")
        folder = None
    if folder is None:
        return compile_kernel()
    try:
        loaded = _load(folder, name)
        if loaded is not None:
            return loaded
    except Exception as error:  # an entry the loader refuses, or an unreadable folder: compiled again below
        warn_once(f"the CuTe kernel cache entry {name} in {folder} could not be loaded ({error}); compiling it again")
    compiled = compile_kernel()
    _store(compiled, folder, name)
    return compiled


def _content_digest(data: bytes) -> str:
    """What an entry's file name ends in: a digest of its bytes."""
    return hashlib.sha256(data).hexdigest()[:16]


def _load(folder: Path, name: str):
    """The function of the entry ``name`` whose bytes match its digest, or ``None``; entries that do
    not match (damaged on disk) are removed, with a warning."""
    from cutlass.runtime import load_module

    for path in sorted(folder.glob(f"{name}-*.o")):
        if _content_digest(path.read_bytes()) == path.stem.rpartition("-")[2]:
            return getattr(load_module(str(path), enable_tvm_ffi=True), name)
        warn_once(
            f"the CuTe kernel cache entry {path} is damaged (its bytes do not match its name); compiling it again"
        )
        with contextlib.suppress(OSError):
            path.unlink()
    return None


def _store(compiled, folder: Path, name: str) -> None:
    """``compiled`` exported into ``folder`` as the entry ``name``, whole (a file of its own renamed
    into place) or not at all (a logged warning)."""
    written = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, written = tempfile.mkstemp(dir=folder, prefix=name, suffix=".tmp")
        os.close(handle)
        compiled.export_to_c(written, function_name=name)
        os.replace(written, folder / f"{name}-{_content_digest(Path(written).read_bytes())}.o")
    except Exception as error:  # a read-only or full disk, say
        warn_once(f"the CuTe kernel cache {folder} cannot store {name} ({error}); each process compiles it")
        if written is not None:
            with contextlib.suppress(OSError):
                os.unlink(written)
