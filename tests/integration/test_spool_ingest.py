"""Ingest of a damaged spool: damaged batches are named (file, batch, reason) in one line per file,
counted in the report and the run's attrs, and never stored; the rest of the file and run are."""

from __future__ import annotations

from pathlib import Path

from gpu_trace.query import reads
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import BATCH_ROWS, SpoolWriter, list_spool
from tests.unit.test_spool import META, spans


def test_damaged_batches_are_named_counted_and_not_stored(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    RunInfo(run_id="r", trace_id="ab" * 16, started_ns=0, ended_ns=10, status="finished").save(
        run_dir
    )
    writer = SpoolWriter(run_dir, META)
    damaged = writer.write("spans", spans(3 * BATCH_ROWS))
    writer.write("spans", spans(100, start=10**12))  # a second, whole file of the same run
    data = bytearray(damaged.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = b"\xff" * 4096  # the probe: 4 KiB of 0xFF mid-file
    damaged.write_bytes(bytes(data))

    with Store(f"chdb://{tmp_path / 'store'}") as store:
        report = ingest(store, run_dir)
        assert report.rows["spans"] == 2 * BATCH_ROWS + 100
        assert report.batches_skipped == 1 and "1 damaged batch(es) skipped" in report.summary()
        (line,) = report.problems
        assert line.startswith(f"{damaged.name}: kept {2 * BATCH_ROWS} rows, skipped batch 1 (")
        _, rows = store.sql(
            "SELECT count(), countIf(start_ns < 0 OR end_ns < start_ns) FROM gpu_trace.spans"
        )
        assert rows == [(2 * BATCH_ROWS + 100, 0)]
        assert reads.run(store, "r")["attrs"]["damaged_batches"] == "1"
        # Logged as done with its problem: a second ingest neither repeats nor stores it.
        again = ingest(store, run_dir)
        assert again.files_skipped == len(list_spool(run_dir)) and again.rows_total == 0


def test_a_file_of_another_run_is_named_and_not_stored_under_either(tmp_path: Path) -> None:
    """A copied run directory (issue 29): its run.json names run "copy", its spool file is run
    "r"'s. The rows were stored under "r", a run no list shows, and the line said they were
    stored; now the file is named, nothing is stored and the spool stays."""
    run_dir = tmp_path / "copy"
    RunInfo(run_id="copy", trace_id="cd" * 16, started_ns=0, ended_ns=10, status="finished").save(
        run_dir
    )
    assert META["run_id"] == "r"
    writer = SpoolWriter(run_dir, META)
    path = writer.write("spans", spans(50))
    with Store(f"chdb://{tmp_path / 'store'}") as store:
        report = ingest(store, run_dir)
        (line,) = report.problems
        assert line.startswith(f"{path.name}: not stored: its rows are run r's, this directory's")
        assert report.rows_total == 0
        _, rows = store.sql("SELECT count() FROM gpu_trace.spans")
        assert rows == [(0,)]
    assert path.exists()


def test_ingest_tells_its_progress_a_file_at_a_time(tmp_path: Path) -> None:
    """What `gpu-trace ingest` and `record` draw on a terminal while a run is stored (issue 29:
    a large run was stored for a minute with no output)."""
    run_dir = tmp_path / "r"
    RunInfo(run_id="r", trace_id="ab" * 16, started_ns=0, ended_ns=10, status="finished").save(
        run_dir
    )
    writer = SpoolWriter(run_dir, META)
    for i in range(3):
        writer.write("spans", spans(10, start=i * 10**9))
    told: list[tuple[str, int, int | None]] = []
    with Store(f"chdb://{tmp_path / 'store'}") as store:
        report = ingest(store, run_dir, progress=lambda *a: told.append(a))
    assert report.rows["spans"] == 30
    files = len(list_spool(run_dir))
    assert told == [("ingesting spool files", i, files) for i in range(files)] + [
        (f"storing the last of {files} spool files", 0, None)
    ]


def test_a_chdb_refusing_its_python_table_function_stores_as_arrowstream(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Inserts read Arrow in place through chDB's ``Python()`` table function; a chDB that
    refuses it (``allow_python_table_function=0`` here, or a build without it) stores every row
    as ArrowStream instead, says so once, and loses nothing (before: every insert failed)."""
    import logging

    from gpu_trace.store import client as store_client

    real = store_client.open_engine

    def refusing(path: str):
        engine = real(path)
        engine.query("SET allow_python_table_function = 0")
        return engine

    monkeypatch.setattr(store_client, "open_engine", refusing)
    run_dir = tmp_path / "r"
    RunInfo(run_id="r", trace_id="ab" * 16, started_ns=0, ended_ns=10, status="finished").save(
        run_dir
    )
    writer = SpoolWriter(run_dir, META)
    writer.write("spans", spans(3 * BATCH_ROWS))
    writer.write("spans", spans(100, start=10**12))
    with caplog.at_level(logging.WARNING, logger="gpu_trace.store.client"):
        with Store(f"chdb://{tmp_path / 'store'}") as store:
            report = ingest(store, run_dir)
            assert report.rows["spans"] == 3 * BATCH_ROWS + 100 and not report.problems
            _, rows = store.sql(
                "SELECT count(), count(DISTINCT (span_id, start_ns)) FROM gpu_trace.spans"
            )
            assert rows == [(3 * BATCH_ROWS + 100, 3 * BATCH_ROWS + 100)]
    said = [r.getMessage() for r in caplog.records if "Python() table function" in r.getMessage()]
    assert len(said) == 1 and "ArrowStream" in said[0], said
