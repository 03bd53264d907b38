"""Holistic Trace Analysis reads our Chrome export: steps, iterations, ops, kernels, durations."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from gpu_trace.tracer.chrome import write_chrome_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_chrome import spans  # noqa: E402

hta_analysis = pytest.importorskip("hta.trace_analysis")

# HTA 0.5 calls pandas APIs that pandas 3 deprecates; those warnings are HTA's, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

BASE = 5_000_000_000
STEPS = 4


def recorded() -> list[tuple]:
    """Four steps on the main thread, three ops each, each op launching a kernel on gpu0/stream7.

    Times are deliberately not whole microseconds, to see what HTA does with nanoseconds.
    """
    rows: list[tuple] = []
    sid = 1
    for k in range(STEPS):
        s0 = BASE + k * 1_000_000 + 137
        rows.append(
            ("h1", sid, 0, 10, 10, "steps", "step", f"ProfilerStep#{k}", s0, s0 + 999_555 - k, None)
        )
        sid += 1
        for j in range(3):
            a = s0 + 1_334 + j * 200_000
            corr = str(100 * k + j)
            rows.append(
                (
                    "h1",
                    sid,
                    0,
                    10,
                    10,
                    "nvtx/torch",
                    "op",
                    "aten::mm",
                    a,
                    a + 150_250 + j,
                    {"correlation": corr},
                )
            )
            sid += 1
            g = a + 20_000
            rows.append(
                (
                    "h1",
                    sid,
                    0,
                    10,
                    11,
                    "gpu0/stream7",
                    "kernel",
                    "sgemm",
                    g,
                    g + 90_500,
                    {"correlation": corr},
                )
            )
            sid += 1
    return sorted(rows, key=lambda r: r[8])


def analyze(tmp_path: Path, rows: list[tuple]) -> tuple[object, pa.Table]:
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    table = spans(rows)
    write_chrome_trace(trace_dir / "rank-0.json", {"run_id": "r", "started_ns": BASE}, [], [table])
    analysis = hta_analysis.TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)
    df = analysis.t.get_trace(0).copy()
    analysis.t.symbol_table.add_symbols_to_trace_df(df, "name")
    analysis.t.symbol_table.add_symbols_to_trace_df(df, "cat")
    return analysis, df


def test_hta_finds_steps_ops_and_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HTA_DISABLE_NS_ROUNDING", raising=False)
    rows = recorded()
    analysis, df = analyze(tmp_path, rows)
    assert analysis.get_profiler_steps() == list(range(STEPS))
    assert analysis.t.meta_data[0]["distributedInfo"]["rank"] == 0

    steps = df[df["name"].str.startswith("ProfilerStep#")].sort_values("ts")
    ops = df[df["cat"] == "cpu_op"]
    kernels = df[df["cat"] == "kernel"]
    assert len(steps) == STEPS and len(ops) == 3 * STEPS and len(kernels) == 3 * STEPS
    assert (steps["stream"] == -1).all() and (kernels["stream"] == 7).all()
    assert sorted(kernels["correlation"]) == sorted(ops["correlation"])

    # HTA rounds nanosecond-precision events inward to whole microseconds (ts up, end down),
    # then shifts time so the first event is at 0.
    def rounded(start: int, end: int) -> tuple[int, int]:
        return math.ceil((start - BASE) / 1000), math.floor((end - BASE) / 1000)

    ours = [rounded(r[8], r[9]) for r in rows if r[6] == "step"]
    shift = min(rounded(r[8], r[9])[0] for r in rows)
    assert list(zip(steps["ts"], steps["dur"], strict=True)) == [
        (s - shift, e - s) for s, e in ours
    ]

    # Every op and its kernel land in the iteration of the step around the op.
    for _, op in ops.iterrows():
        step_ts = steps[steps["ts"] <= op["ts"]]["ts"].max()
        k = int(steps[steps["ts"] == step_ts]["name"].iloc[0].split("#")[1])
        assert op["iteration"] == k
        kernel = kernels[kernels["correlation"] == op["correlation"]]
        assert list(kernel["iteration"]) == [k]


def test_hta_keeps_nanoseconds_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    rows = recorded()
    _, df = analyze(tmp_path, rows)
    steps = df[df["name"].str.startswith("ProfilerStep#")].sort_values("ts")
    want = [(r[9] - r[8]) / 1000 for r in rows if r[6] == "step"]
    assert list(steps["dur"]) == pytest.approx(want, abs=1e-6)
    ops = df[df["cat"] == "cpu_op"].sort_values("ts")
    assert list(ops["dur"]) == pytest.approx(
        [(r[9] - r[8]) / 1000 for r in rows if r[6] == "op"], abs=1e-6
    )
    first = min(r[8] for r in rows)
    assert list(ops["ts"]) == pytest.approx(
        [(r[8] - first) / 1000 for r in rows if r[6] == "op"], abs=1e-6
    )
