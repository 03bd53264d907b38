"""Compiling one C file into a shared object with the system C compiler, and finding it again.

What the NVTX injection library (``collectors/nvtx/build.py``) and the C ``gpu_trace.range``
(``tracer/fastpath_build.py``) have in common: the compiler from ``GPU_TRACE_CC``, an atomic build
(a temporary file renamed into place), and the lookup of a hash-named build next to its source
(prebuilt into the wheel), then in a per-user cache, built there on first use under a lock.

Standard library only: ``setup.py`` loads this file and the builders by path, each a module of its
own, to prebuild both libraries into the wheel before ``gpu_trace`` is importable, and passes this
one to the builders' ``build(..., cbuild=)``; in the package they import it as ``gpu_trace._cbuild``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

BUILD_TIMEOUT_S = 120
#: What every build gets: optimized, position-independent, only what the source exports visible.
FLAGS = ("-O2", "-std=gnu11", "-fPIC", "-shared", "-fvisibility=hidden")


class BuildError(RuntimeError):
    """A C library could not be built or loaded; the message says why."""


def compiler_command(cc: str | None) -> list[str]:
    """The compiler as an argument list (``GPU_TRACE_CC`` may be e.g. ``ccache gcc``)."""
    argv = shlex.split(cc) if cc else ["cc"]
    if not argv:
        raise BuildError("GPU_TRACE_CC is empty")
    return argv


def build(
    source: Path,
    out: Path,
    *,
    include_dirs: Iterable[Path],
    libs: Iterable[str] = (),
    cc: str | None = None,
) -> Path:
    """Compile ``source`` to the shared object ``out`` atomically (a temporary file renamed into
    place, so a reader never sees half a library)."""
    argv = compiler_command(cc)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [*argv, *FLAGS]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    cmd += [str(source), "-o", tmp, *libs]
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
            f"compiling {source.name} failed ({argv[0]} exit {proc.returncode}): {tail}"
        )
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


def find_or_build(
    source: Path,
    name: str,
    cache_dir: Path,
    make: Callable[[Path], Path],
    *,
    check: Callable[[], object] | None = None,
) -> Path:
    """The build ``name`` of ``source``: prebuilt next to the source, in ``cache_dir``, or built
    there now by ``make(path)``. ``check``, if given, runs first where a build is needed and
    raises to stop it before the cache is touched (e.g. missing headers)."""
    prebuilt = source.with_name(name)
    if prebuilt.is_file():
        return prebuilt
    cached = cache_dir / name
    if cached.is_file():
        return cached
    if check is not None:
        check()
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Processes starting together (multiprocessing workers) build once: the others wait here.
    import fcntl

    with open(cache_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.is_file():
            return cached
        return make(cached)
