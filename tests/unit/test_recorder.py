"""The recorder: background flushing, bounded buffers, fork, and the spool it writes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace import config
from gpu_trace.tracer import recorder
from gpu_trace.tracer.run import read_stats
from gpu_trace.tracer.spool import list_spool, read_spool_file


def span_names(run_dir: Path) -> list[str]:
    names: list[str] = []
    for p in list_spool(run_dir):
        f = read_spool_file(p)
        if f.kind == "spans" and f.table is not None:
            names.extend(f.table.column("name").to_pylist())
    return names


@pytest.fixture(autouse=True)
def _no_nvtx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")


def test_background_flush_writes_spool_while_the_program_runs(tmp_path: Path) -> None:
    run_dir = gpu_trace.start(tmp_path / "run", flush_interval_s=0.05)
    try:
        with gpu_trace.range("early"):
            pass
        deadline = time.monotonic() + 10
        while "early" not in span_names(run_dir) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "early" in span_names(run_dir), "not flushed without stop()"
    finally:
        gpu_trace.stop()


def test_wake_flushes_now_not_at_the_interval(tmp_path: Path) -> None:
    """A source that knows when draining is cheapest (op level: while the program's thread is
    inside a stop) has the flusher flush then, however long its interval."""
    gpu_trace.start(tmp_path / "run", flush_interval_s=60)
    try:
        rec = recorder.active
        assert rec is not None
        rec.flush()  # the start-up flush is behind us; the next is 60 s away
        with gpu_trace.range("woken"):
            pass
        rec.wake()
        deadline = time.monotonic() + 10
        while "woken" not in span_names(rec.run_dir) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "woken" in span_names(rec.run_dir), "wake() did not flush"
    finally:
        gpu_trace.stop()


def test_full_buffer_drops_counts_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = gpu_trace.start(tmp_path / "run", flush_interval_s=60, buffer_events=16)
    try:
        with caplog.at_level(logging.WARNING, logger="gpu_trace.tracer.recorder"):
            for _ in range(40):
                with gpu_trace.range("r"):
                    pass
            recorder.active.flush()
            for _ in range(40):
                with gpu_trace.range("r"):
                    pass
            recorder.active.flush()
        assert recorder.active.dropped() == 48
    finally:
        gpu_trace.stop()
    assert span_names(run_dir).count("r") == 32
    assert sum(s["dropped"] for s in read_stats(run_dir)) == 48
    warnings = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 1


def test_fork_child_records_its_own_events(tmp_path: Path) -> None:
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        with gpu_trace.range("parent-before"):
            pass
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                with gpu_trace.range("child"):
                    pass
                gpu_trace.stop()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with gpu_trace.range("parent-after"):
            pass
    finally:
        gpu_trace.stop()
    by_pid: dict[int, set[str]] = {}
    for p in list_spool(run_dir):
        f = read_spool_file(p)
        if f.kind == "spans":
            by_pid.setdefault(int(f.meta["pid"]), set()).update(f.table.column("name").to_pylist())
    assert by_pid[os.getpid()] == {"parent-before", "parent-after"}
    assert by_pid[pid] == {"child"}, "the child neither lost its events nor copied the parent's"


def test_spool_file_metadata_names_the_run_and_process(tmp_path: Path) -> None:
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        with gpu_trace.range("x"):
            pass
    finally:
        gpu_trace.stop()
    (path,) = list_spool(run_dir)
    f = read_spool_file(path)
    assert f.problem is None
    assert f.meta["run_id"] == "run" and f.meta["pid"] == str(os.getpid())
    assert len(f.meta["trace_id"]) == 32 and f.meta["clock"] == "CLOCK_MONOTONIC"
    assert not [p for p in (run_dir / "spool").iterdir() if p.name.endswith(".tmp")]


def test_settings_come_from_arguments_then_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPU_TRACE_FLUSH_INTERVAL", "0.25")
    monkeypatch.setenv("GPU_TRACE_BUFFER_EVENTS", "1000")
    s = config.RecorderSettings.from_env(run_dir=tmp_path)
    assert (s.flush_interval_s, s.buffer_events, s.nvtx) == (0.25, 1000, "off")
    s = config.RecorderSettings.from_env(run_dir=tmp_path, flush_interval_s=2.0)
    assert s.flush_interval_s == 2.0


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("GPU_TRACE_FLUSH_INTERVAL", "soon", "must be a number"),
        ("GPU_TRACE_FLUSH_INTERVAL", "0", r"seconds in \(0, 60\], got '0'"),
        ("GPU_TRACE_FLUSH_INTERVAL", "nan", r"seconds in \(0, 60\], got 'nan'"),
        ("GPU_TRACE_FLUSH_INTERVAL", "inf", r"seconds in \(0, 60\], got 'inf'"),
        ("GPU_TRACE_BUFFER_EVENTS", "2", r"whole number of events in \[16, "),
        ("GPU_TRACE_BUFFER_EVENTS", "100.5", r"whole number of events in \[16, "),
        ("GPU_TRACE_NVTX", "maybe", "one of native, python, off"),
    ],
)
def test_bad_settings_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        config.RecorderSettings.from_env()


def test_every_environment_variable_is_documented() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    for name in config.ENVIRONMENT:
        assert f"`{name}`" in docs, name
