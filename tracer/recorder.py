"""The in-process recorder: per-thread buffers, sources, and the background flusher.

One recorder per process records into one run directory. Threads append to their own
:class:`~gpu_trace.tracer.buffer.ThreadBuffer`; native sources (the NVTX injection library) keep
their own buffers and are drained by the same flusher. The flusher writes spool files at least
every ``flush_interval_s`` and once more at exit, on an uncaught exception, on SIGINT and SIGTERM.
After ``fork`` the child starts with empty buffers, its own spool files and its own flusher.

Nothing here raises into the traced program: failures are logged once and recording goes on or
stops quietly. What a flush writes, the spool's tables (kept and retried while the disk is full)
and the stats file, is :mod:`gpu_trace.tracer.spool_output`'s.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from gpu_trace.config import RecorderSettings
from gpu_trace.tracer.background import BackgroundThread
from gpu_trace.tracer.buffer import ThreadBuffer, ThreadRef
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.records import (
    CLOCK_SYNC_SCHEMA,
    STEP,
    STEP_LANE,
    dict_column,
    numeric_column,
)
from gpu_trace.tracer.spool_output import SpoolOutput, process_name

log = logging.getLogger(__name__)

#: Seconds between two looks at how full the threads' buffers are: the flusher flushes early when
#: one is a quarter full and holds at least FILL_MIN_EVENTS (so an early flush never writes a
#: small file; smaller buffers wait for the interval).
FILL_CHECK_S = 0.05
FILL_MIN_EVENTS = 1 << 16


class Source(Protocol):
    """A producer of records with buffers of its own (for example native NVTX capture)."""

    name: str

    def drain(self) -> Iterable[tuple[str, pa.Table]]:
        """Return ``(kind, table)`` pairs of everything recorded since the last call."""

    def dropped(self) -> int:
        """Events dropped so far because a buffer was full."""

    def after_fork_in_child(self) -> None:
        """Forget the parent's events; called in a forked child."""

    def close(self) -> None: ...


