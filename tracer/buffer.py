"""Per-thread event buffers: the Python recording hot path.

A buffer is a list of tuples with a fixed capacity; the owning thread appends, the flusher thread
takes a prefix with ``drain``. Under the GIL ``list.append``, slicing and ``del lst[:n]`` are each
atomic, so the writer never takes a lock: events appended while the flusher copies land after the
prefix it deletes. When a buffer is full the event is dropped and counted.

Span tuples are ``(span_id, parent_span_id, lane, category, name, start_ns, end_ns, depth, attrs)``
and counter tuples ``(source, device, metric, ts_ns, value, labels)``.
"""

from __future__ import annotations

import random
import threading


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
        "prefix",
        "seq",
        "__weakref__",
    )

    def __init__(self, capacity: int) -> None:
        self.spans: list[tuple] = []
        self.counters: list[tuple] = []
        #: span ids of the ranges open on this thread, innermost last: parent and depth come from it.
        self.stack: list[int] = []
        self.capacity = capacity
        self.dropped = 0
        self.tid = threading.get_native_id()
        self.thread_name = threading.current_thread().name
        # Span ids: a random 32-bit thread prefix and a sequence number, unique within a run with
        # overwhelming probability and allocated without any shared state.
        # The hot path inlines next_id: ``buf.seq += 1; sid = buf.prefix + buf.seq``.
        self.prefix = (random.getrandbits(31) | 1) << 32
        self.seq = 0

    def next_id(self) -> int:
        self.seq += 1
        return self.prefix + self.seq

    def add_span(self, event: tuple) -> None:
        if len(self.spans) < self.capacity:
            self.spans.append(event)
        else:
            self.dropped += 1

    def add_counter(self, event: tuple) -> None:
        if len(self.counters) < self.capacity:
            self.counters.append(event)
        else:
            self.dropped += 1

    def drain(self) -> tuple[list[tuple], list[tuple]]:
        """Take every event appended so far (called by the flusher thread)."""
        n = len(self.spans)
        spans = self.spans[:n]
        del self.spans[:n]
        m = len(self.counters)
        counters = self.counters[:m]
        del self.counters[:m]
        return spans, counters
