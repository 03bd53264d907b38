"""The program's own ``torch.profiler``, beside ours: what module and op level do around it.

PyTorch's Python tracer (``with_stack=True``) records, when it starts, the stack of every Python
thread, and sets its profile function on each. The recorder's flusher has no frame between its
flushes and clears that function before each one (``tracer/background.py``); what is left is a
profiler that starts *during* a flush, which records that flush's frames. So from the moment the
program prepares its profiler (``torch.autograd.profiler._prepare_profiler``, which
``torch.profiler.profile`` and ``torch.autograd.profiler.profile`` call first, before the tracer
starts) the flusher is held (:meth:`Recorder.hold_flushes`: the flush in progress ends, none
starts), until the profiler is seen on at the next top-level module call (:func:`on_root`), or
has ended (``_run_on_profiler_stop``, which PyTorch calls right after ``_disable_profiler``).

Op level's sessions (:class:`.ops.OpSource`) step aside at the same two points: PyTorch runs one
profiler session at a time, and preparing the program's ends ours.

Both wrappers run while the tracer is off, so the program's profile has no frame of them.
PyTorch imports ``torch.profiler._cupti_monitor`` at the first ``record_function``, often inside
the program's profile, where its tracer keeps names pointing into the module body's code object,
freed once run (``UnicodeDecodeError`` in ``key_averages()``, plain too): :func:`watch` imports
it first.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

log = logging.getLogger(__name__)

#: Modules PyTorch imports the first time a profiler range opens (``record_function``, which
#: ``Optimizer.step`` uses): imported when recording patches torch, outside any profile.
LAZY_PROFILER_PARTS = ("torch.profiler._cupti_monitor",)
#: Seconds the flusher is held at most while the program's profiler is prepared but not on
#: (a schedule's warmup steps; a profile never started).
MAX_HOLD_S = 5.0


class Flushes(Protocol):
    def hold_flushes(self, held: bool) -> None: ...


class Aside(Protocol):
    def step_aside(self) -> None: ...

    def step_back(self) -> None: ...


_wrapped: tuple[ModuleType, Callable[..., object], Callable[..., object]] | None = None
_rec: Flushes | None = None
_source: Aside | None = None
_enabled: Callable[[], bool] = lambda: False  # noqa: E731
#: time.monotonic() when the flusher was held for the program's profiler; 0.0: not held.
held_since = 0.0


def watch(torch: ModuleType, rec: Flushes | None, source: Aside | None) -> None:
    """Wrap the program's profiler's start and end (first undoing an earlier watch)."""
    global _wrapped, _rec, _source, _enabled
    unwatch()
    _import_lazy_parts()
    mod = getattr(getattr(torch, "autograd", None), "profiler", None)
    prepare = getattr(mod, "_prepare_profiler", None)
    stopped = getattr(mod, "_run_on_profiler_stop", None)
    enabled = getattr(getattr(torch, "autograd", None), "_profiler_enabled", None)
    if mod is None or prepare is None or stopped is None or enabled is None:
        log.debug("gpu-trace: torch.autograd.profiler's entry points moved; not watched")
        return
    _rec, _source, _enabled = rec, source, enabled

    def _prepare_profiler(*args: object, **kwargs: object) -> object:
        _starting()
        try:
            return prepare(*args, **kwargs)
        except BaseException:
            _stopped()  # the program's profiler did not start
            raise

    def _run_on_profiler_stop(*args: object, **kwargs: object) -> object:
        try:
            return stopped(*args, **kwargs)
        finally:
            _stopped()

    _prepare_profiler.__wrapped__ = prepare  # type: ignore[attr-defined]
    _run_on_profiler_stop.__wrapped__ = stopped  # type: ignore[attr-defined]
    setattr(mod, "_prepare_profiler", _prepare_profiler)  # noqa: B010 (torch's private names)
    setattr(mod, "_run_on_profiler_stop", _run_on_profiler_stop)  # noqa: B010
    _wrapped = (mod, prepare, stopped)


def unwatch() -> None:
    """Undo :func:`watch` (and release the flusher). Idempotent."""
    global _wrapped, _rec, _source
    _release()
    if _wrapped is not None:
        mod, prepare, stopped = _wrapped
        for name, original in (("_prepare_profiler", prepare), ("_run_on_profiler_stop", stopped)):
            if getattr(getattr(mod, name, None), "__wrapped__", None) is original:
                setattr(mod, name, original)  # not if the program replaced ours since
        _wrapped = None
    _rec = _source = None


def is_watching() -> bool:
    return _wrapped is not None


def on_root() -> None:
    """At a top-level module call while the flusher is held: release it once the program's
    profiler is on (its tracer has taken every thread's stack), or after :data:`MAX_HOLD_S`."""
    try:
        if _enabled() or time.monotonic() - held_since > MAX_HOLD_S:
            _release()
    except Exception:
        _release()


def _starting() -> None:
    global held_since
    if _rec is not None and not held_since:
        held_since = time.monotonic()
        _rec.hold_flushes(True)
    if _source is not None:
        _source.step_aside()


def _stopped() -> None:
    _release()
    if _source is not None:
        _source.step_back()


def _release() -> None:
    global held_since
    if held_since:
        held_since = 0.0
        if _rec is not None:
            _rec.hold_flushes(False)


def _import_lazy_parts() -> None:
    """Import now, outside any profile, what PyTorch would import lazily inside one."""
    for name in LAZY_PROFILER_PARTS:
        try:
            importlib.import_module(name)
        except Exception:  # another version: nothing to import
            log.debug("gpu-trace: %s not imported", name, exc_info=True)
