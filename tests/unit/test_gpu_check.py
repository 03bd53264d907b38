"""scripts/gpu_check.py, the one command that proves the GPU parts (issue 24), kept from rotting
where no GPU is: its CPU dry run end to end (every part has a status, Markdown and JSON agree),
the one line without a GPU, a part past its deadline killed with its process group while the
rest still run, a stop (SIGTERM) mid-part, the report rewritten after every part, test files run
a few at once (each with its own deadline), and the readers of the benches' outputs and of
pytest's JUnit files against their targets (a figure from one round marked as such)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # gpu_check imports its pieces (scripts/gpucheck/) so
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert spec is not None and spec.loader is not None
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)
sys.path.remove(str(SCRIPT.parent))

from gpucheck import figures, parts, report  # noqa: E402
from gpucheck.parts import Outcome, Part, Run  # noqa: E402
from gpucheck.runner import Step, StepResult, run_step, run_steps  # noqa: E402

PARTS = ["machine", "tests", "tenants", "activity", "overhead", "nvml", "paging", "forward"]
FINAL = {s for s in report.STATUSES if s not in ("pending", "running", "cut short")}


def md_parts(md: str) -> dict[str, str]:
    """The Parts table of a Markdown report: part name -> status."""
    section = md.split("## Parts", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    return {cells[1].strip(): cells[2].strip() for cells in (r.split("|") for r in rows)}


def md_figures(md: str) -> list[tuple[str, str, str]]:
    """The Figures table: (figure, value, result) per row."""
    section = md.split("## Figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    return [(c[1].strip(), c[2].strip(), c[5].strip()) for c in (r.split("|") for r in rows)]


def assert_md_matches_json(out: Path) -> dict[str, Any]:
    data = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert md_parts(md) == {p["name"]: p["status"] for p in data["parts"]}
    shown = [
        (f["name"], f["value"], figures.result(f)) for p in data["parts"] for f in p["figures"]
    ]
    assert md_figures(md) == shown
    assert data["verdict"] in md
    return data


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cpu_dry_run_reports_every_part_and_markdown_agrees_with_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=800,
        cwd=tmp_path,  # it runs from any folder
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = assert_md_matches_json(out)
    assert data["mode"] == "cpu-dry-run" and data["finished"]
    assert [p["name"] for p in data["parts"]] == PARTS
    for p in data["parts"]:
        assert p["status"] in FINAL, p
        for f in p["figures"]:  # CPU figures never pass or miss a GPU target
            assert f["verdict"] in ("n/a (CPU)", "not measured", "peer", "info"), f
    by = {p["name"]: p for p in data["parts"]}
    assert by["machine"]["status"] == "ok" and data["machine"]["gpu"] is False
    assert by["tests"]["status"] == "ok" and "skipped" in by["tests"]["summary"]
    (files,) = by["tests"]["details"]["files"]  # one process on the dry run
    assert re.fullmatch(r"\d+ files in one process", files["file"]) and "skipped" in files["result"]
    expected = "not present" if not (REPO / parts.TENANT_TEST).is_file() else "ok"
    assert by["tenants"]["status"] == expected
    # only a few files come back from a GPU machine: the logs travel packed
    assert sorted(x.name for x in out.iterdir()) == ["logs.tar.gz", "report.json", "report.md"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/machine-machine.log" in names and "data/machine.json" in names


def test_without_a_gpu_it_says_so_in_one_line_and_writes_a_report(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU may be here: this would run the whole check")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--commit", "abc"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "No GPU here" in lines[0], done.stdout
    data = assert_md_matches_json(out)
    assert data["mode"] == "no-gpu" and data["commit"] == "abc" and data["finished"]
    assert [p["status"] for p in data["parts"]] == ["ok"] + ["not run"] * (len(PARTS) - 1)
    assert "No GPU here" in (out / "report.md").read_text()


# ---- the runner, through the check's seam: a list of parts -------------------------------------

HANG = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print("started", child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no longer does: it may wait for a reaper here)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _part(name: str, argv: list[str], limit: float = 30.0, expect: float = 0.0, **kw: Any) -> Part:
    def collect(run: Run, results: list) -> Outcome:
        return Outcome(parts.steps_status(results), f"{name} done")

    return Part(
        name,
        f"the {name} part",
        expect,
        limit,
        lambda run: [Step(name, argv, limit)],
        kw.pop("collect", collect),
        **kw,
    )


def _check(tmp_path: Path, plist: list[Part], budget: float = 60.0) -> dict[str, Any]:
    run = Run("cpu-dry-run", tmp_path / "work")
    rep = gpu_check.new_report(plist, "cpu-dry-run", budget, "test")
    return gpu_check.check(plist, run, tmp_path / "out", budget, rep, grace_s=1.0, say=str)


def test_a_part_past_its_deadline_is_killed_with_its_group_and_the_rest_run(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    plist = [
        _part("hang", [sys.executable, "-c", HANG, str(pid_file)], limit=3.0),
        _part("after", [sys.executable, "-c", "print('after ran')"]),
        _part("big", [sys.executable, "-c", "pass"], expect=1000.0),
        _part("absent", [sys.executable, "-c", "pass"], absent=lambda run: "not here"),
        _part("broken", [sys.executable, "-c", "pass"], collect=lambda run, results: 1 / 0),
    ]
    t0 = time.monotonic()
    data = _check(tmp_path, plist)
    assert time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    assert not alive(grandchild)  # the whole group, not only the child
    status = {p["name"]: p for p in data["parts"]}
    hang = status["hang"]
    assert hang["status"] == "timed out" and hang["steps"][0]["timed_out"]
    assert any("started" in line for line in hang["steps"][0]["tail"])
    assert any("process group killed" in line for line in hang["steps"][0]["tail"])
    assert status["after"]["status"] == "ok"
    assert status["after"]["steps"][0]["tail"] == ["after ran"]
    assert status["big"]["status"] == "skipped" and "budget left" in status["big"]["summary"]
    assert status["absent"]["status"] == "not present"
    assert (
        status["broken"]["status"] == "failed"
        and "ZeroDivisionError" in status["broken"]["summary"]
    )
    assert_md_matches_json(tmp_path / "out")


def test_the_report_is_rewritten_after_every_part(tmp_path: Path) -> None:
    seen: list[dict[str, str]] = []

    def snapshot(run: Run) -> list[Step]:
        data = json.loads((tmp_path / "out" / "report.json").read_text())
        seen.append({p["name"]: p["status"] for p in data["parts"]})
        return [Step("snap", [sys.executable, "-c", "pass"], 30)]

    plist = [_part(n, [sys.executable, "-c", "pass"]) for n in ("one", "two")]
    plist[1].steps = snapshot
    _check(tmp_path, plist)
    assert seen == [{"one": "ok", "two": "running"}]


def test_a_stop_mid_part_ends_its_group_and_says_cut_short(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    plist = [
        _part("hang", [sys.executable, "-c", HANG, str(pid_file)], limit=60.0),
        _part("later", [sys.executable, "-c", "pass"]),
    ]
    old = signal.signal(signal.SIGUSR1, gpu_check._stop)

    def stop_soon() -> None:
        deadline = time.monotonic() + 30
        while not pid_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    stopper = threading.Thread(target=stop_soon)
    stopper.start()
    try:
        with pytest.raises(gpu_check.Stopped):
            _check(tmp_path, plist)
    finally:
        stopper.join()
        signal.signal(signal.SIGUSR1, old)
    assert not alive(int(pid_file.read_text()))
    data = assert_md_matches_json(tmp_path / "out")
    assert [p["status"] for p in data["parts"]] == ["cut short", "pending"]
    assert not data["finished"] and data["verdict"].startswith("Cut short (SIGUSR1)")


STAMP = """
import pathlib, sys, time
me = pathlib.Path(sys.argv[1])
me.with_suffix(".start").write_text(str(time.monotonic_ns()))
time.sleep(float(sys.argv[2]))
me.with_suffix(".end").write_text(str(time.monotonic_ns()))
"""


def _stamps(folder: Path, name: str) -> tuple[int, int]:
    return int((folder / f"{name}.start").read_text()), int((folder / f"{name}.end").read_text())


def test_steps_run_at_most_workers_at_once_the_longest_expected_first(tmp_path: Path) -> None:
    def step(name: str, expect: float, sleep: float) -> tuple[Step, Path]:
        argv = [sys.executable, "-c", STAMP, str(tmp_path / name), str(sleep)]
        return Step(name, argv, 30, expect_s=expect), tmp_path / f"{name}.log"

    # one at a time: they start by expected time, longest first; results in the jobs' order
    jobs = [step("short", 1, 0), step("long", 9, 0), step("middle", 5, 0)]
    results = run_steps(jobs, 60, workers=1, grace_s=1.0)
    assert [r.name for r in results] == ["short", "long", "middle"]
    assert all(r.rc == 0 and not r.timed_out for r in results)
    starts = sorted(("short", "long", "middle"), key=lambda n: _stamps(tmp_path, n)[0])
    assert starts == ["long", "middle", "short"]
    # two at once: no third starts before one of them has ended
    names = [f"p{i}" for i in range(5)]
    results = run_steps([step(n, 0, 0.3) for n in names], 60, workers=2, grace_s=1.0)
    assert [r.name for r in results] == names and all(r.rc == 0 for r in results)
    spans = [_stamps(tmp_path, n) for n in names]
    for start, _ in spans:
        assert sum(a <= start < b for a, b in spans) <= 2


def test_each_step_of_a_pool_has_its_own_deadline_and_is_told_its_time(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    told = "import sys; print('told', sys.argv[1:])"
    jobs = [
        (Step("hang", [sys.executable, "-c", HANG, str(pid_file)], 2.0), tmp_path / "hang.log"),
        (Step("told", [sys.executable, "-c", told], 30.0, budget_flag="--budget"), tmp_path / "t"),
    ]
    hang, ok = run_steps(jobs, 60, workers=2, grace_s=1.0)
    assert hang.timed_out and hang.rc is None and not alive(int(pid_file.read_text()))
    assert "process group killed" in (tmp_path / "hang.log").read_text()
    assert ok.rc == 0 and not ok.timed_out
    # its limit (30 s) less the margin kept for its own end
    assert ok.argv[-2:] == ["--budget", "20"]
    assert "told ['--budget', '20']" in (tmp_path / "t").read_text()
    # a step that would start with under a second of the part left is not run
    (late,) = run_steps([(Step("late", [sys.executable, "-c", "pass"], 30), tmp_path / "l")], 0.5)
    assert late.not_run and late.rc is None and "not run" in (tmp_path / "l").read_text()


# ---- pytest's JUnit files ----------------------------------------------------------------------

SAMPLE_TESTS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "arithmetic"

def test_skips():
    pytest.skip("needs something absent")
"""


