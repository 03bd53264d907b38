"""A run's raw GPU activity files become span spool files, before ingest reads the spool.

The injection library runs in processes that may have no Python (a C++ binary) and writes raw
records (``activity_file.py``); spans need the recorder's spans of the same run (an API call's
parent is the op or range open on its thread). Both are in the run directory once the program is
done, so the conversion runs there: ``store/ingest.py`` calls every ``gpu_trace.spool_converters``
entry point (this module's :func:`convert_run`) before it lists the spool, and every command that
ingests (``record``, ``ingest``, ``profile()``, the server's sink) gets it without knowing of it.

Each activity file becomes ``spans`` spool files of its process (the Arrow spool, with its
checksums), and is removed only once they are written: its records are then in the spool in the
form every reader knows, and a second ingest does not convert them twice. What the run should
show (records, drops, records without an API call, notes such as another profiler holding CUPTI)
goes into ``run.json``'s attrs as ``gpu_activity*``, and from there into ``gpu-trace show``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.collectors.gpu_activity import activity_file
from gpu_trace.collectors.gpu_activity.conversion import Conversion, Parents, convert
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolWriter, list_spool, read_spool_file, spool_dir

log = logging.getLogger(__name__)

_PID = re.compile(r"^gpu_activity-(\d+)-")
#: run.json attrs this module keeps (summed over processes and over repeated conversions).
COUNTS = ("gpu_activity_records", "gpu_activity_dropped", "gpu_activity_unmatched")


def convert_run(run_dir: str | Path) -> list[str]:
    """Convert ``run_dir``'s activity files; return one line per problem (nothing raises)."""
    run_dir = Path(run_dir)
    files = activity_file.activity_files(spool_dir(run_dir))
    if not files:
        return []
    problems: list[str] = []
    info = RunInfo.load(run_dir) if RunInfo.exists(run_dir) else None
    parents = _recorder_spans(run_dir, {_pid_of(f) for f in files})
    totals = dict.fromkeys(COUNTS, 0)
    notes: list[str] = []
    for path in files:
        try:
            conv, data = _convert_file(path, parents)
            problems.extend(data.problems)
            notes.extend(data.notes)
            _write(run_dir, info, path, conv)
            path.unlink()
        except (OSError, ValueError, pa.ArrowException) as exc:
            problems.append(f"{path.name}: GPU activity not converted ({exc}); the file is kept")
            continue
        totals["gpu_activity_records"] += sum(conv.counts.values())
        totals["gpu_activity_dropped"] += data.dropped
        totals["gpu_activity_unmatched"] += conv.unmatched
        if data.dropped:
            problems.append(
                f"{path.name}: CUPTI dropped {data.dropped} GPU activity records (buffers full)"
            )
    if info is not None:
        _update_run(run_dir, totals, notes)
    return [*dict.fromkeys(notes), *problems]  # what the library said (CUPTI missing...) first


def _pid_of(path: Path) -> int:
    m = _PID.match(path.name)
    return int(m[1]) if m else -1


def _convert_file(path: Path, parents: Parents) -> tuple[Conversion, activity_file.ActivityData]:
    data = activity_file.read([path])
    conv = convert(data.records, data.names, anchors=data.anchors, parents=parents)
    return conv, data


def _recorder_spans(run_dir: Path, pids: set[int]) -> Parents:
    """The run's own spans of those processes that can hold an API call."""
    tables = []
    for path in list_spool(run_dir):
        if not path.name.startswith("spans-") or _spool_pid(path) not in pids:
            continue
        spool = read_spool_file(path)
        if spool.table is not None and spool.table.num_rows:
            t = spool.table.select(
                [
                    "span_id",
                    "parent_span_id",
                    "pid",
                    "tid",
                    "lane",
                    "category",
                    "start_ns",
                    "end_ns",
                    "depth",
                ]
            )
            tables.append(t.cast(pa.schema([f.with_type(_plain(f.type)) for f in t.schema])))
    if not tables:
        return Parents.none()
    return Parents.from_table(pa.concat_tables(tables))


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _spool_pid(path: Path) -> int:
    parts = path.name.split("-")
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else -1


def _write(run_dir: Path, info: RunInfo | None, path: Path, conv: Conversion) -> None:
    table = conv.table
    if table.num_rows == 0:
        return
    pids = pc.unique(table.column("pid")).to_pylist()
    meta = {
        "run_id": info.run_id if info else "",
        "trace_id": info.trace_id if info else "",
        "host": info.hosts[0] if info and info.hosts else "",
        "clock": "CLOCK_MONOTONIC",
        "source": "gpu_activity",
    }
    for pid in pids:
        part = table.filter(pc.equal(table.column("pid"), pid)) if len(pids) > 1 else table
        SpoolWriter(run_dir, {**meta, "pid": str(pid)}).write("spans", part)


def _update_run(run_dir: Path, totals: dict[str, int], notes: list[str]) -> None:
    info = RunInfo.load(run_dir)
    for key, value in totals.items():
        info.attrs[key] = str(int(info.attrs.get(key, "0") or 0) + value)
    if notes:
        info.attrs["gpu_activity_note"] = "; ".join(dict.fromkeys(notes))
    info.save(run_dir)