class Recorder:
    """Records one process's events into one run directory."""

    def __init__(
        self,
        settings: RecorderSettings,
        *,
        trace_id: str = "",
        run_id: str = "",
        warn_write_errors: bool = True,
    ) -> None:
        """``warn_write_errors=False``: spool write failures are logged at INFO only, for a
        recorder whose parent (`gpu-trace record`) reports them from the stats file."""
        if settings.run_dir is None:
            raise ValueError("a recorder needs a run directory")
        self.settings = settings
        self.run_dir = Path(settings.run_dir)
        self.run_id = run_id or settings.run_id or self.run_dir.name
        self.trace_id = trace_id
        self.host = socket.gethostname()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._buffers: list[tuple[ThreadRef, ThreadBuffer]] = []
        self._sources: list[Source] = []
        self._clock_samples: list[tuple[str, int, int, int, int]] = []
        # (number, start_ns, buffer, span_id)
        self._step: tuple[int, int, ThreadBuffer, int] | None = None
        self._step_number = -1
        self._write_errors = 0
        self._io_level = logging.WARNING if warn_write_errors else logging.INFO
        self._warned_drop = False
        self._stop = threading.Event()
        self._due = 0.0  # time.monotonic() of the next interval's flush
        self._flusher: BackgroundThread | None = None
        self._flush_lock = threading.Lock()
        self._closed = False
        self._open_writer()

    # ---- set-up -------------------------------------------------------------------------------

    def _open_writer(self) -> None:
        self.pid = os.getpid()
        meta = {
            "run_id": self.run_id,
            "trace_id": self.trace_id,
            "host": self.host,
            "pid": str(self.pid),
            "process_name": process_name(),
            "clock": "CLOCK_MONOTONIC",
        }
        #: The spool and stats files this process's flushes write (:mod:`.spool_output`).
        self.output = SpoolOutput(
            self.run_dir, meta, self.pid, self.settings.buffer_events, self._io_level
        )

    def start(self) -> None:
        """Start the background flusher: a thread with no Python frame between its flushes, so
        the program's own profiler (torch.profiler with_stack) never shows it (background.py)."""
        self._stop.clear()
        interval = self.settings.flush_interval_s
        self._due = time.monotonic() + interval
        self._flusher = BackgroundThread(
            self._flush_step, "gpu-trace-flusher", min(interval, FILL_CHECK_S)
        )
        self._flusher.start()

    def add_source(self, source: Source) -> None:
        with self._lock:
            self._sources.append(source)

    def wake(self) -> None:
        """Have the flusher flush now rather than at its next interval.

        For a source whose draining is cheapest at a moment it knows: PyTorch's op sessions
        wake it just before the program's thread stops a session, which releases the GIL for
        as long as PyTorch processes the session, so the flusher converts the previous one
        without taking the GIL from the program."""
        flusher = self._flusher
        if flusher is not None:
            flusher.wake()

    def hold_flushes(self, held: bool) -> None:
        """``held``: let a flush in progress end and start none until called with False (while
        the program's own profiler starts, so that it records no frame of the flusher:
        background.py). Idempotent either way."""
        flusher = self._flusher
        if flusher is not None and held:
            flusher.hold()
        elif flusher is not None:
            flusher.release()

    # ---- hot path helpers ---------------------------------------------------------------------

    def buffer(self) -> ThreadBuffer:
        """This thread's buffer, created on first use."""
        try:
            buf: ThreadBuffer = self._local.buf
            return buf
        except AttributeError:
            return self._new_buffer()

    def _new_buffer(self) -> ThreadBuffer:
        buf = ThreadBuffer(self.settings.buffer_events)
        self._local.buf = buf
        with self._lock:
            self._buffers.append((buf.owner, buf))
        return buf

    def begin_step(self, number: int | None) -> int:
        """Close the open step range (if any) and open step ``number`` (default: the next one)."""
        now = now_ns()
        buf = self.buffer()  # before the lock: a new buffer registers itself under it
        with self._lock:
            self._close_step(now)
            self._step_number = self._step_number + 1 if number is None else int(number)
            self._step = (self._step_number, now, buf, buf.next_id())
            return self._step_number

    def end_step(self, number: int | None = None) -> None:
        now = now_ns()
        with self._lock:
            if self._step is not None and (number is None or self._step[0] == number):
                self._close_step(now)

    def _close_step(self, now: int) -> None:
        if self._step is None:
            return
        number, start, buf, sid = self._step
        self._step = None
        buf.add_span((sid, 0, STEP_LANE, STEP, f"ProfilerStep#{number}", start, now, 0, None))

    def add_clock_sample(
        self, peer: str, ts_ns: int, offset_ns: int, rtt_ns: int, uncertainty_ns: int
    ) -> None:
        with self._lock:
            self._clock_samples.append((peer, ts_ns, offset_ns, rtt_ns, uncertainty_ns))

    # ---- flushing -----------------------------------------------------------------------------

    def _flush_step(self, woken: bool) -> bool:
        # Every flush_interval_s, and as soon as a buffer is a quarter full (see _filling): a
        # thread emitting ranges as fast as it can fills the default buffer in under a second,
        # and what is flushed before the buffer is full is never dropped. Looking costs a len()
        # per buffer. Called every FILL_CHECK_S and when woken; False ends the flusher.
        if self._stop.is_set():
            return False
        if woken or time.monotonic() >= self._due or self._filling():
            self.flush()
            self._due = time.monotonic() + self.settings.flush_interval_s
        return True

    def _filling(self) -> bool:
        """Whether a thread's buffer is a quarter full and holds FILL_MIN_EVENTS or more."""
        with self._lock:
            buffers = [b for _, b in self._buffers]
        for b in buffers:
            n = max(len(b.spans), len(b.counters))
            if n >= FILL_MIN_EVENTS and 4 * n >= b.capacity:
                return True
        return False

    def flush(self) -> None:
        """Write everything recorded so far to the spool. Never raises."""
        with self._flush_lock:
            try:
                self._flush()
            except Exception:  # one boundary for every collector and writer failure
                self._write_errors += 1
                if self._write_errors == 1:
                    log.exception(
                        "gpu-trace: flushing to %s failed; recording continues", self.run_dir
                    )

    def _flush(self) -> None:
        with self._lock:
            buffers = list(self._buffers)
            sources = list(self._sources)
            samples, self._clock_samples = self._clock_samples, []
        spans: list[tuple[object, ...]] = []
        tids: list[np.ndarray] = []
        counters: list[tuple[object, ...]] = []
        dead = []
        for ref, buf in buffers:
            s, c = buf.drain()
            spans.extend(s)
            tids.append(np.full(len(s), buf.tid, dtype=np.uint64))
            counters.extend(c)
            thread = ref()  # once: the thread may be collected between two calls
            if thread is None or not thread.is_alive():
                dead.append(buf)
        out = self.output
        out.write_spans(spans, tids)
        out.write_counters(counters)
        if samples:
            cols = list(zip(*samples))
            arrays = [dict_column(cols[0])] + [numeric_column(c, pa.int64()) for c in cols[1:]]
            out.write("clock_sync", pa.table(arrays, schema=CLOCK_SYNC_SCHEMA))
        for source in sources:
            try:
                for kind, table in source.drain():
                    if kind == "spans":
                        out.name_threads(table)
                    out.write(kind, table)
            except Exception:
                log.exception("gpu-trace: source %s failed to drain; dropping it", source.name)
                with self._lock:
                    self._sources.remove(source)
        if dead:
            with self._lock:
                self._buffers = [
                    (r, b) for r, b in self._buffers if b not in dead or b.spans or b.counters
                ]
        out.write_stats(
            [(b.tid, b.thread_name) for _, b in buffers],
            sum(b.dropped for _, b in buffers) + sum(s.dropped() for s in sources),
        )
        if not self._warned_drop and any(b.dropped for _, b in buffers):
            self._warned_drop = True
            log.warning(
                "gpu-trace: a thread's event buffer filled up between flushes; events are being "
                "dropped and counted (raise GPU_TRACE_BUFFER_EVENTS or lower GPU_TRACE_FLUSH_INTERVAL)"
            )

    def dropped(self) -> int:
        with self._lock:
            total = sum(b.dropped for _, b in self._buffers)
            sources = list(self._sources)
        return total + sum(s.dropped() for s in sources) + self.output.not_written

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the flusher and write everything left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        flusher = self._flusher
        if flusher is not None:
            flusher.stop()  # held or not
        if flusher is not None and flusher.ident != threading.get_ident() and flusher.is_alive():
            flusher.join(timeout=5)
        with self._lock:
            self._close_step(now_ns())
        self.flush()
        if self.output.give_up():  # the disk is still full: what waits is lost, and counted
            self.flush()  # the stats file, with the count (it fits where it was)
        for source in list(self._sources):
            try:
                source.close()
            except Exception:
                log.exception("gpu-trace: closing source %s failed", source.name)

    def after_fork_in_child(self) -> None:
        """Called in a forked child: new pid, empty buffers, own spool files, own flusher."""
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._local = threading.local()
        self._buffers = []
        self._clock_samples = []
        self._step = None
        self._closed = False
        self._stop = threading.Event()
        self._open_writer()  # and a new output: nothing unwritten, no counts, no stats yet
        for source in self._sources:
            try:
                source.after_fork_in_child()
            except Exception:
                log.exception("gpu-trace: source %s failed after fork", source.name)
        self.start()


