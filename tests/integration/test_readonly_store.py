"""A store this user can only read: `ls`, `show`, `sql` and `export` read it; `import`, `rm`,
`ingest` and `record` say in one line that it is read-only. Before, every command refused it
('not writable'), reading ones too: chDB cannot open a directory it cannot write.

The commands run on a read-only bind mount of a real store (root can write any directory a mode
forbids, and tests run as root; mounting needs root too, so elsewhere those tests are skipped).
The Store tests use the writability check's seam on a writable store, and check that reading
it read-only changes no file."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_trace.query import reads
from gpu_trace.store import embedded
from gpu_trace.store.client import Store, StoreError
from gpu_trace.tracer.run import RunInfo

REPO = Path(__file__).resolve().parents[2]
KINETO = REPO / "tests" / "data" / "kineto-h100-lm-5steps.json.gz"


def cli(*args: str, home: Path, store: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_HOME": str(home), "GPU_TRACE_STORE": str(store)},
        timeout=240,
    )


def one_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home whose store holds one recorded run."""
    home = tmp_path_factory.mktemp("ro-home")
    prog = home / "prog.py"
    prog.write_text("import gpu_trace\nwith gpu_trace.range('read-me'):\n    pass\n")
    out = cli("record", "--nvtx", "off", "--", sys.executable, str(prog), home=home,
              store=home / "store")  # fmt: skip
    assert out.returncode == 0, out.stderr
    return home


@contextlib.contextmanager
def read_only_view(source: Path) -> Iterator[Path]:
    """``source`` bind-mounted read-only at a path of its own (EROFS for every write)."""
    where = Path(tempfile.mkdtemp(prefix="gpu-trace-ro-"))
    try:
        if os.geteuid() != 0:
            pytest.skip("a read-only bind mount needs root")
        mounted = subprocess.run(["mount", "--bind", str(source), str(where)],
                                 capture_output=True, text=True)  # fmt: skip
        if mounted.returncode != 0:
            pytest.skip(f"cannot bind-mount here: {mounted.stderr.strip()}")
        try:
            ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(where)],
                                capture_output=True, text=True)  # fmt: skip
            if ro.returncode != 0:
                pytest.skip(f"cannot make a bind mount read-only here: {ro.stderr.strip()}")
            yield where
        finally:
            subprocess.run(["umount", str(where)], check=True)
    finally:
        where.rmdir()


@pytest.fixture(scope="module")
def ro_store(home: Path) -> Iterator[Path]:
    with read_only_view(home / "store") as where:
        with pytest.raises(OSError):
            (where / "probe").write_text("x")
        yield where


def test_reading_commands_read_a_read_only_store(
    home: Path, ro_store: Path, tmp_path: Path
) -> None:
    listed = cli("ls", "--json", home=home, store=ro_store)
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)
    shown = cli("show", "last", "--json", home=home, store=ro_store)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["run"]["run_id"] == run["run_id"]
    queried = cli("sql", "--json", "SELECT name, count() AS n FROM spans GROUP BY name",
                  home=home, store=ro_store)  # fmt: skip
    assert queried.returncode == 0, queried.stderr
    assert json.loads(queried.stdout) == {"name": "read-me", "n": 1}
    out = tmp_path / "trace.json"
    exported = cli("export", run["run_id"][:12], "-o", str(out), home=home, store=ro_store)
    assert exported.returncode == 0, exported.stderr
    assert "read-me" in out.read_text()
    for done in (listed, shown, queried, exported):
        assert "read-only" not in done.stderr  # no warning either


NOTEBOOK = """
import sys, gpu_trace
print(len(gpu_trace.runs(store=sys.argv[1])))
run = gpu_trace.run("last", store=sys.argv[1])
print(list(run.spans().name), run.summary().by_total.name.tolist())
"""


def test_the_python_api_reads_a_read_only_store(home: Path, ro_store: Path) -> None:
    """gpu_trace.runs() and run() (notebooks) read as `ls` and `show` do."""
    out = subprocess.run(
        [sys.executable, "-c", NOTEBOOK, str(ro_store)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "GPU_TRACE_HOME": str(home)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["1", "['read-me'] ['read-me']"], out.stdout


def test_writing_commands_say_the_store_is_read_only(home: Path, ro_store: Path) -> None:
    imported = cli("import", str(KINETO), home=home, store=ro_store)
    assert imported.returncode == 1
    line = one_line(imported)
    assert line.startswith("gpu-trace: import failed, nothing was stored: ")
    assert f"the store {ro_store} is read-only (Read-only file system)" in line
    removed = cli("rm", "last", home=home, store=ro_store)
    assert removed.returncode == 1 and "is read-only (Read-only file system)" in one_line(removed)
    prog = home / "prog.py"
    recorded = cli("record", "--", sys.executable, str(prog), home=home, store=ro_store)
    assert recorded.returncode == 2 and "is read-only" in one_line(recorded)
    # ... and the run is still there, alone.
    listed = cli("ls", "--json", home=home, store=ro_store)
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 1, listed.stderr


# ---- Store, through the writability check's seam -------------------------------------------------


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}  # fmt: skip


@pytest.fixture
def seamed(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the recorded store that the writability check calls read-only."""
    copy = tmp_path / "store"
    subprocess.run(["cp", "-a", str(home / "store"), str(copy)], check=True)

    def read_only(path: str) -> str:
        return f"the store {path} is read-only (Permission denied): nothing can be stored in it"

    monkeypatch.setattr(embedded, "_check_dir_writable", read_only)
    return copy


def test_a_store_read_read_only_is_read_whole_and_left_as_it_was(seamed: Path) -> None:
    before = files(seamed)
    with Store(f"chdb://{seamed}", reading=True) as store:
        assert store.read_only
        scratch = Path(store._scratch or "")
        (run,) = reads.runs(store)
        assert store.sql("SELECT name FROM spans")[1] == [("read-me",)]
        assert reads.counts(store, run["run_id"])["spans"] == 1
        assert list(reads.iter_spans(store, run["run_id"]))[0].num_rows == 1
        sizes = store.run_bytes([run["run_id"]])
        assert sizes is not None and sizes[run["run_id"]] > 0
        # Its tables are read-only in the engine itself: no insert, no delete.
        info = RunInfo(
            run_id="other", trace_id="ab" * 16, started_ns=0, ended_ns=1, status="finished"
        )
        with pytest.raises(StoreError, match="readonly mode"):
            store.upsert_run(info)
        with pytest.raises(StoreError, match="read-only"):
            store.delete_run(run["run_id"])
        assert [r["run_id"] for r in reads.runs(store)] == [run["run_id"]]
    assert not scratch.exists()
    assert files(seamed) == before  # no file added, changed or removed: no merge, no cleanup


def test_a_store_opened_to_write_is_refused_in_one_line(seamed: Path) -> None:
    with pytest.raises(StoreError, match=r"^the store .* is read-only \(Permission denied\)"):
        Store(f"chdb://{seamed}")
