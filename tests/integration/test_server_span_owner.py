"""Each server span carries the session and tenant the server wrote it for: a real server on
loopback with two tenants (a tenants file), both forwarding into one run, stored in the real
chDB, by either path a server's spans take (back to the client, or the server's own spool)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpu_trace
from gpu_trace import runtime
from gpu_trace.export.chrome import write_chrome_trace
from gpu_trace.export.span_mapping import RunFacts, SpanMapper, parse_kinds, rows
from gpu_trace.query import reads
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.server.sink import SpoolSink
from gpu_trace.runtime.sharing.tenants import load_tenants
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.run import RunInfo

ALICE = "alice-owner-token-0123456789"
BOB = "bob-owner-token-0123456789"
TENANTS = f"""
[[tenant]]
name = "alice"
token = "{ALICE}"

[[tenant]]
name = "bob"
token = "{BOB}"
"""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"chdb://{tmp_path / 'store'}") as s:
        yield s


def _forward_as_each_tenant(address: str, run_dir: Path, monkeypatch) -> dict[str, str]:
    """alice, then bob, then alice again forward a few ops into one run; their sessions."""
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    sessions: dict[str, str] = {}
    gpu_trace.start(run_dir)
    try:
        for tenant, token in (("alice", ALICE), ("bob", BOB), ("alice", ALICE)):
            dev = runtime.connect(address, token=token)
            try:
                x = torch.arange(16.0, device=dev)
                for _ in range(5):
                    x = x * 0.5 + 1
                assert x.sum().item() > 0
                rt.conn.trace.clock_exchange(2)
                sessions[str(rt.conn.session_id)] = tenant
            finally:
                runtime.disconnect()
    finally:
        gpu_trace.stop()
    return sessions


@pytest.mark.parametrize("sink", ["return", "spool"])
def test_each_server_span_reads_back_with_the_session_and_tenant_it_was_written_for(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch, sink: str
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(TENANTS)
    spool = tmp_path / "server-spool"
    kwargs = {"sink": SpoolSink(spool)} if sink == "spool" else {}
    with Server("127.0.0.1:0", tenants=load_tenants(tenants_file), **kwargs) as server:
        written = _forward_as_each_tenant(server.address, tmp_path / "run", monkeypatch)
    assert sorted(written.values()) == ["alice", "alice", "bob"]  # three sessions

    info = RunInfo.load(tmp_path / "run")
    ingest(store, tmp_path / "run")
    if sink == "spool":
        ingest(store, spool / info.run_id)
    found = store.sql(
        """
        SELECT attrs['session'], attrs['tenant'], groupUniqArray(lane), count()
        FROM spans WHERE run_id = {run:String} AND category = 'server'
        GROUP BY attrs['session'], attrs['tenant']
        """,
        {"run": info.run_id},
    )[1]
    assert {session: tenant for session, tenant, _, _ in found} == written
    for _, _, lanes, n in found:  # every kind of server span, op spans too
        assert {"server/receive", "server/execute", "server/op", "server/reply"} <= set(lanes)
        assert n >= 5 * 2 + 4

    # Exported, a server span keeps them: Chrome args, OTLP attributes.
    run = reads.run(store, info.run_id)
    chrome = tmp_path / "trace.json"
    write_chrome_trace(
        chrome, run, reads.threads(store, info.run_id), reads.iter_spans(store, info.run_id)
    )
    events = json.loads(chrome.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    served = [e for e in events if e.get("cat") == "server" and e.get("ph") == "X"]
    assert served
    assert {(e["args"]["session"], e["args"]["tenant"]) for e in served} == set(written.items())
    mapper = SpanMapper(RunFacts.of(run), parse_kinds("all"))
    sent = []
    for batch in reads.iter_spans(store, info.run_id):
        sent += mapper.add(rows(batch))
    sent += mapper.finish()
    owners = {
        tuple(
            next(kv.value.string_value for kv in span.attributes if kv.key == key)
            for key in ("session", "tenant")
        )
        for row, span in sent
        if row.category == "server"
    }
    assert owners == set(written.items())
