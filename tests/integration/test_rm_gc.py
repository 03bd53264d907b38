"""`gpu-trace rm` and `gpu-trace gc` on the real chDB store and real run directories: what they
remove (store rows in every table, run directories, spools), what they never touch (other runs, a
live run, young runs, directories outside GPU_TRACE_HOME/runs), sizes in their output, and one
clear error that removes nothing for bad input."""

from __future__ import annotations

import io
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from gpu_trace import cli, config
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.store.schema import TABLES
from gpu_trace.tracer.run import RunInfo, recorder_attrs
from gpu_trace.tracer.spool import SpoolWriter, list_spool
from tests.conftest import REPO
from tests.unit.test_spool import META, spans

DAY_NS = 86_400 * 10**9


def make_run(
    run_id: str, *, days_ago: float = 0, stored: bool = True, status: str = "finished", **attrs: str
) -> Path:
    """A run directory under runs/ that started ``days_ago`` (wall clock and file times), ingested
    into the default store unless ``stored`` is false; its spool stays."""
    run_dir = config.runs_dir() / run_id
    wall = time.time_ns() - int(days_ago * DAY_NS)
    RunInfo(
        run_id=run_id,
        trace_id="ab" * 16,
        started_ns=1,
        ended_ns=2,
        status=status,
        attrs={"anchor_mono_ns": "1", "anchor_wall_ns": str(wall), **attrs},
    ).save(run_dir)
    SpoolWriter(run_dir, {**META, "run_id": run_id}).write("spans", spans(50))
    if stored:
        with Store() as store:
            ingest(store, run_dir)
    for path in [run_dir, *run_dir.rglob("*")]:
        os.utime(path, ns=(wall, wall))
    return run_dir


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def stored_rows(run_id: str) -> dict[str, int]:
    with Store() as store:
        return store.table_rows([run_id]).get(run_id, {})


