"""The periodic sampler: a thread that calls ``sample`` at a fixed rate and records what it reads.

A sampler runs outside the traced program (in the `gpu-trace record` parent, or in a server) and
records into a :class:`~gpu_trace.tracer.recorder.Recorder` through that thread's own buffer, so
its counters and marks reach the spool with the recorder's flushes. Counters are stamped with the
recorder's clock (``now_ns``, CLOCK_MONOTONIC), the clock every span of the run is on.

Ticks are on a fixed grid (``start + k * period``); a tick that comes late is not made up with a
burst, the next one is simply the next on the grid. A failing ``sample`` is logged once and the
sampler keeps going: nothing here raises into the caller after construction.

A sampler's threads run at a lower priority (``nice`` +10, per thread) and, where the record
process may use four CPUs or more, on the last of them: on a launch-bound training step the
program's launch thread must never wait for a core behind a sampler (:func:`calm_thread`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

from gpu_trace.tracer.buffer import ThreadBuffer
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.records import MARK

log = logging.getLogger(__name__)

#: Highest sampling rate accepted (Hz); NVML's own buffers are the way to finer resolution.
MAX_HZ = 1000.0
#: How much nicer than the record process a sampler thread runs.
NICE = 10
#: Below this many usable CPUs a sampler thread is not pinned: there is no spare core to give it.
PIN_MIN_CPUS = 4


def sampler_cpus(allowed: set[int]) -> set[int] | None:
    """The CPUs a sampler thread is pinned to, given the ones the process may use: the last one
    where there are ``PIN_MIN_CPUS`` or more (the scheduler fills low-numbered cores first), else
    None (not pinned)."""
    return {max(allowed)} if len(allowed) >= PIN_MIN_CPUS else None


def calm_thread() -> str:
    """Lower the calling thread's priority and pin it off the program's cores where there are
    spare ones; returns what was done (``nice+10 cpu15``), for the run's attributes. Never raises:
    a platform without per-thread nice or affinity just samples at normal priority."""
    done = []
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))
        done.append(f"nice+{NICE}")
    except (AttributeError, OSError):
        log.debug("gpu-trace: cannot lower the sampler's priority", exc_info=True)
    try:
        cpus = sampler_cpus(os.sched_getaffinity(0))
        if cpus is not None:
            os.sched_setaffinity(tid, cpus)
            done.append("cpu" + ",".join(map(str, sorted(cpus))))
    except (AttributeError, OSError):
        log.debug("gpu-trace: cannot pin the sampler's thread", exc_info=True)
    return " ".join(done)


class Sink(Protocol):
    """Where a sampler's records go: anything with a per-thread ``buffer()`` (a Recorder)."""

    def buffer(self) -> ThreadBuffer: ...


class Sampler:
    """Calls :meth:`sample` ``hz`` times a second on a daemon thread, between start() and stop().

    Subclasses implement ``sample(now)`` with :meth:`counter` and :meth:`mark`. ``sample_once``
    runs one tick on the calling thread (tests, benchmarks).
    """

    #: The ``source`` column of this sampler's counters (``nvml``, ``host``).
    source = "sampler"

    def __init__(
        self, sink: Sink, hz: float, *, clock: Callable[[], int] = now_ns, name: str = ""
    ) -> None:
        if not 0 < hz <= MAX_HZ:
            raise ValueError(f"sampling rate must be in (0, {MAX_HZ:g}] Hz, got {hz}")
        self.sink = sink
        self.hz = float(hz)
        self.period_ns = int(1e9 / hz)
        self.clock = clock
        self.name = name or f"gpu-trace-{self.source}"
        self.ticks = 0
        self.failures = 0
        #: What calm_thread did to the sampling thread ("" before it started, or where nothing).
        self.calmed = ""
        self._local = threading.local()  # each sampling thread records into its own buffer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifetime -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling on a background thread. Calling it twice is an error."""
        if self._thread is not None:
            raise ValueError(f"{self.name} is already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling and wait for the thread; idempotent. The caller flushes the sink."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("gpu-trace: %s did not stop within %.1f s", self.name, timeout)
        self.close()

    def close(self) -> None:
        """Release what the sampler holds (its source); called once by stop()."""

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        self.every(self.period_ns, self.sample_once)

    def every(self, period_ns: int, step: Callable[[], None]) -> None:
        """Call ``step`` every ``period_ns`` on the calling thread (calmed) until stop()."""
        self.calmed = calm_thread()
        next_ns = self.clock()
        while not self._stop.is_set():
            step()
            next_ns += period_ns
            now = self.clock()
            if next_ns < now:  # late: skip the missed ticks rather than burst
                next_ns += ((now - next_ns) // period_ns + 1) * period_ns
            if self._stop.wait((next_ns - now) / 1e9):
                break

    # ---- one tick -----------------------------------------------------------------------------

    def sample_once(self) -> None:
        """Take one sample now. Never raises: failures are logged (the first) and counted."""
        self._local.buf = self.sink.buffer()
        try:
            self.sample(self.clock())
            self.ticks += 1
        except Exception:  # the one boundary between a source's failures and the run
            self.failures += 1
            if self.failures == 1:
                log.exception("gpu-trace: %s failed; it keeps sampling", self.name)

    def sample(self, now: int) -> None:
        raise NotImplementedError

    # ---- recording helpers (called from sample) -----------------------------------------------

    def counter(
        self,
        device: str,
        metric: str,
        ts_ns: int,
        value: float,
        labels: dict[str, str] | None = None,
    ) -> None:
        self._local.buf.add_counter((self.source, device, metric, ts_ns, float(value), labels))

    def mark(self, lane: str, name: str, ts_ns: int, attrs: dict[str, str] | None = None) -> None:
        """An instant event (category ``mark``) on ``lane``: an error, an XID, a throttle change."""
        buf = self._local.buf
        buf.add_span((buf.next_id(), 0, lane, MARK, name, ts_ns, ts_ns, 0, attrs))
