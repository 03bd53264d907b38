"""The server's spans and counters as Arrow tables, and its entry in a run's ``stats/``.

A server's spans travel to the client as rows (the ``TRACE`` frame) or go straight to a spool
(``--store``); either way the same tables come out of them, so both sides build them here: the
client's :mod:`gpu_trace.runtime.client.trace` and the server's
:mod:`gpu_trace.runtime.server.sink`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

#: Server lanes and the thread rows they are drawn on.
SERVER_TIDS = {
    "server/receive": 1,
    "server/queue": 2,
    "server/execute": 2,
    "server/op": 2,
    "server/reply": 2,
    "server/quota-wait": 2,
}
SERVER_THREADS = {"1": "receive", "2": "executor"}
#: The attrs a server span carries its session and tenant in (:func:`span_owner`).
OWNER_KEYS = ("session", "tenant")
#: GPU activity categories made on a thread (the CUDA calls, the waits): the executor's row.
THREAD_CATEGORIES = ("cuda_api", "cuda_sync")


def slot_lane(ends: list[int], lane: str, start: int, end: int) -> str:
    """The lane of a span ``[start, end]`` of a kind that may overlap itself (batches in
    flight, batches queued): ``lane``, else the first of ``lane/1``, ``lane/2``... whose spans
    all ended by ``start``, so that no lane holds two spans that overlap. ``ends``: each of
    those lanes' latest end, kept by the caller (one list per kind) and updated here."""
    for i, last in enumerate(ends):
        if last <= start:
            ends[i] = max(last, end)
            return f"{lane}/{i}" if i else lane
    ends.append(end)
    return f"{lane}/{len(ends) - 1}" if len(ends) > 1 else lane


def span_table(
    spans: list[list[Any]], pid: int, new_id: Any, owner: dict[str, str] | None = None
) -> pa.Table:
    """TRACE/SpanLog spans ``[id, parent, lane, name, start, end, attrs]`` as a spool table.

    Times stay on the server's clock; attrs get ``raw_start_ns``/``raw_end_ns`` and ``owner``'s
    keys (the session and tenant the server recorded them for, :func:`span_owner`). Spans
    without an id get one from ``new_id()``.
    """
    from gpu_trace.tracer.columns import spans_to_table
    from gpu_trace.tracer.records import SERVER

    rows: list[tuple] = []  # Span records
    tids: list[int] = []
    for span_id, parent_id, span_lane, span_name, t0, t1, span_attrs in spans:
        a = dict(span_attrs or {})
        a["raw_start_ns"] = str(t0)
        a["raw_end_ns"] = str(t1)
        if owner:
            a.update(owner)
        depth = 2 if span_lane == "server/op" else 1
        rows.append(
            (span_id or new_id(), parent_id, span_lane, SERVER, span_name, t0, t1, depth, a)
        )
        tids.append(SERVER_TIDS.get(span_lane, 2))  # server/queue/N too
    return spans_to_table(rows, pid, tids)


def span_owner(session: Any) -> dict[str, str]:
    """What the server stamps on each span it records for ``session``: attrs ``session`` (its
    id) and ``tenant`` (the tenant it authenticated as), the labels its counters carry too. A
    reader takes a server span's session and tenant from these, never from its id."""
    tenant = getattr(getattr(session, "tenant", None), "name", "default")
    return {"session": str(session.id), "tenant": str(tenant)}


def trace_owner(msg: dict[str, Any]) -> dict[str, str]:
    """A TRACE message's ``session`` and ``tenant`` (:func:`span_owner`, as the server sent
    them); only well-formed ones (strings of at most 256 characters) are kept."""
    return {
        key: value
        for key in OWNER_KEYS
        if isinstance(value := msg.get(key), str) and 0 < len(value) <= 256
    }


def encode_tables(tables: list[pa.Table]) -> str:
    """``spans`` tables (the server's GPU activity) as one TRACE message field: an Arrow IPC
    stream, base64 (TRACE messages are JSON; the columns cross as they are, not span by span)."""
    import base64

    import pyarrow as pa

    from gpu_trace.tracer.columns import empty_table

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, empty_table().schema) as writer:
        for table in tables:
            writer.write_table(table)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode("ascii")


def decode_tables(field: object) -> pa.Table | None:
    """A TRACE message's ``gpu`` field back as one ``spans`` table (None: absent or empty);
    :class:`ValueError` when it is not one (the caller logs it, the program goes on)."""
    import base64
    import binascii

    import pyarrow as pa

    from gpu_trace.tracer.columns import is_spans_table

    if not field:
        return None
    if not isinstance(field, str):
        raise ValueError("the server's GPU spans are not a string")
    try:
        table = pa.ipc.open_stream(base64.b64decode(field, validate=True)).read_all()
    except (binascii.Error, pa.ArrowException) as exc:
        raise ValueError(f"the server's GPU spans do not read: {exc}") from None
    if not is_spans_table(table):
        raise ValueError("the server's GPU spans are not spans")
    return table if table.num_rows else None


def counter_table(counters: list[list[Any]], device: str) -> pa.Table:
    """TRACE/SpanLog counters ``[metric, ts, value, labels]`` as a spool table (server times)."""
    import pyarrow as pa

    from gpu_trace.tracer.records import COUNTER_SCHEMA, attrs_column, dict_column, numeric_column

    metric, ts, value, labels = zip(*counters) if counters else ((), (), (), ())
    n = len(metric)
    return pa.table(
        {
            "source": dict_column(["runtime"] * n),
            "device": dict_column([device] * n),
            "metric": dict_column(list(metric)),
            "ts_ns": numeric_column(list(ts), pa.int64()),
            "value": numeric_column(list(value), pa.float64()),
            "labels": attrs_column(
                [{str(k): str(v) for k, v in (lb or {}).items()} for lb in labels]
            ),
        },
        schema=COUNTER_SCHEMA,
    )


def clock_table(samples: list[tuple[int, int, int, int]]) -> pa.Table | None:
    """Usable ``(t0, t1, t2, t3)`` exchanges as ``clock_sync`` rows (as the client records them)."""
    import pyarrow as pa

    from gpu_trace.tracer.clocksync import Sample
    from gpu_trace.tracer.records import CLOCK_SYNC_SCHEMA

    rows = [s for s in (Sample(*raw) for raw in samples) if s.problem() is None]
    if not rows:
        return None
    return pa.table(
        {
            "peer": pa.array([socket.gethostname()] * len(rows)).dictionary_encode(),
            "ts_ns": pa.array([s.ts_ns for s in rows], pa.int64()),
            "offset_ns": pa.array([s.offset_ns for s in rows], pa.int64()),
            "rtt_ns": pa.array([s.rtt_ns for s in rows], pa.int64()),
            "uncertainty_ns": pa.array([s.uncertainty_ns for s in rows], pa.int64()),
        },
        schema=CLOCK_SYNC_SCHEMA,
    )


def write_stats(run_dir: Path, pid: int, session_id: int, events: int) -> None:
    """The server process's ``stats/`` entry in a run (its thread names, its event count)."""
    from gpu_trace.tracer.run import STATS_DIR

    stats = {
        "pid": pid,
        "process_name": f"gpu-trace serve (session {session_id})",
        "events": events,
        "dropped": 0,
        "threads": SERVER_THREADS,
    }
    d = Path(run_dir) / STATS_DIR
    d.mkdir(parents=True, exist_ok=True)
    name = f"server-{pid}-{session_id}.json"
    tmp = d / f".{name}.tmp"
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, d / name)