def test_a_test_files_failures_and_skips_come_from_its_junit_file(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    sample = tmp_path / "tests" / "test_sample.py"
    sample.write_text(SAMPLE_TESTS)
    run = Run("gpu", tmp_path / "work")
    (run.work / "data").mkdir(parents=True)
    step = parts.pytest_step(run, [str(sample)], 60)
    assert "ignore::pytest.PytestConfigWarning" in step.argv
    done = run_step(step, tmp_path / "log", 60)
    assert done.rc == 1
    outcome = parts.pytest_outcome(run, [done])
    assert outcome.status == "failed"
    assert outcome.summary.startswith("1 passed, 1 failed, 1 skipped in 1 file")
    assert "needs something absent" in outcome.summary
    (entry,) = outcome.details["files"]
    assert entry["file"] == str(sample)
    (failure,) = entry["failures"]
    assert failure["test"].endswith("::test_fails") and "arithmetic" in failure["message"]
    assert parts.junit(tmp_path / "missing.xml") is None
    # on a GPU, a file whose tests all skipped has shown nothing
    (run.work / "data" / "junit-only.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"><skipped message="no GPU"/>'
        "</testcase></testsuite></testsuites>"
    )
    skipped = StepResult("only", ["python", "-m", "pytest", "t.py"], tmp_path / "l", rc=0)
    assert parts.pytest_outcome(run, [skipped]).status == "failed"
    assert parts.pytest_outcome(Run("cpu-dry-run", run.work), [skipped]).status == "ok"


FAILS_THEN_HANGS = """
import time
from pathlib import Path

def test_fails():
    assert 1 + 1 == 3, "arithmetic"

def test_hangs():
    # "hangs" until its stacks are in the log (faulthandler_timeout), then ends the session
    deadline = time.monotonic() + 120
    while "in test_hangs" not in Path({log!r}).read_text():
        assert time.monotonic() < deadline, "no stacks dumped"
        time.sleep(0.1)
"""


def test_a_file_cut_at_its_deadline_would_still_say_why_and_where(tmp_path: Path) -> None:
    """The failure's text is in the log when the test fails, before the next test runs (not at
    the session's end), and a test still running near the deadline has its stack dumped
    (scripts/gpucheck/instant.py): a file cut at its deadline brings back both (on 2026-11-28's
    H200 it brought back ``FF``). The "hanging" test ends once its stacks are in the log."""
    log = tmp_path / "log"
    sample = tmp_path / "test_sample.py"
    sample.write_text(FAILS_THEN_HANGS.format(log=str(log)))
    run = Run("gpu", tmp_path / "work")
    (run.work / "data").mkdir(parents=True)
    step = parts.pytest_step(run, [str(sample)], 180)
    assert "faulthandler_timeout=165" in step.argv
    step.argv[step.argv.index("faulthandler_timeout=165")] = "faulthandler_timeout=2"
    done = run_step(step, log, 180)
    assert done.rc == 1 and not done.timed_out
    text = log.read_text()
    now = text.index("[failed now] ")
    assert "::test_fails (call)" in text[now:] and "arithmetic" in text[now:]
    assert now < text.index("Timeout") < text.index("in test_hangs")


MEET = """
import time
from pathlib import Path

def test_meets_the_other():
    here = Path({folder!r})
    (here / "{me}.started").write_text("")
    deadline = time.monotonic() + {wait}
    while not (here / "{other}.started").exists():
        assert time.monotonic() < deadline, "{other} did not run while {me} ran"
        time.sleep(0.05)
"""


@pytest.mark.parametrize("workers", [2, 1])
def test_test_files_run_at_once_each_in_its_own_process(tmp_path: Path, workers: int) -> None:
    """Each file waits until the other has started: both pass only if they run at once (the
    wait's deadline is long where they should; one at a time, the first gives up soon)."""
    wait = 60 if workers == 2 else 2
    files = []
    for me, other in (("a", "b"), ("b", "a")):
        path = tmp_path / f"test_meet_{me}.py"
        path.write_text(MEET.format(folder=str(tmp_path), me=me, other=other, wait=wait))
        files.append(str(path))

    def steps(run: Run) -> list[Step]:
        return [parts.pytest_step(run, [f], 90, expect_s=10) for f in files]

    part = Part("meet", "two files", 0, 120, steps, parts.pytest_outcome, workers=lambda r: workers)
    data = _check(tmp_path, [part], budget=200)
    (meet,) = data["parts"]
    results = [f["result"] for f in meet["details"]["files"]]
    assert [f["file"] for f in meet["details"]["files"]] == files
    if workers == 2:
        assert meet["status"] == "ok" and results == ["1 passed", "1 passed"], meet
    else:  # the control: one at a time, the first to run cannot meet the other
        assert sorted(results) == ["1 failed", "1 passed"], meet
    assert_md_matches_json(tmp_path / "out")


def test_each_gpu_test_file_has_a_deadline_after_its_expected_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = Run("gpu", Path("/nonexistent"))
    steps = {Path(s.argv[-1]).name: s for s in parts.tests_steps(run)}
    assert list(steps) == [Path(f).name for f in parts.test_files()]
    slow = steps["test_forward_training_gpu.py"]
    assert slow.expect_s == parts.TEST_SECONDS["test_forward_training_gpu.py"]
    assert slow.limit_s == parts.file_limit(slow.expect_s) > slow.expect_s
    assert slow.limit_s > steps["test_pager_gpu.py"].limit_s
    assert all(s.limit_s >= max(60, s.expect_s) for s in steps.values())
    (tests,) = [p for p in parts.default_parts(dry=False) if p.name == "tests"]
    assert tests.limit_s >= max(s.limit_s for s in steps.values())
    for cpus, workers in ((16, 4), (64, 4), (8, 2), (2, 1), (None, 1)):
        monkeypatch.setattr(parts.os, "cpu_count", lambda cpus=cpus: cpus)
        assert tests.workers(run) == workers
    assert tests.workers(Run("cpu-dry-run", run.work)) == 1
    assert len(parts.tests_steps(Run("cpu-dry-run", run.work))) == 1  # one for every file


def test_the_parts_but_forward_fit_the_default_budget_on_their_expected_times() -> None:
    """forward (100 s and more) comes last: it runs where time is left, or with --only."""
    gpu = parts.default_parts(dry=False)
    assert [p.name for p in gpu] == PARTS and PARTS[-1] == "forward"
    assert sum(p.expect_s for p in gpu[:-1]) <= gpu_check.GPU_BUDGET_S
    assert all(p.expect_s < p.limit_s for p in gpu)
    dry = parts.default_parts(dry=True)
    assert sum(p.expect_s for p in dry) <= gpu_check.DRY_BUDGET_S


def test_tests_gpu_files_run_most_important_first_and_the_tenant_check_apart(
    tmp_path: Path,
) -> None:
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    for name in ("test_zeta.py", "test_pager_gpu.py", "test_gpu_activity.py"):
        (gpu / name).write_text("")
    (tmp_path / parts.TENANT_TEST).write_text("")
    assert parts.test_files(tmp_path) == [
        "tests/gpu/test_gpu_activity.py",
        "tests/gpu/test_pager_gpu.py",
        "tests/gpu/test_zeta.py",
    ]


# ---- the benches' outputs against their targets ------------------------------------------------


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows}


