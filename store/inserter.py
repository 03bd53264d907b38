"""Batched inserts and the ingest log: what makes ingest idempotent.

Spool rows go in as Arrow, batched across files (about :data:`BATCH_ROWS` rows per insert), up
to :data:`INSERT_WORKERS` inserts side by side, each on its own connection (:class:`Inserter`).
Every file is recorded in ``ingest_log`` by run id, file name and size (:func:`logged_files`
reads it back); a batch is logged ``pending`` before its insert and ``done`` after it, so a file
found ``pending`` (a crash between the two) is inserted again without the rows already there
(:func:`drop_present`), matched by key: spans by pid and span id, counters by source, device,
metric and time, clock samples by peer and time. Apart from ingest's reading of the spool
(:mod:`gpu_trace.store.ingest`), which decides what goes in; this is how it goes in.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.tracer.records import SCHEMAS
from gpu_trace.tracer.spool import count_rows

if TYPE_CHECKING:
    from gpu_trace.store.client import InsertConnection, Store
    from gpu_trace.store.ingest import IngestReport

log = logging.getLogger(__name__)

#: Most rows per insert: about one part of the engine's (``max_insert_block_size``, 1,048,449
#: rows). Each insert makes a part the engine merges later: smaller batches cost more CPU in all
#: (at 3M spans, 250k-row batches took 1.8x the CPU of 1M-row ones), but a kind with fewer rows
#: than this many inserts' worth is split so that its inserts run side by side
#: (:func:`rows_per_batch`). The rows are the spool files' own, memory-mapped, so a batch's
#: memory is mostly the page cache's.
BATCH_ROWS = 1_000_000
#: Inserts in flight at once, each on its own connection: the engine writes one batch while the
#: next is read and checked. At most this many batches are held in memory.
INSERT_WORKERS = 2

#: What identifies a row already in the store, when a crashed ingest is resumed.
_KEYS = {
    "spans": (("pid", "span_id"), "start_ns"),
    "counters": (("source", "device", "metric", "ts_ns"), "ts_ns"),
    "clock_sync": (("peer", "ts_ns"), "ts_ns"),
}

#: ``ingest_log`` rows: file name, size, rows kept, problem ("" for none).
LogRow = tuple[str, int, int, str]


@dataclass
class Pending:
    """Files read and waiting for one batched insert of one kind."""

    tables: list[pa.Table] = field(default_factory=list)
    files: list[LogRow] = field(default_factory=list)
    rows: int = 0


def rows_per_batch(files: list[Path]) -> dict[str, int]:
    """Rows per insert of each kind: :data:`BATCH_ROWS`, or less so that a kind's rows make at
    least :data:`INSERT_WORKERS` inserts to run side by side (a million spans: two of 500k). The
    rows are counted from the files' batch headers (memory-mapped, not decoded)."""
    rows = dict.fromkeys(SCHEMAS, 0)
    for path in files:
        kind = path.name.split("-", 1)[0]
        if kind in rows:
            rows[kind] += count_rows(path) or 0
    return {kind: max(1, min(BATCH_ROWS, -(-n // INSERT_WORKERS))) for kind, n in rows.items()}


def drop_present(store: Store, kind: str, table: pa.Table) -> pa.Table:
    """Rows of ``table`` not yet in the store (for a file whose earlier ingest was cut short)."""
    keys, time_col = _KEYS[kind]
    run_id = table.column("run_id")[0].as_py()
    host = table.column("host")[0].as_py()
    lo, hi = pc.min_max(table.column(time_col)).values()
    existing = store.query_arrow(
        f"SELECT {', '.join(keys)} FROM __db__.{kind} WHERE run_id = {{run_id:String}} AND host = {{host:String}}"
        f" AND {time_col} BETWEEN {{lo:Int64}} AND {{hi:Int64}}",
        {"run_id": run_id, "host": host, "lo": lo.as_py(), "hi": hi.as_py()},
    )
    if existing.num_rows == 0:
        return table
    left = {}
    for k in keys:
        col = table.column(k)
        left[k] = col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col
    left["__row"] = pa.array(np.arange(table.num_rows, dtype=np.int64))
    right = pa.table({k: existing.column(k).cast(left[k].type) for k in keys})
    kept = pa.table(left).join(right, keys=list(keys), join_type="left anti")
    rows = np.sort(kept.column("__row").to_numpy())
    log.info(
        "gpu-trace: resumed %s: %d of %d rows were already stored",
        kind,
        table.num_rows - len(rows),
        table.num_rows,
    )
    return table.take(pa.array(rows))


def logged_files(store: Store, run_id: str) -> dict[tuple[str, int], str]:
    result = store.query(
        """
        SELECT file, size, argMax(status, ingested_ns) FROM __db__.ingest_log
        WHERE run_id = {run_id:String} GROUP BY file, size
        """,
        {"run_id": run_id},
    )
    return {(f, int(s)): status for f, s, status in result.result_rows}


def _log(store: Store, run_id: str, entries: list[tuple[str, str, LogRow]]) -> None:
    """Write ``ingest_log`` rows, ``(kind, status, (file, size, rows, problem))`` each, in one
    insert (as Arrow: the engine reads it in place)."""
    if not entries:
        return
    n = len(entries)
    files = [row for _, _, row in entries]
    table = pa.table(
        {
            "run_id": pa.array([run_id] * n, pa.string()),
            "file": pa.array([f[0] for f in files], pa.string()),
            "size": pa.array([f[1] for f in files], pa.uint64()),
            "kind": pa.array([kind for kind, _, _ in entries], pa.string()),
            "rows": pa.array([f[2] for f in files], pa.uint64()),
            "status": pa.array([status for _, status, _ in entries], pa.string()),
            "problem": pa.array([f[3] for f in files], pa.string()),
            "ingested_ns": pa.array([time.time_ns()] * n, pa.int64()),
        }
    )
    store.insert_arrow("ingest_log", table)


class Inserter:
    """Runs batched inserts on worker connections, logging each batch pending before and done after.

    The log entries go through the store's own connection from the calling thread, so a batch is
    never logged done before its insert returned; a batch's done entries wait for the next batch's
    pending ones (or the end) and go in the same insert. A failed insert raises StoreError from
    ``submit`` or ``__exit__`` after the other in-flight inserts have finished (and the batches
    that were stored are logged done).
    """

    def __init__(self, store: Store, run_id: str, report: IngestReport) -> None:
        self.store = store
        self.run_id = run_id
        self.report = report
        self._connections: list[InsertConnection] = []
        self._free: list[InsertConnection] = []
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: list[tuple[Future[int], str, Pending, InsertConnection]] = []
        self._unlogged: list[tuple[str, str, LogRow]] = []  # done, not yet written

    def __enter__(self) -> Inserter:
        return self

    def submit(self, kind: str, batch: Pending) -> None:
        _log(
            self.store,
            self.run_id,
            [*self._unlogged, *((kind, "pending", f) for f in batch.files)],
        )
        self._unlogged = []
        if not batch.tables:
            self._done(kind, batch, 0)
            return
        while len(self._in_flight) >= INSERT_WORKERS:
            self._wait_oldest()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(INSERT_WORKERS, thread_name_prefix="gpu-trace-ingest")
        if not self._free:
            connection = self.store.connect_again()
            self._connections.append(connection)
            self._free.append(connection)
        connection = self._free.pop()
        future = self._pool.submit(_insert_batch, self.store, kind, batch.tables, connection)
        self._in_flight.append((future, kind, batch, connection))

    def _wait_oldest(self) -> None:
        future, kind, batch, connection = self._in_flight.pop(0)
        try:
            rows = future.result()
        finally:
            self._free.append(connection)
        self._done(kind, batch, rows)

    def _done(self, kind: str, batch: Pending, rows: int) -> None:
        self._unlogged.extend((kind, "done", f) for f in batch.files)
        self.report.rows[kind] += rows
        self.report.files_ingested += len(batch.files)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        error: BaseException | None = None
        while self._in_flight:
            try:
                self._wait_oldest()
            except BaseException as e:  # keep waiting for the rest, then raise the first
                error = error or e
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for connection in self._connections:
            connection.close()
        try:
            _log(self.store, self.run_id, self._unlogged)
        except BaseException as e:
            error = error or e
        if error is not None and exc_type is None:
            raise error


def _insert_batch(
    store: Store, kind: str, tables: list[pa.Table], connection: InsertConnection
) -> int:
    table = pa.concat_tables(tables)  # the files' own dictionaries: the store unifies if it must
    store.insert_arrow(kind, table, connection=connection)
    rows: int = table.num_rows
    return rows
