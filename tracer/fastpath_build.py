"""Building and loading ``_fastpath.c``, the C twin of ``gpu_trace.range``, with the system C compiler.

Standard library only: ``setup.py`` loads this file by path to prebuild the extension into the
wheel, before ``gpu_trace`` is importable. At run time the extension is looked for next to the
source (a prebuilt copy shipped in the wheel), then in the per-user cache the NVTX library uses
(``GPU_TRACE_HOME/lib``), and built into the cache on first use. The file name carries a hash of
the source and of the Python ABI, so a changed source or another interpreter never loads a stale
build. Anything that goes wrong gives :class:`BuildError`; the caller then uses the Python twin.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("_fastpath.c")
MODULE = "gpu_trace.tracer._fastpath"
BUILD_TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


def _ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or importlib.machinery.EXTENSION_SUFFIXES[0]


def source_hash() -> str:
    """A short hash of the source and the interpreter ABI: the build's identity."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{_ext_suffix()}|{sys.version}|{sys.implementation.cache_tag}".encode())
    return h.hexdigest()[:16]


def library_name() -> str:
    return f"_fastpath-{source_hash()}{_ext_suffix()}"


def include_dirs() -> list[Path]:
    """Where ``Python.h`` is (``sysconfig``); raises BuildError when the headers are missing."""
    paths = sysconfig.get_paths()
    dirs = [Path(p) for p in dict.fromkeys((paths.get("include"), paths.get("platinclude"))) if p]
    if not any((d / "Python.h").is_file() for d in dirs):
        raise BuildError(
            f"Python headers (Python.h) not found in {', '.join(map(str, dirs)) or '?'}; "
            "install the python3-dev package"
        )
    return dirs


def supported() -> str | None:
    """Why this interpreter can't use the extension, or None if it can."""
    if sys.platform != "linux":
        return f"the C range is built for Linux only, not {sys.platform}"
    if sys.implementation.name != "cpython":
        return f"the C range needs CPython, not {sys.implementation.name}"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return "the C range relies on the GIL; this is a free-threaded build"
    return None


def compiler_command(cc: str | None) -> list[str]:
    argv = shlex.split(cc) if cc else ["cc"]
    if not argv:
        raise BuildError("GPU_TRACE_CC is empty")
    return argv


def build(out: Path, *, cc: str | None = None) -> Path:
    """Compile the extension to ``out`` atomically (a temporary file renamed into place)."""
    reason = supported()
    if reason:
        raise BuildError(reason)
    incs = include_dirs()
    argv = compiler_command(cc)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [*argv, "-O2", "-std=gnu11", "-fPIC", "-shared", "-fvisibility=hidden"]
    for d in incs:
        cmd += ["-I", str(d)]
    cmd += [str(SOURCE), "-o", tmp]
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
    """The extension for this source and interpreter: prebuilt, cached, or built now."""
    reason = supported()
    if reason:
        raise BuildError(reason)
    name = library_name()
    prebuilt = SOURCE.with_name(name)
    if prebuilt.is_file():
        return prebuilt
    cached = cache_dir / name
    if cached.is_file():
        return cached
    include_dirs()  # fail fast, without running the compiler, where the headers are missing
    cache_dir.mkdir(parents=True, exist_ok=True)
    import fcntl

    # Processes starting together build once: the others wait here (the NVTX build's lock).
    with open(cache_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.is_file():
            return cached
        return build(cached, cc=cc)


def load(path: Path) -> ModuleType:
    """Import the extension at ``path`` as ``gpu_trace.tracer._fastpath``."""
    existing = sys.modules.get(MODULE)
    if existing is not None:
        return existing
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    if spec is None:
        raise BuildError(f"cannot load {path}")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        raise BuildError(f"loading {path} failed: {exc}") from None
    sys.modules[MODULE] = module
    return module