def test_capture_cost_and_kernels_against_their_targets() -> None:
    data = {
        "conversion": {"records": 10, "scale": 1, "records_per_s": {"convert": [2e6, 3e6]}},
        "capture": {
            "steps": 30,
            "rounds": 3,
            "round_median_ms": {
                "plain": [20.0, 21.0, 20.0],
                "gpu activity": [20.6, 21.3, 21.5],  # 1.03, 1.014, 1.075: median 1.03
                "profiler": [28.0, 29.0, 30.0],
            },
            "worst_window": {"plain": [1.0], "gpu activity": [1.1, 1.6], "profiler": [1.2]},
            "kernels": {"gpu activity": 13_250, "profiler": 13_200, "dropped": 0},
        },
    }
    rows = _by_name(figures.activity(data, dry=False))
    capture = rows["GPU activity capture: LM step vs plain"]
    assert capture["verdict"] == "pass" and capture["value"] == "1.030x"
    assert capture["spread"] == "1.014-1.075 (3 rounds)"
    assert rows["torch.profiler (CPU + CUDA activities): LM step vs plain"]["verdict"] == "peer"
    assert rows["GPU activity: worst 5-step window / median"]["verdict"] == "miss"
    kernels = rows["kernels captured vs torch.profiler's (timed steps)"]
    assert kernels["verdict"] == "pass" and "0.38% apart" in kernels["value"]
    data["capture"]["kernels"]["gpu activity"] = 13_500  # 2.3% more
    rows = _by_name(figures.activity(data, dry=False))
    assert rows["kernels captured vs torch.profiler's (timed steps)"]["verdict"] == "miss"
    dry = figures.activity(data, dry=True)
    assert {r["verdict"] for r in dry} == {"n/a (CPU)"}
    skipped = figures.activity({"capture": {"skipped": "no CUPTI"}}, dry=False)
    assert skipped[0]["verdict"] == "not measured" and skipped[0]["note"] == "no CUPTI"