# ---- the process-wide recorder -----------------------------------------------------------------

#: The active recorder, or None. Read on the hot path, so a plain module global.
active: Recorder | None = None
_hooks_installed = False


def start(
    settings: RecorderSettings,
    *,
    trace_id: str = "",
    run_id: str = "",
    warn_write_errors: bool = True,
) -> Recorder:
    """Make a recorder active for this process (replacing none: it is an error if one is)."""
    global active
    if active is not None:
        raise ValueError(f"a recorder is already active for {active.run_dir}")
    rec = Recorder(settings, trace_id=trace_id, run_id=run_id, warn_write_errors=warn_write_errors)
    rec.start()
    active = rec
    _install_hooks()
    return rec


def stop() -> Recorder | None:
    """Flush and deactivate the active recorder; returns it (or None if none was active)."""
    global active, _stopping, _deferred_signal
    rec, active = active, None
    if rec is not None:
        _stopping = True
        try:
            rec.close()
        finally:
            _stopping = False
            signum, _deferred_signal = _deferred_signal, None
            if signum is not None:
                _reraise(signum)
    return rec


#: True while stop() flushes; a SIGTERM arriving then is deferred until the flush is done.
_stopping = False
_deferred_signal: int | None = None


def _at_exit() -> None:
    try:
        stop()
    except Exception:
        log.exception("gpu-trace: final flush failed")


#: The recorder whose flush lock _before_fork took, released after the fork in the parent.
_held_for_fork: Recorder | None = None


def _before_fork() -> None:
    # A fork while the flusher is inside Arrow or file I/O would leave those libraries' internal
    # locks held forever in the child; wait (bounded) for the flush to finish instead.
    global _held_for_fork
    rec = active
    if rec is not None and rec._flush_lock.acquire(timeout=2.0):
        _held_for_fork = rec


def _after_fork_in_parent() -> None:
    global _held_for_fork
    rec, _held_for_fork = _held_for_fork, None
    if rec is not None:
        rec._flush_lock.release()


def _after_fork_in_child() -> None:
    global _held_for_fork
    _held_for_fork = None  # the child gets fresh locks below
    rec = active
    if rec is not None:
        try:
            rec.after_fork_in_child()
            _register_mp_finalizer()
        except Exception:
            log.exception("gpu-trace: could not restart recording after fork")


def _register_mp_finalizer() -> None:
    # multiprocessing's forked processes leave through os._exit, which skips atexit; its own exit
    # function runs finalizers that have an exit priority, so flush there. Process._bootstrap
    # clears the finalizers inherited at fork and then runs its after-fork callbacks, so the
    # finalizer is registered again from one of those.
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None and active is not None:
        mp_util.Finalize(None, _at_exit, exitpriority=-100)
        mp_util.register_after_fork(active, _mp_after_fork)


def _mp_after_fork(_rec: Recorder) -> None:
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util.Finalize(None, _at_exit, exitpriority=-100)


def _signal_handler(signum: int, frame: object) -> None:
    global _deferred_signal
    if _stopping:
        # The process is already flushing (at exit, say, when a pool terminates its worker):
        # let that flush finish, then die of this signal.
        _deferred_signal = signum
        return
    _at_exit()
    _reraise(signum, frame)


def _reraise(signum: int, frame: object = None) -> None:
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_previous_handlers: dict[int, object] = {}


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_at_exit)
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
    if threading.current_thread() is threading.main_thread():
        # SIGINT raises KeyboardInterrupt by default and atexit then flushes; SIGTERM kills
        # without running atexit, so flush first. A handler the program installs later wins.
        try:
            previous = signal.getsignal(signal.SIGTERM)
            if previous in (signal.SIG_DFL, None):
                _previous_handlers[signal.SIGTERM] = signal.SIG_DFL
                signal.signal(signal.SIGTERM, _signal_handler)
        except (ValueError, OSError):
            pass
