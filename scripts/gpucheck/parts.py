"""The GPU check's parts: for each, the children it runs (``steps``, GPU or CPU dry-run variant),
how long it is expected to take and may take, and how its results become an outcome (status,
summary, figures). In the order they run: :func:`default_parts`. Standard library only."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpucheck import figures as gpu_figures
from gpucheck.runner import ROOT, Step, StepResult

TENANT_TEST = "tests/gpu/test_tenant_isolation_gpu.py"
#: tests/gpu files, most important first (the issue's list; others follow by name), each with
#: the seconds its process takes alone on an H100 (2026-11-27's runs, pytest's start included).
TEST_SECONDS: dict[str, float] = {
    # 45 s on the H100; on the H200 (2026-11-28) cut at 70 s after two failures. Four recorded
    # runs, each failing with its stacks after 30 s (tests/gpu/children.py): within 90 s.
    "test_gpu_activity.py": 60,
    "test_forward_training_gpu.py": 90,  # 3 cases of about 20 s and an 18 s server start
    "test_cuda_emulation_gpu.py": 45,
    "test_pager_gpu.py": 13,
    "test_nvml_gpu.py": 11,
    "test_module_level_gpu.py": 16,
    "test_forwarded_kernels_gpu.py": 30,
    "test_forward_amp_gpu.py": 70,  # bf16 took 48 s with the server's start; fp16 not yet seen
    "test_sharing_gpu.py": 12,
    "test_executor_plan_gpu.py": 15,
}
#: A tests/gpu file not in :data:`TEST_SECONDS`.
TEST_DEFAULT_S = 30.0


@dataclass
class Run:
    """What the parts share: the mode, the folder their logs and outputs go to, the machine."""

    mode: str  # "gpu" or "cpu-dry-run"
    work: Path
    python: str = sys.executable
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def dry(self) -> bool:
        return self.mode == "cpu-dry-run"

    def bench(self, name: str, *args: str) -> list[str]:
        return [self.python, str(ROOT / "bench" / name), *args]

    def data(self, name: str) -> Path:
        return self.work / "data" / name


@dataclass
class Outcome:
    status: str
    summary: str = ""
    figures: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    halt: str = ""  # set: the parts after this one are not run, and this says why


@dataclass
class Part:
    name: str
    title: str
    expect_s: float
    limit_s: float
    steps: Callable[[Run], list[Step]]
    collect: Callable[[Run, list[StepResult]], Outcome]
    absent: Callable[[Run], str] = lambda run: ""
    workers: Callable[[Run], int] = lambda run: 1  # its steps at once


def steps_status(results: list[StepResult]) -> str:
    """``timed out`` if a step timed out or did not run, ``failed`` if one failed, else ``ok``."""
    if any(r.timed_out or r.not_run for r in results):
        return "timed out"
    return "failed" if any(r.rc != 0 for r in results) else "ok"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def bench_outcome(
    run: Run,
    results: list[StepResult],
    outputs: list[tuple[str, Callable[[dict[str, Any], bool], list[dict[str, Any]]]]],
) -> Outcome:
    """Figures from each bench output that exists; the status from the steps and the figures:
    a target missed is ``missed``, a target not measured on a GPU is ``failed``."""
    figures: list[dict[str, Any]] = []
    missing = []
    for name, read in outputs:
        data = read_json(run.data(name))
        if data is None:
            missing.append(name)
            continue
        try:
            figures += read(data, run.dry)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            missing.append(f"{name} (unreadable: {type(exc).__name__}: {exc})")
    status = steps_status(results)
    targets = [f for f in figures if f["target"] not in ("-", "peer")]
    met = sum(f["verdict"] == "pass" for f in targets)
    missed = [f for f in targets if f["verdict"] == "miss"]
    unmeasured = [f for f in targets if f["verdict"] == "not measured"]
    if status == "ok" and (missing or (unmeasured and not run.dry)):
        status = "failed"
    elif status == "ok" and missed:
        status = "missed"
    if run.dry:
        summary = f"{gpu_figures.plural(len(figures), 'figure')} read from the CPU variant"
        summary += " (not GPU figures)"
    else:
        summary = f"{met} of {len(targets)} targets met"
        if missed:
            summary += "; missed: " + ", ".join(
                f"{f['name']} {f['value']}" + (" (1 round)" if f.get("rounds") == 1 else "")
                for f in missed
            )
        if unmeasured:
            summary += "; not measured: " + ", ".join(f["name"] for f in unmeasured)
    if missing:
        summary += "; no figures from " + ", ".join(missing)
    return Outcome(status, summary, figures)


# machine


def machine_steps(run: Run) -> list[Step]:
    return [
        Step(
            "machine",
            run.bench("machine.py", "--json", str(run.data("machine.json"))),
            60 if run.dry else 120,
        )
    ]


def machine_collect(run: Run, results: list[StepResult]) -> Outcome:
    data = read_json(run.data("machine.json"))
    if data is None:
        status = "timed out" if results and results[0].timed_out else "failed"
        halt = "" if run.dry else "the machine probe gave no answer: torch is not importable?"
        return Outcome(status, "the probe gave no answer (see its log)", halt=halt)
    run.machine = data
    torch = data.get("torch") or {}
    devices = torch.get("devices") or []
    parts = data.get("c_parts") or {}
    built = sum(str(v).startswith("ok") for v in parts.values())
    pkgs = data.get("packages") or {}
    summary = (
        (", ".join(d["name"] for d in devices) or "no CUDA device")
        + f"; torch {torch.get('version')} (CUDA {torch.get('cuda')});"
        f" driver {(data.get('nvml') or {}).get('driver', 'unknown')};"
        f" C parts {built} of {len(parts)};"
        f" chDB {'present' if isinstance(pkgs, dict) and pkgs.get('chdb') else 'absent'}"
    )
    halt = ""
    if not run.dry and not data.get("gpu"):
        why = torch.get("error") or f"torch {torch.get('version')} sees no CUDA device"
        halt = f"no GPU here ({why})"
    return Outcome("ok", summary, details={"machine": "in the report's machine section"}, halt=halt)


# tests/gpu


def test_files(root: Path = ROOT) -> list[str]:
    """tests/gpu's test files, most important first, the tenant check left to its own part."""
    names = sorted(p.name for p in (root / "tests" / "gpu").glob("test_*.py"))
    names = [n for n in names if f"tests/gpu/{n}" != TENANT_TEST]
    ordered = [n for n in TEST_SECONDS if n in names] + [n for n in names if n not in TEST_SECONDS]
    return [f"tests/gpu/{n}" for n in ordered]


