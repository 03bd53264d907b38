"""The store's schema: its tables (:data:`TABLES`), the columns added since stores were first
made (:data:`ADDED_COLUMNS`), and the DDL that creates them (:func:`schema_ddl`) or adds what an
older store lacks (:func:`migration_ddl`), for chDB and a server or cluster alike.
docs/schema.md explains the tables."""

from __future__ import annotations

import re
from collections.abc import Iterable

from gpu_trace.store.dsn import DEFAULT_DATABASE, IDENTIFIER

__all__ = ["TABLES", "ADDED_COLUMNS", "schema_ddl", "migration_ddl"]

_CLUSTER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

#: Table name -> (columns, engine, ORDER BY, shard key for Distributed). docs/schema.md explains them.
TABLES: dict[str, tuple[str, str, str, str]] = {
    "runs": (
        "run_id String, trace_id String, started_ns Int64, ended_ns Int64, started_wall_ns Int64,"
        " command String, hosts Array(String), status LowCardinality(String),"
        " attrs Map(String, String), updated_ns Int64, stored_ns Int64 DEFAULT updated_ns",
        "ReplacingMergeTree(updated_ns)",
        "run_id",
        "cityHash64(run_id)",
    ),
    "spans": (
        "run_id LowCardinality(String), trace_id LowCardinality(String), span_id UInt64,"
        " parent_span_id UInt64, host LowCardinality(String), pid UInt32, tid UInt64,"
        " lane LowCardinality(String), category LowCardinality(String), name LowCardinality(String),"
        " start_ns Int64, end_ns Int64, depth UInt16, attrs Map(String, String)",
        "MergeTree",
        "(run_id, start_ns)",
        "rand()",
    ),
    "counters": (
        "run_id LowCardinality(String), host LowCardinality(String), source LowCardinality(String),"
        " device LowCardinality(String), metric LowCardinality(String), ts_ns Int64, value Float64,"
        " labels Map(String, String)",
        "MergeTree",
        "(run_id, ts_ns)",
        "rand()",
    ),
    "clock_sync": (
        "run_id LowCardinality(String), host LowCardinality(String), peer LowCardinality(String),"
        " ts_ns Int64, offset_ns Int64, rtt_ns Int64, uncertainty_ns Int64",
        "MergeTree",
        "(run_id, ts_ns)",
        "cityHash64(run_id)",
    ),
    "threads": (
        "run_id String, host LowCardinality(String), pid UInt32, tid UInt64, process_name String,"
        " thread_name String, updated_ns Int64, process_attrs Map(String, String)",
        "ReplacingMergeTree(updated_ns)",
        "(run_id, host, pid, tid)",
        "cityHash64(run_id)",
    ),
    "ingest_log": (
        "run_id String, file String, size UInt64, kind LowCardinality(String), rows UInt64,"
        " status LowCardinality(String), problem String, ingested_ns Int64",
        "ReplacingMergeTree(ingested_ns)",
        "(run_id, file, size)",
        "cityHash64(run_id)",
    ),
}


#: Columns added to a table after stores were made without them: (table, column, its definition
#: as in :data:`TABLES`). A store without one gets it when opened; rows stored before read the
#: default (docs/schema.md, "How the schema changes").
ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # When the run first reached the store (wall clock): what `last` means. Rows from before it
    # read their last upsert's time.
    ("runs", "stored_ns", "Int64 DEFAULT updated_ns"),
    # A process's place in a distributed job (rank, world size, node, ...: tracer/ranks.py),
    # repeated on each of its threads' rows. Rows from before it read an empty map.
    ("threads", "process_attrs", "Map(String, String)"),
)


def schema_ddl(database: str = DEFAULT_DATABASE, cluster: str | None = None) -> list[str]:
    """The statements that create the database and tables, in order; all ``IF NOT EXISTS``.

    With a cluster, each table is ``<name>_local`` on every node (``ON CLUSTER``) and ``<name>`` is
    a Distributed table over them, so queries read ``<name>`` either way.
    """
    if not IDENTIFIER.match(database):
        raise ValueError(f"database name must be a plain identifier, got {database!r}")
    if cluster is not None and not _CLUSTER.match(cluster):
        raise ValueError(f"cluster name may hold letters, digits, '_', '.', '-', got {cluster!r}")
    on = f" ON CLUSTER `{cluster}`" if cluster else ""
    out = [f"CREATE DATABASE IF NOT EXISTS {database}{on}"]
    for name, (columns, engine, order_by, shard_key) in TABLES.items():
        local = f"{name}_local" if cluster else name
        out.append(
            f"CREATE TABLE IF NOT EXISTS {database}.{local}{on} ({columns}) "
            f"ENGINE = {engine} ORDER BY {order_by}"
        )
        if cluster:
            out.append(
                f"CREATE TABLE IF NOT EXISTS {database}.{name}{on} AS {database}.{local} "
                f"ENGINE = Distributed('{cluster}', '{database}', '{local}', {shard_key})"
            )
    return out


def migration_ddl(
    missing: Iterable[tuple[str, str]], database: str = DEFAULT_DATABASE, cluster: str | None = None
) -> list[str]:
    """The statements that add the :data:`ADDED_COLUMNS` named in ``missing`` ((table, column)
    pairs a store lacks), in order; with a cluster, to each node's local table and to the
    Distributed table over them."""
    on = f" ON CLUSTER `{cluster}`" if cluster else ""
    wanted = set(missing)
    out = []
    for table, column, definition in ADDED_COLUMNS:
        if (table, column) not in wanted:
            continue
        for name in (f"{table}_local", table) if cluster else (table,):
            out.append(
                f"ALTER TABLE {database}.{name}{on} ADD COLUMN IF NOT EXISTS {column} {definition}"
            )
    return out
