"""`gpu-trace serve` with a tenants file, stopped by SIGTERM: every connected client is told why at
its next sync point (not a hang), traced sessions' spans are flushed, and the server exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import gpu_trace
from gpu_trace import runtime
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import Connection
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.run import RunInfo

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789xyz"
TENANTS = f"""\
[[tenant]]
name = "alice"
token = "{ALICE}"
memory = 0.5

[[tenant]]
name = "bob"
token_env = "BOB_TOKEN"
weight = 2
admin = true
"""


class Served:
    """A `gpu-trace serve --tenants` subprocess and what its first line says."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        tenants = tmp_path / "tenants.toml"
        tenants.write_text(TENANTS)
        argv = [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0"]
        argv += ["--device", "cpu", "--tenants", str(tenants), "--device-memory", "1GiB", *extra]
        self.proc = subprocess.Popen(
            argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "BOB_TOKEN": BOB}
        )
        assert self.proc.stderr is not None
        self.line = self.proc.stderr.readline()
        assert "serving cpu on" in self.line, self.line + self.proc.stderr.read()
        self.address = self.line.split(" on ")[1].split()[0]
        found = re.search(r"metrics at (http://\S+/metrics)", self.line)
        self.metrics_url = found.group(1) if found else None

    def terminate(self) -> tuple[int, str]:
        """SIGTERM; the exit status and the rest of stderr."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.stderr is not None
        rest = self.proc.stderr.read()
        return self.proc.wait(timeout=60), rest

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        assert self.proc.stderr is not None
        self.proc.stderr.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    yield s
    s.close()


def test_sigterm_tells_every_client_why_and_the_server_exits_0(served: Served) -> None:
    dev = runtime.connect(served.address, token=ALICE)
    bob = Connection(served.address, token=BOB)
    try:
        assert rt.conn is not None and rt.conn.tenant == "alice" and bob.tenant == "bob"
        x = torch.ones(1 << 16, device=dev)
        assert x.sum().item() == 1 << 16

        # The serve process's /metrics, over HTTP: both tenants' sessions.
        assert served.metrics_url is not None
        with urllib.request.urlopen(served.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        sessions = {
            s.labels["tenant"]: s.value for s in families["gpu_trace_tenant_sessions"].samples
        }
        assert sessions == {"alice": 1, "bob": 1}
        (limit,) = families["gpu_trace_tenant_memory_limit_bytes"].samples
        assert limit.labels == {"tenant": "alice"} and limit.value == 1 << 29

        code, rest = served.terminate()
        assert code == 0, rest
        assert "stopped (SIGTERM)" in rest
        told = rf"the server at {re.escape(served.address)} is shutting down \(SIGTERM\)"
        t0 = time.monotonic()
        with pytest.raises(runtime.ServerGone, match=told):
            (x + 1).sum().item()
        assert time.monotonic() - t0 < 30  # told, not timed out
        bob.wait_for(lambda: bob.broken is None, time.monotonic() + 30)
        assert bob.broken is not None and re.search(told, bob.broken)
    finally:
        bob.close()
        runtime.disconnect()


def test_sigterm_flushes_traced_sessions_spans_into_the_store(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --store, spans the server still held at SIGTERM are spooled (and ingest is tried);
    the store here is down, so the spool stays, and it holds every batch's spans."""
    served = Served(tmp_path, "--store", "http://127.0.0.1:1", "--metrics", "off")
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    run_dir = tmp_path / "run"
    gpu_trace.start(run_dir)
    try:
        dev = runtime.connect(served.address, token=ALICE)
        assert rt.conn is not None and rt.conn.server_sink == "store"
        x = torch.arange(64.0, device=dev)
        for _ in range(10):
            x = x * 0.5 + 1
            x.sum().item()  # a batch each, most within the server's 200 ms export interval
        batches = rt.conn.batches_sent
        code, rest = served.terminate()
        assert code == 0, rest
        with pytest.raises(runtime.ServerGone, match=r"shutting down \(SIGTERM\)"):
            (x + 1).sum().item()
    finally:
        runtime.disconnect()
        gpu_trace.stop()
        served.close()
    info = RunInfo.load(run_dir)
    server_dir = home / "serve-spool" / info.run_id
    with Store(f"chdb://{tmp_path / 'store'}") as store:
        ingest(store, server_dir)
        (row,) = store.sql(
            "SELECT count() FROM spans WHERE run_id = {run:String} AND lane = 'server/execute'",
            {"run": info.run_id},
        )[1]
    assert row[0] == batches >= 10
