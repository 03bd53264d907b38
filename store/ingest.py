"""Ingest: a run directory's spool files, stats and run.json into the store.

Spool files go in as Arrow, batched across files (about :data:`BATCH_ROWS` rows per insert),
with ``run_id``, ``trace_id`` and ``host`` added from each file's metadata. Ingest is idempotent:

- every file is recorded in ``ingest_log`` by run id, file name and size; a file logged ``done``
  is skipped the next time;
- a batch is logged ``pending`` before its insert and ``done`` after it, so a file found
  ``pending`` (a crash between the two) is inserted again without the rows already there, matched
  by key (spans by pid and span id, counters by source, device, metric and time, clock samples by
  peer and time). Clock samples are always matched so (a forwarding client and a server writing
  to a shared store both write them).

Spool files whose metadata names a ``clock_peer`` (a forwarding server's spans and counters) hold
that host's raw times: they are ingested last, mapped onto the run's clock with a
:class:`~gpu_trace.tracer.clocksync.ClockModel` fitted to all the run's ``clock_sync`` rows for
that peer (stored and in this spool), keeping the raw times and the offset applied in attrs.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.store import jobs
from gpu_trace.tracer import ranks
from gpu_trace.tracer.clocksync import ClockModel
from gpu_trace.tracer.records import SCHEMAS
from gpu_trace.tracer.run import STATS_DIR, RunInfo, recorder_died
from gpu_trace.tracer.spool import (
    SUFFIX,
    SpoolFile,
    count_rows,
    list_spool,
    read_spool_file,
    spool_dir,
)

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from gpu_trace.store.client import InsertConnection, Store

log = logging.getLogger(__name__)

#: Most rows per insert: about one part of the engine's (``max_insert_block_size``, 1,048,449
#: rows). Each insert makes a part the engine merges later: smaller batches cost more CPU in all
#: (at 3M spans, 250k-row batches took 1.8x the CPU of 1M-row ones), but a kind with fewer rows
#: than this many inserts' worth is split so that its inserts run side by side (``_batch_rows``).
#: The rows are the spool files' own, memory-mapped, so a batch's memory is mostly the page
#: cache's.
BATCH_ROWS = 1_000_000
#: Inserts in flight at once, each on its own connection: the engine writes one batch while the
#: next is read and checked. At most this many batches are held in memory.
INSERT_WORKERS = 2

#: Spool metadata naming the host whose clock a file's times are on; ingest maps them onto the
#: run's clock with the run's ``clock_sync`` rows for that peer (forwarding servers' spans).
CLOCK_PEER = "clock_peer"
#: Clock samples are filtered per window of this many ns (lowest RTTs kept in each), as the
#: forwarding client does.
CLOCK_WINDOW_NS = 30_000_000_000

#: Columns the store adds to each kind from the spool file's metadata, in table order.
ADDED_COLUMNS = {
    "spans": ("run_id", "trace_id", "host"),
    "counters": ("run_id", "host"),
    "clock_sync": ("run_id", "host"),
}

#: What identifies a row already in the store, when a crashed ingest is resumed.
_KEYS = {
    "spans": (("pid", "span_id"), "start_ns"),
    "counters": (("source", "device", "metric", "ts_ns"), "ts_ns"),
    "clock_sync": (("peer", "ts_ns"), "ts_ns"),
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


#: ``ingest_log`` rows: file name, size, rows kept, problem ("" for none).
LogRow = tuple[str, int, int, str]


@dataclass
class _Pending:
    """Files read and waiting for one batched insert of one kind."""

    tables: list[pa.Table] = field(default_factory=list)
    files: list[LogRow] = field(default_factory=list)
    rows: int = 0


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
    logged = _logged(store, info.run_id)
    job = _JobPart.of(store, info)
    with _Inserter(store, info.run_id, report) as inserter:
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
    inserter: _Inserter,
    report: IngestReport,
    progress: Progress | None = None,
    job: _JobPart | None = None,
) -> tuple[list[str], dict[int, str]]:
    pending = {kind: _Pending() for kind in SCHEMAS}
    batch_rows = _batch_rows([p for p in files if logged.get((p.name, p.stat().st_size)) != "done"])
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
            table = _drop_present(store, kind, table)
        batch = pending[kind]
        batch.files.append((path.name, size, kept, problem or ""))
        if table is not None and table.num_rows:
            batch.tables.append(table)
            batch.rows += table.num_rows
        if batch.rows >= batch_rows[kind]:
            inserter.submit(kind, batch)
            pending[kind] = _Pending()

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
            _collect_clock(spool.table, clock_rows)
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
                pending["clock_sync"].tables.append(_job_clock_rows(info, job.clock, samples))
                pending["clock_sync"].rows += len(samples)
        models = _clock_models(store, info.run_id, clock_rows)
        for path, size, state, spool in deferred:
            add(path, size, state, spool, models)
    if progress is not None:
        progress(f"storing the last of {len(files):,} spool files", 0, None)
    for kind, batch in pending.items():
        if batch.files or batch.tables:
            inserter.submit(kind, batch)
    return hosts, pid_hosts


def _batch_rows(files: list[Path]) -> dict[str, int]:
    """Rows per insert of each kind: :data:`BATCH_ROWS`, or less so that a kind's rows make at
    least :data:`INSERT_WORKERS` inserts to run side by side (a million spans: two of 500k). The
    rows are counted from the files' batch headers (memory-mapped, not decoded)."""
    rows = dict.fromkeys(SCHEMAS, 0)
    for path in files:
        kind = path.name.split("-", 1)[0]
        if kind in rows:
            rows[kind] += count_rows(path) or 0
    return {kind: max(1, min(BATCH_ROWS, -(-n // INSERT_WORKERS))) for kind, n in rows.items()}


# ---- clocks of other hosts ----------------------------------------------------------------------


@dataclass
class _JobPart:
    """A run directory that is one part of a job, and the job's run as stored before it."""

    stored: RunInfo | None
    peer: str  # the part's host when its times need mapping onto the run's clock, else ""
    clock: jobs.PartClock | None = None

    @classmethod
    def of(cls, store: Store, info: RunInfo) -> _JobPart | None:
        if not jobs.is_part(info):
            return None
        stored = _stored_run(store, info.run_id)
        host = info.hosts[0] if info.hosts else ""
        other = stored is not None and bool(host) and host != jobs.clock_host(stored)
        return cls(stored, host if other else "")


def _job_clock_rows(
    info: RunInfo, clock: jobs.PartClock, samples: set[tuple[int, int, int]]
) -> pa.Table:
    """The part's offset as the run's ``clock_sync`` rows (``show`` and the dashboard list them):
    on the run's clock host, the part's host the peer."""
    rows = sorted(samples)
    n = len(rows)
    return pa.table(
        {
            "peer": pa.array([clock.host] * n, pa.string()),
            "ts_ns": pa.array([r[0] for r in rows], pa.int64()),
            "offset_ns": pa.array([r[1] for r in rows], pa.int64()),
            "rtt_ns": pa.array([r[2] for r in rows], pa.int64()),
            "uncertainty_ns": pa.array([r[2] // 2 for r in rows], pa.int64()),
            "run_id": pa.array([info.run_id] * n, pa.string()),
            "host": pa.array([clock.clock_host] * n, pa.string()),
        }
    )


def _collect_clock(table: pa.Table, rows: dict[str, set[tuple[int, int, int]]]) -> None:
    peers = table.column("peer").cast(pa.string()).to_pylist()
    ts, off, rtt = (table.column(c).to_pylist() for c in ("ts_ns", "offset_ns", "rtt_ns"))
    for peer, t, o, r in zip(peers, ts, off, rtt):
        rows.setdefault(peer or "", set()).add((int(t), int(o), int(r)))


def _clock_models(
    store: Store, run_id: str, rows: dict[str, set[tuple[int, int, int]]]
) -> dict[str, ClockModel]:
    """A clock model per peer from the run's ``clock_sync`` rows: stored ones and this ingest's."""
    stored = store.query(
        "SELECT peer, ts_ns, offset_ns, rtt_ns FROM __db__.clock_sync WHERE run_id = {run_id:String}",
        {"run_id": run_id},
    )
    for peer, t, o, r in stored.result_rows:
        rows.setdefault(peer, set()).add((int(t), int(o), int(r)))
    models = {}
    for peer, samples in rows.items():
        try:
            models[peer] = ClockModel.from_measurements(sorted(samples), window_ns=CLOCK_WINDOW_NS)
        except ValueError as exc:
            log.warning("gpu-trace: clock of %s in run %s: %s", peer, run_id, exc)
    return models


def map_clock(
    kind: str, table: pa.Table, model: ClockModel | None, peer: str
) -> tuple[pa.Table, str | None]:
    """A peer's spans or counters on the run's clock, with what was applied.

    Spans keep their raw times in attrs ``raw_start_ns``/``raw_end_ns`` (the writer puts them
    there) and get ``clock_offset_ns`` and ``clock_uncertainty_ns``. Without a model (no clock
    samples of ``peer`` in the run) the times stay as they are, with an offset of 0.
    """
    note = None if model is not None else f"no clock_sync rows for {peer!r}: times not mapped"
    if kind == "counters":
        if model is not None:
            ts = table.column("ts_ns").to_numpy()
            table = table.set_column(
                table.schema.get_field_index("ts_ns"), "ts_ns", pa.array(model.map_to_client(ts)[0])
            )
        return table, note
    start = table.column("start_ns").to_numpy()
    end = table.column("end_ns").to_numpy()
    if model is not None:
        start, offset, unc = model.map_to_client(start)
        end = model.map_to_client(end)[0]
    else:
        offset = unc = np.zeros(len(start), dtype=np.int64)
    i = table.schema.get_field_index
    table = table.set_column(i("start_ns"), "start_ns", pa.array(start, pa.int64()))
    table = table.set_column(i("end_ns"), "end_ns", pa.array(end, pa.int64()))
    attrs = _append_attrs(
        table.column("attrs"),
        {"clock_offset_ns": offset.astype(str), "clock_uncertainty_ns": unc.astype(str)},
    )
    return table.set_column(i("attrs"), "attrs", attrs), note


def _append_attrs(column: pa.ChunkedArray, extra: dict[str, np.ndarray]) -> pa.Array:
    """Each row's map with ``extra``'s keys added (one value per row), built in one pass."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(arr)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    keys = arr.keys.slice(offsets[0], offsets[-1] - offsets[0])
    items = arr.items.slice(offsets[0], offsets[-1] - offsets[0])
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    k = len(extra)
    old_total = int(offsets[-1])
    # New layout per row: its old entries, then the k new ones.
    new_offsets = np.concatenate(([0], np.cumsum(lengths + k)))
    order = np.empty(old_total + n * k, dtype=np.int64)
    row_of = np.repeat(np.arange(n), lengths)
    order[np.arange(old_total) + k * row_of] = np.arange(old_total)
    for j in range(k):
        order[offsets[1:] + k * np.arange(n) + j] = old_total + j * n + np.arange(n)
    all_keys = pa.concat_arrays(
        [keys.cast(pa.string()), *(pa.array([name] * n, pa.string()) for name in extra)]
    )
    all_items = pa.concat_arrays(
        [items.cast(pa.string()), *(pa.array(v.tolist(), pa.string()) for v in extra.values())]
    )
    take = pa.array(order)
    return pa.MapArray.from_arrays(
        pa.array(new_offsets, pa.int32()), all_keys.take(take), all_items.take(take)
    ).cast(arr.type)


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


def _drop_present(store: Store, kind: str, table: pa.Table) -> pa.Table:
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


def _logged(store: Store, run_id: str) -> dict[tuple[str, int], str]:
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


class _Inserter:
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
        self._in_flight: list[tuple[Future[int], str, _Pending, InsertConnection]] = []
        self._unlogged: list[tuple[str, str, LogRow]] = []  # done, not yet written

    def __enter__(self) -> _Inserter:
        return self

    def submit(self, kind: str, batch: _Pending) -> None:
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

    def _done(self, kind: str, batch: _Pending, rows: int) -> None:
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
