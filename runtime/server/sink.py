"""Where a server session's spans go: back to the client's run, or straight into a shared store.

The executor records each traced batch's server spans (``server/receive``, ``server/queue``,
``server/execute`` with its ``server/op`` children, ``server/reply``), its GPU activity (tables
from :mod:`gpu_trace.runtime.server.device_activity`, under ``gpu``) and a few counters in the
session's :class:`~gpu_trace.runtime.sharing.sessions.SpanLog`, and hands them to the server's sink
every 200 ms and when the session says goodbye:

- :class:`ReturnSink` (the default) sends them to the client in TRACE messages; the client writes
  them into its own run (:mod:`gpu_trace.runtime.client.trace`).
- :class:`SpoolSink` writes them, with the clock-sync samples the client sends in CLOCK messages,
  as spool files of a run directory named after the client's run (``<root>/<run_id>``), under the
  client's ``run_id`` and ``trace_id`` and the server's host and pid. It is the seam of
  :class:`StoreSink` (``gpu-trace serve --store DSN``), which ingests those directories into a
  ClickHouse server every few seconds and when a session ends.

Either way the spool holds the server's raw times (``start_ns``/``end_ns`` on the server's clock,
also kept in attrs ``raw_start_ns``/``raw_end_ns``) and names the clock in its metadata
(``clock_peer``); ingest maps them onto the client's clock with the run's ``clock_sync`` rows
(:mod:`gpu_trace.store.clock_mapping`), so both paths give the same rows. Either way each span carries
its session and tenant in attrs ``session`` and ``tenant``
(:func:`~gpu_trace.runtime.protocol.span_tables.span_owner`): a TRACE message names them once
and the client stamps them on its spans, a spool's spans are stamped here.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpu_trace.runtime.protocol.span_tables import (
    clock_table,
    counter_table,
    encode_tables,
    slot_lane,
    span_owner,
    span_table,
    write_stats,
)
from gpu_trace.runtime.protocol.wire import MsgType, json_frame
from gpu_trace.store.clock_mapping import CLOCK_PEER

if TYPE_CHECKING:
    from gpu_trace.runtime.server.device_activity import DeviceActivity
    from gpu_trace.runtime.sharing.sessions import Session

log = logging.getLogger(__name__)

#: Run ids a server accepts as directory names.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")

now_ns = time.perf_counter_ns
#: GPU activity spans per TRACE message: a few MB, far under a frame's limit (``wire.MAX_FRAME``).
GPU_SPANS_PER_MESSAGE = 20_000


# ---- recording a batch ---------------------------------------------------------------------------


def record_batch(
    session: Session,
    head: dict[str, Any],
    recv: tuple[int, int],
    execute_id: int,
    exec_start: int,
    exec_end: int,
    op_spans: list[tuple[str, int, int]],
    queue_depth: int,
    sink: Any,
    memory: Any = None,
    activity: DeviceActivity | None = None,
    threads: list[tuple[int, int]] | None = None,
) -> None:
    """One batch's server spans into the session's log; hands the log to ``sink`` when due.

    With the counters go the session's tenant's numbers from ``memory``
    (:class:`~gpu_trace.runtime.sharing.memory.Memory`): its own tenant's only, never another's.
    With GPU activity capture (``activity``), the batch's execute and op spans are where its
    CUDA calls, and through them its kernels, are found (called on the thread that ran it;
    ``threads``: where a batch that waited for memory ran its ops before, see ``Parked``).
    """
    from gpu_trace.tracer.context import parse_traceparent

    slog = session.log
    span = slog.span
    new_id = slog.new_id
    tp = head.get("tp")  # a traceparent, or the client's span id (a CALLS frame's)
    if type(tp) is int:
        parent = tp if 0 < tp < 1 << 64 else 0
    else:
        parsed = parse_traceparent(tp) if type(tp) is str else None
        parent = int(parsed[1], 16) if parsed else 0
    seq = {"seq": str(head.get("seq"))}
    span(new_id(), parent, "server/receive", "receive", recv[0], recv[1], seq)
    wait = (recv[1], exec_start)
    # Batches waiting at once would overlap on one lane: each waits on the first free one.
    queue = slot_lane(slog.lane_ends.setdefault("server/queue", []), "server/queue", *wait)
    span(new_id(), parent, queue, "queue", *wait, seq)
    execute = {**seq, "ops": str(len(op_spans))}
    span(execute_id, parent, "server/execute", "execute", exec_start, exec_end, execute)
    if activity is None:
        for name, t0, t1 in op_spans:
            span(0, execute_id, "server/op", name, t0, t1)
    else:  # ids now: the op spans are the parents of the batch's CUDA calls
        ids = []
        for name, t0, t1 in op_spans:
            op_id = new_id()
            ids.append(op_id)
            span(op_id, execute_id, "server/op", name, t0, t1)
        activity.batch(session, execute_id, exec_start, exec_end, op_spans, ids, threads)
    reply_end = now_ns()
    span(new_id(), parent, "server/reply", "reply", exec_end, reply_end, seq)
    if reply_end - slog.last_sent_ns > 200_000_000 or len(slog.spans) > 20000:
        record_counters(session, reply_end, queue_depth, memory)
        slog.last_sent_ns = reply_end
        sink.export(session, slog.take())


def record_counters(session: Session, ts: int, queue_depth: int, memory: Any = None) -> None:
    """The session's counters, labelled with its session and tenant, into its log.

    Per session: ``session_memory_bytes``, ``session_handles``, ``queue_depth``, ``busy_ns``,
    ``queue_wait_ns``, ``bytes_in``, ``bytes_out``, ``quota_waits``, ``quota_errors`` (totals
    since it connected), and ``gpu_busy_ns`` where kernels are measured. Per tenant (the session's own): ``tenant_memory_bytes`` (logical: on the
    device and paged out), ``tenant_resident_bytes`` and ``quota_bytes`` (its limit; absent
    without a quota).
    """
    counter = session.log.counter
    labels = span_owner(session)  # the session's spans carry the same
    tenant = labels["tenant"]
    usage = session.usage
    counter("session_memory_bytes", ts, float(session.account.bytes), labels)
    counter("session_handles", ts, float(len(session.handles)), labels)
    counter("queue_depth", ts, float(queue_depth), labels)
    for metric, value in (
        ("busy_ns", usage.busy_ns),
        ("queue_wait_ns", usage.queue_ns),
        ("bytes_in", usage.bytes_in),
        ("bytes_out", usage.bytes_out),
        ("quota_waits", usage.quota_waits),
        ("quota_errors", usage.quota_errors),
    ):
        counter(metric, ts, float(value), labels)
    if usage.gpu_busy_ns is not None:  # measured from kernels (GPU activity capture on)
        counter("gpu_busy_ns", ts, float(usage.gpu_busy_ns), labels)
    numbers = memory.tenant_numbers(tenant) if memory is not None else None
    if numbers is not None:
        tenant_labels = {"tenant": tenant}
        counter("tenant_memory_bytes", ts, float(numbers["used_bytes"]), tenant_labels)
        counter("tenant_resident_bytes", ts, float(numbers["resident_bytes"]), tenant_labels)
        if numbers["limit_bytes"] is not None:
            counter("quota_bytes", ts, float(numbers["limit_bytes"]), tenant_labels)


def record_quota_wait(
    session: Session, head: dict[str, Any] | None, start: int, end: int, attrs: dict[str, str]
) -> None:
    """A wait for memory (``server/quota-wait``), a child of the batch's client span."""
    from gpu_trace.tracer.context import parse_traceparent

    tp = head.get("tp") if head is not None else None
    parsed = parse_traceparent(tp) if type(tp) is str else None
    parent = int(parsed[1], 16) if parsed else 0
    slog = session.log
    slog.span(slog.new_id(), parent, "server/quota-wait", "quota-wait", start, end, attrs)