def test_overhead_ratios_are_per_round_against_the_same_rounds_runs() -> None:
    def run(ms: float) -> list[float]:
        return [ms] * 30

    data = {
        "rounds": [
            {"none": run(20), "off": run(20.1), "off-nonvml": run(20.0), "module": run(20.4),
             "op": run(27)},
            {"none": run(10), "off": run(10.3), "off-nonvml": run(10.0), "module": run(10.2),
             "op": run(12)},
        ]
    }  # fmt: skip
    rows = _by_name(figures.overhead(data, dry=False))
    nvml = rows["NVML default families: record --torch off vs --no-nvml"]
    assert nvml["number"] == pytest.approx((1.005 + 1.03) / 2) and nvml["verdict"] == "miss"
    module = rows["module level (record --torch module) vs no recording"]
    assert module["number"] == pytest.approx(1.02) and module["verdict"] == "pass"
    op = rows["op level (record --torch op) vs no recording"]
    assert op["number"] == pytest.approx((1.35 + 1.2) / 2) and op["verdict"] == "pass"


def test_a_target_met_or_missed_on_one_round_says_so(tmp_path: Path) -> None:
    def run(ms: float) -> list[float]:
        return [ms] * 30

    first = {"none": run(20), "off": run(24), "off-nonvml": run(20), "module": run(20.2),
             "op": run(25)}  # fmt: skip
    second = {"none": run(20), "off": run(20.2), "off-nonvml": run(20), "module": run(20.2)}
    rows = _by_name(figures.overhead({"rounds": [first]}, dry=False))
    nvml = rows["NVML default families: record --torch off vs --no-nvml"]
    assert (
        nvml["verdict"] == "miss" and nvml["rounds"] == 1 and nvml["spread"].endswith("(1 round)")
    )
    assert figures.result(nvml) == "miss (1 round)"
    module = rows["module level (record --torch module) vs no recording"]
    assert figures.result(module) == "pass (1 round)"
    info = rows["record --torch off (samplers only) vs no recording"]
    assert figures.result(info) == "info"
    # a second round settles what it has: op level, not in it, stays on one round
    rows = _by_name(figures.overhead({"rounds": [first, second]}, dry=False))
    assert figures.result(rows["NVML default families: record --torch off vs --no-nvml"]) == "miss"
    assert figures.result(rows["module level (record --torch module) vs no recording"]) == "pass"
    assert figures.result(rows["op level (record --torch op) vs no recording"]) == "pass (1 round)"
    # the part's summary, the Markdown and the verdict say it too
    r = Run("gpu", tmp_path / "work")
    r.data("x").parent.mkdir(parents=True)
    r.data("overhead.json").write_text(json.dumps({"rounds": [first]}))
    ok = StepResult("gpu_overhead", ["x"], tmp_path / "log", rc=0)
    outcome = parts.overhead_collect(r, [ok])
    assert outcome.status == "missed" and "1.200x (1 round)" in outcome.summary
    plist = [_part("overhead", [sys.executable, "-c", "pass"])]
    rep = gpu_check.new_report(plist, "gpu", 60, "test")
    rep["parts"][0].update(status=outcome.status, figures=outcome.figures)
    rep["verdict"] = gpu_check.verdict(rep)
    assert "3 of them on one round only" in rep["verdict"]
    report.write(rep, tmp_path / "out")
    assert (
        "NVML default families: record --torch off vs --no-nvml",
        "1.200x",
        "miss (1 round)",
    ) in (md_figures((tmp_path / "out" / "report.md").read_text()))
    assert_md_matches_json(tmp_path / "out")


