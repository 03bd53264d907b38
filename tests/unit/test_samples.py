"""The packed sample runs: unpacked once into GPU_TRACE_HOME/samples; a damaged archive is one
warning and the other samples still load."""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path

import pytest

from gpu_trace.dashboard import samples


def _pack(tmp_path: Path, name: str) -> Path:
    src = tmp_path / "src" / name
    src.mkdir(parents=True)
    (src / "run.json").write_text("{}")
    archive = tmp_path / "runs" / f"{name}.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=name)
    return archive


def test_a_packed_run_is_unpacked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _pack(tmp_path, "packed-run")
    monkeypatch.setattr(samples, "PACKED_SAMPLES", ("packed-run",))
    monkeypatch.setattr(samples, "samples_dir", lambda: archive.parent)
    monkeypatch.setenv("GPU_TRACE_HOME", str(tmp_path / "home"))
    (run,) = samples.packed_runs()
    assert run == tmp_path / "home" / "samples" / "packed-run"
    assert (run / "run.json").read_text() == "{}"
    archive.unlink()  # unpacked already: the archive is not read again
    assert samples.packed_runs() == [run]


def test_a_damaged_archive_is_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    archive = _pack(tmp_path, "packed-run")
    archive.write_bytes(archive.read_bytes()[:40])  # cut short
    monkeypatch.setattr(samples, "PACKED_SAMPLES", ("packed-run",))
    monkeypatch.setattr(samples, "samples_dir", lambda: archive.parent)
    monkeypatch.setenv("GPU_TRACE_HOME", str(tmp_path / "home"))
    with caplog.at_level(logging.WARNING, logger=samples.__name__):
        assert samples.packed_runs() == []
    assert "sample run packed-run not unpacked" in caplog.text