# ---- sinks ---------------------------------------------------------------------------------------


class Sink(Protocol):
    """Where a server sends its traced sessions' spans: what the server and executor call.

    ``export`` is the one that matters (a session's spans and counters, as
    :meth:`~gpu_trace.runtime.sharing.sessions.SpanLog.take` gives them); the rest tell a sink
    which clients it traces, their clock samples, and when a session or the server ends. Called on
    the executor's thread, except ``accepts`` and ``clock`` (a connection's).
    """

    #: Its name in the server's status (``return``, ``spool``, ``store``).
    kind: str
    #: The server's device, for the counters' ``device`` column (set by the server).
    server_device: str

    def accepts(self, client: dict[str, str]) -> bool:
        """Are the sessions of a client that says ``client`` in its hello traced?"""
        ...

    def export(self, session: Session, body: dict[str, Any]) -> None:
        """``session``'s spans and counters recorded since its last export."""
        ...

    def clock(self, session: Session, samples: list[tuple[int, int, int, int]]) -> None:
        """Clock-sync samples ``session``'s client sent."""
        ...

    def session_closed(self, session: Session) -> None:
        """``session`` ended; nothing more of it comes."""
        ...

    def shutdown(self) -> None:
        """The server stops: write out what is left."""
        ...


class ReturnSink:
    """Server spans go back to the client in TRACE messages (the default)."""

    kind = "return"
    server_device = ""

    def accepts(self, client: dict[str, str]) -> bool:
        return client.get("trace") == "1"

    def export(self, session: Session, body: dict[str, Any]) -> None:
        gpu = body.pop("gpu", None) or []
        if body["spans"] or body["counters"]:
            # The spans' session and tenant, once per message: the client stamps them on each.
            session.send(json_frame(MsgType.TRACE, {**body, **span_owner(session)}))
        # The server's GPU activity: Arrow, in one field, a bounded number of spans per message
        # (a frame has a size limit; a burst of kernels must not break the session).
        for table in gpu:
            for lo in range(0, table.num_rows, GPU_SPANS_PER_MESSAGE):
                part = table.slice(lo, GPU_SPANS_PER_MESSAGE)
                msg = {"spans": [], "counters": [], "gpu": encode_tables([part])}
                session.send(json_frame(MsgType.TRACE, msg))

    def clock(self, session: Session, samples: list[tuple[int, int, int, int]]) -> None:
        pass

    def session_closed(self, session: Session) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _RunFiles:
    """One traced session's run directory and its spool writers."""

    def __init__(self, root: Path, session: Session, device: str) -> None:
        from gpu_trace.tracer.run import RunInfo
        from gpu_trace.tracer.spool import SpoolWriter

        client = session.client
        self.run_id = client["run_id"]
        self.dir = root / self.run_id
        self.session_id = session.id
        self.device = device
        self.pid = os.getpid()
        self.events = 0
        host = socket.gethostname()
        base = {"run_id": self.run_id, "trace_id": client["trace_id"]}
        self.spans = SpoolWriter(
            self.dir,
            {
                **base,
                "host": host,
                "pid": str(self.pid),
                "process_name": f"gpu-trace serve (session {session.id})",
                CLOCK_PEER: host,
            },
        )
        # Clock samples are the client's measurements: its host, as in the client's own run.
        client_pid = client.get("pid", "0")
        self.clock = SpoolWriter(
            self.dir,
            {
                **base,
                "host": client.get("host", ""),
                "pid": client_pid if client_pid.isdigit() else "0",
            },
        )
        info = RunInfo(
            run_id=self.run_id,
            trace_id=client["trace_id"],
            started_ns=0,
            command=f"gpu-trace serve: session {session.id} of {client.get('host', '?')}",
            hosts=[host],
            status="server",
            attrs={"side": "server", "server": f"{host}:{self.pid}"},
        )
        if not RunInfo.exists(self.dir):
            info.save(self.dir)


