"""Holistic Trace Analysis reads our Chrome export: steps, iterations, ops, kernels, durations."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from gpu_trace.export.chrome import write_chrome_trace

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


def test_hta_reads_the_cupti_collectors_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real CUPTI records of three H100 steps, through the collector's own conversion (the
    replay seam), exported: HTA's kernel, temporal, idle-time and launch analyses find every
    kernel, copy and memset with its GPU time and every launch with its runtime call."""
    from gpu_trace.collectors.gpu_activity.conversion import convert
    from gpu_trace.collectors.gpu_activity.replay_file import read_replay

    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    records, names, _ = read_replay(Path(__file__).parents[1] / "data" / "cupti-h100-lm.jsonl.gz")
    table = convert(records, names).table.sort_by("start_ns")
    n = table.num_rows
    for column, value in (("run_id", "r"), ("trace_id", "a" * 32), ("host", "h100")):
        table = table.append_column(column, pa.array([value] * n))
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    run = {
        "run_id": "r",
        "started_ns": table["start_ns"][0].as_py(),
        "attrs": {"gpus": "gpu0=H100"},
    }
    write_chrome_trace(trace_dir / "rank-0.json", run, [], [table])

    rows = table.to_pylist()
    work = [r for r in rows if r["category"] in ("kernel", "memcpy", "memset")]
    analysis = hta_analysis.TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)
    # HTA's own table of the file: every piece of device work on its stream, with its GPU time.
    df = analysis.t.get_trace(0).copy()
    analysis.t.symbol_table.add_symbols_to_trace_df(df, "cat")
    on_streams = df[df["stream"].ne(-1)].groupby("cat")["dur"].agg(["count", "sum"])
    for category, cat in (("kernel", "kernel"), ("memcpy", "gpu_memcpy"), ("memset", "gpu_memset")):
        mine = [r["end_ns"] - r["start_ns"] for r in work if r["category"] == category]
        assert on_streams.loc[cat, "count"] == len(mine)
        assert on_streams.loc[cat, "sum"] == pytest.approx(sum(mine) / 1000, rel=1e-9)
    types, kernels = analysis.get_gpu_kernel_breakdown(visualize=False)
    assert set(types["kernel_type"]) == {"COMPUTATION", "MEMORY"} and len(kernels) > 1
    temporal = analysis.get_temporal_breakdown(visualize=False)
    assert temporal["idle_time(us)"].iloc[0] > 0
    idle = analysis.get_idle_time_breakdown(visualize=False)[0]
    assert set(idle["stream"]) == {7}
    launches = analysis.get_cuda_kernel_launch_stats(visualize=False)[0]
    # Each launch HTA finds pairs a runtime call with device work of the same correlation.
    correlations = {int(dict(r["attrs"])["correlation"]) for r in work}
    kernels = sum(1 for r in work if r["category"] == "kernel" and r["parent_span_id"])
    assert set(launches["correlation"]) <= correlations and len(launches) >= kernels > 500