def pytest_step(
    run: Run, paths: list[str], limit_s: float, name: str = "", expect_s: float = 0.0
) -> Step:
    """pytest on ``paths`` (named after the file, or ``name``), its JUnit file in the data."""
    name = name or Path(paths[0]).stem
    argv = [run.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs"]
    # pyproject.toml names pytest-timeout's `timeout` option: where the plugin is missing (the
    # GPU machines), pytest's unknown-option warning is an error under filterwarnings=error.
    argv += ["-W", "ignore::pytest.PytestConfigWarning"]
    argv += ["--junitxml", str(run.data(f"junit-{name}.xml"))]
    # Failures written when they happen, and the stacks of a test still running near the
    # deadline: a file killed at its deadline still says why (scripts/gpucheck/instant.py).
    argv += ["-p", "scripts.gpucheck.instant"]
    argv += ["-o", f"faulthandler_timeout={max(10, int(limit_s) - 15)}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv += ["--timeout", str(max(10, int(limit_s) - 10))]  # a hung test fails alone
    return Step(name, [*argv, *paths], limit_s, expect_s=expect_s)


def file_limit(expect_s: float) -> float:
    """A test file's deadline: half as long again as it is expected to take, at least 60 s."""
    return max(60.0, 1.5 * expect_s)


def tests_steps(run: Run) -> list[Step]:
    """One process per file on a GPU (a hang or crash costs one file), each with a deadline
    after its expected time; on the dry run, where every test skips, one for all (the same
    reading, a tenth of the start-ups)."""
    if run.dry:
        return [pytest_step(run, test_files(), 100.0, name="tests-gpu")]
    steps = []
    for f in test_files():
        expect = TEST_SECONDS.get(Path(f).name, TEST_DEFAULT_S)
        steps.append(pytest_step(run, [f], file_limit(expect), expect_s=expect))
    return steps


def tests_workers(run: Run) -> int:
    """Test files run at once on a GPU: one per 4 CPUs (a file starts torch, often a server
    and a client beside it), at most 4; the whole GPU is theirs, and no test times anything
    against a bound. Sequential on the dry run (one process anyway)."""
    if run.dry:
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def junit(path: Path) -> dict[str, Any] | None:
    """Counts and failures of one pytest JUnit XML file (None if it is missing or damaged)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures, skips = [], []
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                lines = [x for x in (child.text or "").splitlines() if x.strip()]
                failures.append(
                    {
                        "test": test,
                        "message": (child.get("message") or "").splitlines()[0][:300]
                        if child.get("message")
                        else "",
                        "tail": [x[:300] for x in lines[-12:]],
                    }
                )
                break
            if child.tag == "skipped":
                outcome = "skipped"
                skips.append((child.get("message") or "")[:200])
        counts[outcome] += 1
    return {"counts": counts, "failures": failures, "skips": skips}


def pytest_outcome(run: Run, results: list[StepResult]) -> Outcome:
    files, skips, n_files = [], [], 0
    total = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in results:
        paths = [a for a in r.argv[3:] if a.endswith(".py")]
        n_files += len(paths)
        label = paths[0] if len(paths) == 1 else f"{len(paths)} files in one process"
        entry: dict[str, Any] = {"file": label, "seconds": round(r.seconds, 1)}
        parsed = None if r.not_run or r.timed_out else junit(run.data(f"junit-{r.name}.xml"))
        if r.not_run:
            entry["result"] = f"not run: {r.not_run}"
        elif r.timed_out:
            entry["result"] = f"timed out after {r.seconds:.0f} s (its process group killed)"
        elif parsed is None:
            entry["result"] = f"no JUnit report (exit status {r.rc}): see the log"
        else:
            c = parsed["counts"]
            for k in total:
                total[k] += c[k]
            entry["result"] = ", ".join(f"{v} {k}" for k, v in c.items() if v) or "no tests"
            entry["failures"] = parsed["failures"]
            skips += parsed["skips"]
        files.append(entry)
    status = steps_status(results)
    if status == "failed" or any("no JUnit" in f["result"] for f in files):
        status = "failed"
    if status == "ok" and (total["failed"] or total["error"]):
        status = "failed"
    if status == "ok" and not run.dry and not total["passed"]:
        status = "failed"  # on a GPU, tests that all skip have shown nothing
    summary = ", ".join(f"{v} {k}" for k, v in total.items() if v) or "no tests ran"
    summary += f" in {gpu_figures.plural(n_files, 'file')}"
    bad = [f["file"] for f in files if f["result"].startswith(("timed out", "not run", "no JUnit"))]
    if bad:
        summary += "; " + ", ".join(bad) + ": see details"
    if skips:
        reasons = sorted(set(skips), key=skips.count, reverse=True)
        summary += f"; skipped because: {reasons[0]}" + (
            f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else ""
        )
    return Outcome(status, summary, details={"files": files, "skip_reasons": sorted(set(skips))})


# the two-tenant check


def tenants_absent(run: Run) -> str:
    return "" if (ROOT / TENANT_TEST).is_file() else f"{TENANT_TEST} is not in this checkout"


def tenants_steps(run: Run) -> list[Step]:
    return [pytest_step(run, [TENANT_TEST], 40.0 if run.dry else 120.0)]


# the figures


def activity_steps(run: Run) -> list[Step]:
    out = str(run.data("activity.json"))
    if run.dry:
        return [
            Step(
                "gpu_activity",
                run.bench("gpu_activity.py", "--scale", "1", "--rounds", "1", "--json", out),
                40,
            )
        ]
    # a fresh process per mode and round, 3 modes: 2 rounds are 6 starts of torch and CUDA
    args = ["--gpu", "--scale", "1", "--rounds", "1", "--capture-rounds", "2", "--steps", "30"]
    return [Step("gpu_activity", run.bench("gpu_activity.py", *args, "--json", out), 130)]


def activity_collect(run: Run, results: list[StepResult]) -> Outcome:
    return bench_outcome(run, results, [("activity.json", gpu_figures.activity)])


OVERHEAD_CONFIGS = "none,off,off-nonvml,module,op"


def overhead_steps(run: Run) -> list[Step]:
    """Told its time (``--budget``), the bench starts no run it could not finish and ends with
    the rounds it has. On a GPU a run is a fresh process, about 15 s on an H100 (torch and CUDA
    starting; its 40 steps are 1 s of it): 2 rounds of 5 are about 150 s."""
    out = str(run.data("overhead.json"))
    if run.dry:  # --quick: the tiny CPU model, one window; op level is not among its configs
        args = ["--quick", "--configs", OVERHEAD_CONFIGS, "--timeout", "60"]
        limit = 90.0
    else:
        args = ["--configs", OVERHEAD_CONFIGS, "--rounds", "2", "--steps", "30", "--timeout", "60"]
        limit = 190.0
    bench = run.bench("gpu_overhead.py", *args, "--json", out)
    return [Step("gpu_overhead", bench, limit, budget_flag="--budget")]


def overhead_collect(run: Run, results: list[StepResult]) -> Outcome:
    return bench_outcome(run, results, [("overhead.json", gpu_figures.overhead)])


def forward_steps(run: Run) -> list[Step]:
    out = run.data("forward.json")
    if run.dry:  # on a CPU there is no GPU-less peer: it would be the same runs
        args = ["--quick", "--models", "lm", "--peers", "forwarded", "--json"]
        return [Step("forward_gpu", run.bench("forward_gpu.py", *args), 60, stdout=out)]
    args = ["--models", "lm", "--peers", "forwarded,forwarded-gpuless", "--rounds", "2"]
    args += ["--steps", "10", "--warmup", "3", "--json"]
    return [Step("forward_gpu", run.bench("forward_gpu.py", *args), 150, stdout=out)]


def forward_collect(run: Run, results: list[StepResult]) -> Outcome:
    return bench_outcome(run, results, [("forward.json", gpu_figures.forward)])


def paging_steps(run: Run) -> list[Step]:
    pages, restores = str(run.data("paging.json")), str(run.data("restore.json"))
    if run.dry:
        a = ["--mb", "8", "--tensor-mb", "4", "--rounds", "1", "--device", "cpu"]
        b = ["--restore-gb", "0.01", "--restore-reps", "1", "--restore-device", "cpu"]
        limit = 45.0
    else:
        a = ["--mb", "64", "256", "--rounds", "3"]
        b = ["--restore-gb", "0.25", "1.0", "--restore-reps", "3"]
        limit = 45.0
    return [
        Step("paging", run.bench("paging.py", *a, "--out", pages), limit),
        Step("restore", run.bench("sharing.py", "--part", "restore", *b, "--out", restores), limit),
    ]


def paging_collect(run: Run, results: list[StepResult]) -> Outcome:
    return bench_outcome(
        run, results, [("paging.json", gpu_figures.paging), ("restore.json", gpu_figures.restore)]
    )


def nvml_steps(run: Run) -> list[Step]:
    out = str(run.data("nvml.json"))
    if run.dry:  # the replayed H100 recording: pynvml is not needed
        args = ["--ticks", "200", "--seconds", "0.3", "--warmup", "0.1", "--timeout", "30"]
        return [Step("collectors", run.bench("collectors.py", *args, "--json", out), 40)]
    args = ["--real-nvml", "--ticks", "500", "--seconds", "1", "--warmup", "0.5", "--timeout", "40"]
    return [Step("collectors", run.bench("collectors.py", *args, "--json", out), 45)]


def nvml_collect(run: Run, results: list[StepResult]) -> Outcome:
    return bench_outcome(run, results, [("nvml.json", gpu_figures.nvml)])


def default_parts(dry: bool) -> list[Part]:
    """The parts in the order they run; ``expect_s``/``limit_s`` on an H100 (as measured on
    2026-11-27 where it was), or on the dry run."""

    def t(gpu: tuple[float, float], cpu: tuple[float, float]) -> tuple[float, float]:
        return cpu if dry else gpu

    # machine, tests and tenants first (what the rest stands on), then the figures with targets;
    # the cheap nvml and paging parts fill what is left; forward (100 s and more) comes last
    # (with the default budget, --only forward in a call of its own).
    return [
        Part(
            "machine",
            "the machine: GPU, driver, CUDA, torch, CUPTI; what is there; C parts",
            *t((10, 90), (5, 60)),  # 10 s, 5 s with the C parts built
            machine_steps,
            machine_collect,
        ),
        Part(
            "tests",
            "pytest tests/gpu (on a GPU one process per file, a few at once)",
            *t((100, 160), (40, 150)),  # the longest file 90 s; 350 s of files, 4 at once
            tests_steps,
            pytest_outcome,
            workers=tests_workers,
        ),
        Part(
            "tenants",
            f"two tenants on CUDA ({TENANT_TEST})",
            *t((90, 120), (5, 40)),  # 89 s
            tenants_steps,
            pytest_outcome,
            tenants_absent,
        ),
        Part(
            "activity",
            "GPU activity capture cost and kernels vs torch.profiler (LM step)",
            *t((90, 130), (5, 40)),  # not yet measured: 6 processes of about 15 s
            activity_steps,
            activity_collect,
        ),
        Part(
            "overhead",
            "NVML default families, module and op level (LM step)",
            *t((150, 190), (25, 90)),  # one round of 5 runs in 73 s
            overhead_steps,
            overhead_collect,
        ),
        Part(
            "nvml",
            "the real NVML sampler's CPU and call latencies",
            *t((10, 45), (5, 40)),  # 8 s
            nvml_steps,
            nvml_collect,
        ),
        Part(
            "paging",
            "restore and page-out vs a plain pinned copy; first op after a restore",
            *t((25, 60), (10, 90)),  # 24 s
            paging_steps,
            paging_collect,
        ),
        Part(
            "forward",
            "a forwarded LM training step vs local, with and without a GPU client",
            *t((100, 150), (15, 60)),  # timed out at 100 s
            forward_steps,
            forward_collect,
        ),
    ]
