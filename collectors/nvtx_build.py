"""Building the NVTX injection library (``nvtx_inject.c``) with the system C compiler.

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

# Relative, not ``gpu_trace._cbuild``: setup.py loads this file where gpu_trace is not importable.
from .. import _cbuild
from .._cbuild import BuildError

SOURCE = Path(__file__).with_name("nvtx_inject.c")
HEADER = Path("nvtx3") / "nvToolsExt.h"


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


def build(out: Path, *, cc: str | None = None) -> Path:
    """Compile the library to ``out`` atomically (a temporary file renamed into place)."""
    if sys.platform != "linux":
        raise BuildError(f"native NVTX capture is built for Linux only, not {sys.platform}")
    inc = include_dir()
    if inc is None:
        raise BuildError(
            "NVTX headers (nvtx3/nvToolsExt.h) not found; install the nvidia-nvtx package"
        )
    return _cbuild.build(SOURCE, out, include_dirs=[inc], libs=["-lpthread"], cc=cc)


def find_or_build(cache_dir: Path, *, cc: str | None = None) -> Path:
    """The library for the current source: prebuilt next to the source, cached, or built now."""
    return _cbuild.find_or_build(SOURCE, library_name(), cache_dir, lambda out: build(out, cc=cc))
