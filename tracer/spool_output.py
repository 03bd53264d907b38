"""What a recorder's flushes write: the spool's tables, in order, and the process's stats file.

A flush hands each table to :class:`SpoolOutput`, which writes it with the run's
:class:`~gpu_trace.tracer.spool.SpoolWriter`. A write that fails (a full disk) keeps its table, up
to one buffer's worth of rows, and is tried again first at the next flush, so recording resumes,
losing nothing, when space comes back; a table the full disk refused is split in halves so that a
nearly full disk takes all it has room for, and rows given up on are counted as dropped
(``not_written`` in the stats file). The stats file (``stats/<pid>.json``: events, drops, the
threads that recorded) is rewritten at every flush where it changed.

Apart from :mod:`gpu_trace.tracer.recorder`, whose threads' buffers and hot path it never sees:
this is the flusher's side only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa

from gpu_trace.tracer.buffer import thread_name
from gpu_trace.tracer.columns import spans_to_table
from gpu_trace.tracer.files import disk_full, replace_text
from gpu_trace.tracer.records import COUNTER_SCHEMA, attrs_column, dict_column, numeric_column
from gpu_trace.tracer.run import STATS_DIR
from gpu_trace.tracer.spool import SpoolWriter

log = logging.getLogger(__name__)

#: A table the full disk refused is split in halves down to this many rows (a few hundred KiB).
MIN_SPLIT_ROWS = 4096


def process_name() -> str:
    """This process's command line, short: the program's base name and its first arguments."""
    argv = getattr(sys, "argv", None) or [sys.executable]
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv[:4]))[:200]


class SpoolOutput:
    """One process's spool files and stats file in ``run_dir``, written by its flusher.

    ``limit`` is the most rows kept in memory while the spool cannot be written (a buffer's
    worth); ``io_level`` the level write failures are logged at."""

    def __init__(
        self, run_dir: Path, meta: dict[str, str], pid: int, limit: int, io_level: int
    ) -> None:
        self.run_dir = run_dir
        self.pid = pid
        self.limit = limit
        self.io_level = io_level
        self.writer = SpoolWriter(run_dir, meta)
        #: Rows written to the spool (spans and counters).
        self.events = 0
        # Tables the spool could not take yet, oldest first: written before anything newer.
        self.unwritten: list[tuple[str, pa.Table]] = []
        self.not_written = 0  # rows given up on (counted as dropped)
        self.write_failures = 0
        self.write_error = ""  # why the spool is not being written now; "" when it is
        self._thread_names: dict[str, str] = {}  # every thread that recorded, by OS thread id
        self._stats_written = ""  # the stats file's text as last written

    def name_threads(self, table: pa.Table) -> None:
        """Name the threads a source's spans were recorded on: those may have no buffer (the
        main thread's ops at op level in a program without module calls, threads whose ops only
        the native observer records), and their lanes were "thread <tid>"."""
        for chunk in table.column("tid").chunks:
            if len(chunk) and not chunk.null_count:  # read from the buffer: no pandas (spool.py)
                tids = np.frombuffer(chunk.buffers()[1], np.uint64, len(chunk), chunk.offset * 8)
                for tid in np.unique(tids).tolist():
                    if str(tid) not in self._thread_names:
                        self._thread_names[str(tid)] = thread_name(tid)

    def write(self, kind: str, table: pa.Table) -> None:
        if table.num_rows:
            self.unwritten.append((kind, table))
            self._write_unwritten()

    def _write_unwritten(self) -> None:
        """Write the waiting tables in order; stop at the first that fails (to retry it next)."""
        while self.unwritten:
            kind, table = self.unwritten[0]
            try:
                self.writer.write(kind, table)
            except OSError as exc:
                if disk_full(exc) and table.num_rows >= 2 * MIN_SPLIT_ROWS:
                    # Less may fit: write halves, so a nearly full disk takes all it has room for.
                    half = table.num_rows // 2
                    self.unwritten[0:1] = [(kind, table.slice(0, half)), (kind, table.slice(half))]
                    continue
                self._write_failed(exc)
                return
            except Exception:
                self.unwritten.pop(0)  # it would fail again: give it up, then the boundary logs
                self.not_written += table.num_rows
                raise
            self.unwritten.pop(0)
            if kind in ("spans", "counters"):
                self.events += table.num_rows
        if self.write_error:
            self.write_error = ""
            log.log(self.io_level, "gpu-trace: writing the spool in %s again", self.run_dir)

    def _write_failed(self, exc: OSError) -> None:
        self.write_failures += 1
        reason = "the disk is full" if disk_full(exc) else (exc.strerror or str(exc))
        waiting = sum(t.num_rows for _, t in self.unwritten)
        limit = self.limit
        while waiting > limit and len(self.unwritten) > 1:
            _, oldest = self.unwritten.pop(0)
            waiting -= oldest.num_rows
            self.not_written += oldest.num_rows
        if not self.write_error:
            log.log(
                self.io_level,
                "gpu-trace: cannot write the spool in %s (%s); up to %d events wait in memory "
                "and are written when it can be, the rest are dropped and counted",
                self.run_dir,
                reason,
                limit,
            )
        self.write_error = reason

    def write_spans(self, spans: list[tuple[object, ...]], tids: list[np.ndarray]) -> None:
        if not spans:
            return
        self.write("spans", spans_to_table(spans, self.pid, np.concatenate(tids)))

    def write_counters(self, counters: list[tuple[object, ...]]) -> None:
        if not counters:
            return
        source, device, metric, ts, value, labels = zip(*counters)
        table = pa.table(
            {
                "source": dict_column(source),
                "device": dict_column(device),
                "metric": dict_column(metric),
                "ts_ns": numeric_column(ts, pa.int64()),
                "value": numeric_column(value, pa.float64()),
                "labels": attrs_column(list(labels)),
            },
            schema=COUNTER_SCHEMA,
        )
        self.write("counters", table)

    def write_stats(self, threads: Iterable[tuple[int, str]], dropped: int) -> None:
        """Per-process totals, rewritten at every flush where they changed, so a killed process
        still reports them (and an idle flush writes nothing: background.py). ``threads``: the
        buffers' (tid, name); ``dropped``: what the buffers and sources dropped."""
        # Ended threads too (their buffers are dropped once drained): a lane keeps its name.
        self._thread_names.update((str(tid), name) for tid, name in threads)
        stats = {
            "pid": self.pid,
            "process_name": process_name(),
            "events": self.events,
            "dropped": dropped + self.not_written,
            "threads": dict(self._thread_names),
        }
        if self.write_failures:
            stats["not_written"] = self.not_written
            stats["write_failures"] = self.write_failures
            stats["write_error"] = self.write_error
        text = json.dumps(stats)
        if text == self._stats_written:
            return
        d = self.run_dir / STATS_DIR
        try:
            d.mkdir(exist_ok=True)
            replace_text(d / f"{self.pid}.json", text)
            self._stats_written = text
        except OSError as exc:  # the spool's failure is the one reported; this one is retried
            if not self.write_failures:
                self._write_failed(exc)

    def give_up(self) -> int:
        """At close, with the disk still full: what waits is lost, and counted; the rows lost."""
        if not self.unwritten:
            return 0
        lost: int = sum(t.num_rows for _, t in self.unwritten)
        self.unwritten = []
        self.not_written += lost
        log.log(
            self.io_level,
            "gpu-trace: %d events could not be written to %s (%s) and are dropped",
            lost,
            self.run_dir,
            self.write_error,
        )
        return lost
