"""``torch.cuda`` streams and events in transparent mode, answered by the forwarding session.

The server runs a session's ops on one stream of its own (the session's CUDA stream on a CUDA
device), in the order the program issued them. So every :class:`Stream` the program makes stands
for that one stream: ``torch.cuda.stream(s)`` contexts, ``current_stream()`` and
``default_stream()`` are kept for what the program reads back, and waiting on another stream or
event (``wait_stream``, ``wait_event``, ``Event.wait``) has nothing to do, since program order
already holds. ``synchronize()`` and ``query()`` wait for every op issued so far (``query()``
then says True, which CUDA's says once the work is done).

An :class:`Event`'s ``record()`` is an op of its own (``rt::mark``) in the op stream: the server
notes where its stream has got to, with a CUDA event on a CUDA device or its clock on the CPU
device; ``elapsed_time()`` asks the server for the time between two marks (``rt::elapsed``), so
it measures the server's device, not the client's view of it, and it waits for the end mark to be
reached (CUDA's raises if that has not happened yet). Errors follow CUDA's: an event not created
with ``enable_timing=True`` or not recorded is a ``ValueError``.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import Connection, OpRecord, now_ns

_ids = itertools.count(1)
_local = threading.local()  # the current stream, per thread as in torch


def _connection() -> Connection:
    c = rt.conn
    if c is None and rt.on_demand is not None:
        c = rt.on_demand()  # a session opened at the device's first use (device.defer)
    if c is None:
        raise RuntimeError("gpu-trace: no forwarding session (the program is not connected)")
    return c


def _call(name: str, args: list[object], wait: str | None = None) -> Any:
    """Issue ``rt::`` op ``name``; with ``wait``, wait for it and return its result."""
    c = _connection()
    record = OpRecord(name, [], now_ns())
    seq = c.issue([name, args, {}, None], record, urgent=wait is not None)
    if wait is None:
        return None
    c.wait(seq, wait)
    return record.result


class Stream:
    """``torch.cuda.Stream``: the session's stream on the server (see the module's docstring)."""

    def __init__(self, device: object = None, priority: int = 0, **kwargs: object) -> None:
        self.device = rt.DEVICE
        self.priority = int(priority)
        stream_id = kwargs.get("stream_id")
        self.stream_id = stream_id if type(stream_id) is int else next(_ids)

    @property
    def cuda_stream(self) -> int:
        return 0  # there is no CUDA stream in this process

    def wait_event(self, event: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None

    def record_event(self, event: Event | None = None) -> Event:
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self) -> bool:
        _connection().synchronize()
        return True

    def synchronize(self) -> None:
        _connection().synchronize()

    def __enter__(self) -> Stream:
        self._previous = current_stream()
        set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        set_stream(self._previous)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("remote-stream", self.stream_id))

    def __repr__(self) -> str:
        return f"<gpu-trace forwarded stream {self.stream_id} on {self.device}>"


class Event:
    """``torch.cuda.Event``: a mark in the session's op stream, timed on the server."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self.interprocess = bool(interprocess)
        self.ident: int | None = None  # the server's name for it, once recorded

    def record(self, stream: object = None) -> None:
        if self.ident is None:
            self.ident = next(_ids)
        _call("rt::mark", [self.ident])

    def wait(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        if self.ident is not None:
            _connection().synchronize()
        return True

    def synchronize(self) -> None:
        if self.ident is not None:
            _connection().synchronize()

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds from this event to ``end_event`` on the server's device."""
        if not (self.enable_timing and getattr(end_event, "enable_timing", False)):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        end = getattr(end_event, "ident", None)
        if self.ident is None or end is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return float(_call("rt::elapsed", [self.ident, end], wait="elapsed_time"))

    def ipc_handle(self) -> bytes:
        raise RuntimeError("gpu-trace: a forwarded CUDA event cannot be shared between processes")

    def __repr__(self) -> str:
        state = "unrecorded" if self.ident is None else f"mark {self.ident}"
        return f"<gpu-trace forwarded event ({state})>"


class StreamContext:
    """``torch.cuda.StreamContext`` / ``torch.cuda.stream(s)``: makes ``s`` current; None is a
    no-op."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream
        self._previous: Stream | None = None

    def __enter__(self) -> Stream | None:
        if self.stream is not None:
            self._previous = current_stream()
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None and self._previous is not None:
            set_stream(self._previous)


_default: Stream | None = None


def default_stream(device: object = None) -> Stream:
    global _default
    if _default is None:
        _default = Stream(stream_id=0)
    return _default


def current_stream(device: object = None) -> Stream:
    current = getattr(_local, "stream", None)
    return current if current is not None else default_stream()


def set_stream(stream: Stream | None) -> None:
    if stream is not None:
        _local.stream = stream


def stream(stream: Stream | None) -> StreamContext:
    return StreamContext(stream)


#: What :func:`gpu_trace.runtime.client.cuda.patch` puts in ``torch.cuda``.
REPLACEMENTS: dict[str, object] = {
    "Stream": Stream,
    "Event": Event,
    "StreamContext": StreamContext,
    "stream": stream,
    "current_stream": current_stream,
    "default_stream": default_stream,
    "set_stream": set_stream,
}
