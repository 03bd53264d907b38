"""Chrome trace JSON export, for Perfetto, chrome://tracing and Holistic Trace Analysis.

The output is the Trace Event Format's JSON object form, written as a stream: a header, one event
per line, a trailer. Memory stays constant in the number of spans: each Arrow batch is formatted
by vectorized string kernels (``json_fragments.py``) into one buffer and written out before the
next is read.

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
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.export.exporter import ExportResult, check_batch
from gpu_trace.export.flows import FlowLinker
from gpu_trace.export.json_fragments import (
    attrs_fragment,
    combined,
    dictionary,
    dictionary_codes,
    dumps,
    int64,
    micros,
    plain,
    quote,
    uint64,
)
from gpu_trace.tracer.records import (
    CUDA_API,
    CUDA_SYNC,
    KERNEL,
    MARK,
    MEMCPY,
    MEMSET,
    MODULE,
    NVTX,
    OP,
    STEP,
    STEP_LANE,
)
from gpu_trace.tracer.trace_format import FORWARD_SPAN, RESERVED_ARGS

log = logging.getLogger(__name__)

Progress = Callable[[int, "int | None"], None]

#: Our categories as Kineto names them (what HTA and Perfetto's PyTorch views expect).
KINETO_CATEGORIES = {
    OP: "cpu_op",
    MODULE: "python_function",
    NVTX: "user_annotation",
    STEP: "user_annotation",
    KERNEL: "kernel",
    MEMCPY: "gpu_memcpy",
    MEMSET: "gpu_memset",
    CUDA_API: "cuda_runtime",  # "cuda_driver" for a call whose attribute api is "driver"
    CUDA_SYNC: "cuda_sync",
}
#: Device work: in the Kineto dialect, the flow from its launching call is an ``ac2g`` arrow.
DEVICE_CATEGORIES = (KERNEL, MEMCPY, MEMSET)
#: First synthetic tid (lane tracks) and pid (counter processes, renumbered pids). Linux pids and
#: tids stay below 2**22, so these never meet a real one; both stay below 2**31 for old viewers.
SYNTHETIC_BASE = 1 << 30
#: Kineto argument names HTA reads as integers: attributes with these names and an integer value
#: are written as JSON numbers (everything else stays a string, as recorded).
INT_ARGS = ("correlation", "External id", "Sequence number", "Fwd thread id", "Ev Idx", "cbid")
#: More of Kineto's numeric arguments, written as JSON numbers in the Kineto dialect as
#: PyTorch's profiler writes them (HTA reads them as numbers): integers, numbers, integer lists.
KINETO_INT_ARGS = (
    *INT_ARGS,
    "context",
    "bytes",
    "registers per thread",
    "shared memory",
    "static shared memory",
    "dynamic shared memory",
    "queued",
    "est. achieved occupancy %",
    "wait_on_stream",
    "wait_on_cuda_event_record_corr_id",
    "Record function id",
)
KINETO_NUMBER_ARGS = ("memory bandwidth (GB/s)", "blocks per SM", "warps per SM")
KINETO_LIST_ARGS = ("grid", "block")
#: Rows formatted at a time; bounds the exporter's memory whatever the batch size.
CHUNK_ROWS = 1 << 14

_GPU_LANE = re.compile(r"^gpu(\d+)/stream(\d+)$")
#: A device lane, or the lane of a GPU annotation on one stream (imported traces).
_DEVICE_TRACK = re.compile(r"^gpu(\d+)/stream(\d+)(/annotations)?$")


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

        self._hosts: dict[str, int] = {}
        self._lanes: dict[str, int] = {}
        self._lane_names: list[str] = []
        self._pids: dict[tuple[str, int], int] = {}
        self._used_pids: set[int] = set()
        self._used_tids: set[int] = set()
        self._threads: dict[tuple[int, int], tuple[int, int]] = {}  # (cpid, tid) -> (rank, lanes)
        self._tracks: dict[tuple[int, int, int, int], tuple[int, int, str, str]] = {}
        self._counter_pids: dict[str, int] = {}
        self._device_pids: dict[tuple[str, int], int] = {}
        self._device_streams: set[tuple[int, int]] = set()
        self._next_pid = SYNTHETIC_BASE
        self._next_tid = SYNTHETIC_BASE
        #: What each Chrome process and thread track stands for, for the trailer: the recorded
        #: host, pid and tid behind renumbered pids and synthetic tids (``gpu-trace import``).
        self._process_rows: list[dict[str, str | int | bool]] = []
        self._track_rows: list[dict[str, int]] = []
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
        self._write_header(world_size)

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

        cpid, ctid, track_frag, lane_frag = self._track_columns(batch)
        device_rows = np.zeros(n, dtype=bool)
        if self._kineto:
            lane_codes, lane_dict = dictionary(batch["lane"])
            on_device = [bool(_GPU_LANE.match(x or "")) for x in lane_dict.to_pylist()]
            device_rows = np.array(on_device or [False])[lane_codes]
        cat_codes, cat_dict = dictionary(batch["category"])
        cat_names = cat_dict.to_pylist()
        is_mark_cat = np.array([c == MARK for c in cat_names], dtype=bool)
        is_mark = is_mark_cat[cat_codes] if len(cat_names) else np.zeros(n, dtype=bool)
        shown = [KINETO_CATEGORIES.get(c, c) if self._kineto else c for c in cat_names]
        cat_json = pa.array([dumps(c) for c in shown], pa.string()).take(pa.array(cat_codes))
        if self._kineto:
            cat_json = _kineto_rows(batch, cat_names, cat_codes, cat_json)
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
                _without_lane_args(batch, device_rows) if self._kineto else batch["attrs"],
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
            backward_of = _forward_spans(batch)
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
            [f'"pid":{self._counter_pid(h or "")},"tid":0' for h in hosts], pa.string()
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
            self._write_trailer()
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

    # ---- header, trailer, metadata events -----------------------------------------------------

    def _write_header(self, world_size: int) -> None:
        # One key per line, "rank" first with a space after the colon: HTA finds a file's rank
        # with the regex '"rank":\s+(\d+)' over the first lines of the file.
        head = (
            "{\n"
            f'"distributedInfo": {{"rank": {self.rank}, "world_size": {world_size}'
            + (f', "backend": {dumps(self.backend)}' if self.backend else "")
            + "},\n"
            '"schemaVersion": 1,\n'
            '"displayTimeUnit": "ns",\n'
            f'"deviceProperties": {self._device_properties()},\n'
            f'"traceName": {dumps(str(self.run.get("run_id", "")))},\n'
            '"traceEvents": [\n'
        )
        self._put(head.encode())

    def _device_properties(self) -> str:
        """The run's GPUs as Kineto lists them: the ``device_properties`` attribute (what an
        imported trace had), else the names NVML gave a recorded run (``gpus``:
        ``gpu0=NVIDIA H100 80GB HBM3,...``) as ``{"id", "name"}``; ``[]`` without either. HTA
        reads the GPUs' properties from here."""
        attrs = self.run.get("attrs") or {}
        if isinstance(attrs, list):
            attrs = dict(attrs)
        try:
            props = json.loads(attrs.get("device_properties", "[]"))
        except (TypeError, ValueError):
            props = []
        if not props and attrs.get("gpus"):
            for entry in str(attrs["gpus"]).split(","):
                key, _, name = entry.partition("=")
                index = key.strip().removeprefix("gpu")
                if index.isdigit() and name:
                    props.append({"id": int(index), "name": name.strip()})
        return dumps(props if isinstance(props, list) else [])

    def _write_trailer(self) -> None:
        base = self.base_ns if self.base_ns is not None else 0
        info = {
            "run_id": self.run.get("run_id", ""),
            "trace_id": self.run.get("trace_id", ""),
            "command": self.run.get("command", ""),
            "hosts": list(self.run.get("hosts") or []),
            "status": self.run.get("status", ""),
            "time_base_ns": base,
            "time_base": "ts 0 is time_base_ns on the run's reference clock (CLOCK_MONOTONIC ns)",
            "ts_unit": "us",
            "spans": self.stats["spans"],
            "marks": self.stats["marks"],
            "counters": self.stats["counters"],
            "flows": self.stats["flows"],
            "flow_window": self.flow_window,
            "complete": self.stats["complete"],
        }
        attrs = self.run.get("attrs") or {}
        if isinstance(attrs, list):  # a map as the store may return it: (key, value) pairs
            attrs = dict(attrs)
        # What `gpu-trace import` needs to store the run again as it was (docs/import.md).
        info.update(
            {
                "categories": "kineto" if self._kineto else "native",
                "started_ns": _int_or_zero(self.run.get("started_ns")),
                "ended_ns": _int_or_zero(self.run.get("ended_ns")),
                "attrs": {str(k): str(v) for k, v in attrs.items()},
                "threads": self._thread_rows,
                "processes": self._process_rows,
                "tracks": self._track_rows,
            }
        )
        tail = f'\n],\n"gpu_trace": {dumps(info)}'
        try:
            wall = base - int(attrs["anchor_mono_ns"]) + int(attrs["anchor_wall_ns"])
            tail += f',\n"baseTimeNanoseconds": {wall}'
        except (KeyError, TypeError, ValueError):
            pass
        self._put((tail + "\n}\n").encode())

    def _meta(self, name: str, pid: int, tid: int | None, args: dict[str, Any]) -> str:
        # Process-wide events carry tid 0 as Kineto's do: a missing tid turns HTA's tid column
        # into floats.
        return f',\n{{"ph":"M","name":"{name}","pid":{pid},"tid":{tid or 0},"args":{dumps(args)}}}'

    def _process(self, host: str, pid: int) -> int:
        key = (host, pid)
        cpid = self._pids.get(key)
        if cpid is not None:
            return cpid
        cpid = pid
        if cpid in self._used_pids or not 0 < cpid < SYNTHETIC_BASE:
            cpid = self._new_pid()
        self._used_pids.add(cpid)
        self._pids[key] = cpid
        self._process_rows.append({"chrome_pid": cpid, "host": host, "pid": pid})
        meta = self._meta(
            "process_name", cpid, None, {"name": self._process_label(host, pid, cpid)}
        )
        meta += self._meta("process_sort_index", cpid, None, {"sort_index": len(self._pids)})
        self._put_meta(meta, 2)
        self.stats["processes"] += 1
        return cpid

    def _process_label(self, host: str, pid: int, cpid: int) -> str:
        """A process's name as a viewer shows it: Perfetto and chrome://tracing put the Chrome
        pid after it themselves, so the recorded pid is in the name only where the Chrome pid is
        not it (a pid another host took first)."""
        parts = [host, self._process_names.get((host, pid), "")]
        if cpid != pid:
            parts.append(f"(pid {pid})")
        return " ".join(p for p in parts if p) or "process"

    def _new_pid(self) -> int:
        while self._next_pid in self._used_pids:
            self._next_pid += 1
        self._next_pid += 1
        return self._next_pid - 1

    def _counter_pid(self, host: str) -> int:
        """The Chrome process a host's counters sit under (Perfetto and chrome://tracing draw a
        counter event as a track of its pid's process): the host's first process in this file,
        else its first in the threads rows; only a host without either gets a process of its
        own, ``<host> counters`` on a synthetic pid."""
        cpid = self._counter_pids.get(host)
        if cpid is not None:
            return cpid
        pid = next((p for h, p in self._pids if h == host), None)
        if pid is None:
            pid = next((int(t["pid"]) for t in self._thread_rows if t["host"] == host), None)
        if pid is not None:
            cpid = self._counter_pids[host] = self._process(host, pid)
            return cpid
        cpid = self._counter_pids[host] = self._new_pid()
        self._used_pids.add(cpid)
        self._process_rows.append({"chrome_pid": cpid, "host": host, "counters": True})
        label = f"{host} counters" if host else "counters"
        meta = self._meta("process_name", cpid, None, {"name": label})
        meta += self._meta("process_sort_index", cpid, None, {"sort_index": 1 << 20})
        self._put_meta(meta, 2)
        self.stats["processes"] += 1
        return cpid

    def _track(self, host: int, pid: int, tid: int, lane: int) -> tuple[int, int, str, str]:
        """Chrome pid and tid of one lane of one thread, announcing it the first time."""
        key = (host, pid, tid, lane)
        found = self._tracks.get(key)
        if found is not None:
            return found
        host_name = next(h for h, i in self._hosts.items() if i == host)
        lane_name = self._lane_names[lane]
        device = _DEVICE_TRACK.match(lane_name) if self._kineto else None
        if device is not None:
            found = self._tracks[key] = self._device_track(host_name, device)
            return found
        cpid = self._process(host_name, pid)
        rank, lanes = self._threads.get(
            (cpid, tid), (sum(1 for c, _ in self._threads if c == cpid), 0)
        )
        self._threads[(cpid, tid)] = (rank, lanes + 1)
        if lane_name == STEP_LANE and 0 < tid < SYNTHETIC_BASE and tid not in self._used_tids:
            ctid, order = tid, 0
        else:
            while self._next_tid in self._used_tids:
                self._next_tid += 1
            ctid, order = self._next_tid, lanes + 1
        self._used_tids.add(ctid)
        self._track_rows.append({"chrome_pid": cpid, "chrome_tid": ctid, "tid": tid})
        base = self._thread_names.get((host_name, pid, tid)) or f"thread {tid}"
        meta = self._meta("thread_name", cpid, ctid, {"name": f"{base} · {lane_name}"})
        meta += self._meta("thread_sort_index", cpid, ctid, {"sort_index": rank * 1024 + order})
        self._put_meta(meta, 2)
        self.stats["tracks"] += 1
        lane_args = f',"lane":{dumps(lane_name)}'
        m = _GPU_LANE.match(lane_name)
        if m:
            lane_args += f',"device":{int(m.group(1))},"stream":{int(m.group(2))}'
        found = self._tracks[key] = (cpid, ctid, f'"pid":{cpid},"tid":{ctid}', lane_args)
        return found

    def _device_track(self, host: str, m: re.Match[str]) -> tuple[int, int, str, str]:
        """Kineto's place for device work: pid the device, tid the stream (a renumbered pid when
        the device's number is taken), one process per device and host."""
        dev, stream = int(m.group(1)), int(m.group(2))
        cpid = self._device_pids.get((host, dev))
        if cpid is None:
            cpid = dev if dev not in self._used_pids and dev < SYNTHETIC_BASE else self._new_pid()
            self._used_pids.add(cpid)
            self._device_pids[(host, dev)] = cpid
            self._process_rows.append({"chrome_pid": cpid, "host": host, "device": dev})
            label = f"{host} GPU {dev}" if host else f"GPU {dev}"
            meta = self._meta("process_name", cpid, None, {"name": label})
            meta += self._meta("process_sort_index", cpid, None, {"sort_index": 1 << 19})
            self._put_meta(meta, 2)
            self.stats["processes"] += 1
        if (cpid, stream) not in self._device_streams:
            self._device_streams.add((cpid, stream))
            meta = self._meta("thread_name", cpid, stream, {"name": f"stream {stream}"})
            meta += self._meta("thread_sort_index", cpid, stream, {"sort_index": stream})
            self._put_meta(meta, 2)
            self.stats["tracks"] += 1
        lane_args = f',"lane":{dumps(m.string)}'
        if not m.group(3):  # Kineto's GPU annotations carry neither
            lane_args += f',"device":{dev},"stream":{stream}'
        return cpid, stream, f'"pid":{cpid},"tid":{stream}', lane_args

    def _track_columns(self, batch: pa.Table) -> tuple[np.ndarray, np.ndarray, pa.Array, pa.Array]:
        """Per row: Chrome pid, Chrome tid, the ``"pid":..,"tid":..`` and lane args fragments."""
        host_codes, host_dict = dictionary(batch["host"])
        host_map = np.array(
            [self._hosts.setdefault(h or "", len(self._hosts)) for h in host_dict.to_pylist()]
            or [0],
            dtype=np.int64,
        )
        lane_codes, lane_dict = dictionary(batch["lane"])
        lane_ids = []
        for lane in lane_dict.to_pylist():
            lane = lane or ""
            if lane not in self._lanes:
                self._lanes[lane] = len(self._lane_names)
                self._lane_names.append(lane)
            lane_ids.append(self._lanes[lane])
        lane_map = np.array(lane_ids or [0], dtype=np.int64)
        # Distinct (host, pid, tid, lane) by hashing, not sorting: one mixed-radix code per row.
        parts = [host_map[host_codes], lane_map[lane_codes]]
        values = []
        for col in (int64(batch["pid"]), uint64(batch["tid"]).view(np.int64)):
            codes, uniq = dictionary_codes(col)
            parts.append(codes)
            values.append(uniq)
        radix = [len(self._hosts), len(self._lane_names), len(values[0]), len(values[1])]
        code = np.zeros(batch.num_rows, dtype=np.int64)
        for part, r in zip(parts, radix, strict=True):
            code = code * r + part
        inverse, combos = dictionary_codes(code)
        tracks = []
        for c in combos.tolist():
            c, t = divmod(c, radix[3])
            c, p = divmod(c, radix[2])
            h, ln = divmod(c, radix[1])
            tid = int(np.int64(values[1][t]).view(np.uint64))
            tracks.append(self._track(int(h), int(values[0][p]), tid, int(ln)))
        cpid = np.array([t[0] for t in tracks], dtype=np.int64)[inverse]
        ctid = np.array([t[1] for t in tracks], dtype=np.int64)[inverse]
        idx = pa.array(inverse.astype(np.int32))
        track_frag = pa.array([t[2] for t in tracks], pa.string()).take(idx)
        lane_frag = pa.array([t[3] for t in tracks], pa.string()).take(idx)
        return cpid, ctid, track_frag, lane_frag

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


