"""NVTX capture: every NVTX range in the process, from Python or native code, into the recorder.

Two paths, one result (same lanes, categories, names, nesting; a parity test holds them together):

- **native** (default): the injection library ``inject.c``, loaded by each NVTX user through
  ``NVTX_INJECTION64_PATH``, records on every thread into per-thread C buffers that
  :class:`~gpu_trace.collectors.nvtx.native.NativeSource` drains at each flush.
- **python**: the ``nvtx`` package's functions are patched (:mod:`.patch`); used when native
  capture can't work here (no C compiler or headers, another NVTX tool such as Nsight Systems
  already attached, or NVTX initialized before recording started), with one warning saying why.

``gpu-trace record`` puts :func:`injection_env` in the program's environment; every recorded
process then calls :func:`attach` (from ``tracer/session.py``) with ``GPU_TRACE_NVTX``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
from pathlib import Path

from gpu_trace import _cbuild, config
from gpu_trace.collectors.nvtx import build as nvtx_build
from gpu_trace.collectors.nvtx import patch as nvtx_patch
from gpu_trace.collectors.nvtx.native import NativeSource, declare

log = logging.getLogger(__name__)

ENV = "NVTX_INJECTION64_PATH"
MODES = ("native", "python", "off")
#: Per-thread ring capacity cap of the native path (64 bytes an event: 16 MiB a thread at most,
#: reserved up front and committed as it is touched). ``GPU_TRACE_BUFFER_EVENTS`` lowers it.
NATIVE_MAX_EVENTS = 1 << 18

_lock = threading.Lock()
_built: dict[tuple[str, str], tuple[Path | None, str | None]] = {}
_last_error: str | None = None
_warned = False


def _compiler() -> str | None:
    return config.c_compiler()


def library_path() -> Path | None:
    """The injection library for this source, built on first use; None if it can't be built.

    Looked for next to the source (prebuilt in the wheel), then in ``GPU_TRACE_HOME/lib``, else
    compiled there with ``GPU_TRACE_CC`` (default ``cc``). :func:`build_error` says why not.
    """
    global _last_error
    cc = _compiler() or ""
    key = (str(config.home()), cc)
    with _lock:
        if key not in _built:
            try:
                _built[key] = (nvtx_build.find_or_build(config.home() / "lib", cc=cc or None), None)
            except (_cbuild.BuildError, OSError) as exc:
                _built[key] = (None, str(exc))
        path, _last_error = _built[key]
    return path


def build_error() -> str | None:
    """Why the last :func:`library_path` call found no library (None if it found one)."""
    return _last_error


def injection_env(mode: str | None = None) -> dict[str, str]:
    """Variables `gpu-trace record` adds to the program's environment for native capture.

    ``{}`` when capture is not native, when another NVTX tool is already named in the environment
    (it keeps its place; the program falls back to the Python path), or when the library can't be
    built.
    """
    if mode is None:
        try:
            mode = config.RecorderSettings.from_env().nvtx
        except ValueError:
            return {}
    if mode != "native" or os.environ.get(ENV):
        return {}
    path = library_path()
    return {ENV: str(path)} if path is not None else {}


def attach(rec, mode: str) -> str:  # rec: gpu_trace.tracer.recorder.Recorder
    """Start NVTX capture for ``rec`` in this process; returns the mode in effect.

    ``native`` falls back to ``python`` (logging one warning with the reason) when the injection
    library is not, and can't become, this process's NVTX tool. ``python`` gives ``off`` only if the
    ``nvtx`` package is missing.
    """
    if mode not in MODES:
        raise ValueError(f"NVTX mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return "off"
    if mode == "native":
        lib, reason = _load_native()
        if lib is not None:
            capacity = min(int(rec.settings.buffer_events), NATIVE_MAX_EVENTS)
            rec.add_source(NativeSource(lib, capacity, tsc=_use_tsc()))
            return "native"
        _warn_once(reason or "unknown reason")
    if nvtx_patch.patch():
        rec.add_source(PatchSource())
        return "python"
    return "off"


class PatchSource:
    """Ties the Python path's patches to the recorder's lifetime (events go to its buffers)."""

    name = "nvtx-python"

    def drain(self):
        return ()

    def dropped(self) -> int:
        return 0

    def after_fork_in_child(self) -> None:
        pass

    def close(self) -> None:
        nvtx_patch.unpatch()


def _use_tsc() -> bool:
    """Whether the injection library may stamp events with the TSC (see ``GPU_TRACE_NVTX_CLOCK``)."""
    try:
        if config.nvtx_clock() != "auto":
            return False
    except ValueError as exc:
        log.warning("gpu-trace: %s; NVTX events use clock_gettime", exc)
        return False
    return tsc_invariant()


def tsc_invariant(
    cpuinfo: str = "/proc/cpuinfo",
    clocksource: str = "/sys/devices/system/clocksource/clocksource0/current_clocksource",
) -> bool:
    """An x86-64 TSC that ticks at a constant rate through every power state, synchronized across
    CPUs well enough that the kernel itself reads CLOCK_MONOTONIC from it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open(clocksource) as f:
            if f.read().strip() != "tsc":
                return False
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"constant_tsc", "nonstop_tsc"} <= flags
    except OSError:
        return False
    return False


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "gpu-trace: native NVTX capture is off (%s); recording the Python nvtx package only",
            reason,
        )


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_ours(path: str) -> bool:
    """A build of our library from another place (a wheel's prebuilt copy, another cache)."""
    name = os.path.basename(path)
    if not (name.startswith("libgpu_trace_nvtx-") and name.endswith(".so")):
        return False  # never dlopen another tool's library ourselves
    try:
        declare(ctypes.CDLL(path))
    except (OSError, AttributeError, RuntimeError):
        return False
    return True


def _load_native() -> tuple[ctypes.CDLL | None, str | None]:
    """Our library as this process's NVTX injection, or None and the reason it can't be."""
    if not sys.platform.startswith("linux"):
        return None, f"native capture needs Linux, not {sys.platform}"
    path = library_path()
    if path is None:
        return None, f"the injection library could not be built: {build_error()}"
    current = os.environ.get(ENV)
    if current == "./.":
        return None, f"{ENV}='./.' asks for no NVTX tool"
    if current and not _same_file(current, str(path)) and not _is_ours(current):
        return None, f"another NVTX tool is attached ({ENV}={current}); a process loads only one"
    set_here = not current
    if set_here:
        os.environ[ENV] = str(path)
    try:
        # The path NVTX dlopens (or will): the same handle, so the same globals.
        lib = declare(ctypes.CDLL(current or str(path)))
    except (OSError, AttributeError, RuntimeError) as exc:
        if set_here:
            os.environ.pop(ENV, None)
        return None, f"loading {path} failed: {exc}"
    if lib.gt_init_count() == 0:
        nvtx_lib = sys.modules.get("nvtx._lib.lib")
        if nvtx_lib is not None:
            # The nvtx package is imported: make it initialize now, which loads us unless it
            # already initialized without a tool (then its calls never reach us).
            try:
                nvtx_lib.initialize()
            except Exception:
                log.debug("nvtx initialize failed", exc_info=True)
            if lib.gt_init_count() == 0:
                if set_here:
                    os.environ.pop(ENV, None)
                return (
                    None,
                    "NVTX was initialized in this process before recording started, with no tool",
                )
    return lib, None
