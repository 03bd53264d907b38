"""Store DSNs and DDL as pure functions: the server and cluster paths without a server."""

from __future__ import annotations

import os

import pytest

from gpu_trace.store.dsn import parse_dsn
from gpu_trace.store.schema import TABLES, schema_ddl


def test_chdb_dsn_forms(tmp_path) -> None:
    assert parse_dsn(f"chdb://{tmp_path}/store").path == f"{tmp_path}/store"
    assert parse_dsn(f"chdb://{tmp_path}/store").kind == "chdb"
    assert parse_dsn(str(tmp_path / "bare")).path == str(tmp_path / "bare")
    assert parse_dsn("chdb://memory").path == ""
    assert parse_dsn("chdb://:memory:").path == ""
    assert parse_dsn("chdb://~/x").path == os.path.expanduser("~/x")
    assert parse_dsn("chdb:///a/with%20space").path == "/a/with space"


def test_http_dsn_parts_and_defaults() -> None:
    t = parse_dsn("http://alice:s%40cret@ch.example:9000/traces")
    assert (t.kind, t.host, t.port, t.username, t.password, t.database, t.secure) == (
        "http",
        "ch.example",
        9000,
        "alice",
        "s@cret",
        "traces",
        False,
    )
    t = parse_dsn("https://ch.example")
    assert (t.port, t.username, t.password, t.database, t.secure) == (
        8443,
        "default",
        "",
        "gpu_trace",
        True,
    )
    assert parse_dsn("http://h").port == 8123


def test_password_never_shown() -> None:
    t = parse_dsn("http://alice:hunter2@h:8123")
    assert "hunter2" not in t.display()
    assert "hunter2" not in repr(t)


@pytest.mark.parametrize(
    "dsn",
    ["", "ftp://h", "http://", "http://h/bad-name", "http://h/a;DROP", "http://h:notaport"],
)
def test_bad_dsn(dsn: str) -> None:
    with pytest.raises(ValueError):
        parse_dsn(dsn)


def test_ddl_single_node() -> None:
    ddl = schema_ddl()
    assert ddl[0] == "CREATE DATABASE IF NOT EXISTS gpu_trace"
    assert len(ddl) == 1 + len(TABLES)
    assert all("IF NOT EXISTS" in s and "ON CLUSTER" not in s for s in ddl)
    spans = next(s for s in ddl if "gpu_trace.spans " in s)
    assert "ENGINE = MergeTree ORDER BY (run_id, start_ns)" in spans
    assert "lane LowCardinality(String)" in spans and "attrs Map(String, String)" in spans
    counters = next(s for s in ddl if "gpu_trace.counters " in s)
    assert "ORDER BY (run_id, ts_ns)" in counters


def test_ddl_on_cluster_has_local_and_distributed_tables() -> None:
    ddl = schema_ddl("traces", "prod-1")
    assert ddl[0] == "CREATE DATABASE IF NOT EXISTS traces ON CLUSTER `prod-1`"
    assert len(ddl) == 1 + 2 * len(TABLES)
    for name in TABLES:
        local = next(s for s in ddl if f"traces.{name}_local " in s)
        assert "ON CLUSTER `prod-1`" in local and "MergeTree" in local
        dist = next(s for s in ddl if f"TABLE IF NOT EXISTS traces.{name} ON" in s)
        assert f"AS traces.{name}_local" in dist
        assert f"ENGINE = Distributed('prod-1', 'traces', '{name}_local'," in dist


@pytest.mark.parametrize("database,cluster", [("bad name", None), ("x", "a b"), ("x", "c'); DROP")])
def test_ddl_rejects_unsafe_names(database: str, cluster: str | None) -> None:
    with pytest.raises(ValueError):
        schema_ddl(database, cluster)
