"""Building the NVTX injection library (``nvtx_inject.c``) with the system C compiler.

Standard library only: ``setup.py`` loads this file by path to prebuild the library into the wheel,
before ``gpu_trace`` is importable. At run time the library is looked for next to the source
(a prebuilt copy shipped in the wheel), then in a per-user cache, and built into the cache on first
use. The file name carries a hash of the source, so a changed source never loads a stale build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("nvtx_inject.c")
HEADER = Path("nvtx3") / "nvToolsExt.h"
BUILD_TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The injection library could not be built; the message says why."""


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


def compiler_command(cc: str | None) -> list[str]:
    """The compiler as an argument list (``GPU_TRACE_CC`` may be e.g. ``ccache gcc``)."""
    argv = shlex.split(cc) if cc else ["cc"]
    if not argv:
        raise BuildError("GPU_TRACE_CC is empty")
    return argv


def build(out: Path, *, cc: str | None = None) -> Path:
    """Compile the library to ``out`` atomically (a temporary file renamed into place)."""
    if sys.platform != "linux":
        raise BuildError(f"native NVTX capture is built for Linux only, not {sys.platform}")
    inc = include_dir()
    if inc is None:
        raise BuildError(
            "NVTX headers (nvtx3/nvToolsExt.h) not found; install the nvidia-nvtx package"
        )
    argv = compiler_command(cc)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [
        *argv,
        "-O2",
        "-std=gnu11",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-I",
        str(inc),
        str(SOURCE),
        "-o",
        tmp,
        "-lpthread",
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        os.unlink(tmp)
        raise BuildError(f"C compiler {argv[0]!r} not found (set GPU_TRACE_CC)") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        raise BuildError(f"running the C compiler {argv[0]!r} failed: {exc}") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise BuildError(
            f"compiling {SOURCE.name} failed ({argv[0]} exit {proc.returncode}): {tail}"
        )
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


def find_or_build(cache_dir: Path, *, cc: str | None = None) -> Path:
    """The library for the current source: prebuilt next to the source, cached, or built now."""
    name = library_name()
    prebuilt = SOURCE.with_name(name)
    if prebuilt.is_file():
        return prebuilt
    cached = cache_dir / name
    if cached.is_file():
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Processes starting together (multiprocessing workers) build once: the others wait here.
    import fcntl

    with open(cache_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.is_file():
            return cached
        return build(cached, cc=cc)