def test_rm_removes_a_run_from_every_table_and_its_directory_and_nothing_else(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gone, other = make_run("20260101-000000-aaaaaa"), make_run("20260102-000000-bbbbbb")
    assert set(stored_rows(gone.name)) == {"runs", "spans", "ingest_log"}
    code, out, _ = run_cli(capsys, "rm", "20260101")  # a unique prefix
    assert code == 0
    assert out.startswith("removed run 20260101-000000-aaaaaa: ~") and " in the store, " in out
    assert f" in {gone}" in out and "estimated from system.parts" in out
    assert stored_rows(gone.name) == {} and not gone.exists()
    assert stored_rows(other.name)["spans"] == 50 and other.exists()
    code, out, _ = run_cli(capsys, "rm", "last")
    assert code == 0 and "removed run 20260102-000000-bbbbbb" in out and not other.exists()


def test_rm_of_a_bad_id_is_one_error_and_removes_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = make_run("20260101-000000-cccccc")
    code, out, err = run_cli(capsys, "rm", good.name, "nosuch")
    assert code == 1 and out == ""
    assert err.strip() == (
        "gpu-trace: no run 'nosuch' in the store or under GPU_TRACE_HOME/runs; recent runs: "
        f"{good.name}; nothing was removed"
    )
    assert stored_rows(good.name)["spans"] == 50 and len(list_spool(good)) == 1


def test_rm_removes_a_run_that_never_reached_the_store(
    capsys: pytest.CaptureFixture[str],
) -> None:
    orphan = make_run("20260103-000000-dddddd", stored=False)
    code, out, _ = run_cli(capsys, "rm", orphan.name)
    assert code == 0 and out.startswith(f"removed run {orphan.name}: ") and not orphan.exists()
    assert "in the store" not in out.splitlines()[0]


def test_rm_refuses_a_live_run_unless_forced(capsys: pytest.CaptureFixture[str]) -> None:
    live = make_run("20260104-000000-eeeeee", status="running", **recorder_attrs())
    code, _, err = run_cli(capsys, "rm", live.name)
    assert code == 1 and "is still recording (recorder pid" in err and "nothing was removed" in err
    assert live.exists() and stored_rows(live.name)["spans"] == 50
    code, out, _ = run_cli(capsys, "rm", "--force", live.name)
    assert code == 0 and not live.exists() and stored_rows(live.name) == {}


def test_gc_removes_what_is_old_and_dead_and_keeps_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    old = make_run("20260105-000000-old000", days_ago=10)
    young = make_run("20260105-000000-young0", days_ago=1)
    orphan = make_run("20260105-000000-orphan", days_ago=9, stored=False)
    young_orphan = make_run("20260105-000000-yorph0", days_ago=2, stored=False)
    live = make_run("20260105-000000-live00", days_ago=30, status="running", **recorder_attrs())
    died = make_run(
        "20260105-000000-died00",
        days_ago=30,
        stored=False,
        status="running",
        recorder_pid="1",
        recorder_host="elsewhere",
    )  # a recorder on another host cannot be checked: it counts as alive
    code, out, _ = run_cli(capsys, "gc", "--dry-run")
    assert code == 0 and "would remove run 20260105-000000-old000: ~" in out
    assert f"would remove {orphan} (run {orphan.name} is not in the store)" in out
    assert all(p.exists() for p in (old, young, orphan, young_orphan, live, died))
    assert stored_rows(old.name)["spans"] == 50

    code, out, err = run_cli(capsys, "gc", "--older-than", "7d")
    assert code == 0
    assert not old.exists() and stored_rows(old.name) == {}
    assert not orphan.exists()
    assert young.exists() and stored_rows(young.name)["spans"] == 50 and young_orphan.exists()
    assert live.exists() and stored_rows(live.name)["spans"] == 50
    assert f"kept run {live.name} is still recording" in err
    assert died.exists() and f"kept run {died.name} is still recording" in err
    assert "removed 1 run(s): ~" in out and "removed 1 run director(ies) not in the store" in out


def test_gc_spools_only_keeps_stored_runs(capsys: pytest.CaptureFixture[str]) -> None:
    old = make_run("20260106-000000-aaaaaa", days_ago=10)
    code, out, _ = run_cli(capsys, "gc", "--spools-only", "--older-than", "1w")
    assert code == 0 and f"removed the spool of run {old.name}: " in out
    assert list_spool(old) == [] and (old / "run.json").exists()
    assert stored_rows(old.name)["spans"] == 50
    code, out, _ = run_cli(capsys, "gc", "--spools-only", "--older-than", "1w")
    assert code == 0 and out.strip() == "gc: nothing older than 1w to remove"


def test_gc_never_touches_directories_outside_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = (
        tmp_path / "sample_traces" / "runs" / "local-training"
    )  # a copy: see test_spool_removal
    shutil.copytree(REPO / "sample_traces" / "runs" / "local-training", sample)
    files = sorted(p.name for p in list_spool(sample))
    with Store() as store:
        ingest(store, sample)
    code, out, _ = run_cli(capsys, "gc", "--older-than", "0", "--spools-only")
    assert code == 0 and sorted(p.name for p in list_spool(sample)) == files


@pytest.mark.parametrize("age", ["soon", "7x", "-1d", ""])
def test_gc_refuses_a_bad_age(capsys: pytest.CaptureFixture[str], age: str) -> None:
    code, _, err = run_cli(capsys, "gc", f"--older-than={age}")
    assert code == 2 and "--older-than takes a number and a unit (30m, 12h, 7d, 2w)" in err


def test_delete_run_clears_every_table_keyed_by_run_id(tmp_path: Path) -> None:
    make_run("20260107-000000-aaaaaa")
    with Store() as store:
        assert store.delete_run("20260107-000000-aaaaaa")["spans"] == 50
        for table in TABLES:
            (n,) = store.query(
                f"SELECT count() FROM __db__.{table} WHERE run_id = '20260107-000000-aaaaaa'"
            ).result_rows[0]
            assert n == 0, table


@pytest.mark.parametrize(
    ("age", "seconds"),
    [
        ("30m", 1800),
        ("12h", 43_200),
        ("7d", 604_800),
        ("2w", 1_209_600),
        ("2", 172_800),
        ("0", 0),
        ("1.5h", 5400),
    ],
)
def test_ages_in_their_units(age: str, seconds: int) -> None:
    from gpu_trace.commands.removal import parse_age

    assert parse_age(age) == seconds * 10**9


class _Tty(io.StringIO):
    """A terminal, to the progress line."""

    def isatty(self) -> bool:
        return True


def test_gc_draws_its_progress_on_a_terminal_and_clears_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    old = make_run("20260106-000000-old000", days_ago=10)
    orphan = make_run("20260106-000000-orphan", days_ago=9, stored=False)
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    code, out, _ = run_cli(capsys, "gc", "--older-than", "7d")
    assert code == 0 and not old.exists() and not orphan.exists()
    drawn = tty.getvalue()
    frames = [f.rstrip() for f in drawn.split("\r") if f.strip()]
    empty, half = "." * 30, "#" * 15 + "." * 15
    assert frames == [
        "gc: looking at run directories",
        f"gc: looking at run directories [{empty}]   0% 0/2",
        f"gc: looking at run directories [{half}]  50% 1/2",
        "gc: measuring",
        f"gc: removing runs [{empty}]   0% 0/1",
        f"gc: removing run directories not in the store [{empty}]   0% 0/1",
    ]
    # A shorter frame blanks out what is left of the longer one before it.
    assert f"\rgc: measuring{' ' * (len(frames[2]) - len(frames[3]))}\r" in drawn
    # The line is cleared before each line gc prints (on stdout), so nothing is left of it.
    for frame in frames[4:]:
        assert f"\r{frame}\r{' ' * len(frame)}\r" in drawn
    assert drawn.endswith(f"\r{' ' * len(frames[-1])}\r")
    lines = out.splitlines()
    assert lines[0].startswith(f"removed run {old.name}: ")
    assert lines[1].startswith(f"removed {orphan} (run {orphan.name} is not in the store): ")


def test_rm_and_gc_draw_nothing_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make_run("20260107-000000-aaaaaa"), make_run("20260107-000000-bbbbbb")
    code, _, err = run_cli(capsys, "rm", a.name, b.name)
    assert code == 0 and err == "" and not a.exists() and not b.exists()
    make_run("20260107-000000-cccccc", days_ago=10)
    code, _, err = run_cli(capsys, "gc", "--older-than", "7d")
    assert code == 0 and err == ""


def test_rm_of_many_runs_draws_its_progress_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = make_run("20260108-000000-aaaaaa"), make_run("20260108-000000-bbbbbb")
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    code, out, _ = run_cli(capsys, "rm", a.name, b.name)
    assert code == 0 and len(out.splitlines()) == 3 and not a.exists() and not b.exists()
    frames = [f.rstrip() for f in tty.getvalue().split("\r") if f.strip()]
    assert frames == [
        "rm: measuring",
        f"rm: removing runs [{'.' * 30}]   0% 0/2",
        f"rm: removing runs [{'#' * 15}{'.' * 15}]  50% 1/2",
    ]
    assert tty.getvalue().endswith(f"\r{' ' * len(frames[-1])}\r")
