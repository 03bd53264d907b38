"""Spools removed after a verified ingest, and only then: `record` and `ingest` remove a run's spool
files under GPU_TRACE_HOME/runs once the store holds every row they held (ingest_log and row
counts, the real chDB store); a partial or damaged ingest, a live run, --keep-spool,
GPU_TRACE_KEEP_SPOOL and any directory elsewhere (the repository's sample runs) keep everything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_trace import cli, config
from gpu_trace.query import reads
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.store.retention import INGESTED_FILE, release_spool
from gpu_trace.tracer.run import RunInfo, recorder_attrs
from gpu_trace.tracer.spool import SpoolWriter, list_spool, spool_dir
from tests.conftest import REPO
from tests.unit.test_spool import META, spans


def make_run(run_id: str, *, rows: int = 100, status: str = "finished", **attrs: str) -> Path:
    run_dir = config.runs_dir() / run_id
    RunInfo(
        run_id=run_id, trace_id="ab" * 16, started_ns=1, ended_ns=2, status=status, attrs=attrs
    ).save(run_dir)
    SpoolWriter(run_dir, {**META, "run_id": run_id}).write("spans", spans(rows))
    return run_dir


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_record_removes_the_spool_once_the_store_holds_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    program = "import gpu_trace\nfor i in range(50):\n    with gpu_trace.range('x'): pass\n"
    done = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", "--no-nvml", "--host-hz", "0", "--"]
        + [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    (run_dir,) = config.runs_dir().iterdir()
    assert "; spool removed (" in done.stderr.splitlines()[-1]
    assert list_spool(run_dir) == [] and not spool_dir(run_dir).exists()
    assert {p.name for p in run_dir.iterdir()} == {"run.json", "stats", INGESTED_FILE}
    marker = json.loads((run_dir / INGESTED_FILE).read_text())
    assert marker["rows"]["spans"] >= 50 and marker["removed_files"] >= 1
    with Store() as store:
        assert reads.counts(store, run_dir.name)["spans"] == marker["rows"]["spans"]
    # Nothing is left to ingest: one clear line, not an empty run.
    code, _, err = run_cli(capsys, "ingest", str(run_dir))
    assert code == 2 and "its spool was removed after it was ingested into chdb://" in err


def test_keep_spool_flag_and_setting_keep_it_and_a_later_ingest_removes_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = make_run("kept")
    files = list_spool(run_dir)
    code, out, _ = run_cli(capsys, "ingest", "--keep-spool", str(run_dir))
    assert code == 0 and "spool kept: as asked" in out and list_spool(run_dir) == files
    monkeypatch.setenv("GPU_TRACE_KEEP_SPOOL", "1")
    code, out, _ = run_cli(capsys, "ingest", str(run_dir))
    assert code == 0 and "spool kept: as asked" in out and list_spool(run_dir) == files
    monkeypatch.setenv("GPU_TRACE_KEEP_SPOOL", "maybe")
    with pytest.raises(ValueError, match="GPU_TRACE_KEEP_SPOOL must be one of"):
        config.check_environment()
    monkeypatch.delenv("GPU_TRACE_KEEP_SPOOL")
    code, out, _ = run_cli(capsys, "ingest", str(run_dir))
    assert code == 0 and "spool removed (1 files" in out and list_spool(run_dir) == []


def test_rows_missing_from_the_store_keep_the_spool(tmp_path: Path) -> None:
    run_dir = make_run("partial", rows=120)
    with Store() as store:
        ingest(store, run_dir)
        # What a lost insert looks like: the log says done, the rows are not there.
        store.client.command(
            "ALTER TABLE gpu_trace.spans DELETE WHERE run_id = 'partial' AND span_id > 100",
            settings={"mutations_sync": 2},
        )
        release = release_spool(store, run_dir)
    assert release.kept == "the store holds 100 of the spool's 120 spans rows"
    assert len(list_spool(run_dir)) == 1 and not (run_dir / INGESTED_FILE).exists()


def test_a_file_whose_log_disagrees_with_its_rows_keeps_the_spool() -> None:
    """The file is counted again: an ingest that logged fewer rows than the file holds (a bug in
    ingest's bookkeeping) is not taken at its word."""
    run_dir = make_run("miscounted", rows=120)
    (path,) = list_spool(run_dir)
    with Store() as store:
        ingest(store, run_dir)
        store.insert_rows(
            "ingest_log",
            ["run_id", "file", "size", "kind", "rows", "status", "problem", "ingested_ns"],
            [["miscounted", path.name, path.stat().st_size, "spans", 110, "done", "", 2**62]],
        )
        release = release_spool(store, run_dir)
    assert release.kept == f"{path.name} holds 120 rows, its ingest stored 110"
    assert list_spool(run_dir) == [path]


def test_a_file_not_yet_ingested_keeps_the_spool() -> None:
    run_dir = make_run("late")
    with Store() as store:
        ingest(store, run_dir)
        SpoolWriter(run_dir, {**META, "run_id": "late", "pid": "8"}).write("spans", spans(5))
        release = release_spool(store, run_dir)
    assert release.kept.endswith("is not stored (ingest it again: gpu-trace ingest)")
    assert len(list_spool(run_dir)) == 2


def test_damaged_batches_keep_the_spool() -> None:
    run_dir = make_run("damaged", rows=10)
    (path,) = list_spool(run_dir)
    data = bytearray(path.read_bytes())
    data[-200:-150] = b"\xff" * 50  # inside the one batch: its checksum no longer matches
    path.write_bytes(bytes(data))
    with Store() as store:
        report = ingest(store, run_dir)
        release = release_spool(store, run_dir)
    assert report.batches_skipped == 1
    assert release.kept == "1 spool file(s) had damaged or incomplete batches (see ingest)"
    assert list_spool(run_dir) == [path]


def test_a_live_run_keeps_its_spool() -> None:
    run_dir = make_run("live", status="running", **recorder_attrs())  # this process records it
    with Store() as store:
        ingest(store, run_dir)
        release = release_spool(store, run_dir)
    assert release.kept == "the run is still recording" and len(list_spool(run_dir)) == 1


def test_sample_runs_and_other_directories_are_never_emptied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpu-trace demo` ingests the repository's sample_traces/runs: they must stay whole (a copy
    of one, so that a broken check costs the checkout nothing)."""
    sample = tmp_path / "sample_traces" / "runs" / "local-training"
    shutil.copytree(REPO / "sample_traces" / "runs" / "local-training", sample)
    before = sorted(p.name for p in list_spool(sample))
    with Store() as store:
        ingest(store, sample)
        assert release_spool(store, sample).kept.startswith("it is not under ")
    code, out, _ = run_cli(capsys, "ingest", str(sample))
    assert code == 0 and "spool kept: it is not under " in out
    assert sorted(p.name for p in list_spool(sample)) == before
    assert not (sample / INGESTED_FILE).exists()
    # A link under runs/ to a directory elsewhere is elsewhere too.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(make_run("linked"), elsewhere)
    shutil.rmtree(config.runs_dir() / "linked")
    os.symlink(elsewhere, config.runs_dir() / "linked")
    with Store() as store:
        ingest(store, config.runs_dir() / "linked")
        assert release_spool(store, config.runs_dir() / "linked").kept.startswith("it is not")
    assert len(list_spool(elsewhere)) == 1


def test_a_failed_ingest_keeps_everything_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir = make_run("unreachable")
    code, _, err = run_cli(capsys, "ingest", "--store", "http://127.0.0.1:9", str(run_dir))
    assert code == 1 and "ingest failed, spool kept:" in err
    assert len(list_spool(run_dir)) == 1 and not (run_dir / INGESTED_FILE).exists()
