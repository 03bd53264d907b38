"""The periodic sampler: a thread that calls ``sample`` at a fixed rate and records what it reads.

A sampler runs outside the traced program (in the `gpu-trace record` parent, or in a server) and
records into a :class:`~gpu_trace.tracer.recorder.Recorder` through that thread's own buffer, so
its counters and marks reach the spool with the recorder's flushes. Counters are stamped with the
recorder's clock (``now_ns``, CLOCK_MONOTONIC), the clock every span of the run is on.

Ticks are on a fixed grid (``start + k * period``); a tick that comes late is not made up with a
burst, the next one is simply the next on the grid. A failing ``sample`` is logged once and the
sampler keeps going: nothing here raises into the caller after construction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from gpu_trace.tracer.buffer import ThreadBuffer
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.records import MARK

log = logging.getLogger(__name__)

#: Highest sampling rate accepted (Hz); NVML's own buffers are the way to finer resolution.
MAX_HZ = 1000.0


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
        self._buf: ThreadBuffer | None = None
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
        next_ns = self.clock()
        while not self._stop.is_set():
            self.sample_once()
            next_ns += self.period_ns
            now = self.clock()
            if next_ns < now:  # late: skip the missed ticks rather than burst
                next_ns += ((now - next_ns) // self.period_ns + 1) * self.period_ns
            if self._stop.wait((next_ns - now) / 1e9):
                break

    # ---- one tick -----------------------------------------------------------------------------

    def sample_once(self) -> None:
        """Take one sample now. Never raises: failures are logged (the first) and counted."""
        self._buf = self.sink.buffer()
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
        assert self._buf is not None
        self._buf.add_counter((self.source, device, metric, ts_ns, float(value), labels))

    def mark(self, lane: str, name: str, ts_ns: int, attrs: dict[str, str] | None = None) -> None:
        """An instant event (category ``mark``) on ``lane``: an error, an XID, a throttle change."""
        buf = self._buf
        assert buf is not None
        buf.add_span((buf.next_id(), 0, lane, MARK, name, ts_ns, ts_ns, 0, attrs))
