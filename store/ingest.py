"""Ingest: a run directory's spool files, stats and run.json into the store.

Ingest reads the spool and decides what goes in: each file's table in the store's column order,
with ``run_id``, ``trace_id`` and ``host`` added from its metadata, damaged batches and
impossible rows left out and named in the report. How the rows go in, batched and logged in
``ingest_log`` so that ingest is idempotent (a file logged ``done`` is skipped the next time, a
file found ``pending`` is inserted again without the rows already there), is the inserter's
(:mod:`gpu_trace.store.inserter`). Clock samples are always matched against the stored ones (a
forwarding client and a server writing to a shared store both write them).

Spool files whose metadata names a ``clock_peer`` (a forwarding server's spans and counters), and
a job's part recorded on another host, hold that host's raw times: they are ingested last, mapped
onto the run's clock (:mod:`gpu_trace.store.clock_mapping`).

A run directory whose ``run.json`` says ``side: server`` is a server's part of a client's run:
its ``runs`` row only adds its host to the client's row when that is already stored.

Ingest never changes the spool: when the store fails, :class:`~gpu_trace.store.client.StoreError`
is raised and the same command can be run again. Before it reads the spool, the spool converters
(:func:`convert_spool`) turn raw files a layer above wrote (GPU activity) into spool files; a raw
file is removed only once its spool files are written, so that too can be run again.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from gpu_trace.store import jobs
from gpu_trace.store.clock_mapping import (
    CLOCK_PEER,
    JobPart,
    clock_models,
    collect_clock,
    job_clock_rows,
    map_clock,
)
from gpu_trace.store.inserter import Inserter, Pending, drop_present, logged_files, rows_per_batch
from gpu_trace.tracer import ranks
from gpu_trace.tracer.records import SCHEMAS
from gpu_trace.tracer.run import STATS_DIR, RunInfo, recorder_died
from gpu_trace.tracer.spool import SUFFIX, SpoolFile, list_spool, read_spool_file, spool_dir

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from gpu_trace.store.client import Store

log = logging.getLogger(__name__)

#: Columns the store adds to each kind from the spool file's metadata, in table order.
ADDED_COLUMNS = {
    "spans": ("run_id", "trace_id", "host"),
    "counters": ("run_id", "host"),
    "clock_sync": ("run_id", "host"),
}


@dataclass
class IngestReport:
    """What one ingest did."""

    run_id: str
    rows: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in SCHEMAS})
    files_ingested: int = 0
    files_skipped: int = 0
    #: Spool batches left out as damaged (checksum, unreadable, impossible values); never stored.
    batches_skipped: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rows_total(self) -> int:
        return sum(self.rows.values())

    def summary(self) -> str:
        """One line for the CLI."""
        parts = ", ".join(f"{n} {kind}" for kind, n in self.rows.items() if n)
        text = f"run {self.run_id}: {parts or 'no new rows'} from {self.files_ingested} files"
        if self.files_skipped:
            text += f" ({self.files_skipped} already ingested)"
        if self.batches_skipped:
            text += f"; {self.batches_skipped} damaged batch(es) skipped"
        if self.problems:
            text += f"; {len(self.problems)} problem(s)"
        return text


#: ``progress(phase, done, total)``: what an ingest tells of its work, a spool file at a time.
Progress = Callable[[str, int, "int | None"], None]


def ingest(store: Store, run_dir: str | Path, progress: Progress | None = None) -> IngestReport:
    """Ingest ``run_dir`` into ``store``; see the module docstring. Raises StoreError on store failure.
    ``progress`` is told of each spool file read (for a terminal's progress line).

    Ingest sits above the store and uses only its public methods; the store never imports it.
    """
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    if not RunInfo.exists(run_dir) and not spool_dir(run_dir).is_dir():
        raise ValueError(f"{run_dir} is not a run directory (no run.json and no spool/)")
    converted = convert_spool(run_dir)
    files = list_spool(run_dir)
    info, info_problem = _run_info(run_dir, files)
    report = IngestReport(info.run_id)
    report.problems.extend(converted)
    if info_problem:
        report.problems.append(info_problem)
    died = recorder_died(info)
    if died:  # nobody is left to close the run: it is stored closed, as died, with the reason
        info.status, info.attrs["reason"] = "died", died
        report.problems.append(f"run.json: {died}; the run is marked died")
    logged = logged_files(store, info.run_id)
    # One part of a job: the job's run as stored before it (store/jobs.py).
    job = JobPart.of(info, _stored_run(store, info.run_id)) if jobs.is_part(info) else None
    with Inserter(store, info.run_id, report) as inserter:
        hosts, pid_hosts = _ingest_files(
            store, files, info, logged, inserter, report, progress, job
        )

    stats = _read_stats(run_dir, report)
    info.hosts = hosts
    info.attrs = {
        **info.attrs,
        "events": str(sum(int(s.get("events", 0)) for s in stats)),
        "dropped": str(sum(int(s.get("dropped", 0)) for s in stats)),
        "processes": str(len(stats)),
    }
    if report.batches_skipped:
        info.attrs["damaged_batches"] = str(report.batches_skipped)
    _write_threads(store, info, stats, pid_hosts, ranks.read(run_dir))
    stored = _stored_run(store, info.run_id)
    if job is not None:  # one part of a job: merged into the job's run (store/jobs.py)
        if job.clock is None and job.peer:
            report.problems.append(f"{job.peer}: times not mapped onto the run's clock (no anchor)")
        info = jobs.merge(stored, info, job.clock)
    elif stored is not None:
        info.hosts = list(dict.fromkeys([*stored.hosts, *info.hosts]))
        if info.attrs.get("side") == "server":  # the client's row stays, with our host added
            stored.hosts = info.hosts
            info = stored
    store.upsert_run(info)
    report.seconds = time.perf_counter() - t0
    log.info("gpu-trace: ingested %s in %.2f s", report.summary(), report.seconds)
    return report


#: Entry point group of spool converters: ``fn(run_dir) -> list[str]`` turns raw files that a
#: layer above this one writes into the spool directory (GPU activity, ``collectors/gpu_activity``:
#: ``gpu_activity-*.bin``) into spool files, and returns one line per problem. Found by name, so
#: ingest imports nothing above. They run only when the spool directory holds a file that is not a
#: spool file (a name not ending ``.arrow``, temporaries aside): loading them costs a fresh process
#: about 30 ms.
CONVERTERS = "gpu_trace.spool_converters"


@functools.cache
def _converters() -> tuple[EntryPoint, ...]:
    """The installed spool converters, looked up once per process (a lookup reads every installed
    package's entry points: about 10 ms)."""
    return tuple(entry_points(group=CONVERTERS))


def convert_spool(run_dir: Path) -> list[str]:
    """Run every spool converter on ``run_dir``; a failing one is a problem line, not an error."""
    problems: list[str] = []
    spool = spool_dir(run_dir)
    if not spool.is_dir() or all(
        p.suffix == SUFFIX or p.name.startswith(".") for p in spool.iterdir()
    ):
        return problems  # nothing raw to convert
    for ep in _converters():
        try:
            problems.extend(ep.load()(run_dir))
        except Exception as exc:  # a converter's bug must not lose the rest of the run
            log.warning("gpu-trace: spool converter %s failed", ep.name, exc_info=True)
            problems.append(f"spool converter {ep.name} failed: {exc}")
    return problems


def _ingest_files(
    store: Store,
    files: list[Path],
    info: RunInfo,
    logged: dict[tuple[str, int], str],
    inserter: Inserter,
    report: IngestReport,
    progress: Progress | None = None,
    job: JobPart | None = None,
) -> tuple[list[str], dict[int, str]]:
    pending = {kind: Pending() for kind in SCHEMAS}
    batch_rows = rows_per_batch(
        [p for p in files if logged.get((p.name, p.stat().st_size)) != "done"]
    )
    hosts: list[str] = list(info.hosts)
    pid_hosts: dict[int, str] = {}
    clock_rows: dict[str, set[tuple[int, int, int]]] = {}
    deferred: list[tuple[Path, int, str | None, SpoolFile]] = []

    def add(path: Path, size: int, state: str | None, spool: SpoolFile, models: Any) -> None:
        kind = spool.kind
        host = spool.meta.get("host") or (info.hosts[0] if info.hosts else "")
        if host and host not in hosts:
            hosts.append(host)
        if spool.meta.get("pid", "").isdigit():
            pid_hosts.setdefault(int(spool.meta["pid"]), host)
        table, problem = _prepare(kind, spool.table, spool.meta, info, host)
        if spool.problem:
            problem = spool.problem if problem is None else f"{spool.problem}; {problem}"
        if table is not None and models is not None:
            peer = spool.meta.get(CLOCK_PEER) or (job.peer if job is not None else "")
            table, note = map_clock(kind, table, models.get(peer), peer)
            problem = note if problem is None else f"{problem}; {note}" if note else problem
        kept = table.num_rows if table is not None else 0
        report.batches_skipped += spool.skipped_batches
        if problem:
            # Damaged batches and impossible rows are named in ``problem`` (batch index and reason);
            # a bad tail is "the rest".
            how = ", " if spool.notes else ", skipped the rest: "
            report.problems.append(f"{path.name}: kept {kept} rows{how}{problem}")
            # Info, not a warning: the report carries it, and the CLI prints the report once.
            log.info("gpu-trace: %s: kept %d rows%s%s", path, kept, how, problem)
        if table is not None and kept and (state is not None or kind == "clock_sync"):
            # Logged but not done: an earlier ingest stopped between its insert and its log entry.
            # Clock samples may come twice (a client and a server with a shared store both
            # write them): the ones already stored are left out.
            table = drop_present(store, kind, table)
        batch = pending[kind]
        batch.files.append((path.name, size, kept, problem or ""))
        if table is not None and table.num_rows:
            batch.tables.append(table)
            batch.rows += table.num_rows
        if batch.rows >= batch_rows[kind]:
            inserter.submit(kind, batch)
            pending[kind] = Pending()

    for done, path in enumerate(files):
        if progress is not None:
            progress("ingesting spool files", done, len(files))
        size = path.stat().st_size
        state = logged.get((path.name, size))
        if state == "done":
            report.files_skipped += 1
            continue
        spool = read_spool_file(path)
        if spool.kind not in SCHEMAS:
            report.problems.append(f"{path.name}: skipped: unknown kind {spool.kind!r}")
            continue
        owner = spool.meta.get("run_id")
        if owner and owner != info.run_id:  # stored under its own id, no run would show it
            report.problems.append(
                f"{path.name}: not stored: its rows are run {owner}'s, this directory's run.json"
                f" is run {info.run_id} (a copied run directory? ingest the one it came from)"
            )
            continue
        on_peer = spool.meta.get(CLOCK_PEER) or (job is not None and job.peer)
        if on_peer and spool.kind in ("spans", "counters"):
            deferred.append((path, size, state, spool))  # mapped once every clock row is known
            continue
        if spool.kind == "clock_sync" and spool.table is not None:
            collect_clock(spool.table, clock_rows)
        add(path, size, state, spool, None)
    if deferred:
        if job is not None and job.peer:
            spans = [
                s.table for _, _, _, s in deferred if s.kind == "spans" and s.table is not None
            ]
            run = jobs.stored_collectives(store, info.run_id)
            job.clock = jobs.part_clock(run, job.stored, info, spans)
            if job.clock is not None:
                samples = job.clock.samples(info.started_ns, max(info.ended_ns, info.started_ns))
                clock_rows.setdefault(job.peer, set()).update(samples)
                pending["clock_sync"].tables.append(job_clock_rows(info, job.clock, samples))
                pending["clock_sync"].rows += len(samples)
        models = clock_models(store, info.run_id, clock_rows)
        for path, size, state, spool in deferred:
            add(path, size, state, spool, models)
    if progress is not None:
        progress(f"storing the last of {len(files):,} spool files", 0, None)
    for kind, batch in pending.items():
        if batch.files or batch.tables:
            inserter.submit(kind, batch)
    return hosts, pid_hosts


# ---- run.json, stats, threads --------------------------------------------------------------------


def _run_info(run_dir: Path, files: list[Path]) -> tuple[RunInfo, str | None]:
    if RunInfo.exists(run_dir):
        try:
            return RunInfo.load(run_dir), None
        except (OSError, ValueError, TypeError) as exc:
            problem = f"run.json: unreadable ({exc}); run identity taken from the spool"
    else:
        problem = "run.json: missing; run identity taken from the spool"
    meta: dict[str, str] = {}
    for path in files[:1]:
        meta = read_spool_file(path).meta
    info = RunInfo(
        run_id=meta.get("run_id") or run_dir.name,
        trace_id=meta.get("trace_id", ""),
        started_ns=0,
        hosts=[meta["host"]] if meta.get("host") else [],
        status="unknown",
    )
    return info, problem


def _stored_run(store: Store, run_id: str) -> RunInfo | None:
    result = store.query(
        "SELECT trace_id, started_ns, ended_ns, command, hosts, status, attrs"
        " FROM __db__.runs FINAL WHERE run_id = {run_id:String}",
        {"run_id": run_id},
    )
    if not result.result_rows:
        return None
    trace_id, started, ended, command, hosts, status, attrs = result.result_rows[0]
    return RunInfo(
        run_id, trace_id, int(started), int(ended), command, list(hosts), status, dict(attrs)
    )


def _read_stats(run_dir: Path, report: IngestReport) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    d = run_dir / STATS_DIR
    if not d.is_dir():
        return out
    for path in sorted(d.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
            out.append(data)
        except (OSError, ValueError) as exc:
            report.problems.append(f"stats/{path.name}: skipped: {exc}")
    return out


def _write_threads(
    store: Store,
    info: RunInfo,
    stats: list[dict[str, Any]],
    pid_hosts: dict[int, str],
    facts: dict[int, dict[str, str]],
) -> None:
    """One row per thread of each recording process, carrying its process's rank facts
    (``ranks/<pid>.json``: tracer/ranks.py) if it has any."""
    default_host = info.hosts[0] if info.hosts else ""
    now = time.time_ns()
    rows = []
    for s in stats:
        try:
            pid = int(s["pid"])
        except (KeyError, TypeError, ValueError):
            continue
        host = pid_hosts.get(pid, default_host)
        for tid, name in (s.get("threads") or {}).items():
            if str(tid).isdigit():
                rows.append(
                    [
                        info.run_id,
                        host,
                        pid,
                        int(tid),
                        str(s.get("process_name", "")),
                        str(name),
                        now,
                        facts.get(pid, {}),
                    ]
                )
    store.insert_rows(
        "threads",
        [
            "run_id",
            "host",
            "pid",
            "tid",
            "process_name",
            "thread_name",
            "updated_ns",
            "process_attrs",
        ],  # fmt: skip
        rows,
    )


# ---- spool tables --------------------------------------------------------------------------------


def _constant(value: str, n: int) -> pa.Array:
    return pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(n, dtype=np.int32)), pa.array([value], pa.string())
    )


def _prepare(
    kind: str, table: pa.Table | None, meta: dict[str, str], info: RunInfo, host: str
) -> tuple[pa.Table | None, str | None]:
    """The spool table in the store's column order, with run_id, trace_id and host added."""
    if table is None or table.num_rows == 0:
        return None, None
    schema = SCHEMAS[kind]
    n = table.num_rows
    columns: list[pa.ChunkedArray | pa.Array] = []
    names: list[str] = []
    missing = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            if col.type != f.type:
                try:
                    col = col.cast(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    return None, f"column {f.name} has type {col.type}, expected {f.type}: {exc}"
        else:
            missing.append(f.name)
            # Nulls become the column's default in ClickHouse (input_format_null_as_default).
            col = pa.nulls(n, pa.string() if pa.types.is_dictionary(f.type) else f.type)
        columns.append(col)
        names.append(f.name)
    added = {
        "run_id": meta.get("run_id") or info.run_id,
        "trace_id": meta.get("trace_id") or info.trace_id,
        "host": host,
    }
    for name in ADDED_COLUMNS[kind]:
        columns.append(_constant(added[name], n))
        names.append(name)
    problem = f"columns missing, stored as defaults: {', '.join(missing)}" if missing else None
    return pa.Table.from_arrays(columns, names=names), problem