class SpoolSink:
    """Server spans, counters and clock samples as spool files in ``<root>/<run_id>`` per session.

    Only sessions of clients that record a run (with a well-formed ``run_id`` and ``trace_id``)
    are traced. Writing happens on the executor thread; clock samples arrive on the connection's
    thread and are written with the next export.
    """

    kind = "spool"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        #: The server's device, for the counters' ``device`` column (set by the server).
        self.server_device = ""
        self._lock = threading.Lock()
        self._runs: dict[int, _RunFiles] = {}
        self._clock: dict[int, list[tuple[int, int, int, int]]] = {}
        #: Run directories written since :meth:`take_dirty`.
        self._dirty: set[Path] = set()

    def accepts(self, client: dict[str, str]) -> bool:
        return (
            client.get("trace") == "1"
            and bool(_RUN_ID.match(client.get("run_id", "")))
            and bool(_TRACE_ID.match(client.get("trace_id", "")))
        )

    def _files(self, session: Session) -> _RunFiles:
        files = self._runs.get(session.id)
        if files is None:
            files = self._runs[session.id] = _RunFiles(self.root, session, self.server_device)
        return files

    def export(self, session: Session, body: dict[str, Any]) -> None:
        with self._lock:
            samples = self._clock.pop(session.id, [])
        gpu = body.get("gpu") or []
        if not (body["spans"] or body["counters"] or gpu or samples):
            return
        try:
            files = self._files(session)
            if body["spans"]:
                spans = span_table(
                    body["spans"], files.pid, session.log.new_id, span_owner(session)
                )
                files.spans.write("spans", spans)
            if body["counters"]:
                files.spans.write("counters", counter_table(body["counters"], files.device))
            for table in gpu:  # the server's GPU activity, as converted
                files.spans.write("spans", table)
            table = clock_table(samples) if samples else None
            if table is not None:
                files.clock.write("clock_sync", table)
            files.events += len(body["spans"]) + len(body["counters"])
            files.events += sum(t.num_rows for t in gpu)
            write_stats(files.dir, files.pid, session.id, files.events)
            with self._lock:
                self._dirty.add(files.dir)
        except Exception:  # tracing never takes a session down
            log.exception("gpu-trace serve: writing session %d's spans failed", session.id)

    def clock(self, session: Session, samples: list[tuple[int, int, int, int]]) -> None:
        with self._lock:
            self._clock.setdefault(session.id, []).extend(samples)

    def session_closed(self, session: Session) -> None:
        self.export(session, session.log.take())
        with self._lock:
            self._runs.pop(session.id, None)
            self._clock.pop(session.id, None)

    @property
    def worker_sink(self) -> str:
        """What a worker process writes its session's spans with (the same spool root)."""
        return f"spool:{self.root}"

    def mark_dirty(self, path: str) -> None:
        """A worker wrote spool files in run directory ``path``: ingest it with the others
        (only a directory right under this sink's root counts: a worker is not trusted)."""
        d = Path(path)
        try:
            if d.resolve().parent != self.root.resolve() or not d.is_dir():
                return
        except OSError:
            return
        with self._lock:
            self._dirty.add(d)

    def take_dirty(self) -> list[Path]:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        return sorted(dirty)

    def shutdown(self) -> None:
        pass


