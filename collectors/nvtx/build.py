"""Building the NVTX injection library (``inject.c``) with the system C compiler.

Standard library only: ``setup.py`` loads this file by path to prebuild the library into the wheel,
before ``gpu_trace`` is importable. At run time the library is looked for next to the source
(a prebuilt copy shipped in the wheel), then in a per-user cache, and built into the cache on first
use. The file name carries a hash of the source, so a changed source never loads a stale build.
How a C file is compiled and cached is :mod:`gpu_trace._cbuild`'s; this file says what to build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

# No import of gpu_trace at module level: setup.py loads this file by path, where gpu_trace is not
# importable, and passes :mod:`gpu_trace._cbuild` (loaded by path as well) to :func:`build`.

SOURCE = Path(__file__).with_name("inject.c")
HEADER = Path("nvtx3") / "nvToolsExt.h"


def helper(cbuild: ModuleType | None = None) -> ModuleType:
    """:mod:`gpu_trace._cbuild`, or the copy of it that setup.py loaded by path and passed in."""
    if cbuild is not None:
        return cbuild
    from gpu_trace import _cbuild

    return _cbuild


def include_dir() -> Path | None:
    """The directory holding ``nvtx3/nvToolsExt.h``, searched in the ``nvidia`` package dirs."""
    roots: list[Path] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots.extend(Path(p) for p in spec.submodule_search_locations)
    for root in roots:
        direct = root / "include"
        if (direct / HEADER).is_file():
            return direct
        for candidate in sorted(root.glob("*/include")):
            if (candidate / HEADER).is_file():
                return candidate
    for prefix in {sys.prefix, sys.base_prefix, "/usr/local", "/usr"}:
        candidate = Path(prefix) / "include"
        if (candidate / HEADER).is_file():
            return candidate
    return None


def source_hash() -> str:
    """A short hash of the library source: the build's identity."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def library_name() -> str:
    return f"libgpu_trace_nvtx-{source_hash()}.so"


def build(out: Path, *, cc: str | None = None, cbuild: ModuleType | None = None) -> Path:
    """Compile the library to ``out`` atomically (a temporary file renamed into place)."""
    cb = helper(cbuild)
    if sys.platform != "linux":
        raise cb.BuildError(f"native NVTX capture is built for Linux only, not {sys.platform}")
    inc = include_dir()
    if inc is None:
        raise cb.BuildError(
            "NVTX headers (nvtx3/nvToolsExt.h) not found; install the nvidia-nvtx package"
        )
    return cb.build(SOURCE, out, include_dirs=[inc], libs=["-lpthread"], cc=cc)


def find_or_build(cache_dir: Path, *, cc: str | None = None) -> Path:
    """The library for the current source: prebuilt next to the source, cached, or built now."""
    return helper().find_or_build(SOURCE, library_name(), cache_dir, lambda out: build(out, cc=cc))
