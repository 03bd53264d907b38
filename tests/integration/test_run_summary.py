"""The run summary (`show`, ``Run.summary()``, the dashboard): hand-built spans and counters
ingested into the real chDB where exact numbers are needed, and a real `record`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import gpu_trace
from gpu_trace._summary_text import render_summary
from gpu_trace.query import reads
from gpu_trace.query.summary import RunSummary
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.records import (
    COUNTER_SCHEMA,
    attrs_column,
    dict_column,
    numeric_column,
)
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolWriter
from tests.integration.test_store import spans_table

RUN_NS = 1000


def spans(rows: list[tuple]) -> pa.Table:
    """(span_id, parent, tid, lane, category, name, start, end) rows as a spool table (depth 0)."""
    return spans_table([(*r, 0) for r in rows])


def counters(rows: list[tuple]) -> pa.Table:
    """(source, device, metric, ts, value) rows as a spool table."""
    cols = list(zip(*rows, strict=True))
    return pa.table(
        {
            "source": dict_column(cols[0]),
            "device": dict_column(cols[1]),
            "metric": dict_column(cols[2]),
            "ts_ns": numeric_column(cols[3], pa.int64()),
            "value": numeric_column(cols[4], pa.float64()),
            "labels": attrs_column([None] * len(rows)),
        },
        schema=COUNTER_SCHEMA,
    )


def stored(tmp_path: Path, run_id: str, span_rows: list[tuple], counter_rows=()) -> str:
    """The run ingested into a new chDB store under ``tmp_path``; its DSN."""
    run_dir = tmp_path / run_id
    RunInfo(run_id=run_id, trace_id="ab" * 16, started_ns=0, ended_ns=RUN_NS).save(run_dir)
    meta = {"run_id": run_id, "trace_id": "ab" * 16, "host": "h1", "pid": "7"}
    writer = SpoolWriter(run_dir, meta)
    writer.write("spans", spans(span_rows))
    if counter_rows:
        writer.write("counters", counters(list(counter_rows)))
    dsn = f"chdb://{tmp_path / 'store'}"
    with Store(dsn) as store:
        ingest(store, run_dir)
    return dsn


def summary_of(dsn: str, run_id: str, top: int = 20) -> RunSummary:
    with Store(dsn) as store:
        return reads.summary(store, run_id, top=top)


# A parent A with two children on its thread, one of them with a child of its own; a second A;
# work A started on another thread; another thread of the same lane overlapping A; a mark.
NESTED = [
    (1, 0, 1, "cpu", "nvtx", "A", 0, 100),
    (2, 1, 1, "cpu", "nvtx", "B", 10, 40),
    (3, 1, 1, "cpu", "nvtx", "C", 50, 90),
    (4, 3, 1, "cpu", "nvtx", "D", 55, 65),
    (5, 3, 1, "cpu", "mark", "m", 60, 60),
    (6, 0, 1, "cpu", "nvtx", "A", 200, 220),
    (7, 1, 2, "worker", "nvtx", "W", 20, 80),
    (8, 0, 3, "cpu", "nvtx", "X", 90, 150),
]


def test_lane_busy_counts_nested_time_once(tmp_path: Path) -> None:
    summary = summary_of(stored(tmp_path, "nested", NESTED), "nested")
    lanes = {lane.lane: lane for lane in summary.lanes}
    # cpu: [0, 150) and [200, 220); its spans' durations add up to 260.
    assert (lanes["cpu"].spans, lanes["cpu"].busy_ns) == (6, 170)
    assert lanes["cpu"].share == pytest.approx(170 / RUN_NS)
    assert lanes["worker"].busy_ns == 60
    assert all(lane.busy_ns <= summary.run_ns for lane in summary.lanes)


def test_self_time_is_duration_minus_children(tmp_path: Path) -> None:
    summary = summary_of(stored(tmp_path, "nested", NESTED), "nested")
    cpu = {r.name: r for r in next(lane for lane in summary.lanes if lane.lane == "cpu").ranges}
    assert "m" not in cpu
    a = cpu["A"]
    assert (a.count, a.total_ns, a.self_ns, a.max_ns) == (2, 120, (100 - 30 - 40) + 20, 100)
    assert a.median_ns == 60 and a.mean_ns == 60 and a.share == pytest.approx(120 / RUN_NS)
    assert (cpu["B"].self_ns, cpu["C"].self_ns, cpu["D"].self_ns) == (30, 30, 10)
    assert [r.name for r in summary.top("total", 3)] == [
        "A",
        "W",
        "X",
    ]  # W and X tie at 60 ns: by name
    assert summary.top("self", 1)[0].name == "W"


def test_overlapping_children_are_covered_once(tmp_path: Path) -> None:
    rows = [
        (1, 0, 1, "cpu", "nvtx", "P", 0, 100),
        (2, 1, 1, "cpu", "nvtx", "Q", 10, 60),
        (3, 1, 1, "cpu", "nvtx", "R", 40, 80),
        (4, 1, 1, "cpu", "nvtx", "S", 90, 130),  # runs past its parent: only 10 ns inside it
    ]
    summary = summary_of(stored(tmp_path, "overlap", rows), "overlap")
    p = next(r for r in summary.lanes[0].ranges if r.name == "P")
    assert p.self_ns == 100 - 70 - 10


def test_step_time_distribution_per_kind(tmp_path: Path) -> None:
    rows, t = [], 0
    for i, dur in enumerate([40, 10, 30, 20, 100, 50, 60, 70, 90, 80]):
        rows.append((i + 1, 0, 1, "steps", "step", f"ProfilerStep#{i}", t, t + dur))
        t += dur
    rows += [(50, 0, 1, "steps", "step", "eval 0", 600, 605),
             (51, 0, 1, "steps", "step", "eval 1", 605, 612)]  # fmt: skip
    summary = summary_of(stored(tmp_path, "steps", rows), "steps")
    kinds = {s.kind: s for s in summary.steps}
    assert set(kinds) == {"ProfilerStep", "eval"}
    train = kinds["ProfilerStep"]
    # Linear between the nearest ranks (numpy's default): p50 of 10..100 is 55, p90 is 91.
    assert (train.count, train.p50_ns, train.p90_ns, train.mean_ns, train.max_ns) == (
        10, 55, 91, 55, 100,
    )  # fmt: skip
    assert (kinds["eval"].count, kinds["eval"].max_ns) == (2, 7)
    assert np.percentile(range(10, 101, 10), [50, 90]).tolist() == [55, 91]
    # The steps lane lists step kinds, not single steps.
    names = {r.name: r.count for r in summary.lanes[0].ranges}
    assert names == {"ProfilerStep": 10, "eval": 2}


SAMPLED = [
    ("nvml", "gpu0", "gpu_util_pct", 10, 50.0),
    ("nvml", "gpu0", "gpu_util_pct", 20, 70.0),
    ("nvml", "gpu0", "call_us.clocks", 20, 12.0),
    ("nvml", "gpu0", "call_us.utilization", 20, 8.0),
    ("user", "", "loss", 30, 0.5),
]


def test_sampler_metrics_are_apart(tmp_path: Path) -> None:
    dsn = stored(tmp_path, "sampled", NESTED[:1], SAMPLED)
    summary = summary_of(dsn, "sampled")
    assert [c.metric for c in summary.counters] == ["gpu_util_pct", "loss"]
    assert [c.metric for c in summary.sampler] == ["call_us.clocks", "call_us.utilization"]
    assert summary.events == 1 + len(SAMPLED)
    with Store(dsn) as store:
        text = render_summary(reads.run(store, "sampled"), summary)
    counters, _, sampler = text.partition("the samplers' own metrics")
    assert "gpu_util_pct" in counters and "call_us" not in counters
    assert "call_us.clocks" in sampler and "gpu_util_pct" not in sampler
    # The notebook API shows the same numbers.
    shown = gpu_trace.run("sampled", store=dsn).summary()
    assert list(shown.sampler["metric"]) == ["call_us.clocks", "call_us.utilization"]
    assert list(shown.counters["metric"]) == ["gpu_util_pct", "loss"]
    assert shown.lanes.set_index("lane").loc["cpu", "busy_ns"] == 100
    assert "the samplers' own metrics" in shown.text


def gpu_trace_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=240,
    )


def test_record_and_ls_count_the_same_events(tmp_path: Path) -> None:
    """A torch program whose run also holds clock-offset samples (as a forwarded run does):
    record's closing line, `ls` and `show` give one event count, the spans and counter samples."""
    prog = tmp_path / "prog.py"
    prog.write_text(
        textwrap.dedent(
            """
            import torch
            from gpu_trace.tracer import clock, recorder
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(4):
                loss = model(torch.randn(4, 8)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                recorder.active.add_clock_sample("peer", clock.now_ns(), 0, 1000, 500)
            """
        )
    )
    env = {"GPU_TRACE_HOME": str(tmp_path / "home"), "GPU_TRACE_STORE": f"chdb://{tmp_path / 's'}"}
    out = gpu_trace_cli("record", "--", sys.executable, str(prog), env=env)
    assert out.returncode == 0, out.stderr
    closing = re.search(r"run (\S+): ([\d,]+) events, \d+ dropped, stored", out.stderr)
    assert closing, out.stderr
    run_id, recorded = closing.group(1), int(closing.group(2).replace(",", ""))
    listed = json.loads(gpu_trace_cli("ls", "--json", env=env).stdout)
    row = next(r for r in listed if r["run_id"] == run_id)
    sql = gpu_trace_cli("sql", "--json", "SELECT count() AS n FROM clock_sync", env=env)
    assert json.loads(sql.stdout.splitlines()[0])["n"] == 4, "the run holds clock samples"
    assert recorded == row["events"] == row["spans"] + row["counters"]
    table = gpu_trace_cli("ls", env=env).stdout
    assert re.search(rf"{run_id}\s.*\s{recorded:,}\s+finished", table), table
    show = gpu_trace_cli("show", run_id, env=env).stdout
    assert f"events: {recorded:,} (" in show
    assert "step times" in show and "ProfilerStep" in show
