"""A file cache of compiled CuTe kernels, so that a new process loads a kernel (about 0.1 s) where
it would compile it (3 to 9 s): each configuration is exported once as an object file (the DSL's
``export_to_c``) and loaded through TVM-FFI (``cutlass.runtime.load_module``).

The folder is ``$MEGATRON_FUSED_LM_CUTE_CACHE``, else ``~/.cache/megatron_fused_lm/cute``; the value
``off`` keeps every kernel in its process. An entry's name digests the DSL's and TVM-FFI's
versions, the target architecture, the kernel module's source and the configuration, so a change
of any of them compiles anew; deleting the folder clears the cache. Entries are written whole
(a temporary file renamed into place), so ranks of one host may compile the same entry at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
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


def entry_name(source: Path, architecture: str, configuration: tuple) -> str:
    """The cache entry's name (also the exported function's): a digest of what decides the binary."""
    import cutlass
    import tvm_ffi

    digest = hashlib.sha256(source.read_bytes())
    digest.update(repr((cutlass.__version__, tvm_ffi.__version__, architecture, configuration)).encode())
    return f"{source.stem}_{digest.hexdigest()[:24]}"


def cached_kernel(source: Path, architecture: str, configuration: tuple, compile_kernel: Callable[[], Any]):
    """The kernel of ``configuration`` (a tuple of plain values) from ``source``'s module for
    ``architecture`` (``sm_90a``): loaded from the cache where an entry exists, else compiled by
    ``compile_kernel()`` and stored. Either is called with the kernel's arguments, the stream aside
    (TVM-FFI's current stream). A cache that cannot be read or written costs a compilation and one
    logged warning, never the call."""
    folder = cache_folder()
    if folder is None:
        return compile_kernel()
    name = entry_name(source, architecture, configuration)
    path = folder / f"{name}.o"
    if path.exists():
        try:
            from cutlass.runtime import load_module

            return getattr(load_module(str(path), enable_tvm_ffi=True), name)
        except Exception as error:  # a damaged entry: compiled again and replaced
            warn_once(f"the CuTe kernel cache entry {path} could not be loaded ({error}); compiling it again")
    compiled = compile_kernel()
    written = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        compiled.export_to_c(str(written), function_name=name)
        os.replace(written, path)
    except Exception as error:  # a read-only or full disk, say
        warn_once(f"the CuTe kernel cache {folder} cannot be written ({error}); each process compiles its kernels")
        with contextlib.suppress(OSError):  # a partial file, where there is one
            written.unlink()
    return compiled