class StoreSink(SpoolSink):
    """A :class:`SpoolSink` whose run directories are ingested into a ClickHouse server.

    Ingest runs on its own thread every ``interval_s`` for the directories written since, and
    once more at shutdown. A store that is down only delays it: the spool stays, ingest is
    idempotent and is tried again at the next interval.
    """

    kind = "store"

    def __init__(self, dsn: str, root: str | Path, interval_s: float = 5.0) -> None:
        from gpu_trace.store.dsn import parse_dsn

        target = parse_dsn(dsn)
        if target.kind != "http":
            raise ValueError(
                "--store needs a ClickHouse server DSN (http(s)://...): an embedded chDB store "
                "belongs to one process, and the clients' runs are elsewhere"
            )
        super().__init__(root)
        self.dsn = dsn
        self.display = target.display()
        self.interval_s = interval_s
        self._retry: set[Path] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="gpu-trace-serve-ingest", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.ingest_pending()

    def ingest_pending(self) -> None:
        from gpu_trace.store.client import Store, StoreError
        from gpu_trace.store.ingest import ingest

        dirs = sorted(set(self.take_dirty()) | self._retry)
        if not dirs:
            return
        self._retry = set()
        try:
            with Store(self.dsn) as store:
                for d in dirs:
                    try:
                        ingest(store, d)
                    except (StoreError, ValueError, OSError) as exc:
                        log.warning("gpu-trace serve: ingesting %s: %s", d.name, exc)
                        self._retry.add(d)
        except StoreError as exc:
            log.warning("gpu-trace serve: store %s: %s", self.display, exc)
            self._retry.update(dirs)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        self.ingest_pending()
