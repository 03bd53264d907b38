"""A background thread that stays out of the program's own profilers.

A program may profile itself while it is recorded: ``torch.profiler`` with ``with_stack=True``
(its Python tracer) sets a profile function on every Python thread of the interpreter and, when
it starts, walks each thread's stack. A ``threading.Thread`` always has Python frames on its stack
(``_bootstrap``, ``_bootstrap_inner``, ``run``, and the loop waiting in ``Event.wait``), so the
recorder's flusher used to show up in the program's profile: its frames from the profiler's start
to its end, and every flush (our drains, the spool writer, pyarrow) while the profile ran.

:class:`BackgroundThread` runs a ``step`` function each time it is woken or its interval passes,
and between steps has no Python frame at all: the thread is started with ``_thread`` on a chain
of C iterators (``map``, ``iter``, ``functools.partial``) that waits in ``lock.acquire`` and,
before each step, clears a profile function set on this thread (only if one is set: clearing
raises the ``sys.setprofile`` audit event). So a profiler that starts while it waits finds no
frame to record, and one that started before a step loses this thread before the step's first
frame. A profiler that starts *during* a step (a few milliseconds at most, every half second)
still records that step's frames, up to the next one: :meth:`BackgroundThread.hold` closes that
window where the program's profiler is seen coming (PyTorch's, at module and op level: the
patch holds the flusher from the program's ``_prepare_profiler`` until its profiler is on).

The thread is not a ``threading.Thread``: the program does not see it in
``threading.enumerate()``. Code that runs in a step must not call ``threading.current_thread()``
(it would register the thread as ``Dummy-N``, which the program would see); a warning logged
from a step does so through :mod:`logging`, once, which only happens where recording already
failed.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import itertools
import logging
import operator
import sys
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

_call = operator.methodcaller("__call__")
_call_with_none = operator.methodcaller("__call__", None)
#: By whether the thread's profile object is None: what to call with None (``id``: nothing).
_CLEAR = (sys.setprofile, id)


class BackgroundThread:
    """Calls ``step(woken)`` after each :meth:`wake` (``woken`` True) or ``interval`` seconds
    without one (False), until ``step`` returns False or :meth:`stop` is called; with no Python
    frame on the thread between steps (module docstring). ``step`` should not raise: an
    exception is logged and the thread goes on."""

    def __init__(self, step: Callable[[bool], bool], name: str, interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.name = name
        self.interval = float(interval)
        self._step = step
        self._wake = _thread.allocate_lock()
        self._wake.acquire()  # held while nobody wakes the thread: acquire() then waits
        self._done = _thread.allocate_lock()
        self._busy = _thread.allocate_lock()  # held by a step, and by hold()
        self._holding = threading.Lock()  # guards _held
        self._held = False
        self._stopping = False
        self._started = False
        self.ident: int | None = None
        self.native_id: int | None = None

    def start(self) -> None:
        if self._started:
            raise RuntimeError(f"{self.name} is started already")
        self._started = True
        self._done.acquire()
        waits = iter(functools.partial(self._wake.acquire, True, self.interval), None)
        # before each step: the profile object, whether it is None, what that says to call
        profiles = map(_call, itertools.repeat(sys.getprofile))
        unset = map(operator.is_, profiles, itertools.repeat(None))
        cleared = map(_call_with_none, map(_CLEAR.__getitem__, unset))
        busy = map(_call, itertools.repeat(self._busy.acquire))  # waits while held
        # map takes the next wait first, then the busy lock, then clears, then calls: all in C
        # until the step (which releases the busy lock)
        steps = map(self._run_step, waits, busy, cleared)
        try:
            _thread.start_new_thread(deque, (itertools.takewhile(bool, steps), 0))
        except BaseException:
            self._done.release()
            raise

    def _run_step(self, woken: bool, _busy: object, _cleared: object) -> bool:
        if self.ident is None:
            self.ident = threading.get_ident()
            self.native_id = threading.get_native_id()
        go_on = True
        try:
            if not self._stopping:
                go_on = bool(self._step(woken))
        except Exception:  # never end the thread on a step's failure (STYLE.md 6)
            log.exception("gpu-trace: %s: a step failed", self.name)
        finally:
            self._busy.release()
        if self._stopping or not go_on:
            self._stopping = True
            self._done.release()
            return False
        return True

    def wake(self) -> None:
        """Have the thread step now rather than when its interval passes."""
        with contextlib.suppress(RuntimeError):  # woken already, not stepped yet
            self._wake.release()

    def hold(self) -> None:
        """Wait for a step in progress to end, and start none until :meth:`release`: nothing of
        this thread runs Python meanwhile. Idempotent; a no-op on the thread itself."""
        if threading.get_ident() == self.ident or not self._started:
            return
        with self._holding:
            if not self._held:
                self._busy.acquire()
                self._held = True

    def release(self) -> None:
        """Undo :meth:`hold`. Idempotent."""
        with self._holding:
            if self._held:
                self._held = False
                self._busy.release()

    @property
    def held(self) -> bool:
        return self._held

    def stop(self) -> None:
        """Have the thread end after its current step (without calling ``step`` again)."""
        self._stopping = True
        self.release()
        self.wake()

    def is_alive(self) -> bool:
        return self._started and self._done.locked()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (at most ``timeout`` seconds); whether it has."""
        if not self._started:
            return True
        if self._done.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._done.release()
            return True
        return False
