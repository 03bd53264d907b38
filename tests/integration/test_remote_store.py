"""Server spans straight into a shared store: the server's spool in the client's run, ingested by
the same code into the real chDB, next to the client's own run (no ClickHouse server here: the
spool directory is the seam of ``gpu-trace serve --store``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpu_trace
from gpu_trace import runtime
from gpu_trace.query import reads
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.server.sink import SpoolSink, StoreSink
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.run import RunInfo

TOKEN = "store-test-token-0123"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"chdb://{tmp_path / 'store'}") as s:
        yield s


def _forward(server: Server, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    gpu_trace.start(run_dir)
    try:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            x = torch.arange(64.0, device=dev)
            for _ in range(20):
                x = x * 0.5 + 1
            value = x.sum().item()
            rt.conn.trace.clock_exchange(4)  # as the heartbeat does
        finally:
            runtime.disconnect()
    finally:
        gpu_trace.stop()
    return value


def _rows(store: Store, query: str, run_id: str) -> list[tuple]:
    return store.sql(query, {"run": run_id})[1]


def test_server_spans_go_to_the_shared_store_under_the_clients_run(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "server-spool"
    with Server("127.0.0.1:0", token=TOKEN, sink=SpoolSink(spool)) as server:
        value = _forward(server, tmp_path / "run", monkeypatch)
    expected = torch.arange(64.0)
    for _ in range(20):
        expected = expected * 0.5 + 1
    assert value == expected.sum().item()

    info = RunInfo.load(tmp_path / "run")
    server_dir = spool / info.run_id
    assert RunInfo.load(server_dir).trace_id == info.trace_id
    ingest(store, tmp_path / "run")
    client_server_spans = _rows(
        store,
        "SELECT count() FROM spans WHERE run_id = {run:String} AND category = 'server'",
        info.run_id,
    )
    assert client_server_spans == [(0,)]  # nothing came back to the client
    ingest(store, server_dir)
    ingest(store, server_dir)  # idempotent

    spans = _rows(
        store,
        """
        SELECT s.lane, s.trace_id, s.host, s.pid, s.start_ns, s.end_ns,
               toInt64(s.attrs['raw_start_ns']), toInt64(s.attrs['raw_end_ns']),
               toInt64(s.attrs['clock_offset_ns']), s.attrs['clock_uncertainty_ns'], c.lane
        FROM spans AS s LEFT JOIN (SELECT span_id, lane FROM spans
                                   WHERE run_id = {run:String} AND category = 'forward') AS c
          ON s.parent_span_id = c.span_id
        WHERE s.run_id = {run:String} AND s.category = 'server' AND s.lane != 'server/op'
        """,
        info.run_id,
    )
    lanes = {r[0] for r in spans}
    assert {"server/receive", "server/queue", "server/execute", "server/reply"} <= lanes
    for _, trace_id, host, pid, start, end, raw0, raw1, offset, unc, parent in spans:
        assert trace_id == info.trace_id and pid == os.getpid() and host
        # Mapped at ingest with the offset at the start (the fitted drift moves it a little by
        # the end); the raw times are kept.
        assert start == raw0 - offset and abs(end - (raw1 - offset)) <= max(1000, end - start)
        assert int(unc) > 0
        assert parent.split("/")[:2] == ["forward", "batch"]  # the client's batch span (a lane
        # of its own, forward/batch/N, where others were in flight) is the parent
    ops = _rows(
        store,
        "SELECT count() FROM spans WHERE run_id = {run:String} AND lane = 'server/op'",
        info.run_id,
    )
    assert ops[0][0] >= 40
    counters = _rows(
        store,
        "SELECT count() FROM counters WHERE run_id = {run:String} AND source = 'runtime'",
        info.run_id,
    )
    assert counters[0][0] > 0

    # The clock samples: the client's, and the server's copy of them, stored once.
    clock = _rows(
        store,
        "SELECT count(), uniqExact(peer, ts_ns) FROM clock_sync WHERE run_id = {run:String}",
        info.run_id,
    )
    assert clock[0][0] == clock[0][1] >= 12

    # The client's runs row stays the client's, with the server's host.
    run = reads.run(store, info.run_id)
    assert run["command"] == info.command and run["status"] == info.status


def test_server_written_run_alone_gets_a_placeholder_row(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "server-spool"
    with Server("127.0.0.1:0", token=TOKEN, sink=SpoolSink(spool)) as server:
        _forward(server, tmp_path / "run", monkeypatch)
    info = RunInfo.load(tmp_path / "run")
    ingest(store, spool / info.run_id)  # before the client's run: still on a clock (the copies)
    run = reads.run(store, info.run_id)
    assert run["status"] == "server" and run["trace_id"] == info.trace_id
    offsets = _rows(
        store,
        "SELECT countIf(attrs['clock_offset_ns'] = '') FROM spans WHERE run_id = {run:String}",
        info.run_id,
    )
    assert offsets == [(0,)]
    ingest(store, tmp_path / "run")
    run = reads.run(store, info.run_id)
    assert run["command"] == info.command
    stats = json.loads(next((spool / info.run_id / "stats").glob("server-*.json")).read_text())
    assert stats["events"] > 0


def test_a_store_sink_needs_a_clickhouse_server(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ClickHouse server"):
        StoreSink(f"chdb://{tmp_path / 'store'}", tmp_path / "spool")


def test_untraced_clients_write_nothing(tmp_path: Path) -> None:
    spool = tmp_path / "server-spool"
    with Server("127.0.0.1:0", token=TOKEN, sink=SpoolSink(spool)) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            assert (torch.ones(3, device=dev) * 2).sum().item() == 6.0
        finally:
            runtime.disconnect()
    assert list(spool.iterdir()) == []


def test_serve_refuses_an_embedded_store(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpu_trace",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--token",
            TOKEN,
            "--device",
            "cpu",
            "--store",
            f"chdb://{tmp_path / 'store'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "ClickHouse server" in out.stderr
