"""The store on a real embedded chDB: schema, ingest, idempotency, damaged spool, queries, SQL."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import gpu_trace
from gpu_trace.query import reads
from gpu_trace.query.reads import UnknownRunError
from gpu_trace.query.source import rows as query_rows
from gpu_trace.store.client import Store, StoreError
from gpu_trace.store.embedded import check_writable
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.records import SPAN_SCHEMA, attrs_column, dict_column, numeric_column
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolWriter, list_spool, read_spool_file


@pytest.fixture
def dsn(tmp_path: Path) -> str:
    return f"chdb://{tmp_path / 'store'}"


@pytest.fixture
def store(dsn: str) -> Iterator[Store]:
    with Store(dsn) as s:
        yield s


def record(run_dir: Path, monkeypatch: pytest.MonkeyPatch, steps: int = 3) -> Path:
    """A real recording through the public API."""
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    gpu_trace.start(run_dir)
    try:
        for i in range(steps):
            gpu_trace.step(i)
            with gpu_trace.range("outer", i=i), gpu_trace.range("inner"):
                gpu_trace.mark("tick")
            gpu_trace.counter("loss", 1.0 / (i + 1))
    finally:
        gpu_trace.stop()
    return run_dir


def spans_table(rows: list[tuple]) -> pa.Table:
    """(span_id, parent, tid, lane, category, name, start, end, depth) rows as a spool table."""
    cols = list(zip(*rows, strict=True))
    n = len(rows)
    return pa.table(
        {
            "span_id": numeric_column(cols[0], pa.uint64()),
            "parent_span_id": numeric_column(cols[1], pa.uint64()),
            "pid": numeric_column(np.full(n, 7), pa.uint32()),
            "tid": numeric_column(cols[2], pa.uint64()),
            "lane": dict_column(cols[3]),
            "category": dict_column(cols[4]),
            "name": dict_column(cols[5]),
            "start_ns": numeric_column(cols[6], pa.int64()),
            "end_ns": numeric_column(cols[7], pa.int64()),
            "depth": numeric_column(cols[8], pa.uint16()),
            "attrs": attrs_column([None] * n),
        },
        schema=SPAN_SCHEMA,
    )


def hand_made_run(run_dir: Path, table: pa.Table, run_id: str | None = None) -> Path:
    run_id = run_id or run_dir.name
    RunInfo(run_id=run_id, trace_id="ab" * 16, started_ns=0, ended_ns=1000, status="finished").save(
        run_dir
    )
    meta = {
        "run_id": run_id,
        "trace_id": "ab" * 16,
        "host": "h1",
        "pid": "7",
        "process_name": "test",
    }
    SpoolWriter(run_dir, meta).write("spans", table)
    return run_dir


def test_schema_creation_is_idempotent(dsn: str) -> None:
    with Store(dsn) as s:
        tables = {r[0] for r in s.sql("SHOW TABLES")[1]}
    with Store(dsn) as s:  # again on an existing store: nothing fails, nothing changes
        assert {r[0] for r in s.sql("SHOW TABLES")[1]} == tables
    assert {"runs", "spans", "counters", "clock_sync", "threads", "ingest_log"} <= tables


def test_ingest_roundtrip_from_a_real_recording(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = record(tmp_path / "runs" / "rt-1", monkeypatch)
    report = ingest(store, run_dir)
    assert report.run_id == "rt-1"
    # 3 steps + 3 x (outer, inner, tick)
    assert report.rows == {"spans": 12, "counters": 3, "clock_sync": 0}
    assert report.files_ingested == len(list_spool(run_dir)) and report.problems == []
    assert reads.counts(store, "rt-1") == {
        "spans": 12,
        "counters": 3,
        "clock_sync": 0,
        "threads": 1,
    }

    run = reads.run(store, "rt-1")
    info = RunInfo.load(run_dir)
    assert run["trace_id"] == info.trace_id and run["status"] == "finished"
    assert run["duration_ns"] == info.ended_ns - info.started_ns > 0
    assert run["attrs"]["events"] == "15" and run["attrs"]["dropped"] == "0"
    assert run["started_wall_ns"] > 1_600_000_000 * 10**9

    spans = pa.concat_tables(reads.iter_spans(store, "rt-1"))
    assert spans.num_rows == 12
    assert spans.column("start_ns").to_pylist() == sorted(spans.column("start_ns").to_pylist())
    names = spans.column("name").to_pylist()
    assert names.count("outer") == names.count("inner") == names.count("tick") == 3
    outer = [r for r in spans.to_pylist() if r["name"] == "outer"]
    assert sorted(dict(r["attrs"])["i"] for r in outer) == ["0", "1", "2"]
    assert set(spans.column("trace_id").to_pylist()) == {info.trace_id}
    inner = [r for r in spans.to_pylist() if r["name"] == "inner"]
    outer_ids = {r["span_id"] for r in outer}
    assert all(r["parent_span_id"] in outer_ids and r["depth"] == 1 for r in inner)

    counters = pa.concat_tables(reads.iter_counters(store, "rt-1")).to_pylist()
    assert [c["value"] for c in counters] == [1.0, 0.5, 1.0 / 3]
    assert {c["metric"] for c in counters} == {"loss"}
    threads = reads.threads(store, "rt-1")
    assert len(threads) == 1 and threads[0]["thread_name"] == "MainThread"


def test_ingest_twice_adds_no_rows(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = record(tmp_path / "runs" / "twice", monkeypatch)
    first = ingest(store, run_dir)
    second = ingest(store, run_dir)
    assert second.rows_total == 0
    assert second.files_skipped == first.files_ingested and second.files_ingested == 0
    assert reads.counts(store, "twice")["spans"] == 12
    assert len(reads.runs(store)) == 1


def test_resumes_a_crash_between_insert_and_log(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = record(tmp_path / "runs" / "crash", monkeypatch)
    ingest(store, run_dir)
    # As if the last ingest had died after its inserts, before logging them done, and had only
    # stored part of the spans.
    store.client.command(
        "INSERT INTO gpu_trace.ingest_log (run_id, file, size, kind, rows, status, problem, ingested_ns)"
        " SELECT run_id, file, size, kind, rows, 'pending', '', ingested_ns + 1 FROM gpu_trace.ingest_log"
    )
    store.client.command(
        "ALTER TABLE gpu_trace.spans DELETE WHERE name = 'inner' SETTINGS mutations_sync = 1"
    )
    assert reads.counts(store, "crash")["spans"] == 9
    report = ingest(store, run_dir)
    assert report.rows == {"spans": 3, "counters": 0, "clock_sync": 0}
    assert reads.counts(store, "crash") == {
        "spans": 12,
        "counters": 3,
        "clock_sync": 0,
        "threads": 1,
    }
    assert ingest(store, run_dir).files_skipped == report.files_ingested


def test_truncated_and_corrupt_spool_keep_every_readable_row(store: Store, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "damaged"
    n = 200_000  # several 64k-row batches in one file
    rows = [(i + 1, 0, 1, "lane", "nvtx", f"n{i % 5}", i * 10, i * 10 + 5, 0) for i in range(n)]
    hand_made_run(run_dir, spans_table(rows))
    (path,) = list_spool(run_dir)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])  # cut in the middle of a batch
    readable = read_spool_file(path).table.num_rows
    assert 0 < readable < n
    (path.parent / "spans-7-zzzzzz-000009.arrow").write_bytes(b"not an arrow stream at all")

    report = ingest(store, run_dir)
    assert report.rows["spans"] == readable
    assert reads.counts(store, "damaged")["spans"] == readable
    truncated = next(p for p in report.problems if p.startswith(path.name))
    assert f"kept {readable} rows, skipped the rest:" in truncated
    garbage = next(p for p in report.problems if p.startswith("spans-7-zzzzzz"))
    assert "kept 0 rows, skipped the rest:" in garbage
    # The spool is left as it was.
    assert len(list_spool(run_dir)) == 2


def test_unknown_run_lists_recent_runs_and_last_resolves(store: Store, tmp_path: Path) -> None:
    for name in ("20260101-000000-aaaaaa", "20260101-000000-aabbbb", "20260102-000000-cccccc"):
        hand_made_run(tmp_path / name, spans_table([(1, 0, 1, "l", "nvtx", "x", 0, 5, 0)]))
        ingest(store, tmp_path / name)
    with pytest.raises(UnknownRunError) as err:
        reads.resolve_run(store, "nope")
    assert isinstance(err.value, LookupError)
    assert "nope" in str(err.value)
    assert all(r in str(err.value) for r in ("20260101-000000-aaaaaa", "20260102-000000-cccccc"))
    with pytest.raises(UnknownRunError, match="ambiguous"):
        reads.resolve_run(store, "20260101-000000-aa")
    assert reads.resolve_run(store, "20260101-000000-aab") == "20260101-000000-aabbbb"
    assert reads.resolve_run(store, "20260102-000000-cccccc") == "20260102-000000-cccccc"
    # All three have started_ns 0 and no clock anchor; last is the one ingested last.
    assert reads.resolve_run(store, "last") == "20260102-000000-cccccc"
    with pytest.raises(UnknownRunError):
        reads.run(store, "nope")
    assert [r["run_id"] for r in reads.runs(store, search="CCCC")] == ["20260102-000000-cccccc"]


def test_last_is_the_newest_recording(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ingest(store, record(tmp_path / "runs" / "zz-older", monkeypatch, steps=1))
    time.sleep(0.01)
    ingest(store, record(tmp_path / "runs" / "aa-newer", monkeypatch, steps=1))
    assert reads.resolve_run(store, "last") == "aa-newer"
    assert [r["run_id"] for r in reads.runs(store)] == ["aa-newer", "zz-older"]


def test_summary_self_time_on_a_nested_trace(store: Store, tmp_path: Path) -> None:
    rows = [
        # id, parent, tid, lane, category, name, start, end, depth
        (1, 0, 1, "cpu", "nvtx", "A", 0, 100, 0),
        (2, 1, 1, "cpu", "nvtx", "B", 10, 40, 1),
        (3, 1, 1, "cpu", "nvtx", "C", 50, 90, 1),
        (4, 3, 1, "cpu", "nvtx", "D", 55, 65, 2),
        (5, 3, 1, "cpu", "mark", "m", 60, 60, 3),
        (6, 0, 1, "cpu", "nvtx", "A", 200, 220, 0),  # a second A with no children
        # On another thread with A as parent (async work): not part of A's own time.
        (7, 1, 2, "worker", "nvtx", "W", 20, 80, 0),
    ]
    hand_made_run(tmp_path / "nested", spans_table(rows))
    ingest(store, tmp_path / "nested")
    summary = reads.summary(store, "nested", top=10)
    lanes = {lane.lane: lane for lane in summary.lanes}
    assert set(lanes) == {"cpu", "worker"}
    cpu = {r.name: r for r in lanes["cpu"].ranges}
    assert "m" not in cpu
    a = cpu["A"]
    assert (a.category, a.count, a.total_ns, a.self_ns, a.mean_ns, a.max_ns) == (
        "nvtx", 2, 120, 30 + 20, 60, 100,
    )  # fmt: skip
    assert (cpu["B"].self_ns, cpu["C"].self_ns, cpu["D"].self_ns) == (30, 30, 10)
    assert [r.name for r in lanes["cpu"].ranges] == ["A", "C", "B", "D"]
    assert [r.name for r in lanes["cpu"].by_self][:1] == ["A"]
    assert lanes["cpu"].spans == 5 and lanes["worker"].by_self[0].self_ns == 60
    top1 = reads.summary(store, "nested", top=1)
    cpu1 = next(lane for lane in top1.lanes if lane.lane == "cpu")
    assert [r.name for r in cpu1.ranges] == ["A"]


def test_iter_spans_pages_by_start_without_splitting_ties(store: Store, tmp_path: Path) -> None:
    # 50 distinct start times with 7 spans each: pages of 10 rows must each end on a whole start.
    rows = [
        (i + 1, 0, 1, "l", "nvtx", f"s{i}", (i // 7) * 100, (i // 7) * 100 + 50, i % 7)
        for i in range(350)
    ]
    hand_made_run(tmp_path / "ties", spans_table(rows[::-1]))
    ingest(store, tmp_path / "ties")
    pages = list(reads.iter_spans(store, "ties", batch_rows=10))
    assert sum(p.num_rows for p in pages) == 350
    starts = [s for p in pages for s in p.column("start_ns").to_pylist()]
    assert starts == sorted(starts)
    assert all(p.num_rows <= 14 for p in pages)
    firsts = [p.column("start_ns")[0].as_py() for p in pages]
    assert len(set(firsts)) == len(firsts)
    depths = pages[0].column("depth").to_pylist()[:7]
    assert depths == sorted(depths)  # parents first among equal starts
    # A window keeps spans overlapping it: [120, 260) -> starts 100, 200 (100 ends at 150).
    window = pa.concat_tables(
        reads.iter_spans(store, "ties", batch_rows=3, start_ns=120, end_ns=260)
    )
    assert sorted(set(window.column("start_ns").to_pylist())) == [100, 200]
    assert window.num_rows == 14


def test_sql_is_read_only(store: Store, tmp_path: Path) -> None:
    hand_made_run(tmp_path / "q", spans_table([(1, 0, 1, "l", "nvtx", "x", 0, 5, 0)]))
    ingest(store, tmp_path / "q")
    cols, rows = store.sql(
        "SELECT run_id, count() AS n FROM spans WHERE run_id = {r:String} GROUP BY run_id",
        {"r": "q"},
    )
    assert cols == ["run_id", "n"] and rows == [("q", 1)]
    for statement in (
        "INSERT INTO spans (run_id) VALUES ('x')",
        "DROP TABLE spans",
        "ALTER TABLE spans DELETE WHERE 1",
        "TRUNCATE TABLE runs",
        "  -- a comment\n DROP TABLE runs",
        "SELECT 1; DROP TABLE spans",
        "SELECT * FROM file('/etc/hostname', 'LineAsString')",
        "SELECT count() FROM spans SETTINGS readonly = 0",
    ):
        with pytest.raises(StoreError, match="read-only"):
            store.sql(statement)
    assert reads.counts(store, "q")["spans"] == 1
    assert {"spans", "runs"} <= {r[0] for r in store.sql("SHOW TABLES")[1]}


def test_check_writable(tmp_path: Path) -> None:
    assert check_writable(f"chdb://{tmp_path / 'fine' / 'store'}") is None
    regular = tmp_path / "a-file"
    regular.write_text("")
    reason = check_writable(f"chdb://{regular / 'store'}")
    assert reason and "not a directory" in reason and "\n" not in reason
    assert check_writable("chdb:///proc/gpu-trace-store") is not None
    assert check_writable("ftp://nowhere") is not None
    with pytest.raises(StoreError, match="not a directory"):
        Store(f"chdb://{regular / 'store'}")


def test_store_down_leaves_spool_and_can_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = record(tmp_path / "runs" / "retry", monkeypatch, steps=1)
    before = sorted((p.name, p.stat().st_size) for p in list_spool(run_dir))
    with pytest.raises(StoreError):
        ingest(Store("http://127.0.0.1:9/"), run_dir)
    assert sorted((p.name, p.stat().st_size) for p in list_spool(run_dir)) == before
    with Store(f"chdb://{tmp_path / 'store'}") as s:
        assert ingest(s, run_dir).rows["spans"] == 4  # step, outer, inner, tick


def test_a_store_in_use_by_another_process_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "store"
    code = (
        "import sys, time\n"
        "from gpu_trace.store.client import Store\n"
        f"s = Store({f'chdb://{path}'!r})\n"
        "print('open', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreError, match=f"in use by pid {holder.pid}"):
            Store(f"chdb://{path}", lock_timeout_s=0)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
        holder.stdout.close()
    with Store(f"chdb://{path}") as s:  # free again once the other process is gone
        assert reads.runs(s) == []


def test_a_store_made_before_stored_ns_gets_it_when_opened(tmp_path: Path) -> None:
    """The schema grows in place: a store whose runs table predates ``stored_ns`` gets the column
    at its next open, its rows reading their last upsert's time, and ``last`` orders by it."""
    import clickhouse_connect

    from gpu_trace.store.schema import TABLES, schema_ddl

    path = tmp_path / "old-store"
    old = schema_ddl()
    columns = TABLES["runs"][0]
    assert ", stored_ns Int64 DEFAULT updated_ns" in columns
    old = [s.replace(", stored_ns Int64 DEFAULT updated_ns", "") for s in old]
    client = clickhouse_connect.get_client(interface="chdb", path=str(path))
    try:
        for statement in old:
            client.command(statement)
        for run_id, started, updated in (("old-a", 200, 10), ("old-b", 100, 20)):
            client.command(
                "INSERT INTO gpu_trace.runs (run_id, started_wall_ns, status, updated_ns)"
                f" VALUES ('{run_id}', {started}, 'finished', {updated})"
            )
    finally:
        client.close()
    with Store(f"chdb://{path}") as store:
        rows = store.query("SELECT run_id, stored_ns FROM __db__.runs FINAL ORDER BY run_id")
        assert rows.result_rows == [("old-a", 10), ("old-b", 20)]
        # old-a started later, but old-b was stored (upserted) later.
        assert reads.resolve_run(store, "last") == "old-b"
        store.upsert_run(RunInfo(run_id="new", trace_id="0" * 32, started_ns=0, status="finished"))
        assert reads.resolve_run(store, "last") == "new"
        stored = reads.run(store, "new")["stored_ns"]
        store.upsert_run(RunInfo(run_id="new", trace_id="0" * 32, started_ns=0, status="died"))
        assert (
            reads.run(store, "new")["status"] == "died"
            and reads.run(store, "new")["stored_ns"] == stored
        )
    with Store(f"chdb://{path}") as store:  # opened again: nothing more to add
        assert [
            c for c in query_rows(store, "DESCRIBE TABLE __db__.runs") if c["name"] == "stored_ns"
        ]


def test_a_process_waiting_for_the_store_says_so(tmp_path: Path) -> None:
    """A process that finds the store held takes a shared lock while it waits (what the
    dashboard watches for to give the store up), and lets go once it has the store."""
    import threading

    from gpu_trace.store.embedded import others_waiting

    path = tmp_path / "store"
    Store(f"chdb://{path}").close()
    code = (
        "import sys\n"
        "from gpu_trace.store.client import Store\n"
        f"s = Store({f'chdb://{path}'!r})\n"
        "print('open', flush=True)\n"
        "sys.stdin.readline()\n"
        "s.close()\n"
        "print('closed', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    opened: list[Store] = []
    waiter = threading.Thread(
        target=lambda: opened.append(Store(f"chdb://{path}", lock_timeout_s=120))
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        assert not others_waiting(str(path))
        waiter.start()
        deadline = time.monotonic() + 60
        while not others_waiting(str(path)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert others_waiting(str(path))
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "closed"  # the holder let go (still running)
        waiter.join(timeout=60)
        assert opened and not others_waiting(str(path))
        assert reads.runs(opened[0]) == []
    finally:
        for s in opened:
            s.close()
        holder.stdin.close()
        holder.wait(timeout=60)
        holder.stdout.close()
