"""A full disk under the run directory: the recorder never raises, keeps what it could not write
(up to one buffer's worth) and writes it first once there is room, leaves no temporaries, and
counts what it gave up on. The disk is a seam of SpoolWriter (``open_file``) that fills up after a
byte budget; everything above it is the real code path."""

from __future__ import annotations

import errno
import io
import json
import logging
from pathlib import Path

import pyarrow as pa
import pytest

from gpu_trace.config import RecorderSettings
from gpu_trace.tracer import files
from gpu_trace.tracer.recorder import Recorder
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolWriter, list_spool, read_spool_file
from gpu_trace.tracer.spool_output import MIN_SPLIT_ROWS


class Disk:
    """Files opened here say ENOSPC once the directory they are in holds ``size`` bytes (removing
    files frees space, as on a real disk); ``size = None`` is a disk with room."""

    def __init__(self, size: int | None) -> None:
        self.size = size

    def open(self, path: str) -> pa.NativeFile:
        return pa.PythonFile(_File(self, path), mode="w")

    def room(self, path: str, n: int) -> bool:
        if self.size is None:
            return True
        used = sum(p.stat().st_size for p in Path(path).parent.iterdir())
        return used + n <= self.size


class _File(io.RawIOBase):
    def __init__(self, disk: Disk, path: str) -> None:
        self.disk = disk
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:
        self.f.flush()
        if not self.disk.room(self.f.name, len(data)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def close(self) -> None:
        self.f.close()
        super().close()


def recorder(tmp_path: Path, disk: Disk, buffer_events: int = 1 << 20) -> Recorder:
    settings = RecorderSettings(
        run_dir=tmp_path / "run", run_id="r", flush_interval_s=60, buffer_events=buffer_events
    )
    rec = Recorder(settings)
    rec.output.writer = SpoolWriter(rec.run_dir, rec.output.writer.meta, open_file=disk.open)
    return rec


def emit(rec: Recorder, n: int, start: int = 0) -> None:
    buf = rec.buffer()
    for i in range(start, start + n):
        buf.add_span((buf.next_id(), 0, "nvtx/gpu_trace", "nvtx", "r", i, i + 1, 0, None))


def spooled(run_dir: Path) -> list[int]:
    starts: list[int] = []
    for path in list_spool(run_dir):
        f = read_spool_file(path)
        assert f.problem is None, f.problem
        starts += f.table.column("start_ns").to_pylist()
    return sorted(starts)


def temporaries(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]


def stats(rec: Recorder) -> dict:
    return json.loads((rec.run_dir / "stats" / f"{rec.pid}.json").read_text())


def test_a_full_disk_delays_writes_and_loses_nothing_once_space_comes_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = Disk(size=None)
    rec = recorder(tmp_path, disk)
    emit(rec, 10_000)
    rec.flush()
    assert len(spooled(rec.run_dir)) == 10_000

    used = sum(p.stat().st_size for p in list_spool(rec.run_dir))
    disk.size = used + 1_000_000  # room for part of the next flush only
    emit(rec, 3 * MIN_SPLIT_ROWS * 4, start=10_000)
    with caplog.at_level(logging.INFO, logger="gpu_trace.tracer.recorder"):
        rec.flush()  # never raises
        kept = len(spooled(rec.run_dir))
        assert 10_000 < kept < 10_000 + 12 * MIN_SPLIT_ROWS  # what fitted is on disk
        assert temporaries(rec.run_dir) == []
        emit(rec, 1000, start=100_000)
        rec.flush()  # still full: one more failed try, nothing lost yet
        assert stats(rec)["write_error"] == "the disk is full"
        assert rec.dropped() == 0

        disk.size = None  # space comes back
        emit(rec, 1000, start=200_000)
        rec.close()
    expected = [*range(10_000 + 12 * MIN_SPLIT_ROWS), *range(100_000, 101_000)]
    expected += list(range(200_000, 201_000))
    assert spooled(rec.run_dir) == expected
    assert temporaries(rec.run_dir) == []
    s = stats(rec)
    assert (s["events"], s["dropped"], s["not_written"]) == (len(expected), 0, 0)
    assert s["write_failures"] >= 2 and s["write_error"] == ""
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot write the spool" in m for m in messages) == 1  # once, not per flush
    assert sum("writing the spool in" in m and "again" in m for m in messages) == 1
    assert not any(r.exc_info for r in caplog.records)  # no tracebacks


def test_what_a_full_disk_keeps_waiting_is_bounded_and_counted(tmp_path: Path) -> None:
    disk = Disk(size=0)
    rec = recorder(tmp_path, disk, buffer_events=1000)
    for i in range(3):
        emit(rec, 1000, start=i * 1000)
        rec.flush()
    # One buffer's worth waits; the two oldest flushes were given up and counted as dropped.
    assert rec.dropped() == 2000
    assert stats(rec)["not_written"] == 2000
    rec.close()  # the disk never comes back: what waited is dropped too, and counted
    assert rec.dropped() == 3000
    s = stats(rec)
    assert (s["events"], s["dropped"], s["not_written"]) == (0, 3000, 3000)
    assert list_spool(rec.run_dir) == [] and temporaries(rec.run_dir) == []


def test_a_failed_spool_write_leaves_no_temporary(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, {"pid": "1", "run_id": "r"}, open_file=Disk(size=1000).open)
    table = pa.table({"x": pa.array(range(10_000), pa.int64())})
    with pytest.raises(OSError) as caught:
        writer.write("other", table)
    assert files.disk_full(caught.value)
    assert list((tmp_path / "spool").iterdir()) == []


def test_small_files_are_overwritten_in_place_when_there_is_no_room_for_a_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = RunInfo(run_id="r", trace_id="ab" * 16, started_ns=1)
    info.save(tmp_path)
    real = Path.write_bytes

    def full(self: Path, data: bytes) -> int:
        if self.name.endswith(".tmp"):
            real(self, data[:10])  # a part made it to disk before the error
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    info.status = "finished"
    info.save(tmp_path)
    assert RunInfo.load(tmp_path).status == "finished"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