def _kineto_rows(
    batch: pa.Table, cat_names: list[str], cat_codes: np.ndarray, cat_json: pa.Array
) -> pa.Array:
    """Kineto's category where ours depends on the row: ``cuda_driver`` for a driver call (its
    ``api`` attribute says ``driver``, as an imported trace's do; without one, its name is the
    driver's ``cu*``, not the runtime's ``cuda*``), ``gpu_user_annotation`` for a range on a
    stream's annotation lane (an imported trace's)."""
    if CUDA_API in cat_names:
        is_api = cat_codes == cat_names.index(CUDA_API)
        api = pc.fill_null(pc.map_lookup(_attr_map(batch["attrs"]), "api", "first"), "")
        name = plain(batch["name"])
        named_driver = pc.and_(pc.starts_with(name, "cu"), pc.invert(pc.starts_with(name, "cuda")))
        driver_rows = pc.or_(pc.equal(api, "driver"), pc.and_(pc.equal(api, ""), named_driver))
        driver = is_api & np.asarray(pc.fill_null(driver_rows, False), dtype=bool)
        if driver.any():
            cat_json = pc.if_else(pa.array(driver), '"cuda_driver"', cat_json)
    if NVTX in cat_names:
        lane_codes, lane_dict = dictionary(batch["lane"])
        on_stream = np.array(
            [bool(_DEVICE_TRACK.match(x or "")) for x in lane_dict.to_pylist()] or [False]
        )
        rows = on_stream[lane_codes] & (cat_codes == cat_names.index(NVTX))
        if rows.any():
            cat_json = pc.if_else(pa.array(rows), '"gpu_user_annotation"', cat_json)
    return cat_json


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
    pairs = attrs_fragment(_attr_map(batch["labels"]))
    if isinstance(pairs, str):
        return ""
    text = pc.binary_join_element_wise(',"labels":{', pc.utf8_slice_codeunits(pairs, 1), "}", "")
    return pc.if_else(pc.equal(pairs, ""), "", text)