def test_forwarded_step_ratio_and_bitwise_losses() -> None:
    summary = {
        "local": {"rounds": 2, "errors": [], "median_ms": 20.0},
        "forwarded": {"rounds": 2, "errors": [], "median_ms": 24.0, "ratio": 1.2, "low": 1.1,
                      "high": 1.3, "bitwise": True, "client_cpu_ms": 5.0},
        "forwarded-gpuless": {"rounds": 2, "errors": [], "median_ms": 34.0, "ratio": 1.7,
                              "low": 1.6, "high": 1.8, "bitwise": False, "client_cpu_ms": 6.0},
    }  # fmt: skip
    rows = _by_name(figures.forward({"models": {"lm": {"summary": summary}}}, dry=False))
    assert rows["forwarded lm step vs local (client sees the GPU)"]["verdict"] == "pass"
    assert rows["forwarded lm step vs local (GPU-less client)"]["verdict"] == "miss"
    assert rows["forwarded lm losses bitwise the local run's (GPU-less client)"]["value"] == "NO"
    assert (
        rows["forwarded lm losses bitwise the local run's (GPU-less client)"]["verdict"] == "miss"
    )


def test_a_part_missing_a_target_or_its_output_says_so(tmp_path: Path) -> None:
    run = Run("gpu", tmp_path)
    (tmp_path / "data").mkdir()
    ok = StepResult("x", ["x"], tmp_path / "log", rc=0)

    def read(data: dict[str, Any], dry: bool) -> list[dict[str, Any]]:
        return [figures.figure("a", data["a"], str(data["a"]), target=figures.OP, dry=dry)]

    (tmp_path / "data" / "x.json").write_text(json.dumps({"a": 1.2}))
    assert parts.bench_outcome(run, [ok], [("x.json", read)]).status == "ok"
    (tmp_path / "data" / "x.json").write_text(json.dumps({"a": 1.4}))
    missed = parts.bench_outcome(run, [ok], [("x.json", read)])
    assert missed.status == "missed" and "missed: a 1.4" in missed.summary
    assert parts.bench_outcome(run, [ok], [("y.json", read)]).status == "failed"
    failed = StepResult("x", ["x"], tmp_path / "log", rc=1)
    assert parts.bench_outcome(run, [failed], [("x.json", read)]).status == "failed"


