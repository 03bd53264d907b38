"""How ingest's rows reach an embedded store: Arrow inserts read in place or as an ArrowStream body
(the same rows either way), on the store's own connection or another, and the ingest log written
pending before each batch's insert and done after, also when an insert fails."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from gpu_trace.store import ingest as ingest_module
from gpu_trace.store import inserter
from gpu_trace.store.client import Store, StoreError
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.records import SPAN_SCHEMA, attrs_column, dict_column, numeric_column
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolWriter, list_spool

ATTRS = pa.map_(pa.string(), pa.string())
COLUMNS = "span_id, parent_span_id, lane, category, name, start_ns, depth, attrs, host"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"chdb://{tmp_path / 'store'}") as s:
        yield s


def odd_spans(run_id: str, attrs: pa.Array) -> pa.Table:
    """Four spans with what a spool table may hold: nulls (stored as defaults), the largest
    UInt64, chunks with dictionaries of their own, an empty and a missing map."""
    lane = pa.chunked_array(
        [
            pa.DictionaryArray.from_arrays(pa.array([0, None], pa.int32()), pa.array(["a", "b"])),
            pa.DictionaryArray.from_arrays(pa.array([1, 0], pa.int32()), pa.array(["c", "d"])),
        ]
    )
    return pa.table(
        {
            "span_id": pa.array([1, 2**64 - 1, None, 4], pa.uint64()),
            "parent_span_id": pa.nulls(4, pa.uint64()),
            "pid": pa.array([1, 2, 3, 4], pa.uint32()),
            "tid": pa.array([1, 2, 3, 4], pa.uint64()),
            "lane": lane,
            "category": pa.nulls(4, pa.string()),
            "name": pa.array(["x", None, "z", "é"], pa.string()),
            "start_ns": pa.array([1, 2, 3, -4], pa.int64()),
            "end_ns": pa.array([5, 6, 7, 8], pa.int64()),
            "depth": pa.array([0, 1, None, 65535], pa.uint16()),
            "attrs": attrs,
            "run_id": pa.array([run_id] * 4),
            "trace_id": pa.array(["t"] * 4),
            "host": pa.DictionaryArray.from_arrays(pa.array([0] * 4, pa.int32()), pa.array(["h"])),
        }
    )


def stored(store: Store, run_id: str) -> list[tuple[object, ...]]:
    return store.query(
        f"SELECT {COLUMNS} FROM __db__.spans WHERE run_id = {{r:String}} ORDER BY pid",
        {"r": run_id},
    ).result_rows


def test_an_arrow_insert_stores_the_same_rows_in_place_or_as_a_stream(store: Store) -> None:
    # No null map value: read in place. One null map value: Python() would refuse it, so the
    # table goes as an ArrowStream body, where a null is stored as the default.
    in_place = odd_spans("r1", pa.array([[("k", "v")], None, [], [("k2", "w")]], ATTRS))
    streamed = odd_spans("r2", pa.array([[("k", "v")], None, [], [("k2", None)]], ATTRS))
    store.insert_arrow("spans", in_place)
    store.insert_arrow("spans", streamed)
    expected = [
        (1, 0, "a", "", "x", 1, 0, {"k": "v"}, "h"),
        (2**64 - 1, 0, "", "", "", 2, 1, {}, "h"),
        (0, 0, "d", "", "z", 3, 0, {}, "h"),
        (4, 0, "c", "", "é", -4, 65535, {"k2": "w"}, "h"),
    ]
    assert stored(store, "r1") == expected
    assert stored(store, "r2") == [*expected[:3], (*expected[3][:7], {"k2": ""}, "h")]


def test_inserts_on_another_connection_from_another_thread(store: Store) -> None:
    table = odd_spans("r1", pa.array([[("k", "v")], None, [], []], ATTRS))
    connection = store.connect_again()
    errors: list[BaseException] = []

    def insert() -> None:
        try:
            store.insert_arrow("spans", table, connection=connection)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=insert)
    thread.start()
    thread.join()
    assert not errors
    connection.close()
    connection.close()  # idempotent
    assert len(stored(store, "r1")) == 4
    with pytest.raises(StoreError, match="closed"):
        store.insert_arrow("spans", table, connection=connection)


def test_a_store_set_readonly_refuses_arrow_inserts(store: Store) -> None:
    store.set_readonly()
    with pytest.raises(StoreError, match="writing 4 rows to spans"):
        store.insert_arrow("spans", odd_spans("r1", pa.array([[], [], [], []], ATTRS)))
    assert stored(store, "r1") == []


def spool_run(run_dir: Path, files: int, rows_per_file: int) -> Path:
    RunInfo(run_id=run_dir.name, trace_id="ab" * 16, started_ns=0, status="finished").save(run_dir)
    meta = {"run_id": run_dir.name, "trace_id": "ab" * 16, "host": "h1", "pid": "7"}
    writer = SpoolWriter(run_dir, meta)
    n = rows_per_file
    for f in range(files):
        ids = np.arange(f * n, (f + 1) * n, dtype=np.uint64) + np.uint64(1)
        start = ids.astype(np.int64) * 10
        table = {
            "span_id": numeric_column(ids, pa.uint64()),
            "parent_span_id": numeric_column(np.zeros(n, np.uint64), pa.uint64()),
            "pid": numeric_column(np.full(n, 7), pa.uint32()),
            "tid": numeric_column(np.full(n, 7), pa.uint64()),
            "lane": dict_column(["cpu/main"] * n),
            "category": dict_column(["op"] * n),
            "name": dict_column([f"op{i % 3}" for i in range(n)]),
            "start_ns": numeric_column(start, pa.int64()),
            "end_ns": numeric_column(start + 5, pa.int64()),
            "depth": numeric_column(np.zeros(n, np.uint16), pa.uint16()),
            "attrs": attrs_column([None] * n),
        }
        writer.write("spans", pa.table(table, schema=SPAN_SCHEMA))
    return run_dir


def log_rows(store: Store, run_id: str) -> list[tuple[str, str, int]]:
    return store.query(
        "SELECT file, status, ingested_ns FROM __db__.ingest_log WHERE run_id = {r:String}"
        " ORDER BY ingested_ns, file, status",
        {"r": run_id},
    ).result_rows


def test_each_file_is_logged_pending_before_its_insert_and_done_after(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inserter, "BATCH_ROWS", 20)  # two files a batch
    run_dir = spool_run(tmp_path / "runs" / "logged", files=6, rows_per_file=10)
    report = ingest(store, run_dir)
    assert report.rows["spans"] == 60 and report.files_ingested == 6
    rows = log_rows(store, "logged")
    for path in list_spool(run_dir):
        states = [(status, ns) for name, status, ns in rows if name == path.name]
        assert [s for s, _ in states] == ["pending", "done"], states
        assert states[0][1] <= states[1][1]


def test_a_failed_insert_leaves_its_files_pending_and_the_stored_ones_done(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inserter, "BATCH_ROWS", 20)
    monkeypatch.setattr(inserter, "INSERT_WORKERS", 1)  # batches one after another
    run_dir = spool_run(tmp_path / "runs" / "failing", files=6, rows_per_file=10)
    real = Store.insert_arrow
    calls = {"spans": 0}

    def second_spans_insert_fails(self: Store, name: str, table: pa.Table, **kw: object) -> None:
        if name == "spans":
            calls["spans"] += 1
            if calls["spans"] == 2:
                raise StoreError("the store went away")
        real(self, name, table, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Store, "insert_arrow", second_spans_insert_fails)
    with pytest.raises(StoreError, match="went away"):
        ingest(store, run_dir)
    rows = log_rows(store, "failing")
    last = {name: status for name, status, _ in rows}  # the latest entry of each file
    files = [p.name for p in list_spool(run_dir)]
    assert [last[f] for f in files[:2]] == ["done", "done"]
    assert [last[f] for f in files[2:]] == ["pending"] * 4  # the failed batch, the next one

    monkeypatch.setattr(Store, "insert_arrow", real)
    report = ingest(store, run_dir)
    assert report.files_skipped == 2 and report.rows["spans"] == 40
    count = store.query(
        "SELECT count(), uniqExact(span_id) FROM __db__.spans WHERE run_id = 'failing'"
    ).result_rows[0]
    assert count == (60, 60)


def test_spool_converters_run_when_a_raw_file_is_in_the_spool(tmp_path: Path) -> None:
    run_dir = spool_run(tmp_path / "runs" / "raw", files=1, rows_per_file=10)
    assert ingest_module.convert_spool(run_dir) == []  # spool files only: nothing loaded or run
    (run_dir / "spool" / "gpu_activity-7-abcdef.bin").write_bytes(b"not CUPTI records")
    problems = ingest_module.convert_spool(run_dir)
    assert any("gpu_activity-7-abcdef.bin" in p for p in problems), problems
