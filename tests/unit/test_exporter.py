"""The exporter plugin contract: entry points, the in-memory exporter, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from gpu_trace.export.chrome import ChromeTraceExporter
from gpu_trace.export.exporter import (
    REQUIRED_COLUMNS,
    SPAN_BATCH_SCHEMA,
    CounterExporter,
    Exporter,
    ExportResult,
    InMemoryExporter,
    available_exporters,
    check_batch,
    export_run,
    get_exporter,
)


def batch(n: int = 3, start: int = 0) -> pa.Table:
    rows = {
        "run_id": ["r"] * n,
        "trace_id": ["t"] * n,
        "host": ["h"] * n,
        "span_id": list(range(start + 1, start + n + 1)),
        "parent_span_id": [0] * n,
        "pid": [1] * n,
        "tid": [1] * n,
        "lane": ["nvtx/gpu_trace"] * n,
        "category": ["nvtx"] * n,
        "name": [f"s{i}" for i in range(n)],
        "start_ns": [start + i for i in range(n)],
        "end_ns": [start + i + 1 for i in range(n)],
        "depth": [0] * n,
        "attrs": [[] for _ in range(n)],
    }
    return pa.table(rows, schema=SPAN_BATCH_SCHEMA)


def test_the_batch_schema_holds_every_required_column() -> None:
    assert set(REQUIRED_COLUMNS) <= set(SPAN_BATCH_SCHEMA.names)
    check_batch(batch())
    with pytest.raises(ValueError, match="lacks columns host, span_id"):
        check_batch(batch().drop_columns(["host", "span_id"]))
    with pytest.raises(ValueError, match="pyarrow Table"):
        check_batch([1, 2])  # type: ignore[arg-type]


def test_entry_points_name_the_shipped_exporters() -> None:
    assert {"chrome", "memory"} <= set(available_exporters())
    assert isinstance(get_exporter("memory"), InMemoryExporter)


def test_unknown_exporter_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown exporter 'nope'; available: .*chrome.*memory"):
        get_exporter("nope")


def test_in_memory_exporter_keeps_batches(caplog: pytest.LogCaptureFixture) -> None:
    exp = get_exporter("memory")
    assert isinstance(exp, Exporter)
    assert exp.export(batch(3)) is ExportResult.SUCCESS
    assert exp.export(batch(2, start=10).to_batches()[0]) is ExportResult.SUCCESS
    assert exp.export(pa.table({"name": ["x"]})) is ExportResult.FAILURE
    assert "malformed batch" in caplog.text
    assert exp.force_flush(timeout_millis=10)
    assert exp.spans().num_rows == 5 and exp.spans().column("name").to_pylist()[-1] == "s1"
    exp.shutdown()
    assert exp.export(batch()) is ExportResult.FAILURE
    exp.clear()
    assert exp.spans().num_rows == 0


def test_chrome_exporter_by_name(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.json"
    exp = get_exporter("chrome", path=path, run={"run_id": "r", "started_ns": 0}, threads=[])
    assert isinstance(exp, ChromeTraceExporter) and isinstance(exp, Exporter)
    for i in range(3):
        assert exp.export(batch(4, start=i * 10)) is ExportResult.SUCCESS
    assert exp.force_flush()
    exp.shutdown()
    assert not exp.force_flush()
    trace = json.loads(path.read_text())
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == [
        "s0",
        "s1",
        "s2",
        "s3",
    ] * 3
    assert trace["gpu_trace"]["complete"] is True


class Raising(InMemoryExporter):
    """An exporter that breaks its contract: ``export`` raises."""

    def export(self, batch: pa.Table) -> ExportResult:
        raise RuntimeError("boom")


def test_export_run_logs_an_exporters_exception_and_still_shuts_it_down(caplog) -> None:
    exp = Raising()
    with caplog.at_level("ERROR", logger="gpu_trace.export.exporter"):
        assert export_run(exp, [batch(), batch(3, 3)]) is False
    assert exp.is_shutdown
    assert "failed to export spans" in caplog.text and "boom" in caplog.text


def test_export_run_hands_counters_only_to_exporters_that_take_them(tmp_path: Path) -> None:
    counters = pa.table({"metric": ["m"], "ts_ns": [5], "value": [1.0], "host": ["h"]})
    memory = InMemoryExporter()
    assert export_run(memory, [batch()], [counters]) is True
    assert memory.is_shutdown and memory.spans().num_rows == 3
    chrome = get_exporter("chrome", path=tmp_path / "t.json", run={"run_id": "r"}, threads=[])
    assert isinstance(chrome, CounterExporter) and not isinstance(memory, CounterExporter)
    assert export_run(chrome, [batch()], [counters]) is True
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["ph"] for e in events if e["ph"] in ("X", "C")] == ["X"] * 3 + ["C"]


def test_a_failed_chrome_export_says_why_in_one_line(tmp_path: Path) -> None:
    chrome = get_exporter("chrome", path=tmp_path / "t.json", run={"run_id": "r"}, threads=[])
    assert export_run(chrome, [batch().drop_columns(["host"])]) is False
    assert chrome.error == "span batch lacks columns host"
    meta = json.loads((tmp_path / "t.json").read_text())
    assert meta["gpu_trace"]["complete"] is False


def test_the_cli_exports_through_the_seam(tmp_path: Path, monkeypatch) -> None:
    """`gpu-trace export` takes its exporter from get_exporter: a failing one is one line."""
    import argparse

    from gpu_trace.commands import CLIError
    from gpu_trace.commands import runs as runs_cmd
    from gpu_trace.export import exporter as exporter_mod
    from gpu_trace.store.client import Store
    from tests.dashboard_data import add_run

    dsn = f"chdb://{tmp_path / 'store'}"
    with Store(dsn) as store:  # a real run of three spans
        add_run(store, "r", [{"name": f"s{i}", "lane": "l", "start_ns": i, "end_ns": i + 1}
                             for i in range(3)], 0, 3)  # fmt: skip

    made = []

    def fake_get_exporter(name: str, **kwargs) -> Raising:
        made.append(name)
        return Raising()

    monkeypatch.setattr(exporter_mod, "get_exporter", fake_get_exporter)
    args = argparse.Namespace(
        output=tmp_path / "t.json", run="last", rank=0, world_size=None, store=dsn
    )
    with pytest.raises(CLIError, match=r"^cannot write .*t\.json: the exporter failed"):
        runs_cmd.cmd_export(args)
    assert made == ["chrome"]
