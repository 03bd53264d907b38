"""Kineto's log threshold, raised only while op level starts and stops its own sessions.

PyTorch's profiler library (Kineto) writes ``USDT: ... profiler_start`` and ``profiler_stop`` to
stderr at every session start and stop: its message level ``USDT`` sits above ``ERROR``, the
threshold PyTorch sets when it loads Kineto, so only ``KINETO_LOG_LEVEL`` (read once, at load)
hides them. Op level cycles a session every :data:`~.ops.SESSION_S`, which made a program's
stderr a stream of those lines. Setting the environment variable would change what the
program's own ``torch.profiler`` prints and is visible to it; instead the threshold (the static
``libkineto::Logger::severityLevel_``, exported by ``libtorch_cpu``) is raised around our start
and stop calls only, and put back to the value it had right after, so the program's own profiler
logs as it would without gpu-trace. A message another thread logs through Kineto during those
calls (a fraction of a millisecond, or the stop's processing) is not printed.

Where the symbol is not found (another build of PyTorch, not Linux), nothing is changed and the
lines are printed as before: :func:`quietly` only calls.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The mangled name of ``libkineto::Logger::severityLevel_`` (a ``std::atomic_int``).
SYMBOL = "_ZN9libkineto6Logger14severityLevel_E"
#: Above every Kineto message level (VERBOSE 0 ... USDT 5): nothing is logged.
SILENT = 1 << 20
LIBRARY = "libtorch_cpu.so"

_level: ctypes.c_int | None = None
_looked = False


def threshold() -> ctypes.c_int | None:
    """Kineto's threshold in the loaded ``libtorch_cpu`` (found once), or None."""
    global _level, _looked
    if not _looked:
        _looked = True
        _level = _find()
    return _level


def _find() -> ctypes.c_int | None:
    path = _loaded(LIBRARY)
    if path is None:
        log.debug("gpu-trace: %s is not loaded; Kineto's session lines stay on", LIBRARY)
        return None
    try:
        # RTLD_NOLOAD: the copy PyTorch loaded, never a second one
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return ctypes.c_int.in_dll(lib, SYMBOL)
    except (OSError, ValueError, AttributeError) as exc:
        log.debug("gpu-trace: Kineto's log threshold not found (%s); its lines stay on", exc)
        return None


def _loaded(name: str) -> str | None:
    """The path of the loaded shared library ``name``, from this process's mappings."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(path) == name:
                    return path
    except OSError:
        return None
    return None


def quietly(call: Callable[[], T]) -> T:
    """``call()`` with Kineto's messages off, its threshold put back afterwards."""
    level = threshold()
    if level is None:
        return call()
    saved = level.value
    level.value = SILENT
    try:
        return call()
    finally:
        level.value = saved
