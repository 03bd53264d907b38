"""bench/forward_gpu.py: its CPU-device variant end to end (``--quick``, one model), its figures,
and the baseline checkout its ``@base`` peers import."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "forward_gpu.py"
spec = importlib.util.spec_from_file_location("forward_gpu", BENCH)
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
sys.modules["forward_gpu"] = bench
spec.loader.exec_module(bench)


def test_quick_cpu_variant_times_the_forwarded_step_with_local_losses() -> None:
    """The rpc peer is left out here: its start and shutdown take seconds more than the rest."""
    pytest.importorskip("torch")
    cmd = [
        sys.executable,
        str(BENCH),
        "--quick",
        "--cpu",
        "--models",
        "mlp",
        "--peers",
        "forwarded",
    ]
    out = subprocess.run(
        [*cmd, "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["device"] == "cpu" and "CPU-device variant" in result["note"]
    summary = result["models"]["mlp"]["summary"]
    assert list(summary) == ["local", "forwarded"]
    for peer, row in summary.items():
        assert row["errors"] == [] and row["rounds"] == 1 and row["median_ms"] > 0, peer
        assert row["bitwise"] is True, peer  # every loss as local's, bit for bit
    (round_,) = result["models"]["mlp"]["rounds"]
    assert len(round_["forwarded"]["times_ms"]) == 5
    assert round_["forwarded"]["runtime"] == str(REPO)
    assert summary["forwarded"]["server_cpu_ms"] > 0 and summary["forwarded"]["client_cpu_ms"] > 0
    # Its phases on stderr as they go, the clients' too (gpu_check's log: a run stopped from
    # outside shows where it was; stdout, the JSON, has nothing before the end).
    said = [line.split("s: ", 1)[-1] for line in out.stderr.splitlines() if "forward_gpu" in line]
    for phase in (
        "starting the forwarding server (process isolation)",
        "mlp, round 1/1: local",
        "mlp, round 1/1: forwarded",
        "connected: session 1, worker ",
        "model and batch on the device",
        "5 timed steps done",
        "the forwarding servers stopped",
    ):
        assert any(line.startswith(phase) for line in said), (phase, out.stderr[-2000:])


def test_figures_are_medians_and_ratios_to_local_of_the_same_round() -> None:
    losses = ["0x1.0p+0"]
    rounds = [
        {
            "local": {"times_ms": [1.0, 2.0, 9.0], "losses": losses},
            "forwarded": {"times_ms": [3.0, 4.0, 5.0], "losses": losses},
            "rpc": {"error": "RuntimeError: gone"},
        },
        {
            "local": {"times_ms": [4.0], "losses": losses},
            "forwarded": {"times_ms": [6.0], "losses": ["0x1.8p+0"]},
            "rpc": {"times_ms": [8.0], "losses": losses},
        },
    ]
    s = bench.summarize(rounds)
    assert s["forwarded"]["median_ms"] == 5.0  # of the rounds' medians 4 and 6
    assert (s["forwarded"]["ratio"], s["forwarded"]["low"], s["forwarded"]["high"]) == (
        1.75,
        1.5,
        2.0,
    )
    assert s["forwarded"]["bitwise"] is False  # one loss differed in one round
    assert s["rpc"]["errors"] == ["RuntimeError: gone"] and s["rpc"]["ratio"] == 2.0
    assert "failed" in bench.table("mlp", {"rpc": {"rounds": 0, "errors": ["x"]}})


def test_every_model_trains_a_step_on_the_cpu() -> None:
    pytest.importorskip("torch")
    for model in bench.MODELS:
        trainer = bench.Trainer(model, bench.SIZES["cpu"][model], "cpu")
        got = bench.timed_steps(lambda t=trainer: t.step().item(), 1, 1)
        assert len(got["times_ms"]) == 1 and len(got["losses"]) == 2
        assert got["client_cpu_ms"] > 0 and "server_cpu_ms" not in got


def test_baseline_path_imports_the_other_checkouts_package(tmp_path: Path) -> None:
    path = bench.baseline_path(REPO, tmp_path / "base")
    out = subprocess.run(
        [sys.executable, "-c", "import gpu_trace.runtime.protocol.wire as w; print(w.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(path)},
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(path / "gpu_trace" / "runtime" / "protocol" / "wire.py")
