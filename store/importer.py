"""PyTorch profiler (Kineto) Chrome traces, and our own exports, into the store as runs:
`gpu-trace import`.

Users already have traces that ``torch.profiler`` wrote; importing one makes ``show``, ``sql``,
``export`` and the dashboard work on it, with the same categories, lanes and attributes that
gpu-trace's own recording gives (docs/import.md has the mapping):

- a file ``torch.profiler`` wrote is mapped to them (:mod:`gpu_trace.store.kineto_trace`);
- a file ``gpu-trace export`` wrote (its ``gpu_trace`` trailer says so) is read as the run it was
  (:mod:`gpu_trace.store.exported_trace`).

Both are read the same way first (:mod:`gpu_trace.store.trace_file`: gzip, JSON, exact times).

A run appears whole or not at all: spans, counters and threads go in first, the ``runs`` row
last, and a failure in between removes what was written. A file already imported (same SHA-256)
is refused with the id of its run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from gpu_trace.store.exported_trace import convert_export, is_export
from gpu_trace.store.kineto_trace import convert_kineto
from gpu_trace.store.trace_file import (
    Converted,
    Progress,
    TraceImportError,
    read_trace,
)
from gpu_trace.tracer.records import dict_column
from gpu_trace.tracer.run import RunInfo

if TYPE_CHECKING:
    from gpu_trace.store.client import Store

log = logging.getLogger(__name__)

__all__ = [
    "ImportReport",
    "import_trace",
    "imported_run",
    "store_spans",
    "convert",
    # Named here too for the dashboard, which imports it from this module.
    "Progress",
]

#: Run attribute holding the file's SHA-256 (a second import of the same file is refused).
SOURCE_SHA = "import_sha256"


@dataclass
class ImportReport:
    """What one import did."""

    run_id: str
    counts: dict[str, int]
    skipped: dict[str, int]
    linked: int
    seconds: float
    existing: bool = False  # the file was imported before: run_id is that run
    backward_pairs: int = 0
    counters: int = 0  # counter samples

    def summary(self) -> str:
        """One line for the CLI."""
        if self.existing:
            return f"already imported as run {self.run_id} (gpu-trace rm it to import again)"
        parts = ", ".join(f"{n} {c}" for c, n in self.counts.items() if n)
        if self.counters:
            parts = f"{parts or 'no spans'}, {self.counters} counter samples"
        text = f"run {self.run_id}: {parts or 'no spans'}; {self.linked} launches linked"
        if self.backward_pairs:
            text += f", {self.backward_pairs} backward ops to their forward op"
        if self.skipped:
            text += "; left out: " + ", ".join(f"{k} ({n:,})" for k, n in self.skipped.items())
        return f"{text} ({self.seconds:.1f} s)"


def convert(
    data: dict[str, object], *, name: str, command: str, progress: Progress | None = None
) -> Converted:
    """The trace as the store's rows (see the module docstring); TraceImportError for events that
    lack what they need (a ``ts``, a ``dur``, an integer ``pid``). A file ``gpu-trace export``
    wrote is read as the run it was (:func:`convert_export`). ``progress``: told every
    :data:`~gpu_trace.store.trace_file.EVENTS_CHUNK` events."""
    try:
        if is_export(data):
            return convert_export(data, name=name, command=command, progress=progress)
        return convert_kineto(data, name=name, command=command, progress=progress)
    except OverflowError:  # a column's numpy array: a time or id past 64 bits
        raise TraceImportError("a time, pid or tid too large for 64 bits") from None


# ---- storing ------------------------------------------------------------------------------------


def imported_run(store: Store, sha256: str) -> str | None:
    """The run a file with this SHA-256 was imported as, None if none was."""
    rows = store.query(
        "SELECT run_id FROM __db__.runs FINAL WHERE attrs[{key:String}] = {sha:String} LIMIT 1",
        {"key": SOURCE_SHA, "sha": sha256},
    ).result_rows
    return str(rows[0][0]) if rows else None


def import_trace(
    store: Store, path: str | Path, *, name: str | None = None, progress: Progress | None = None
) -> ImportReport:
    """Import a Kineto trace file into ``store`` as a new run (see the module docstring).

    TraceImportError (one line) for a file that cannot be imported; StoreError when the store fails,
    after removing what was written. A file imported before is not imported again: the report
    names its run, with ``existing`` set. ``progress(phase, done, total)`` is told what is being
    done (reading, decompressing, parsing, converting, storing), for a terminal's progress line.
    """
    t0 = time.perf_counter()
    path = Path(path)
    data, digest = read_trace(path, progress)
    existing = imported_run(store, digest)
    if existing is not None:
        return ImportReport(existing, {}, {}, 0, time.perf_counter() - t0, existing=True)
    converted = convert(
        data, name=path.name, command=name or f"import {path.name}", progress=progress
    )
    del data
    info = converted.info
    info.attrs[SOURCE_SHA] = digest
    counters = converted.counters
    if progress is not None:
        progress(f"storing {converted.spans.num_rows:,} spans", 0, None)
    store_spans(store, info, converted.spans, converted.threads, counters)
    report = ImportReport(
        info.run_id,
        converted.counts,
        dict(converted.skipped),
        converted.linked,
        time.perf_counter() - t0,
        backward_pairs=converted.backward_pairs,
        counters=counters.num_rows if counters is not None else 0,
    )
    log.info("gpu-trace: imported %s: %s", path, report.summary())
    return report


def store_spans(
    store: Store,
    info: RunInfo,
    spans: pa.Table,
    threads: list[tuple[str, int, int, str, str]],
    counters: pa.Table | None = None,
) -> None:
    """Spans, counters and threads, then the ``runs`` row that makes the run visible; on a
    failure what was written is removed again and the StoreError raised. Spans without a
    ``host`` column are the run's first host's."""
    added = {"run_id": info.run_id, "trace_id": info.trace_id}
    if "host" not in spans.column_names:
        added["host"] = info.hosts[0] if info.hosts else ""
    table = _with_columns(spans, added)
    now = time.time_ns()
    try:
        if table.num_rows:
            store.insert_arrow("spans", table)
        if counters is not None and counters.num_rows:
            store.insert_arrow("counters", _with_columns(counters, {"run_id": info.run_id}))
        store.insert_rows(
            "threads",
            ["run_id", "host", "pid", "tid", "process_name", "thread_name", "updated_ns"],
            [[info.run_id, h, p, t, pn, tn, now] for h, p, t, pn, tn in threads],
        )
        store.upsert_run(info)
    except Exception:
        try:
            store.delete_run(info.run_id)
        except Exception:
            log.warning("gpu-trace: could not remove the partly imported run %s", info.run_id)
        raise


def _with_columns(table: pa.Table, values: dict[str, str]) -> pa.Table:
    """``table`` with a column of one value added for each of ``values``."""
    n = table.num_rows
    for column, value in values.items():
        table = table.append_column(column, dict_column([value]).take(np.zeros(n, np.int64)))
    return table
