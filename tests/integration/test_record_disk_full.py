"""`gpu-trace record` with GPU_TRACE_HOME on a small, real filesystem that fills up: the program's
exit status, one closing line and no traceback, no temporaries, everything written before the
disk filled kept and ingestable, and recording that resumes when space comes back.

A tmpfs of a few MiB is mounted for each test, which needs root (CI runs as root); elsewhere the
tests are skipped and tests/unit/test_disk_full.py covers the same code through a seam."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_trace.store.client import Store
from gpu_trace.tracer.run import read_stats


@contextlib.contextmanager
def small_disk(size: str) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="gpu-trace-full-"))
    try:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
        try:
            yield where
        finally:
            subprocess.run(["umount", str(where)], check=True)
    finally:
        where.rmdir()


def record(home: Path, program: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(program))
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", "--nvtx", "off", "--no-nvml", *args]
        + ["--host-hz", "0", "--", sys.executable, str(prog)],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_HOME": str(home)},
        timeout=240,
    )


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def spans_in(dsn: str) -> int:
    with Store(dsn) as store:
        return store.sql("SELECT count() FROM gpu_trace.spans")[1][0][0]


def test_a_disk_that_fills_keeps_what_fitted_and_the_program_s_status(tmp_path: Path) -> None:
    program = """
        import sys, gpu_trace
        for i in range(400_000):
            with gpu_trace.range("r"):
                pass
        sys.exit(3)
    """
    with small_disk("2m") as home:
        out = record(home, program, tmp_path)
        assert out.returncode == 3, out.stderr
        assert "Traceback" not in out.stderr
        (line,) = out.stderr.splitlines()
        (run_dir,) = (home / "runs").iterdir()
        # The store under the same full disk cannot take the run: one line says so, and that
        # the spool is kept for gpu-trace ingest.
        assert " NOT stored: " in line and f"gpu-trace ingest {run_dir}" in line
        assert f"the disk under {run_dir} filled up: " in line and "not written" in line
        assert temporaries(home) == []
        (program_stats,) = [s for s in read_stats(run_dir) if s.get("not_written")]
        lost = program_stats["not_written"]

        dsn = f"chdb://{tmp_path / 'store'}"
        ingest = subprocess.run(
            [sys.executable, "-m", "gpu_trace", "ingest", str(run_dir), "--store", dsn],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert ingest.returncode == 0, ingest.stderr
        kept = spans_in(dsn)
    assert kept > 10_000  # what the disk had room for (about 30k ranges in 2 MiB)
    assert kept + lost == 400_000


def test_recording_resumes_when_space_comes_back(tmp_path: Path) -> None:
    program = """
        import os, gpu_trace
        from gpu_trace.tracer import recorder

        def ranges(name):
            for i in range(20_000):
                with gpu_trace.range(name):
                    pass
            recorder.active.flush()

        ranges("before")
        filler = os.path.join(os.environ["GPU_TRACE_HOME"], "filler")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
            except OSError:
                pass
        ranges("while full")
        os.remove(filler)
        ranges("after")
    """
    with small_disk("8m") as home:
        out = record(home, program, tmp_path)
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr
        (line,) = out.stderr.splitlines()
        assert "every event was written once there was room" in line
        assert " 60,000 events, 0 dropped, stored in " in line
        assert temporaries(home) == []
        (run_dir,) = (home / "runs").iterdir()
        with Store(f"chdb://{home / 'store'}") as store:
            _, rows = store.sql("SELECT name, count() FROM gpu_trace.spans GROUP BY name")
    assert dict(rows) == {"before": 20_000, "while full": 20_000, "after": 20_000}


def test_a_disk_full_before_the_start_is_one_line_and_runs_nothing(tmp_path: Path) -> None:
    with small_disk("1m") as home:
        with open(home / "filler", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 65536)
                f.flush()
        marker = tmp_path / "ran"
        program = f"open({str(marker)!r}, 'w').close()"
        out = record(home, program, tmp_path, "--store", f"chdb://{tmp_path / 'store'}")
        assert out.returncode == 2, out.stderr
        (line,) = out.stderr.splitlines()
        assert line.startswith("gpu-trace: cannot write ") and line.endswith(": the disk is full")
        assert not marker.exists()
        assert list((home / "runs").iterdir()) == [] and temporaries(home) == []
