"""bench/gpu_overhead.py's pieces, cheaply: the worker trains and times, the figures, the commands.

The bench itself (a fresh process per configuration and round) is run by hand: ``--quick`` on a
CPU is about a minute here; on a GPU see its docstring.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_overhead", REPO / "bench" / "gpu_overhead.py")
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
sys.modules["gpu_overhead"] = bench
spec.loader.exec_module(bench)


def test_the_worker_trains_the_program_and_times_each_step() -> None:
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    try:
        times = bench.train(bench.QUICK_MODEL, 12, 1, "cpu", "cpu")
    finally:  # the worker pins one thread, as a process of its own: not this one's later tests
        torch.set_num_threads(threads)
    assert len(times) == 12 and all(t > 0 for t in times)


def test_figures_are_windows_medians_and_ratios_to_none_of_the_same_round() -> None:
    steady = [10.0] * 30
    stalled = [10.0] * 10 + [10.0] * 9 + [40.0] + [10.0] * 10  # one window of 13 ms a step
    assert bench.windows(stalled) == [10.0, 13.0, 10.0]
    assert bench.run_figures(stalled) == (10.0, 1.3)
    rounds = [
        {"none": steady, "op": [20.0] * 30},
        {"none": [5.0] * 30, "op": stalled},
    ]
    rows = {name: rest for name, *rest in bench.summarize(rounds)}
    assert rows["none"] == [7.5, 1.0, 0.0, 1.0, 2]  # the median of 10 and 5 ms
    median, ratio, spread, worst, n = rows["op"]
    assert median == 15.0 and ratio == pytest.approx(2.0) and spread == pytest.approx(0.0)
    assert worst == 1.3 and n == 2
    noisy = [{"none": [10.0] * 10, "off": [10.0 + d] * 10} for d in (0.0, 0.2, 0.4)]
    (_, _, ratio, spread, _, _) = bench.summarize(noisy)[1]
    assert ratio == pytest.approx(1.02) and spread == pytest.approx(2 * 0.02 / 3**0.5)


def test_every_configuration_has_a_command_and_gpu_ones_are_skipped_without_a_gpu(
    tmp_path: Path,
) -> None:
    out, run = tmp_path / "o.json", tmp_path / "run"
    for config in bench.CONFIGS:
        cmd = bench.command(config, out, 20, "quick", run)
        worker = cmd[cmd.index("worker") :]
        assert worker[:4] == ["worker", "--out", str(out), "--steps"] and "quick" in worker
        assert ("--profiler" in worker) == config.startswith("profiler")
    assert bench.command("off-nonvml", out, 20, "quick", run)[3:9] == [
        "record",
        "--no-ingest",
        "--run-dir",
        str(run),
        "--torch",
        "off",
    ]
    assert bench.environment("off-allnvml")["GPU_TRACE_NVML_FAMILIES"] == "all"
    assert "GPU_TRACE_NVML_FAMILIES" not in bench.environment("off")
    keep, notes = bench.available(list(bench.CONFIGS), gpu=False)
    assert "profiler-cuda" not in keep and "nsys" not in keep and len(notes) == 2
    with pytest.raises(ValueError, match="unknown configuration"):
        bench.command("perf", out, 20, "quick", run)


def test_a_budget_starts_no_run_the_slowest_so_far_says_would_not_end_within_it() -> None:
    assert bench.room_for(0.0, 0.0, 10.0)  # the first run always starts
    assert bench.room_for(80.0, 15.0, 95.0) and not bench.room_for(81.0, 15.0, 95.0)
    assert bench.room_for(1e6, 1e6, None)  # no budget: every round runs
