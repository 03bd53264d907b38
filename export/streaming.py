"""Streaming a run's spans to an OTLP collector while the program runs (`record --otlp URL`).

It runs in the `gpu-trace record` process, never in the program: a reader thread follows the
run's spool (``spool/spans-*.arrow`` files appear as the program's recorders flush, every 0.5 s
by default), maps new spans (:class:`~gpu_trace.export.span_mapping.SpanMapper`) and puts them in a
bounded queue; a sender thread takes up to :data:`~gpu_trace.export.span_mapping.BATCH_SPANS` at a time
and sends them. A slow or dead collector costs the program nothing: the program only writes its
spool, as always, and never waits on this. When the queue is full the reader waits (the spool on
disk is the buffer, so a slow collector makes the stream fall behind, not lose spans); a batch the
collector refuses is dropped and counted (the first error is kept for the closing line), and what
is not sent when :meth:`RunStream.close`'s deadline passes is dropped and counted. Everything
stays in the spool and the store either way; ``gpu-trace export RUN --otlp URL`` sends it again.

Spans are sent when they end (that is when they reach the spool); a span's parent id is known
from its start, but whether that parent is sent is not, so a span waits in the mapper until its
parent has been seen (parents end later than their children: a step's spans wait at most one
step). A span naming no parent waits for a span of its thread that encloses it
(:mod:`~gpu_trace.query.nesting`; a top-level range waits for its step), and is sent as
top-level if none came within :data:`HOLD_NS`. For that the mapper needs spans in the order they
ended, which the spool only nearly is (PyTorch's op spans reach it in batches, up to about 1.5 s
after the module around them): spans are mapped once :data:`SETTLE_NS` past their end, in end
order. A forwarding server's spans that come back to the client are on the server's clock; they
are mapped with a clock model from the run's clock samples (:func:`~gpu_trace.store.
clock_mapping.map_clock`), and wait for the first samples. :meth:`RunStream.close` reads the rest, sends it and
the run's root span within a deadline, and reports what was sent and dropped.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from gpu_trace.export.otlp import RequestBuilder
from gpu_trace.export.span_mapping import (
    BATCH_SPANS,
    DEFAULT_KINDS,
    Row,
    RunFacts,
    SpanMapper,
    rows,
)
from gpu_trace.store.clock_mapping import CLOCK_PEER, CLOCK_WINDOW_NS, map_clock
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.clocksync import ClockModel
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolFile, list_spool, read_spool_file

if TYPE_CHECKING:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

    from gpu_trace.export.endpoint import Endpoint

log = logging.getLogger(__name__)

#: Seconds between looks at the spool.
POLL_S = 0.25
#: Spans mapped and waiting to be sent; when full the reader waits (until close's deadline).
QUEUE_SPANS = 64 * 1024
#: Seconds `close` gives the rest of the run to be sent.
CLOSE_TIMEOUT_S = 15.0
#: Spans are mapped in end order once this long past their end (run clock, ns): op-level spans
#: reach the spool up to about 1.5 s after the spans around them (a torch cut waits up to 1 s, a
#: flush 0.5 s).
SETTLE_NS = 3_000_000_000
#: How long a mapped span naming no parent waits for a span enclosing it (ns): a step, or any span,
#: lasting longer than this has its top-level spans sent as top-level.
HOLD_NS = 10_000_000_000
#: Spans waiting to settle; beyond it the oldest are mapped at once.
MAX_SETTLING = 200_000


@dataclass
class StreamReport:
    """What a stream did: spans ``sent`` and ``dropped`` (queue full or refused), the first
    ``error``, ``requests`` made."""

    sent: int = 0
    dropped: int = 0
    requests: int = 0
    error: str | None = None


class RunStream:
    """Follows one run directory's spool and streams its spans to ``endpoint``."""

    def __init__(
        self,
        run_dir: Path,
        endpoint: Endpoint,
        kinds: frozenset[str] = DEFAULT_KINDS,
        *,
        target: str = "",
        poll_s: float = POLL_S,
        queue_spans: int = QUEUE_SPANS,
        batch_spans: int = BATCH_SPANS,
        settle_ns: int = SETTLE_NS,
        hold_ns: int = HOLD_NS,
        clock: Callable[[], int] = now_ns,
    ) -> None:
        if queue_spans < 1 or batch_spans < 1:
            raise ValueError("queue_spans and batch_spans must be positive")
        if settle_ns < 0 or hold_ns < 0:
            raise ValueError("settle_ns and hold_ns must not be negative")
        self.run_dir = Path(run_dir)
        self.endpoint = endpoint
        self.target = target or "the collector"
        facts = RunFacts.of(asdict(RunInfo.load(self.run_dir)))
        self.mapper = SpanMapper(facts, kinds, order="end")
        self.builder = RequestBuilder(facts)
        self.settle_ns = settle_ns
        self.hold_ns = hold_ns
        self.clock = clock
        self._settling: list[tuple[int, int, int, Row]] = []  # a heap: end, -start, seq, row
        self._settle_seq = 0
        self.poll_s = poll_s
        self.queue_spans = queue_spans
        self.batch_spans = batch_spans
        self.report = StreamReport()
        self._seen_files: set[str] = set()
        self._deferred: list[SpoolFile] = []  # a peer's spans waiting for its clock samples
        self._clock_rows: dict[str, set[tuple[int, int, int]]] = {}
        self._models: dict[str, ClockModel] = {}
        self._queue: deque[tuple[Row, OtlpSpan]] = deque()
        self._cond = threading.Condition()
        self._stop_reading = threading.Event()
        self._reader_done = False
        self._in_flight = 0  # spans of the request the sender is making
        self._deadline: float | None = None  # set by close(): waits for room end then
        self._closed = False  # close() has counted what is left: the sender adds nothing more
        self._reader = threading.Thread(
            target=self._read_loop, name="gpu-trace-otlp-read", daemon=True
        )
        self._sender = threading.Thread(
            target=self._send_loop, name="gpu-trace-otlp-send", daemon=True
        )

    def start(self) -> RunStream:
        self._reader.start()
        self._sender.start()
        return self

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> StreamReport:
        """Read what is left, send it and the run's root span; whatever is not sent within
        ``timeout_s`` counts as dropped."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._deadline = deadline
            self._cond.notify_all()
        self._stop_reading.set()
        # The reader's waits for room end by the deadline; the last read below is local work.
        self._reader.join()
        if not self._reader.is_alive():
            try:
                self._read_new(final=True)
                facts = RunFacts.of(asdict(RunInfo.load(self.run_dir)))
                self.mapper.run = facts
                self.builder.run = facts
                self._enqueue(self.mapper.finish())
                self._enqueue([self.mapper.root_span()])
            except Exception as exc:  # a damaged run.json or spool: say so, keep the rest
                log.debug("gpu-trace: OTLP stream: the last read failed", exc_info=True)
                self._fail(f"reading the run failed: {exc}")
        with self._cond:
            self._reader_done = True
            self._cond.notify_all()
        self._sender.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            # A request still in flight counts as dropped: whether the collector took it is unknown.
            left = len(self._queue) + self._in_flight
            self._queue.clear()
            self.report.dropped += left
            self._closed = True
            self._cond.notify_all()
        if left and self.report.error is None:
            self.report.error = f"not all sent within {timeout_s:g} s"
        try:
            self.endpoint.close()
        except Exception:
            log.debug("gpu-trace: closing the OTLP endpoint failed", exc_info=True)
        return self.report

    # ---- reading ---------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        while not self._stop_reading.wait(self.poll_s):
            try:
                self._read_new(final=False)
            except Exception as exc:  # never let the stream take `record` down
                log.debug("gpu-trace: OTLP stream: reading the spool failed", exc_info=True)
                self._fail(f"reading the spool failed: {exc}")
                return

    def _read_new(self, final: bool) -> None:
        for path in list_spool(self.run_dir):
            if path.name in self._seen_files:
                continue
            kind = path.name.split("-", 1)[0]
            if kind not in ("spans", "clock_sync"):
                self._seen_files.add(path.name)
                continue
            self._seen_files.add(path.name)
            spool = read_spool_file(path)
            if spool.table is None:
                continue
            if spool.kind == "clock_sync":
                self._add_clock(spool.table)
            elif spool.kind == "spans":
                if spool.meta.get(CLOCK_PEER):
                    self._deferred.append(spool)
                else:
                    self._map(spool, spool.table)
        waiting, self._deferred = self._deferred, []
        for spool in waiting:
            peer = spool.meta[CLOCK_PEER]
            model = self._models.get(peer)
            if model is None and not final:
                self._deferred.append(spool)
                continue
            assert spool.table is not None
            table, _ = map_clock("spans", spool.table, model, peer)
            self._map(spool, table)
        if final:  # (followed by finish(), which sends everything)
            self._settle(None)
            return
        settled = self.clock() - self.settle_ns
        self._settle(settled)
        self._enqueue(self.mapper.release(settled - self.hold_ns))

    def _settle(self, ended_before: int | None) -> None:
        """Map the spans that ended before ``ended_before`` (all with None), in end order."""
        heap = self._settling
        ready: list[Row] = []
        while heap and (
            ended_before is None or heap[0][0] < ended_before or len(heap) > MAX_SETTLING
        ):
            ready.append(heapq.heappop(heap)[3])
        if ready:
            self._enqueue(self.mapper.add(ready))

    def _add_clock(self, table: pa.Table) -> None:
        peers = table.column("peer").cast(pa.string()).to_pylist()
        cols = [table.column(c).to_pylist() for c in ("ts_ns", "offset_ns", "rtt_ns")]
        changed = set()
        for peer, t, o, r in zip(peers, *cols):
            self._clock_rows.setdefault(peer or "", set()).add((int(t), int(o), int(r)))
            changed.add(peer or "")
        for peer in changed:
            try:
                self._models[peer] = ClockModel.from_measurements(
                    sorted(self._clock_rows[peer]), window_ns=CLOCK_WINDOW_NS
                )
            except ValueError:
                continue

    def _map(self, spool: SpoolFile, table: pa.Table) -> None:
        host = spool.meta.get("host", "")
        table = table.append_column("host", pa.array([host] * table.num_rows, pa.string()))
        for row in rows(table):
            heapq.heappush(self._settling, (row.end_ns, -row.start_ns, self._settle_seq, row))
            self._settle_seq += 1

    def _enqueue(self, spans: list[tuple[Row, OtlpSpan]]) -> None:
        """Queue ``spans``, waiting for room: the spool on disk is the buffer while the program
        runs, so a slow collector only makes the reader fall behind. After close's deadline what
        has no room is dropped and counted."""
        done = 0
        with self._cond:
            while done < len(spans):
                room = self.queue_spans - len(self._queue)
                if room > 0:
                    self._queue.extend(spans[done : done + room])
                    done += min(room, len(spans) - done)
                    self._cond.notify_all()
                    continue
                if self._deadline is None:
                    self._cond.wait(0.5)
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            self.report.dropped += len(spans) - done

    # ---- sending ----------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._reader_done:
                    self._cond.wait(1.0)
                if not self._queue and self._reader_done:
                    return
                n = min(self.batch_spans, len(self._queue))
                chunk = [self._queue.popleft() for _ in range(n)]
                self._in_flight = n
                self._cond.notify_all()  # room for the reader
            try:
                problem = self.endpoint.send(self.builder.request(chunk))
            except Exception as exc:  # the endpoint never raises; this is the boundary anyway
                problem = str(exc)
            with self._cond:
                self._in_flight = 0
                if self._closed:  # close() gave up on this request and counted it
                    return
                if problem is None:
                    self.report.sent += len(chunk)
                    self.report.requests += 1
                else:
                    self.report.dropped += len(chunk)
                    if self.report.error is None:
                        self.report.error = problem
                        log.info("gpu-trace: OTLP stream: %s", problem)

    def _fail(self, problem: str) -> None:
        with self._cond:
            if self.report.error is None:
                self.report.error = problem
