"""Runs with known spans for the dashboard tests, written straight into a store as Arrow."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.store import Store

XSS = "<script>alert(1)</script>"


def add_run(store: Store, run_id: str, spans: list[dict[str, Any]], start: int, end: int) -> None:
    """Insert ``spans`` (dicts with at least name, lane, start_ns, end_ns) as run ``run_id``."""
    rows = []
    for i, s in enumerate(spans):
        rows.append(
            {
                "run_id": run_id,
                "trace_id": "0" * 32,
                "span_id": s.get("span_id", 1000 + i),
                "parent_span_id": s.get("parent_span_id", 0),
                "host": s.get("host", "client"),
                "pid": s.get("pid", 10),
                "tid": s.get("tid", 10),
                "lane": s["lane"],
                "category": s.get("category", "nvtx"),
                "name": s["name"],
                "start_ns": s["start_ns"],
                "end_ns": s["end_ns"],
                "depth": s.get("depth", 0),
                "attrs": list((s.get("attrs") or {}).items()),
            }
        )
    schema = pa.schema(
        [
            ("run_id", pa.string()),
            ("trace_id", pa.string()),
            ("span_id", pa.uint64()),
            ("parent_span_id", pa.uint64()),
            ("host", pa.string()),
            ("pid", pa.uint32()),
            ("tid", pa.uint64()),
            ("lane", pa.string()),
            ("category", pa.string()),
            ("name", pa.string()),
            ("start_ns", pa.int64()),
            ("end_ns", pa.int64()),
            ("depth", pa.uint16()),
            ("attrs", pa.map_(pa.string(), pa.string())),
        ]
    )
    store._insert_arrow("spans", pa.Table.from_pylist(rows, schema=schema))
    store.upsert_run(
        RunInfo(
            run_id=run_id,
            trace_id="0" * 32,
            started_ns=start,
            ended_ns=end,
            command=f"test {run_id}",
            hosts=["client"],
            status="finished",
            attrs={"anchor_mono_ns": "0", "anchor_wall_ns": str(1_700_000_000 * 10**9 + start)},
        )
    )


def lod_run(store: Store, run_id: str = "lod") -> None:
    """1000 spans of 1 µs every 10 µs and 5 spans of 1 ms on one lane, over 10 ms."""
    spans = [
        {"name": "tiny", "lane": "nvtx/a", "start_ns": 10_000 * i, "end_ns": 10_000 * i + 1_000,
         "depth": 1}
        for i in range(1000)
    ]  # fmt: skip
    spans += [
        {"name": f"long{i}", "lane": "nvtx/a", "start_ns": 2_000_000 * i,
         "end_ns": 2_000_000 * i + 1_000_000, "depth": 0, "span_id": 90 + i}
        for i in range(5)
    ]  # fmt: skip
    add_run(store, run_id, spans, 0, 10_000_000)


def forwarded_run(store: Store, run_id: str = "fwd") -> None:
    """Three steps, each with two ``fwd`` batches forwarded to a server span on another host, and
    a span named like a script tag."""
    spans: list[dict[str, Any]] = []
    sid = 1
    for step in range(3):
        t = step * 1_000_000
        spans.append({"name": f"ProfilerStep#{step}", "lane": "steps", "category": "step",
                      "start_ns": t, "end_ns": t + 900_000, "span_id": sid})  # fmt: skip
        sid += 1
        for k in range(2):
            b0 = t + 100_000 + k * 400_000
            batch = sid
            spans.append({"name": "batch", "lane": "forward/batch", "category": "forward",
                          "start_ns": b0, "end_ns": b0 + 100_000, "span_id": batch,
                          "attrs": {"k": str(k)}})  # fmt: skip
            spans.append({"name": "execute", "lane": "server/execute", "category": "server",
                          "start_ns": b0 + 150_000, "end_ns": b0 + 250_000, "span_id": sid + 1,
                          "parent_span_id": batch, "host": "gpu-box", "pid": 99, "tid": 2,
                          "depth": 1, "attrs": {"clock_uncertainty_ns": "5000",
                                                "clock_offset_ns": "123"}})  # fmt: skip
            sid += 2
    spans.append({"name": XSS, "lane": "nvtx/<b>lane</b>", "start_ns": 2_950_000,
                  "end_ns": 3_000_000, "span_id": 500, "attrs": {"note": XSS}})  # fmt: skip
    add_run(store, run_id, spans, 0, 3_000_000)
