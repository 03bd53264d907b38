"""Per-thread event buffers: the Python recording hot path.

A buffer is a list of tuples with a fixed capacity; the owning thread appends, the flusher thread
takes a prefix with ``drain``. Under the GIL ``list.append``, slicing and ``del lst[:n]`` are each
atomic, so the writer never takes a lock: events appended while the flusher copies land after the
prefix it deletes. When a buffer is full the event is dropped and counted.

Span tuples are laid out as :class:`gpu_trace.tracer.records.Span`, counter tuples as
:class:`~gpu_trace.tracer.records.Counter`. :meth:`ThreadBuffer.add_span` is the one place a span
is appended: every Python producer calls it, and the C ``range`` (``tracer/_fastpath.c``) is its
native twin (a parity test holds them together).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

#: A thread whose buffer is over half full is outrunning the flusher: every GIVE_WAY_MASK + 1
#: spans from then on (appended, or dropped once it is full) it releases the GIL and yields the
#: CPU (``sched_yield``), so a flusher waiting for the GIL gets it at once rather than after the
#: switch interval (5 ms, in which such a thread appends thousands of spans). Below half full (any
#: program but a flood of ranges) this never runs. The C range does the same.
GIVE_WAY_MASK = 1023
give_way = getattr(os, "sched_yield", lambda: time.sleep(0))


class Alive(Protocol):
    def is_alive(self) -> bool: ...


#: What a buffer keeps of its thread: called, the thread (None once collected); the recorder drops
#: a drained buffer whose thread is gone or no longer alive.
ThreadRef = Callable[[], "Alive | None"]


class _Foreign:
    """The owner of a buffer on a thread that ``threading`` did not start (TensorFlow's and
    tf.data's C++ threads, PyTorch's autograd device threads): its own reference, never taken
    for ended, so the buffer stays (such threads mostly live as long as the process)."""

    __slots__ = ()

    def __call__(self) -> _Foreign:
        return self

    def is_alive(self) -> bool:
        return True


FOREIGN = _Foreign()


def running_thread() -> threading.Thread | None:
    """The :class:`threading.Thread` running this code, or None on a thread ``threading`` did not
    start. Not ``threading.current_thread()``, which registers such a thread as a ``Dummy-N``
    thread: the program then saw it in ``threading.enumerate()``, and it took a number from
    threading's counter, so the program's next ``threading.Thread()`` was ``Thread-3``, not
    ``Thread-1`` (docs/frameworks.md, "What recording leaves untouched")."""
    ident = threading.get_ident()
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread
    return None


def _comm(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _unnamed() -> set[str]:
    """The names a thread has that nobody named: a new thread inherits its creator's, so the
    process's own (its main thread's, which PyTorch renames ``pt_main_thread`` when imported)
    or the program's file name, as the kernel named the process at exec."""
    names = {_comm("/proc/self/comm")}
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0]
        names.add(os.path.basename(argv0.decode(errors="replace"))[:15])
    except OSError:
        pass
    return names - {""}


def native_name(tid: int) -> str:
    """The name the OS has for this process's thread ``tid``, as the library that started it set
    it (PyTorch's autograd device threads: ``pt_autograd_0``; tf.data's ``tf_data_private``),
    else ``thread <tid>``: also for a thread nobody named, whose name is its process's."""
    name = _comm(f"/proc/self/task/{tid}/comm")
    if not name or name in _unnamed():
        return f"thread {tid}"
    return name


def _dummy(thread: threading.Thread) -> bool:
    """A thread ``threading`` did not start but was asked about (``current_thread()`` on it,
    by the program, ``logging`` or a library): ``threading`` calls it ``Dummy-N``."""
    return isinstance(thread, getattr(threading, "_DummyThread", ()))


def thread_name(tid: int) -> str:
    """The name of this process's thread ``tid`` (an OS thread id): its ``threading`` name where
    ``threading`` started it (the main thread: ``MainThread``), else the OS's
    (:func:`native_name`), also where ``threading`` has only made up a ``Dummy-N`` for it.
    Never registers a thread with ``threading`` (see :func:`running_thread`)."""
    for thread in threading.enumerate():
        if thread.native_id == tid and not _dummy(thread):
            return thread.name
    return native_name(tid)


def private_bits(k: int) -> int:
    """``k`` random bits from the OS, never from the program's ``random``: a seeded program
    must draw the same numbers recorded or not (docs/frameworks.md, "What recording leaves
    untouched"); a private ``random.Random`` would repeat its ids in every forked child."""
    return int.from_bytes(os.urandom((k + 7) // 8), "little") >> (-k % 8)


class ThreadBuffer:
    """Events of one thread of one process."""

    __slots__ = (
        "spans",
        "counters",
        "stack",
        "capacity",
        "dropped",
        "tid",
        "thread_name",
        "owner",
        "prefix",
        "seq",
        "__weakref__",
    )

    def __init__(self, capacity: int) -> None:
        self.spans: list[tuple[object, ...]] = []
        self.counters: list[tuple[object, ...]] = []
        #: span ids of the ranges open on this thread, innermost last: parent and depth come from it.
        self.stack: list[int] = []
        self.capacity = capacity
        self.dropped = 0
        self.tid = threading.get_native_id()
        thread = running_thread()
        # A Dummy-N is threading's name, not the thread's: the OS has the one it was given.
        if thread is not None and not _dummy(thread):
            self.thread_name = thread.name
        else:
            self.thread_name = native_name(self.tid)
        # The main thread is never taken for ended: threading marks it stopped once the
        # program's last line has run (threading._shutdown, before the non-daemon threads are
        # joined and atexit runs), while the flusher still flushes and atexit still records (the
        # last step). Its buffer was dropped then, its lane lost its name ("thread <tid>") and
        # what it recorded later was never drained.
        main = thread is threading.main_thread()
        self.owner: ThreadRef = weakref.ref(thread) if thread is not None and not main else FOREIGN
        # Span ids: a random 32-bit thread prefix and a sequence number, unique within a run with
        # overwhelming probability and allocated without any shared state.
        # The hot path inlines next_id: ``buf.seq += 1; sid = buf.prefix + buf.seq``.
        self.prefix = (private_bits(31) | 1) << 32
        self.seq = 0

    def next_id(self) -> int:
        self.seq += 1
        return self.prefix + self.seq

    def add_span(self, span: tuple[object, ...]) -> None:
        """Append one span record (a :class:`~gpu_trace.tracer.records.Span` layout tuple), or
        count it dropped when the buffer is full; give way to the flusher when outrunning it."""
        spans = self.spans
        n = len(spans)
        if n < self.capacity:
            spans.append(span)
            if n > self.capacity >> 1 and not n & GIVE_WAY_MASK:
                give_way()
        else:
            self.dropped = dropped = self.dropped + 1
            if not dropped & GIVE_WAY_MASK:  # full: the more so
                give_way()

    def add_counter(self, event: tuple[object, ...]) -> None:
        if len(self.counters) < self.capacity:
            self.counters.append(event)
        else:
            self.dropped += 1

    def drain(self) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
        """Take every event appended so far (called by the flusher thread)."""
        n = len(self.spans)
        spans = self.spans[:n]
        del self.spans[:n]
        m = len(self.counters)
        counters = self.counters[:m]
        del self.counters[:m]
        return spans, counters