def test_the_check_imports_nothing_but_the_standard_library() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r});"
        f" sys.argv = ['gpu_check']; import runpy;"
        f" runpy.run_path({str(SCRIPT)!r}, run_name='not_main');"
        " print(sorted(m for m in ('torch', 'numpy', 'pyarrow', 'gpu_trace') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- the benches' machine-readable outputs ------------------------------------------------------


def _load_bench(name: str) -> Any:
    bspec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert bspec is not None and bspec.loader is not None
    module = importlib.util.module_from_spec(bspec)
    bspec.loader.exec_module(module)
    return module


def test_gpu_activity_counts_the_kernels_that_start_inside_the_timed_steps(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from gpu_trace.collectors.gpu_activity import activity, activity_file

    bench = _load_bench("gpu_activity")
    records = np.zeros(5, activity.RECORD)
    records["kind"] = [activity.CONCURRENT_KERNEL] * 3 + [activity.MEMCPY, activity.RUNTIME]
    records["start"] = [100, 200, 300, 200, 200]  # CUPTI's clock: monotonic is +1000
    records["end"] = records["start"] + 10
    blob = activity_file.encode(records, {}, [(0, 1000)], dropped=2)
    spool = tmp_path / "spool"
    spool.mkdir()
    activity_file.write(spool / "gpu_activity-1-x.bin", blob)
    assert bench.captured_kernels(tmp_path, 1150, 1300) == (2, 2)  # 1200 and 1300, not 1100


def test_machine_probe_answers_every_section_here() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "machine.py"), "--no-build"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert set(info) >= {"host", "torch", "nvml", "cupti", "tools", "packages", "c_parts", "gpu"}
    assert re.match(r"\d+\.\d+", info["host"]["python"])
    assert info["packages"]["pytest"]
