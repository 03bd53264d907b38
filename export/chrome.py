"""Chrome trace JSON export, for Perfetto, chrome://tracing and Holistic Trace Analysis.

The output is the Trace Event Format's JSON object form, written as a stream: a header, one event
per line, a trailer. Memory stays constant in the number of spans: each Arrow batch is formatted
by vectorized string kernels (``json_fragments.py``) into one buffer and written out before the
next is read. Beside it: ``tracks.py`` (which Chrome pid and tid each lane is drawn on),
``kineto_dialect.py`` (what the Kineto dialect writes differently), ``envelope.py`` (the header
and the trailer), ``flows.py`` (flow arrows) and ``rank_traces.py`` (one file per rank).

What goes where (docs/export.md has the user's view):

- A span is a complete event (``ph: X``); a ``mark`` is an instant event (``ph: i``, thread scope).
  ``ts`` and ``dur`` are microseconds written as decimals with three fraction digits, computed from
  integer nanoseconds, so no precision is lost. ``ts`` is relative to the run's ``started_ns`` (or
  the first span's start when the run does not say); the trailer's ``gpu_trace.time_base_ns`` names
  the base and ``baseTimeNanoseconds`` its Unix time where the run has a wall-clock anchor.
- Each ``(host, pid)`` is one process, named ``"host process_name"`` (viewers show the pid after
  the name themselves); a pid already used by another host is renumbered, and its name then ends
  ``(pid N)`` with the recorded one. Each ``(host, pid, tid, lane)`` is one thread track: lanes of one
  OS thread (``steps``, ``nvtx/gpu_trace``, ``nvtx/<domain>``) overlap without nesting, which Chrome
  events on one tid must not, so every lane but ``steps`` gets a synthetic tid (from 2**30 up) and a
  thread name such as ``"MainThread · nvtx/gpu_trace"``; the ``steps`` lane keeps the real tid.
- Categories map onto the ones PyTorch's profiler (Kineto) writes and HTA reads: ``op`` ->
  ``cpu_op``, ``nvtx``/``step`` -> ``user_annotation``, ``module`` -> ``python_function``,
  ``kernel`` -> ``kernel``, ``memcpy`` -> ``gpu_memcpy``; ``args.category`` keeps ours. Steps are
  named ``ProfilerStep#N`` by the recorder, which is what HTA's iteration analysis looks for.
- A span whose parent is in another process (a forwarded call's server spans) gets a flow arrow
  (``s``/``f`` events) from the parent's start to the child's start. Parents are looked up in a
  bounded window (``flows.py``): the most recent ``flow_window`` spans of any category plus the
  most recent ``flow_window`` spans of category ``forward``; a parent older than both is not
  linked.
- Counters are counter events (``ph: C``) under their host's first process (a process's
  counter tracks in Perfetto), named by metric, one series per device, ``cat`` the source, the
  labels (if any) in ``labels`` beside ``args``; a host without a process in the file gets a
  ``<host> counters`` process on a synthetic pid.
- A span's ``args`` carry what the store has and Chrome's fields do not (span ids, category,
  lane, depth), and the trailer's ``gpu_trace`` the run's metadata and what each Chrome pid and
  tid stands for: ``gpu-trace import`` (``exported_trace.convert_export``) stores the run again from
  them, exactly.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.export.envelope import header, trailer
from gpu_trace.export.exporter import ExportResult, check_batch
from gpu_trace.export.flows import FlowLinker
from gpu_trace.export.json_fragments import (
    attrs_fragment,
    combined,
    dictionary,
    dumps,
    int64,
    micros,
    plain,
    quote,
    uint64,
)
from gpu_trace.export.kineto_dialect import (
    DEVICE_CATEGORIES,
    INT_ARGS,
    KINETO_CATEGORIES,
    KINETO_INT_ARGS,
    KINETO_LIST_ARGS,
    KINETO_NUMBER_ARGS,
    attr_map,
    forward_spans,
    kineto_rows,
    without_lane_args,
)
from gpu_trace.export.tracks import GPU_LANE, Tracks
from gpu_trace.tracer.records import MARK
from gpu_trace.tracer.trace_format import RESERVED_ARGS

log = logging.getLogger(__name__)

Progress = Callable[[int, "int | None"], None]

#: Rows formatted at a time; bounds the exporter's memory whatever the batch size.
CHUNK_ROWS = 1 << 14

_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)
_NIBBLES = np.arange(60, -4, -4, dtype=np.uint64)


def span_id_text(ids: np.ndarray) -> pa.Array:
    """Span ids as 16 lower-case hex digits, as W3C trace context and OpenTelemetry write them
    and as the dashboard shows them: one form of an id everywhere a person reads it."""
    nibbles = (np.asarray(ids, np.uint64)[:, None] >> _NIBBLES) & np.uint64(15)
    digits = np.ascontiguousarray(_HEX_DIGITS[nibbles.astype(np.intp)])
    return pa.array(digits.view("S16").ravel(), pa.binary(16)).cast(pa.string())


class ChromeTraceExporter:
    """Writes spans (and counters) to a Chrome trace JSON file; ``.gz`` paths are gzipped.

    ``run`` is the run's row (``run_id``, ``trace_id``, ``started_ns``, ``command``, ``hosts``,
    ``attrs``...), ``threads`` a list of ``{host, pid, tid, process_name, thread_name}``.
    ``rank``, ``world_size`` and ``backend`` (when given) go to ``distributedInfo`` (HTA reads the
    rank from there; name the file ``rank-N.json`` when several ranks share a directory:
    :func:`write_rank_traces`). ``progress(done, total)`` is called
    after each batch. The file is written under a temporary name and moved into place by
    :meth:`shutdown`, which also writes the trailer: call it, also after an error or Ctrl-C, to get
    a valid file with what was written so far.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        run: dict[str, Any],
        threads: Iterable[dict[str, Any]] = (),
        rank: int = 0,
        world_size: int = 1,
        progress: Progress | None = None,
        total_spans: int | None = None,
        categories: str = "kineto",
        flow_window: int = 1 << 18,
        compresslevel: int = 3,
        backend: str = "",
    ) -> None:
        if categories not in ("kineto", "native"):
            raise ValueError(f"categories must be 'kineto' or 'native', got {categories!r}")
        if (
            not isinstance(rank, int)
            or rank < 0
            or not isinstance(world_size, int)
            or world_size <= rank
        ):
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}"
            )
        if not isinstance(run, dict):
            raise ValueError(f"run must be a dict, got {type(run).__name__}")
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise ValueError(f"no directory {self.path.parent} to write {self.path.name} into")
        self.run = dict(run)
        self.rank = rank
        self.backend = str(backend)
        self.progress = progress
        self.total_spans = total_spans
        self.flow_window = max(int(flow_window), 0)
        self._kineto = categories == "kineto"
        self._thread_names: dict[tuple[str, int, int], str] = {}
        self._process_names: dict[tuple[str, int], str] = {}
        #: The threads rows as given, for the trailer (``gpu-trace import`` stores them again).
        self._thread_rows: list[dict[str, str | int]] = []
        for t in threads:
            key = (str(t.get("host", "")), int(t.get("pid", 0)))
            self._thread_rows.append(
                {
                    "host": key[0],
                    "pid": key[1],
                    "tid": int(t.get("tid") or 0),
                    "process_name": str(t.get("process_name") or ""),
                    "thread_name": str(t.get("thread_name") or ""),
                }
            )
            if t.get("tid") is not None and t.get("thread_name"):
                thread = (*key, int(t["tid"]))  # a local: mypy reads d[(*a, b)] as 3.11's d[*a, b]
                self._thread_names[thread] = str(t["thread_name"])
            if t.get("process_name"):
                self._process_names.setdefault(key, str(t["process_name"]))
        started = run.get("started_ns")
        self.base_ns: int | None = int(started) if started else None

        self._flows = FlowLinker(self.flow_window)
        self.stats: dict[str, Any] = {
            "path": str(self.path),
            "spans": 0,
            "marks": 0,
            "counters": 0,
            "flows": 0,
            "processes": 0,
            "tracks": 0,
            "events": 0,
            "bytes": 0,
            "complete": False,
        }
        #: Which Chrome pid and tid each recorded thread's lane is drawn on (export/tracks.py).
        self._tracks = Tracks(
            kineto=self._kineto,
            thread_names=self._thread_names,
            process_names=self._process_names,
            thread_rows=self._thread_rows,
            stats=self.stats,
            put_meta=self._put_meta,
        )
        self._closed = False
        self._failed = False
        #: Why the first failed ``export``/``export_counters`` failed, in one line; None if none did.
        self.error: str | None = None
        self._first = True
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        raw = open(self._tmp, "wb")  # noqa: SIM115 - closed by shutdown
        self._file: io.BufferedIOBase = (
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=compresslevel, mtime=0)
            if self.path.name.endswith(".gz")
            else raw
        )
        self._raw = raw
        self._put(header(self.run, rank=rank, world_size=world_size, backend=self.backend).encode())

    # ---- the plugin contract ------------------------------------------------------------------

    def export(self, batch: pa.Table) -> ExportResult:
        """Write one batch of spans (see ``exporter.SPAN_BATCH_SCHEMA``); never raises."""
        return self._guarded(self.write_spans, batch)

    def export_counters(self, batch: pa.Table) -> ExportResult:
        """Write one batch of counter samples (see :meth:`write_counters`); never raises."""
        return self._guarded(self.write_counters, batch)

    def _guarded(self, write: Callable[[pa.Table], None], batch: pa.Table) -> ExportResult:
        if self._closed:
            return ExportResult.FAILURE
        try:
            write(batch)
        except Exception as exc:
            self._fail(exc)
            return ExportResult.FAILURE
        return ExportResult.SUCCESS

    def _fail(self, exc: Exception) -> None:
        """Note a failed write: the result says FAILURE and :attr:`error` why, which every caller
        reports in its own words (the CLI in its one line), so the traceback is only a debug
        record here."""
        log.debug("gpu-trace: Chrome trace export to %s failed", self.path, exc_info=exc)
        self._failed = True
        if self.error is None:
            self.error = (
                exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            ) or type(exc).__name__

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self._closed:
            return False
        try:
            self._file.flush()
        except OSError:
            log.exception("gpu-trace: flushing %s failed", self.path)
            return False
        return True

    def shutdown(self) -> None:
        """Write the trailer and move the file into place. Idempotent; never raises: a file
        that cannot be finished is removed, and :attr:`error` says why."""
        try:
            self.close(complete=not self._failed)
        except Exception as exc:
            self._fail(exc)

    # ---- writing ------------------------------------------------------------------------------

    def write_spans(self, batch: pa.Table | pa.RecordBatch) -> None:
        """Format and write one batch of spans; raises on bad input or I/O errors."""
        if self._closed:
            raise ValueError(f"{self.path} is already closed")
        check_batch(batch)
        if isinstance(batch, pa.RecordBatch):
            batch = pa.Table.from_batches([batch])
        # Big batches are formatted in slices: memory follows CHUNK_ROWS, not the caller's batch.
        for offset in range(0, batch.num_rows, CHUNK_ROWS):
            self._write_span_chunk(batch.slice(offset, CHUNK_ROWS))
        if self.progress is not None:
            done = self.stats["spans"] + self.stats["marks"]
            try:
                self.progress(done, self.total_spans)
            except Exception:
                log.exception("gpu-trace: progress callback failed; export goes on without it")
                self.progress = None

    def _write_span_chunk(self, batch: pa.Table) -> None:
        n = batch.num_rows
        start = int64(batch["start_ns"])
        if self.base_ns is None:
            self.base_ns = int(start.min())
        end = int64(batch["end_ns"])
        rel = start - self.base_ns
        dur = np.maximum(end - start, 0)

        cpid, ctid, track_frag, lane_frag = self._tracks.columns(batch)
        device_rows = np.zeros(n, dtype=bool)
        if self._kineto:
            lane_codes, lane_dict = dictionary(batch["lane"])
            on_device = [bool(GPU_LANE.match(x or "")) for x in lane_dict.to_pylist()]
            device_rows = np.array(on_device or [False])[lane_codes]
        cat_codes, cat_dict = dictionary(batch["category"])
        cat_names = cat_dict.to_pylist()
        is_mark_cat = np.array([c == MARK for c in cat_names], dtype=bool)
        is_mark = is_mark_cat[cat_codes] if len(cat_names) else np.zeros(n, dtype=bool)
        shown = [KINETO_CATEGORIES.get(c, c) if self._kineto else c for c in cat_names]
        cat_json = pa.array([dumps(c) for c in shown], pa.string()).take(pa.array(cat_codes))
        if self._kineto:
            cat_json = kineto_rows(batch, cat_names, cat_codes, cat_json)
        our_cat = quote(cat_dict).take(pa.array(cat_codes))
        mark = pa.array(is_mark)

        sid = uint64(batch["span_id"])
        parent = uint64(batch["parent_span_id"])
        has_parent = parent != 0
        parent_str = span_id_text(parent)
        parent_frag = pc.if_else(
            pa.array(has_parent),
            pc.binary_join_element_wise(',"parent_span_id":"', parent_str, '"', ""),
            "",
        )
        events = pc.binary_join_element_wise(
            pc.if_else(mark, ',\n{"ph":"i","s":"t","cat":', ',\n{"ph":"X","cat":'),
            cat_json,
            ',"name":',
            quote(batch["name"]),
            ",",
            track_frag,
            ',"ts":',
            micros(rel),
            pc.if_else(mark, "", pc.binary_join_element_wise(',"dur":', micros(dur), "")),
            ',"args":{"span_id":"',
            span_id_text(sid),
            '"',
            parent_frag,
            ',"category":',
            our_cat,
            lane_frag,
            _depth_fragment(batch),
            attrs_fragment(
                without_lane_args(batch, device_rows) if self._kineto else batch["attrs"],
                reserved=RESERVED_ARGS,
                integer_keys=KINETO_INT_ARGS if self._kineto else INT_ARGS,
                number_keys=KINETO_NUMBER_ARGS if self._kineto else (),
                list_keys=KINETO_LIST_ARGS if self._kineto else (),
            ),
            "}}",
            "",
        )
        self._write_strings(events)
        marks = int(is_mark.sum())
        self.stats["marks"] += marks
        self.stats["spans"] += n - marks

        categories = np.array(cat_names, dtype=object)[cat_codes] if len(cat_names) else None
        launched = backward_of = None
        if self._kineto:
            if categories is not None:
                launched = np.isin(categories, DEVICE_CATEGORIES)
            backward_of = forward_spans(batch)
        arrows = self._flows.link(
            sid, parent, has_parent, cpid, ctid, rel, categories, launched, backward_of
        )
        if arrows is not None:
            starts, ends = arrows
            self._write_strings(starts)
            self._write_strings(ends)
            self.stats["flows"] += len(starts)

    def write_counters(self, batch: pa.Table | pa.RecordBatch) -> None:
        """Write counter samples (``host, device, metric, ts_ns, value``; ``source`` optional)."""
        if self._closed:
            raise ValueError(f"{self.path} is already closed")
        missing = [c for c in ("metric", "ts_ns", "value") if c not in batch.column_names]
        if missing:
            raise ValueError(f"counter batch lacks columns {', '.join(missing)}")
        if isinstance(batch, pa.RecordBatch):
            batch = pa.Table.from_batches([batch])
        value = pc.cast(batch["value"], pa.float64())
        keep = pc.fill_null(pc.is_finite(value), False)
        batch = batch.filter(keep)
        n = batch.num_rows
        if n == 0:
            return
        ts = int64(batch["ts_ns"])
        if self.base_ns is None:
            self.base_ns = int(ts.min())
        if "host" in batch.column_names:
            host_codes, host_dict = dictionary(batch["host"])
            hosts = host_dict.to_pylist()
        else:
            host_codes, hosts = np.zeros(n, dtype=np.int32), [""]
        pid_frag = pa.array(
            [f'"pid":{self._tracks.counter_pid(h or "")},"tid":0' for h in hosts], pa.string()
        )
        if "device" in batch.column_names:
            device = pc.fill_null(plain(batch["device"]), "")
            series = pc.if_else(pc.equal(device, ""), "value", device)
        else:
            series = pa.array(["value"] * n, pa.string())
        # The shortest text that reads back as the same float64; "-0" would read back as 0.
        number = pc.cast(combined(value.filter(keep)), pa.string())
        number = pc.if_else(pc.equal(number, "-0"), "-0.0", number)
        events = pc.binary_join_element_wise(
            ',\n{"ph":"C",',
            _counter_source(batch),
            '"name":',
            quote(batch["metric"]),
            ",",
            pid_frag.take(pa.array(host_codes)),
            ',"ts":',
            micros(ts - self.base_ns),
            ',"args":{',
            quote(series),
            ":",
            number,
            "}",
            _counter_labels(batch),
            "}",
            "",
        )
        self._write_strings(events)
        self.stats["counters"] += n

    def close(self, complete: bool = True) -> dict[str, Any]:
        """Write the trailer, close and move the file into place; returns the stats.

        ``complete=False`` records in the trailer that the export stopped early.
        """
        if self._closed:
            return self.stats
        self._closed = True
        self.stats["complete"] = complete
        try:
            tail = trailer(
                self.run,
                base_ns=self.base_ns,
                stats=self.stats,
                flow_window=self.flow_window,
                kineto=self._kineto,
                thread_rows=self._thread_rows,
                process_rows=self._tracks.process_rows,
                track_rows=self._tracks.track_rows,
            )
            self._put(tail.encode())
            self._file.close()
            if self._file is not self._raw:
                self._raw.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            # Not finished (a full disk, most often): no half-written file is left behind,
            # under either name.
            with contextlib.suppress(Exception):
                self._raw.close()
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            raise
        finally:
            self._flows.clear()
        return self.stats

    # ---- bytes out ----------------------------------------------------------------------------

    def _put_meta(self, text: str, events: int) -> None:
        self.stats["events"] += events
        self._put(text.encode())

    def _put(self, data: bytes | memoryview) -> None:
        # Every event starts with ",\n"; the first one in the array must not.
        if self._first and data[:2] == b",\n":
            data = data[2:]
            self._first = False
        self._file.write(data)
        self.stats["bytes"] += len(data)

    def _write_strings(self, arr: pa.Array | pa.ChunkedArray) -> None:
        """Write the concatenation of a string array (one event each) without a Python copy."""
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if len(arr) == 0:
            return
        self.stats["events"] += len(arr)
        offsets = np.frombuffer(
            arr.buffers()[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4
        )
        data = arr.buffers()[2]
        self._put(memoryview(data)[offsets[0] : offsets[-1]])


def _depth_fragment(batch: pa.Table) -> pa.Array | str:
    """Per row ``,"depth":N`` where the span's depth is not 0 (``""`` there): the store's depth
    is the recorder's, which the importer cannot work out again from the parents."""
    if "depth" not in batch.column_names:
        return ""
    depth = int64(batch["depth"])
    if not depth.any():
        return ""
    text = pc.binary_join_element_wise(',"depth":', pa.array(depth).cast(pa.string()), "")
    return pc.if_else(pa.array(depth != 0), text, "")


def _counter_source(batch: pa.Table) -> pa.Array | str:
    """Per row ``"cat":"<source>",`` (``nvml``, ``host``, ``user``...), ``""`` without one."""
    if "source" not in batch.column_names:
        return ""
    source = pc.fill_null(plain(batch["source"]), "")
    text = pc.binary_join_element_wise('"cat":', quote(source), ",", "")
    return pc.if_else(pc.equal(source, ""), "", text)


def _counter_labels(batch: pa.Table) -> pa.Array | str:
    """Per row ``,"labels":{...}`` for a sample with labels (``""`` for one without): beside
    ``args``, whose every entry a viewer draws as a series."""
    if "labels" not in batch.column_names:
        return ""
    pairs = attrs_fragment(attr_map(batch["labels"]))
    if isinstance(pairs, str):
        return ""
    text = pc.binary_join_element_wise(',"labels":{', pc.utf8_slice_codeunits(pairs, 1), "}", "")
    return pc.if_else(pc.equal(pairs, ""), "", text)


# ---- the convenience entry point ----------------------------------------------------------------


def write_chrome_trace(
    path: str | os.PathLike[str],
    run: dict[str, Any],
    threads: Iterable[dict[str, Any]],
    span_batches: Iterable[pa.Table],
    counter_batches: Iterable[pa.Table] = (),
    total_spans: int | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Write a whole run to ``path`` and return the stats (events written, bytes, base).

    ``span_batches`` are tables as ``Store.iter_spans`` yields them (ordered by ``start_ns``),
    ``counter_batches`` as ``Store.iter_counters``. ``options`` go to :class:`ChromeTraceExporter`
    (``rank``, ``world_size``, ``categories``, ``flow_window``, ``compresslevel``). Errors raise;
    the file is still finished with what was written (``gpu_trace.complete`` is false then).
    """
    exporter = ChromeTraceExporter(
        path, run=run, threads=threads, progress=progress, total_spans=total_spans, **options
    )
    ok = False
    try:
        for batch in span_batches:
            exporter.write_spans(batch)
        for batch in counter_batches:
            exporter.write_counters(batch)
        ok = True
    finally:
        stats = exporter.close(complete=ok)
    return stats