def _int_or_zero(value: object) -> int:
    """A run's time as an integer (a store's number, or its text); 0 where it has none."""
    if isinstance(value, (int, np.integer, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            return int(value)
    return 0


def _forward_spans(batch: pa.Table) -> np.ndarray | None:
    """Per row, the span id in the ``forward span`` attribute (a backward op's forward op, in an
    imported trace), 0 where there is none; None when no row has one."""
    value = pc.map_lookup(_attr_map(batch["attrs"]), FORWARD_SPAN, "first")
    if value.null_count == len(value):
        return None
    ok = pc.fill_null(pc.match_substring_regex(value, r"^[0-9]{1,19}$"), False)
    ids = pc.cast(pc.if_else(ok, value, "0"), pa.uint64())
    return np.asarray(ids, dtype=np.uint64)


def _attr_map(col: pa.Array | pa.ChunkedArray) -> pa.MapArray:
    attrs = combined(col)
    if isinstance(attrs, pa.MapArray):
        return attrs
    # (key, value) structs, as some reads give a map
    return pa.MapArray.from_arrays(attrs.offsets, attrs.values.field(0), attrs.values.field(1))


def _without_lane_args(batch: pa.Table, device_rows: np.ndarray) -> pa.Array:
    """The attrs of ``batch`` less ``device`` and ``stream`` on the rows of device lanes, where
    the exporter writes both from the lane (Kineto writes each once, as a number)."""
    attrs = _attr_map(batch["attrs"])
    if not device_rows.any():
        return attrs
    offsets = np.asarray(attrs.offsets, np.int64)
    lo, hi = int(offsets[0]), int(offsets[-1])  # a slice's keys and items are not sliced
    offsets = offsets - lo
    keys = plain(attrs.keys.slice(lo, hi - lo))
    items = plain(attrs.items.slice(lo, hi - lo))
    row = np.repeat(np.arange(len(attrs)), np.diff(offsets))
    drop = np.asarray(pc.is_in(keys, pa.array(["device", "stream"])), dtype=bool) & device_rows[row]
    if not drop.any():
        return attrs
    keep = pa.array(~drop)
    counts = np.bincount(row[~drop], minlength=len(attrs))
    new_offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    return pa.MapArray.from_arrays(pa.array(new_offsets), keys.filter(keep), items.filter(keep))


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


def write_rank_traces(
    directory: str | os.PathLike[str],
    run: dict[str, object],
    threads: Iterable[dict[str, object]],
    rank_pids: dict[int, set[tuple[str, int]]],
    span_batches: Iterable[pa.Table],
    counter_batches: Iterable[pa.Table] = (),
    *,
    world_size: int | None = None,
    backend: str = "",
    suffix: str = ".json",
) -> dict[int, dict[str, object]]:
    """Write one Chrome trace per rank into ``directory``, ``rank-<N><suffix>``, as HTA reads a
    multi-rank trace (a directory of files, each with ``distributedInfo``); returns each rank's
    stats. ``rank_pids`` gives each rank's processes as (host, pid); a rank's file holds their
    spans and its hosts' counters. Spans of processes without a rank (the launcher's) are in no
    file. One pass over the batches."""
    import pyarrow.compute as pc

    out = Path(directory)
    world = world_size if world_size is not None else max(rank_pids, default=-1) + 1
    thread_rows = list(threads)
    exporters: dict[int, ChromeTraceExporter] = {}
    keys: dict[int, pa.Array] = {}
    hosts: dict[int, pa.Array] = {}
    for rank, pids in sorted(rank_pids.items()):
        mine = [
            t for t in thread_rows if (str(t.get("host", "")), int(str(t.get("pid", 0)))) in pids
        ]
        exporters[rank] = ChromeTraceExporter(
            out / f"rank-{rank}{suffix}",
            run=run,
            threads=mine,
            rank=rank,
            world_size=world,
            backend=backend,
        )
        keys[rank] = pa.array(sorted(f"{h}\x00{p}" for h, p in pids))
        hosts[rank] = pa.array(sorted({h for h, _ in pids}))
    ok = False
    try:
        for batch in span_batches:
            key = pc.binary_join_element_wise(
                pc.cast(batch["host"], pa.string()), pc.cast(batch["pid"], pa.string()), "\x00"
            )
            for rank, exporter in exporters.items():
                part = batch.filter(pc.is_in(key, value_set=keys[rank]))
                if part.num_rows:
                    exporter.write_spans(part)
        for batch in counter_batches:
            host = pc.cast(batch["host"], pa.string())
            for rank, exporter in exporters.items():
                part = batch.filter(pc.is_in(host, value_set=hosts[rank]))
                if part.num_rows:
                    exporter.write_counters(part)
        ok = True
    finally:
        stats = {rank: exporter.close(complete=ok) for rank, exporter in exporters.items()}
    return stats
