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
#: GPU activity categories made on a thread (the CUDA calls, the waits): the executor's row.
THREAD_CATEGORIES = ("cuda_api", "cuda_sync")


def span_table(spans: list[list[Any]], pid: int, new_id: Any) -> pa.Table:
    """TRACE/SpanLog spans ``[id, parent, lane, name, start, end, attrs]`` as a spool table.

    Times stay on the server's clock; attrs get ``raw_start_ns``/``raw_end_ns``. Spans without
    an id get one from ``new_id()``. A row with an eighth element is the server's GPU activity
    (``runtime/server/device_activity.py``): its category (``kernel``, ``memcpy``, ``memset``,
    ``cuda_api``, ``cuda_sync``), on its own lane (``gpu<d>/stream<s>``, ``cuda_api``): CUDA
    calls on the executor's thread row under their op (depth 3), device work on thread 0.
    """
    from gpu_trace.tracer.columns import spans_to_table
    from gpu_trace.tracer.records import SERVER

    rows: list[tuple] = []  # Span records
    tids: list[int] = []
    for row in spans:
        span_id, parent_id, span_lane, span_name, t0, t1, span_attrs = row[:7]
        a = dict(span_attrs or {})
        a["raw_start_ns"] = str(t0)
        a["raw_end_ns"] = str(t1)
        if len(row) > 7:
            category = str(row[7])
            on_thread = category in THREAD_CATEGORIES
            depth, tid = (3, SERVER_TIDS["server/op"]) if on_thread else (0, 0)
        else:
            category, tid = SERVER, SERVER_TIDS.get(span_lane, 2)
            depth = 2 if span_lane == "server/op" else 1
        rows.append(
            (span_id or new_id(), parent_id, span_lane, category, span_name, t0, t1, depth, a)
        )
        tids.append(tid)
    return spans_to_table(rows, pid, tids)


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
