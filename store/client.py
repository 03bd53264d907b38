"""The ClickHouse store: one client API for embedded chDB and a ClickHouse server or cluster.

A :class:`Store` opens a DSN (``chdb:///path`` or ``http(s)://user:password@host:port[/db]``)
through clickhouse-connect, creates the database and tables if they are missing (the same DDL for
both; ``ON CLUSTER`` plus Distributed tables when a cluster is named), and answers the queries the
CLI, the dashboard and the exporters ask (:mod:`gpu_trace.query.reads`). Ingest
(:mod:`gpu_trace.store.ingest`) sits above it and writes through its public methods
(:meth:`Store.query`, :meth:`Store.insert_rows`, :meth:`Store.insert_arrow`...); the store never
imports ingest. Every value reaches the server as a ``{name:Type}`` query parameter; the only
names put into SQL text are the database and cluster, checked against a strict identifier pattern
first.

How a store is opened (chDB's one-process lock on a directory, and reading a directory this
process can't write read-only: :attr:`Store.read_only` for a ``Store`` opened with
``reading=True``; every other ``Store`` refuses such a directory in one line) is
:mod:`gpu_trace.store.embedded`'s; where a DSN points, :mod:`gpu_trace.store.dsn`'s.

The schema (:mod:`gpu_trace.store.schema`) grows by columns added with a default
(:data:`~gpu_trace.store.schema.ADDED_COLUMNS`): a store made by an
older version gets them at its next open (``ALTER TABLE ... ADD COLUMN``), its rows unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from gpu_trace import config
from gpu_trace.store import guard as query_guard
from gpu_trace.store.arrow_inserts import (
    InsertConnection,
    insert_in_place,
    open_engine,
    python_fn_refused,
    reads_in_place,
)
from gpu_trace.store.dsn import parse_dsn
from gpu_trace.store.embedded import (
    RUNS_CHANGED,
    StoreError,
    connect,
    first_line,
    open_read_only,
    others_waiting,
    read_only_reason,
    runs_changed_mark,
)
from gpu_trace.store.schema import ADDED_COLUMNS, TABLES, migration_ddl, schema_ddl
from gpu_trace.tracer.run import RunInfo

if TYPE_CHECKING:
    from chdb.state.sqlitelike import Connection as Engine
    from clickhouse_connect.driver.client import Client
    from clickhouse_connect.driver.query import QueryResult

log = logging.getLogger(__name__)

__all__ = [
    "Store",
    "StoreError",
    "InsertConnection",  # from store/arrow_inserts.py, which ingest uses through the Store
    "LimitExceeded",
    # Named here too for the dashboard, which imports them from this module.
    "parse_dsn",
    "others_waiting",
    "runs_changed_mark",
]


class LimitExceeded(StoreError):
    """A read stopped at one of its :class:`~gpu_trace.store.guard.Limits`: ``what`` is
    ``rows``, ``bytes``, ``time`` or ``memory``, ``limit`` its value (rows, bytes or seconds)."""

    def __init__(self, what: str, limit: float) -> None:
        said = {
            "rows": f"stopped at {limit:,} rows: the result has more",
            "bytes": f"stopped at {limit:,} bytes of result",
            "time": f"stopped after {limit:g} s",
            "memory": f"stopped at {limit:,} bytes of memory",
        }
        super().__init__(said[what])
        self.what = what
        self.limit = limit


class Store:
    """A connection to the gpu-trace database: ingest, queries, read-only SQL.

    ``Store()`` opens the configured store (``GPU_TRACE_STORE``, default chDB under
    ``GPU_TRACE_HOME/store``) and creates what is missing. Use it as a context manager or call
    :meth:`close`: an embedded store is locked to this process while it is open.

    ``reading=True`` says only reads will be asked: an embedded store this process can't write
    is then opened read-only (:attr:`read_only`; see :mod:`gpu_trace.store.embedded`) instead of refused.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        cluster: str | None = None,
        lock_timeout_s: float = 10.0,
        reading: bool = False,
    ) -> None:
        self.dsn = config.store_dsn(dsn)
        try:
            self.target = parse_dsn(self.dsn)
        except ValueError as exc:
            raise StoreError(f"bad store DSN: {exc}") from None
        self.cluster = config.cluster(cluster)
        if self.cluster and self.target.kind == "chdb":
            raise StoreError("a cluster needs a ClickHouse server DSN (http://...), not chDB")
        self.database = self.target.database
        self._databases: list[str] | None = None  # other databases, for Store.sql's check
        self._insert_settings: dict[str, Any] = (
            {"insert_distributed_sync": 1} if self.cluster else {}
        )
        #: The scratch directory of a store read read-only (removed at close), else None.
        self._scratch: str | None = None
        #: A second handle on an embedded store's engine for this store's own Arrow inserts
        #: (opened at the first), and its lock; None on a server.
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        #: Set by :meth:`set_readonly`: inserts then go through the refusing connection.
        self._refusing = False
        #: chDB's ``Python()`` table function answers here (False once it refused: a chDB
        #: without it, or ``allow_python_table_function=0``); inserts then go as ArrowStream.
        self._python_fn = True
        self._python_fn_lock = threading.Lock()  # inserts run on several threads
        #: True when the store is read from its files, read-only (``reading=True`` on an
        #: embedded store this process can't write): reads work, every write fails.
        self.read_only = False
        if reading and read_only_reason(self.target):
            self.client, self._scratch = open_read_only(self.target, self.database)
            self.read_only = True
            log.info("gpu-trace: store %s is read-only; reading its files", self.target.path)
            return
        ddl = schema_ddl(self.database, self.cluster)
        self.client = connect(self.target, lock_timeout_s=lock_timeout_s)
        try:
            for statement in ddl:
                self.client.command(statement)
            for statement in migration_ddl(self._missing_columns(), self.database, self.cluster):
                self.client.command(statement)
            self.client.database = self.database
        except Exception as exc:
            self.client.close()
            raise StoreError(
                f"cannot create the gpu-trace tables in {self.target.display()}: {first_line(exc)}"
            ) from exc

    def __repr__(self) -> str:
        return f"Store({self.target.display()!r})"

    def _missing_columns(self) -> list[tuple[str, str]]:
        """The (table, column) pairs of :data:`ADDED_COLUMNS` this store's tables lack."""
        tables = sorted({t for t, _, _ in ADDED_COLUMNS})
        if self.cluster:
            tables += [f"{t}_local" for t in tables]
        found = {
            (str(table), str(name))
            for table, name in self.client.query(
                "SELECT table, name FROM system.columns"
                " WHERE database = {db:String} AND table IN {tables:Array(String)}",
                parameters={"db": self.database, "tables": tables},
            ).result_rows
        }
        return [
            (table, column)
            for table, column, _ in ADDED_COLUMNS
            if (table, column) not in found
            or (self.cluster and (f"{table}_local", column) not in found)
        ]

    # ---- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (and release an embedded store's directory). Idempotent."""
        # None once closed, so a use after close fails loudly rather than reopening anything.
        client, self.client = getattr(self, "client", None), None  # type: ignore[assignment]
        engine, self._engine = getattr(self, "_engine", None), None
        for handle in (engine, client):  # the engine (and its directory) goes with the last
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.close()
        scratch, self._scratch = getattr(self, "_scratch", None), None
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- queries and inserts (the API ingest, the dashboard and the CLI use) ----------------------

    def render(self, template: str) -> str:
        """A query template as SQL text: ``__db__`` becomes this store's (validated) database."""
        return template.replace("__db__", self.database)

    def query(self, template: str, params: dict[str, Any] | None = None) -> QueryResult:
        """Run one query template (``__db__`` for the database, values as ``{name:Type}``
        parameters); StoreError (one line) when it fails or the store is closed."""
        if self.client is None:
            raise StoreError("the store is closed")
        try:
            return self.client.query(self.render(template), parameters=params or {})
        except Exception as exc:
            raise StoreError(f"query failed on {self.target.display()}: {first_line(exc)}") from exc

    def query_arrow(self, template: str, params: dict[str, Any] | None = None) -> pa.Table:
        """:meth:`query` as an Arrow table, strings as ``str``."""
        if self.client is None:
            raise StoreError("the store is closed")
        try:
            return self.client.query_arrow(
                self.render(template), parameters=params or {}, use_strings=True
            )
        except Exception as exc:
            raise StoreError(f"query failed on {self.target.display()}: {first_line(exc)}") from exc

    def connect_again(self) -> InsertConnection:
        """Another connection to the same store, for inserts running beside this one's queries
        (pass it to :meth:`insert_arrow`; the caller closes it)."""
        if self._scratch:
            import clickhouse_connect

            return InsertConnection(
                client=clickhouse_connect.get_client(interface="chdb", path=self._scratch)
            )
        if self._in_place:
            return InsertConnection(engine=self._open_engine())
        return InsertConnection(client=connect(self.target, lock_timeout_s=0))

    @property
    def _in_place(self) -> bool:
        """Whether Arrow inserts go to the engine in memory (an embedded store this process
        writes) rather than as an ArrowStream body."""
        return (
            self.target.kind == "chdb"
            and not self.read_only
            and not self._refusing
            and self._python_fn
        )

    def _open_engine(self) -> Engine:
        try:
            return open_engine(self.target.path)
        except Exception as exc:
            raise StoreError(
                f"cannot open the store {self.target.display()}: {first_line(exc)}"
            ) from exc

    def set_readonly(self) -> None:
        """Make the engine refuse writes from this connection from now on (the dashboard's
        guard; chDB keeps the setting for the session)."""
        if self.client is None:
            raise StoreError("the store is closed")
        self.client.command("SET readonly = 1")
        self._refusing = True

    def insert_arrow(
        self, table_name: str, table: pa.Table, connection: InsertConnection | None = None
    ) -> None:
        """Insert an Arrow table into ``table_name``, on ``connection`` (from
        :meth:`connect_again`) or this store's own.

        On an embedded store the engine reads the table where it lies (chDB's ``Python()`` table
        function, :mod:`gpu_trace.store.arrow_inserts`: no copy of the rows); on a server, or for a
        column that function reads otherwise (``reads_in_place``), the table goes as one
        ArrowStream body. Missing values (nulls) are stored as the column's default either way.
        """
        if self.client is None:
            raise StoreError("the store is closed")
        try:
            if self._in_place and all(reads_in_place(c) for c in table.columns):
                try:
                    if connection is not None and connection.engine is not None:
                        insert_in_place(connection.engine, self._table(table_name), table)
                        return
                    if connection is None:
                        with self._engine_lock:
                            if self._engine is None:
                                self._engine = self._open_engine()
                            insert_in_place(self._engine, self._table(table_name), table)
                        return
                except Exception as exc:
                    if not python_fn_refused(exc):
                        raise
                    self._without_python_fn(exc)
            if connection is not None and connection.client is None and not self._in_place:
                connection.client = connect(self.target, lock_timeout_s=0)  # was an engine's
            client = connection.client if connection is not None else self.client
            if client is None:
                raise StoreError("the connection is closed")
            self._insert_stream(client, table_name, table)
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(
                f"writing {table.num_rows} rows to {table_name} in {self.target.display()} failed: "
                f"{first_line(exc)}"
            ) from exc

    def _without_python_fn(self, exc: BaseException) -> None:
        """chDB refused its ``Python()`` table function (before reading a row): every insert of
        this store goes as an ArrowStream body from now on, said once."""
        with self._python_fn_lock:
            said, self._python_fn = not self._python_fn, False
        if not said:
            log.warning(
                "gpu-trace: chDB's Python() table function is not available (%s): inserts go as "
                "ArrowStream (slower, the same rows)",
                first_line(exc),
            )

    def _insert_stream(self, client: Client, table_name: str, table: pa.Table) -> None:
        """``table`` as one ArrowStream body through clickhouse-connect."""
        table = table.unify_dictionaries()  # a stream's dictionary is one for all its batches
        # Sized once, written once: a growing buffer costs more than the insert's own parsing.
        mock = pa.MockOutputStream()
        with pa.ipc.new_stream(mock, table.schema) as writer:
            writer.write_table(table, max_chunksize=1 << 20)
        buf = pa.allocate_buffer(mock.size())
        with pa.ipc.new_stream(pa.FixedSizeBufferWriter(buf), table.schema) as writer:
            writer.write_table(table, max_chunksize=1 << 20)
        client.raw_insert(
            self._table(table_name),
            table.column_names,
            memoryview(buf),  # type: ignore[arg-type]  # any buffer is sent; stubs say bytes
            settings=self._insert_settings,
            fmt="ArrowStream",
        )

    def insert_rows(self, table_name: str, columns: list[str], rows: Iterable[list[Any]]) -> None:
        """Insert rows (lists in ``columns`` order) into ``table_name``; nothing for no rows."""
        if self.client is None:
            raise StoreError("the store is closed")
        rows = list(rows)
        if not rows:
            return
        try:
            self.client.insert(
                self._table(table_name), rows, column_names=columns, settings=self._insert_settings
            )
        except Exception as exc:
            raise StoreError(
                f"writing to {table_name} in {self.target.display()} failed: {first_line(exc)}"
            ) from exc

    def _table(self, name: str) -> str:
        return f"{self.database}.{name}"

    # ---- writing ----------------------------------------------------------------------------------

    def upsert_run(self, info: RunInfo) -> None:
        """Insert or replace the ``runs`` row of a run. Its ``stored_ns`` is the time the run
        first reached the store, kept by later upserts (``last`` is the run stored last)."""
        now = time.time_ns()
        stored = self.query(
            "SELECT min(stored_ns) FROM __db__.runs WHERE run_id = {run_id:String} AND stored_ns > 0",
            {"run_id": info.run_id},
        ).result_rows
        stored_ns = int(stored[0][0]) if stored and stored[0][0] else now
        attrs = {str(k): str(v) for k, v in info.attrs.items()}
        wall = 0  # unknown without the run's clock anchor
        with contextlib.suppress(KeyError, ValueError):
            wall = (
                int(attrs["anchor_wall_ns"]) + int(info.started_ns) - int(attrs["anchor_mono_ns"])
            )
        row = [
            info.run_id,
            info.trace_id,
            int(info.started_ns),
            int(info.ended_ns),
            wall,
            info.command,
            [str(h) for h in info.hosts],
            info.status,
            attrs,
            now,
            stored_ns,
        ]
        columns = [
            "run_id",
            "trace_id",
            "started_ns",
            "ended_ns",
            "started_wall_ns",
            "command",
            "hosts",
            "status",
            "attrs",
            "updated_ns",
            "stored_ns",
        ]
        self.insert_rows("runs", columns, [row])
        self._note_runs_changed()

    def _note_runs_changed(self) -> None:
        """Rewrite an embedded store's :data:`RUNS_CHANGED` (a failure only costs a dashboard
        its shortcut: it then asks the store)."""
        if self.target.kind != "chdb" or not self.target.path or self.read_only:
            return
        try:
            (Path(self.target.path) / RUNS_CHANGED).write_text(
                f"{time.time_ns()} {os.getpid()}\n", encoding="ascii"
            )
        except OSError as exc:
            log.debug("gpu-trace: could not note a change of runs: %s", exc)

    # ---- removing runs ----------------------------------------------------------------------------

    def delete_run(self, run_id: str) -> dict[str, int]:
        """Remove every row of one run from every table keyed by ``run_id``; its rows per table
        before. Runs ``ALTER TABLE ... DELETE`` (on each node's local table with a cluster) and
        waits for the mutation (``mutations_sync=2``), so the rows are gone when it returns;
        StoreError when a delete fails or rows remain."""
        if self.client is None:
            raise StoreError("the store is closed")
        before = self.table_rows([run_id])
        on = f" ON CLUSTER `{self.cluster}`" if self.cluster else ""
        try:
            for name in TABLES:
                local = f"{name}_local" if self.cluster else name
                try:
                    self.client.command(
                        f"ALTER TABLE {self.database}.{local}{on}"
                        " DELETE WHERE run_id = {run_id:String}",
                        parameters={"run_id": run_id},
                        settings={"mutations_sync": 2},
                    )
                except Exception as exc:
                    raise StoreError(
                        f"removing run {run_id} from {name} in {self.target.display()} failed: "
                        f"{first_line(exc)}"
                    ) from exc
        finally:
            self._note_runs_changed()  # its runs row may be gone, even if a later table failed
        left = {t: n for t, n in self.table_rows([run_id]).get(run_id, {}).items() if n}
        if left:
            shown = ", ".join(f"{n} {t}" for t, n in left.items())
            raise StoreError(f"run {run_id} still has rows after its delete: {shown}")
        return before.get(run_id, {})

    def table_rows(self, run_ids: list[str]) -> dict[str, dict[str, int]]:
        """Rows per table of each run (every table keyed by ``run_id``); runs with none are left
        out."""
        out: dict[str, dict[str, int]] = {}
        if not run_ids:
            return out
        for name in TABLES:
            result = self.query(
                f"SELECT run_id, count() FROM __db__.{name} WHERE run_id IN {{ids:Array(String)}}"
                " GROUP BY run_id",
                {"ids": list(run_ids)},
            )
            for run_id, n in result.result_rows:
                out.setdefault(str(run_id), {})[name] = int(n)
        return out

    def run_bytes(self, run_ids: list[str]) -> dict[str, int] | None:
        """Estimated bytes each run takes in the store: per table, the table's bytes on disk
        (``system.parts``, active parts) times the run's share of its rows. None when
        ``system.parts`` cannot be read (a user without access): sizes are then not known."""
        try:
            parts = self.query(
                "SELECT table, sum(bytes_on_disk), sum(rows) FROM system.parts"
                " WHERE database = {db:String} AND active GROUP BY table",
                {"db": self.database},
            ).result_rows
        except StoreError:
            return None
        per_table = {str(t).removesuffix("_local"): (int(b), int(r)) for t, b, r in parts}
        out = {run_id: 0 for run_id in run_ids}
        for run_id, tables in self.table_rows(list(run_ids)).items():
            total = 0.0
            for name, n in tables.items():
                size, rows = per_table.get(name, (0, 0))
                if rows:
                    total += size * min(n, rows) / rows
            out[run_id] = int(total)
        return out

    # ---- read-only SQL ----------------------------------------------------------------------------

    def sql(
        self,
        query: str,
        parameters: dict[str, Any] | None = None,
        *,
        limits: query_guard.Limits | None = None,
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read of the store's tables: ``SELECT``, ``SHOW TABLES``, ``DESCRIBE``, ``EXISTS``.

        The database ``gpu_trace`` is the default, so ``SELECT count() FROM spans`` works. Values go
        in as ``{name:Type}`` parameters. ClickHouse's parser decides what the query does
        (:mod:`gpu_trace.store.guard`): writes, table functions, file and URL functions,
        ``INTO OUTFILE``, ``SETTINGS`` and most system tables are refused before it runs, and the
        engine runs it with ``readonly=1`` as well. Refusals are :class:`StoreError` starting
        ``gpu-trace sql is read-only: ``.

        ``limits`` (:class:`~gpu_trace.store.guard.Limits`; none by default) bound the
        result's rows and bytes, the time and the engine's memory: the engine is given them as
        settings, and the result is read block by block, each block checked, so a read that
        passes one stops there with :class:`LimitExceeded` and no rows.
        """
        checked = self.check_read(query, parameters)
        limits = limits or query_guard.Limits()
        # readonly last: a server applies URL settings in order, and readonly=1 would refuse
        # the ones after it.
        settings = {**limits.settings(), "readonly": 1}
        started = time.monotonic()
        rows: list[tuple[object, ...]] = []
        size = 0

        def take(block: Sequence[Sequence[object]]) -> None:
            nonlocal size
            if limits.timeout_s and time.monotonic() - started > limits.timeout_s:
                raise LimitExceeded("time", limits.timeout_s)
            if limits.max_rows and len(rows) + len(block[0]) > limits.max_rows:
                raise LimitExceeded("rows", limits.max_rows)
            if limits.max_bytes:
                size += sum(map(query_guard.column_bytes, block))
                if size > limits.max_bytes:
                    raise LimitExceeded("bytes", limits.max_bytes)
            rows.extend(zip(*block))

        try:
            if checked.statement == "SelectWithUnionQuery":
                with self.client.query_column_block_stream(
                    checked.text, parameters=parameters or {}, settings=settings
                ) as stream:
                    for block in stream:
                        take(block)
                    columns = list(stream.source.column_names)
            else:  # SHOW, DESCRIBE, EXISTS, EXPLAIN: a little metadata, which chDB won't stream
                result = self.client.query(
                    checked.text, parameters=parameters or {}, settings=settings
                )
                if result.result_columns:
                    take(result.result_columns)
                columns = list(result.column_names)
        except LimitExceeded:
            raise
        except Exception as exc:
            message = first_line(exc)
            hit = query_guard.exceeded(str(exc), limits)
            if hit:
                limit = {
                    "rows": limits.max_rows,
                    "bytes": limits.max_bytes,
                    "time": limits.timeout_s,
                    "memory": limits.max_memory,
                }[hit]
                raise LimitExceeded(hit, limit) from exc
            # ClickHouse's READONLY error (code 164), not any message that quotes the query's
            # `SETTINGS readonly = '1'` (an unknown column's does)
            if "(READONLY)" in str(exc) or "in readonly mode" in message:
                raise StoreError(f"gpu-trace sql is read-only: {message}") from exc
            raise StoreError(f"query failed: {message}") from exc
        return columns, rows

    def check_read(
        self, query: str, parameters: dict[str, Any] | None = None
    ) -> query_guard.Checked:
        """The query as it will run (:class:`~gpu_trace.store.guard.Checked`), if it only
        reads the store's tables; StoreError saying what was refused if not."""
        if self.client is None:
            raise StoreError("the store is closed")
        if self._databases is None:
            try:
                self._databases = [
                    str(r[0]) for r in self.client.query("SHOW DATABASES").result_rows
                ]
            except Exception as exc:
                raise StoreError(f"query failed: {first_line(exc)}") from exc

        def ask(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
            return [tuple(row) for row in self.client.query(sql, parameters=params).result_rows]

        try:
            return query_guard.check(
                query, parameters, ask, database=self.database, databases=self._databases
            )
        except query_guard.QueryRefused as exc:
            raise StoreError(f"gpu-trace sql is read-only: {exc}") from None
