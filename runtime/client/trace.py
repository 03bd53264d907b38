"""Tracing of forwarded calls: client spans, server spans brought home, clock sync.

For every batch the client records, in the active run (lanes ``forward/...``, category
``forward``): the ``batch`` span from its first op's issue to its DONE (or to the end of its send,
if that is noted later), its ``serialize`` and ``send`` spans, one span per op (``forward/op``,
named by the op, lasting as long as the client spent issuing it) and ``wait`` spans where the
program blocked at a sync point. A batch span goes on the first of ``forward/batch``,
``forward/batch/1``, ``/2``... whose spans have all ended when it begins (:meth:`ClientTrace.lane`:
batches in flight at once overlap), so the spans of one lane never overlap, and each batch's
children lie inside it. The batch span's attrs hold its breakdown: ``client_ns`` (issuing,
serializing and sending), ``wire_ns`` (the round trip minus the server's time), ``queue_ns`` and
``execute_ns``.

The server's spans (``server/receive``, ``server/queue``, ``server/execute``, ``server/op``,
``server/reply``; category ``server``) are children of the batch span: its id travels in the
batch header as a W3C ``traceparent``. They come back in TRACE messages and are written into the
client's run under the server's host and pid, on the server's clock (the spool names it,
``clock_peer``), with the server's GPU activity (kernels under its ops, an Arrow field of the
message); ingest maps them onto the client's clock with a
:class:`~gpu_trace.tracer.clocksync.ClockModel` fitted to the run's ``clock_sync`` rows (the
exchanges measured at connect and with every heartbeat, and each heartbeat interval's batch round
trip with the least time on the wire). Each keeps its raw server times in attrs
``raw_start_ns``/``raw_end_ns`` next to the ``clock_offset_ns`` and ``clock_uncertainty_ns``
applied. A server with a shared store (``gpu-trace serve --store``) keeps its spans itself: the
client sends it the clock-sync exchanges instead (CLOCK messages), see
:mod:`gpu_trace.runtime.server.sink`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from gpu_trace.runtime.protocol.span_tables import (
    counter_table,
    decode_tables,
    slot_lane,
    span_table,
    trace_owner,
    write_stats,
)
from gpu_trace.store.clock_mapping import CLOCK_PEER
from gpu_trace.tracer import recorder
from gpu_trace.tracer.buffer import private_bits
from gpu_trace.tracer.clocksync import ClockModel, Sample, measure
from gpu_trace.tracer.context import format_traceparent
from gpu_trace.tracer.records import FORWARD
from gpu_trace.tracer.spool import SpoolWriter

if TYPE_CHECKING:
    from gpu_trace.runtime.client.batch import Batch

log = logging.getLogger(__name__)

MAX_SAMPLES = 2000
#: The batch spans' lane; a batch that began while others were in flight: ``forward/batch/N``.
BATCH_LANE = "forward/batch"


class Peer(Protocol):
    """What the trace reads of its connection
    (:class:`~gpu_trace.runtime.client.connection.Connection`, which owns the trace): the server
    at the other end, as its WELCOME named it, and the clock-sync exchanges."""

    server_host: str
    server_pid: int
    server_device: str
    server_sink: str
    session_id: int

    def ping(self) -> tuple[int, int, int, int]: ...

    def send_clock(self, samples: list[tuple[int, int, int, int]]) -> None: ...


class ClientTrace:
    """The client side of forwarded-call tracing for one connection."""

    def __init__(self, conn: Peer, enabled: bool | None) -> None:
        self.conn = conn
        self.rec = recorder.active
        self.enabled = self.rec is not None and enabled is not False
        self.trace_id = self.rec.trace_id if self.rec is not None else ""
        self._prefix = (private_bits(30) | 1) << 33  # never the program's `random`
        self._seq = 0
        self._lock = threading.Lock()
        self.samples: list[Sample] = []
        self._model: ClockModel | None = None
        self._server: list[dict[str, Any]] = []
        self._writer: SpoolWriter | None = None
        self._server_events = 0
        self._lane_ends: list[int] = []  # per batch lane, the end of its last span
        self._best_batch: Sample | None = None

    def identity(self) -> dict[str, str]:
        if self.rec is None:
            return {}
        return {"run_id": self.rec.run_id, "trace_id": self.trace_id}

    def new_span_id(self) -> int:
        self._seq += 1
        return self._prefix + self._seq

    def traceparent(self, span_id: int) -> str:
        if not self.enabled or len(self.trace_id) != 32:
            return ""
        return format_traceparent(self.trace_id, span_id)

    def parent(self, span_id: int) -> int:
        """:meth:`traceparent`'s span id alone (0: none), for a CALLS frame: the server knows
        the session's trace id from its HELLO."""
        return span_id if self.enabled and len(self.trace_id) == 32 else 0

    # ---- clock sync ------------------------------------------------------------------------------

    def start_clock(self) -> None:
        self.clock_exchange(8)

    def clock_exchange(self, n: int) -> None:
        raw: list[tuple[int, int, int, int]] = []

        def exchange() -> tuple[int, int, int, int]:
            sample = self.conn.ping()
            raw.append(sample)
            return sample

        measure(exchange, n, peer=self.conn.server_host)
        if self.enabled and self.conn.server_sink != "return" and raw:
            self.conn.send_clock(raw)  # the server writes them next to its spans
        with self._lock:
            self.samples.extend(Sample(*s) for s in raw if Sample(*s).problem() is None)
            del self.samples[:-MAX_SAMPLES]
            self._model = None

    def _clock_candidate(self, raw: tuple[int, int, int, int]) -> None:
        """A batch's round trip is a clock exchange too: the server read it after the client
        began sending it and replied before the client read the DONE. The one of each
        heartbeat interval with the least time on the wire is kept (:meth:`_batch_clock`)."""
        sample = Sample(*raw)
        if sample.problem() is None and (
            self._best_batch is None or sample.rtt_ns < self._best_batch.rtt_ns
        ):
            self._best_batch = sample

    def _batch_clock(self) -> None:
        """Record the interval's best batch exchange as a clock sample (``clock_sync``), beside
        the pings': a busy server answers pings late, and batches cover the whole run."""
        best, self._best_batch = self._best_batch, None
        rec = self.rec
        if best is None or rec is None:
            return
        try:
            rec.add_clock_sample(
                self.conn.server_host, best.ts_ns, best.offset_ns, best.rtt_ns, best.uncertainty_ns
            )
            if self.conn.server_sink != "return":
                self.conn.send_clock([(best.t0, best.t1, best.t2, best.t3)])
        except Exception:  # never break the program over tracing
            log.debug("gpu-trace: recording a batch's clock sample failed", exc_info=True)
        with self._lock:
            self.samples.append(best)
            del self.samples[:-MAX_SAMPLES]
            self._model = None

    def model(self) -> ClockModel | None:
        with self._lock:
            if self._model is None and self.samples:
                try:
                    self._model = ClockModel(self.samples, window_ns=30_000_000_000)
                except ValueError:
                    self._model = None
            return self._model

    # ---- client spans ----------------------------------------------------------------------------

    def lane(self, start: int, end: int) -> str:
        """The lane of a batch span ``[start, end]``: batches in flight at once overlap, so
        each then has a lane of its own (:func:`~gpu_trace.runtime.protocol.span_tables.slot_lane`)."""
        with self._lock:
            return slot_lane(self._lane_ends, BATCH_LANE, start, end)

    def batch_done(self, batch: Batch, t_done: int, server_t: Any, failed: bool) -> None:
        rec = self.rec
        if not self.enabled or rec is None or recorder.active is not rec:
            return
        buf = rec.buffer()
        sid = batch.span_id
        # The batch holds its ops (another thread's op may have begun before its first was
        # appended) and its send (the DONE can be read before the sender has noted the end).
        start = min(batch.t_first, batch.t_serialize, *(r.t0 for r in batch.records))
        end = max(t_done, batch.t_sent)
        client_ns = sum(r.t1 - r.t0 for r in batch.records) + (batch.t_sent - batch.t_serialize)
        attrs = {
            "seq": str(batch.seq),
            "ops": str(len(batch.records)),
            "bytes": str(batch.nbytes),
            "client_ns": str(client_ns),
            "send_ns": str(batch.t_sent - batch.t_serialize),
        }
        if (
            isinstance(server_t, list)
            and len(server_t) == 5
            and all(type(t) is int for t in server_t)
        ):
            recv0, recv1, exec0, exec1, reply0 = server_t
            attrs["wire_ns"] = str(max(0, (t_done - batch.t_send) - (reply0 - recv0)))
            self._clock_candidate((batch.t_send, recv0, reply0, t_done))
            attrs["queue_ns"] = str(max(0, exec0 - recv1))
            attrs["execute_ns"] = str(max(0, exec1 - exec0))
        if failed:
            attrs["error"] = "1"
        add = buf.add_span
        add((sid, 0, self.lane(start, end), FORWARD, "batch", start, end, 0, attrs))
        add(
            (
                self.new_span_id(),
                sid,
                "forward/send",
                FORWARD,
                "serialize",
                batch.t_serialize,
                batch.t_send,
                1,
                None,
            )
        )
        add(
            (
                self.new_span_id(),
                sid,
                "forward/send",
                FORWARD,
                "send",
                batch.t_send,
                batch.t_sent,
                1,
                None,
            )
        )
        for r in batch.records:
            add((self.new_span_id(), sid, "forward/op", FORWARD, r.name, r.t0, r.t1, 1, None))

    def wait_span(self, reason: str, t0: int, t1: int, seq: int) -> None:
        rec = self.rec
        if self.enabled and rec is not None and recorder.active is rec:
            rec.buffer().add_span(
                (
                    self.new_span_id(),
                    0,
                    "forward/wait",
                    FORWARD,
                    reason,
                    t0,
                    t1,
                    0,
                    {"seq": str(seq)},
                )
            )

    # ---- server spans ----------------------------------------------------------------------------

    def server_records(self, msg: dict[str, Any]) -> None:
        if self.enabled:
            with self._lock:
                self._server.append(msg)

    def flush(self) -> None:
        """Write the server spans received so far into the run, and the interval's best batch
        clock sample (heartbeat thread and close)."""
        self._batch_clock()
        with self._lock:
            pending, self._server = self._server, []
        if not pending or self.rec is None:
            return
        try:
            self._write(pending)
        except Exception:  # never break the program over tracing
            log.exception("gpu-trace: writing server spans failed")

    def _write(self, messages: list[dict[str, Any]]) -> None:
        # Spans by the session and tenant their message names (one per connection, but each
        # message says it: the server stamped them, the client only writes them).
        spans: dict[tuple[tuple[str, str], ...], list[list[Any]]] = {}
        counters: list[list[Any]] = []
        gpu = []  # the server's GPU activity: spans tables (device_activity.py on the server)
        for msg in messages:
            if msg.get("spans"):
                owner = tuple(trace_owner(msg).items())
                spans.setdefault(owner, []).extend(msg["spans"])
            counters.extend(msg.get("counters") or [])
            try:
                table = decode_tables(msg.get("gpu"))
            except ValueError as exc:  # that field is lost, the rest of the message is kept
                log.warning("gpu-trace: %s", exc)
                table = None
            if table is not None:
                gpu.append(table)
        writer = self._spool()
        for owner, rows in spans.items():
            table = span_table(rows, self.conn.server_pid, self.new_span_id, dict(owner))
            writer.write("spans", table)
        if counters:
            writer.write("counters", counter_table(counters, self.conn.server_device))
        for table in gpu:
            writer.write("spans", table)
        n_spans = sum(len(rows) for rows in spans.values())
        self._server_events += n_spans + len(counters) + sum(t.num_rows for t in gpu)
        assert self.rec is not None
        write_stats(
            self.rec.run_dir, self.conn.server_pid, self.conn.session_id, self._server_events
        )

    def _spool(self) -> SpoolWriter:
        if self._writer is None:
            assert self.rec is not None
            meta = {
                "run_id": self.rec.run_id,
                "trace_id": self.trace_id,
                "host": self.conn.server_host,
                "pid": str(self.conn.server_pid),
                "process_name": f"gpu-trace serve (session {self.conn.session_id})",
                CLOCK_PEER: self.conn.server_host,
            }
            self._writer = SpoolWriter(self.rec.run_dir, meta)
        return self._writer

    def close(self) -> None:
        self.flush()
