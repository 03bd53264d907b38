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

chDB keeps one store directory to one process at a time (ClickHouse locks ``<dir>/status`` while
the engine runs, and the engine runs while a connection to the directory is open). A process that
finds the store held waits up to ``lock_timeout_s`` for it, saying so (:func:`others_waiting`: the
dashboard, which holds the store between requests, gives it up then), and gets
:class:`StoreError` naming the holder if it is not let in.

chDB cannot open a directory it cannot write (it writes ``status`` first). A ``Store`` opened for
reading (``reading=True``: what ``ls``, ``show``, ``sql`` and ``export`` ask for) on such a store
reads it another way (:attr:`Store.read_only`): an engine in a scratch directory of its own
attaches the store's tables from their files, each on a write-once disk (``local_blob_storage``
with ``plain`` metadata), so they are permanently read-only there (no insert, merge, mutation or
cleanup touches a file), and chDB's lock on the store is neither needed nor taken. Every other
``Store`` refuses such a directory in one line saying it is read-only.

The schema grows by columns added with a default (:data:`ADDED_COLUMNS`): a store made by an
older version gets them at its next open (``ALTER TABLE ... ADD COLUMN``), its rows unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import pyarrow as pa

from gpu_trace import config
from gpu_trace.store import guard as query_guard
from gpu_trace.tracer.run import RunInfo

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client
    from clickhouse_connect.driver.query import QueryResult

log = logging.getLogger(__name__)

__all__ = [
    "Store",
    "StoreError",
    "LimitExceeded",
    "Target",
    "parse_dsn",
    "schema_ddl",
    "migration_ddl",
    "check_writable",
    "others_waiting",
    "runs_changed_mark",
]

DEFAULT_DATABASE = "gpu_trace"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CLUSTER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class StoreError(RuntimeError):
    """The store can't be opened, written or asked; the message says why in one line."""


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


# ---- DSN -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where a DSN points: an embedded chDB directory or a ClickHouse server."""

    kind: str  # "chdb" or "http"
    path: str = ""  # chdb: the store directory ("" = in memory)
    host: str = ""
    port: int = 0
    username: str = "default"
    password: str = field(default="", repr=False)
    secure: bool = False
    database: str = DEFAULT_DATABASE

    def display(self) -> str:
        """The DSN without its password, for messages and logs."""
        if self.kind == "chdb":
            return f"chdb://{self.path or ':memory:'}"
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{self.username}@{self.host}:{self.port}/{self.database}"


def parse_dsn(dsn: str) -> Target:
    """Parse a store DSN. A bare path means a chDB directory. Raises ValueError when malformed."""
    dsn = dsn.strip()
    if not dsn:
        raise ValueError("empty store DSN")
    if dsn.startswith("chdb:"):
        rest = dsn[len("chdb:") :]
        if rest.startswith("//"):
            rest = rest[2:]
        if rest in ("", "memory", ":memory:"):
            return Target("chdb", path="")
        if not rest.startswith("/"):  # chdb://relative/dir or chdb:~/dir
            rest = os.path.expanduser(rest)
        return Target("chdb", path=os.path.abspath(os.path.expanduser(unquote(rest))))
    if "://" not in dsn:
        if not dsn.startswith(("/", "./", "../", "~")):
            # A bare word is more likely a mistyped option than a store to create here.
            raise ValueError(
                f"not a store DSN: {dsn!r}; give chdb:///path or a path (/dir, ./dir, ~/dir) "
                "for an embedded store, or http(s)://user:password@host:port for a ClickHouse "
                "server"
            )
        return Target("chdb", path=os.path.abspath(os.path.expanduser(dsn)))
    url = urlparse(dsn)
    if url.scheme not in ("http", "https"):
        raise ValueError(f"store DSN must be chdb://, http:// or https://, got {url.scheme}://")
    if not url.hostname:
        raise ValueError(f"store DSN has no host: {dsn.split('@')[-1]}")
    if url.params or url.query or url.fragment:
        raise ValueError("store DSN takes no parameters after the database name")
    secure = url.scheme == "https"
    database = unquote(url.path.strip("/")) or DEFAULT_DATABASE
    if not _IDENTIFIER.match(database):
        raise ValueError(f"database name must be a plain identifier, got {database!r}")
    try:
        port = url.port or (8443 if secure else 8123)
    except ValueError:
        raise ValueError("store DSN has an invalid port") from None
    return Target(
        "http",
        host=url.hostname,
        port=port,
        username=unquote(url.username) if url.username else "default",
        password=unquote(url.password) if url.password else "",
        secure=secure,
        database=database,
    )


# ---- schema --------------------------------------------------------------------------------------

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
    if not _IDENTIFIER.match(database):
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


# ---- writability and chDB's directory lock -------------------------------------------------------


def check_writable(dsn: str | None = None) -> str | None:
    """None if the store can be written, else a one-line reason. Call before starting a program.

    For chDB the directory (or its nearest existing parent) must be a directory a file can be
    created in; for a server, it must answer and not be read-only for this user.
    """
    try:
        target = parse_dsn(config.store_dsn(dsn))
    except ValueError as exc:
        return str(exc)
    if target.kind == "chdb":
        return _check_dir_writable(target.path) if target.path else None
    try:
        client = _connect(target, lock_timeout_s=0)
    except StoreError as exc:
        return str(exc)
    try:
        readonly = client.query("SELECT getSetting('readonly')").result_rows[0][0]
        if str(readonly) != "0":
            return f"{target.display()} is read-only for user {target.username}"
    except Exception as exc:
        return f"cannot ask {target.display()}: {_first_line(exc)}"
    finally:
        client.close()
    return None


def _check_dir_writable(path: str) -> str | None:
    p = Path(path)
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing parent directory for the store {path}"
        probe = probe.parent
    if not probe.is_dir():
        return f"the store {path} can't be created: {probe} is not a directory"
    if probe != p:
        # A parent exists; the store's own directory must be creatable in it.
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"the store directory {path} can't be created: {exc.strerror or exc}"
    try:
        fd, name = tempfile.mkstemp(prefix=".gpu-trace-probe-", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return (
            f"the store {path} is read-only ({exc.strerror or exc}): nothing can be stored in it "
            "(ls, show, sql and export read it)"
        )
    return None


def _read_only_reason(target: Target) -> str | None:
    """Why an existing chDB store directory can't be written (:func:`_check_dir_writable`'s
    line), or None: a server, memory, a writable directory, or none there to read."""
    if target.kind != "chdb" or not target.path or not Path(target.path).is_dir():
        return None
    return _check_dir_writable(target.path)


def lock_holder(path: str) -> str | None:
    """Which other process holds a chDB directory open ("pid N (cmd)"), or None if it is free."""
    status = Path(path) / "status"
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None  # a stale status file from a process that died
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    finally:
        os.close(fd)
    m = re.search(r"PID:\s*(\d+)", text)
    if not m:
        return "another process"
    pid = int(m.group(1))
    if pid == os.getpid():
        return None  # this process: chDB shares its engine between clients on one path
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        cmd = ""
    return f"pid {pid}" + (f" ({cmd[:120]})" if cmd else "")


# ---- connection ----------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # chDB puts the reason after a long prefix and a stack trace after it.
    for marker in ("e.what() = ", "DB::Exception: "):
        if marker in text:
            text = text.rsplit(marker, 1)[-1]
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _http_reason(exc: BaseException) -> str:
    """The cause of a failed HTTP request, without the connection pool's wrapping
    (``Connection refused``, ``Name or service not known``, ``timed out``)."""
    text = str(exc)
    m = re.search(r"\[Errno -?\d+\] ([^'\"()]+)", text)
    if m:
        return m.group(1).strip().rstrip(".")
    for cause in ("timed out", "Name or service not known", "Connection refused"):
        if cause in text:
            return cause
    return _first_line(exc)


@contextlib.contextmanager
def _opening(path: str, timeout_s: float) -> Iterator[None]:
    """Only one gpu-trace process at a time tries to open the chDB directory ``path``.

    chDB prints ``Cannot lock file .../status`` to stderr itself when its lock is taken while it
    opens; a process that finds the store in use waits instead (:func:`_connect`), but two that
    both find it free, or one that probes the lock while another opens, would race. A lock file
    of our own beside chDB's (``.gpu-trace-open.lock``), held for the open only, orders them.
    """
    Path(path).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(path) / ".gpu-trace-open.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + max(timeout_s, 5.0)  # an open takes well under a second
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"the store {path} is being opened by another process"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # releases the lock


#: Beside chDB's own files: shared-locked by every gpu-trace process waiting to open the store.
WAITING_LOCK = ".gpu-trace-waiting.lock"
#: Seconds between looks at a held store by a process waiting for it.
WAIT_POLL_S = 0.05


def others_waiting(path: str) -> bool:
    """Whether another process is waiting to open the chDB directory ``path`` (the dashboard,
    which keeps the store open between requests, gives it up when this is true)."""
    try:
        fd = os.open(Path(path) / WAITING_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        return False
    finally:
        os.close(fd)  # releases the lock, if taken


#: Beside chDB's own files: rewritten by every Store that stores, changes or removes a run, so
#: a dashboard that gave the store up knows, without opening it, whether its run list is current.
RUNS_CHANGED = ".gpu-trace-runs-changed"


def runs_changed_mark(path: str) -> str:
    """What the chDB directory ``path``'s :data:`RUNS_CHANGED` says ("" before any change): it
    differs after each run stored, changed or removed by a gpu-trace process."""
    try:
        return (Path(path) / RUNS_CHANGED).read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""


def _say_waiting(path: str) -> int:
    """Take a shared lock on the store's :data:`WAITING_LOCK` (held until the fd is closed)."""
    fd = os.open(Path(path) / WAITING_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while someone looks (a moment)
    except OSError:
        os.close(fd)
        raise
    return fd


def _connect(target: Target, *, lock_timeout_s: float) -> Client:
    import clickhouse_connect

    if target.kind == "http":
        try:
            return clickhouse_connect.get_client(
                host=target.host,
                port=target.port,
                username=target.username,
                password=target.password,
                secure=target.secure,
                interface="https" if target.secure else "http",
                compress=False,
            )
        except Exception as exc:
            raise StoreError(
                f"cannot reach the store {target.display()}: {_http_reason(exc)}"
            ) from exc
    if target.path:
        problem = _check_dir_writable(target.path)
        if problem:
            raise StoreError(problem)
    deadline = time.monotonic() + lock_timeout_s
    waiting = -1  # the fd of our shared lock on WAITING_LOCK while we wait for the store
    try:
        while True:
            with _opening(target.path, lock_timeout_s) if target.path else contextlib.nullcontext():
                holder = lock_holder(target.path) if target.path else None
                if holder is None:
                    try:
                        return clickhouse_connect.get_client(
                            interface="chdb", path=target.path or None
                        )
                    except Exception as exc:
                        holder = lock_holder(target.path) if target.path else None
                        if holder is None:
                            raise StoreError(
                                f"cannot open the store {target.display()}: {_first_line(exc)}"
                            ) from exc
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"the store {target.path} is in use by {holder}; chDB lets one process open a "
                    "store directory at a time. Stop that process, or point GPU_TRACE_STORE at a "
                    "ClickHouse server (http://user:password@host:8123)"
                )
            if waiting < 0:
                # Said until we have the store: a dashboard holding it gives it up.
                waiting = _say_waiting(target.path)
                log.info("gpu-trace: store %s is in use by %s; waiting", target.path, holder)
            time.sleep(WAIT_POLL_S)
    finally:
        if waiting >= 0:
            os.close(waiting)


#: The scratch directories of read-only opens: ``<tmp>/gpu-trace-read-<pid>-<random>``.
SCRATCH_PREFIX = "gpu-trace-read-"

_UUID = re.compile(
    r"ATTACH TABLE _ UUID '([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})'"
)


def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _table_uuid(path: str, database: str, table: str) -> str | None:
    """The UUID a chDB store's metadata gives ``database.table`` (its files are under
    ``store/<uuid[:3]>/<uuid>/``), or None if the store has no such table."""
    meta = Path(path) / "metadata" / database / f"{table}.sql"
    try:
        head = meta.read_text(encoding="utf-8", errors="replace")[:200]
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"cannot read the store {path}: {exc.strerror or exc}") from None
    m = _UUID.match(head)
    if not m:
        raise StoreError(f"cannot read the store {path} read-only: {meta} names no table UUID")
    return m.group(1)


def _sweep_scratch() -> None:
    """Remove the scratch directories of read-only opens whose process is gone (one killed, or
    stopped by `gpu-trace sql`'s hard time limit, leaves its own)."""
    for entry in Path(tempfile.gettempdir()).glob(SCRATCH_PREFIX + "*"):
        pid = entry.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass  # alive, another user's


def _open_read_only(target: Target, database: str) -> tuple[Client, str]:
    """A chDB engine in a scratch directory with the store's tables attached read-only from
    their files (see the module's docstring); the client and the scratch directory."""
    import clickhouse_connect

    _sweep_scratch()
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    client: Client | None = None
    try:
        client = clickhouse_connect.get_client(interface="chdb", path=scratch)
        client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
        disk = (
            "disk(type = 'local_blob_storage', metadata_type = 'plain', "
            f"path = {_sql_string(target.path.rstrip('/') + '/')})"
        )
        for name, (columns, engine, order_by, _) in TABLES.items():
            uuid = _table_uuid(target.path, database, name)
            if uuid is None:  # a store made before the table: read it as empty
                client.command(
                    f"CREATE TABLE {database}.{name} ({columns}) ENGINE = {engine} "
                    f"ORDER BY {order_by}"
                )
                continue
            # This version's columns: a column the store's files lack reads its default, as
            # after ALTER ... ADD COLUMN (ADDED_COLUMNS).
            client.command(
                f"ATTACH TABLE {database}.{name} UUID '{uuid}' ({columns}) ENGINE = {engine} "
                f"ORDER BY {order_by} SETTINGS disk = {disk}"
            )
        client.database = database
    except Exception as exc:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(exc, StoreError):
            raise
        raise StoreError(
            f"cannot read the store {target.display()} read-only: {_first_line(exc)}"
        ) from exc
    return client, scratch


class Store:
    """A connection to the gpu-trace database: ingest, queries, read-only SQL.

    ``Store()`` opens the configured store (``GPU_TRACE_STORE``, default chDB under
    ``GPU_TRACE_HOME/store``) and creates what is missing. Use it as a context manager or call
    :meth:`close`: an embedded store is locked to this process while it is open.

    ``reading=True`` says only reads will be asked: an embedded store this process can't write
    is then opened read-only (:attr:`read_only`; see the module's docstring) instead of refused.
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
        #: True when the store is read from its files, read-only (``reading=True`` on an
        #: embedded store this process can't write): reads work, every write fails.
        self.read_only = False
        if reading and _read_only_reason(self.target):
            self.client, self._scratch = _open_read_only(self.target, self.database)
            self.read_only = True
            log.info("gpu-trace: store %s is read-only; reading its files", self.target.path)
            return
        ddl = schema_ddl(self.database, self.cluster)
        self.client = _connect(self.target, lock_timeout_s=lock_timeout_s)
        try:
            for statement in ddl:
                self.client.command(statement)
            for statement in migration_ddl(self._missing_columns(), self.database, self.cluster):
                self.client.command(statement)
            self.client.database = self.database
        except Exception as exc:
            self.client.close()
            raise StoreError(
                f"cannot create the gpu-trace tables in {self.target.display()}: {_first_line(exc)}"
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
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
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
            raise StoreError(
                f"query failed on {self.target.display()}: {_first_line(exc)}"
            ) from exc

    def query_arrow(self, template: str, params: dict[str, Any] | None = None) -> pa.Table:
        """:meth:`query` as an Arrow table, strings as ``str``."""
        if self.client is None:
            raise StoreError("the store is closed")
        try:
            return self.client.query_arrow(
                self.render(template), parameters=params or {}, use_strings=True
            )
        except Exception as exc:
            raise StoreError(
                f"query failed on {self.target.display()}: {_first_line(exc)}"
            ) from exc

    def connect_again(self) -> Client:
        """Another connection to the same store, for inserts running beside this one's queries
        (pass it to :meth:`insert_arrow`; the caller closes it)."""
        if self._scratch:
            import clickhouse_connect

            return clickhouse_connect.get_client(interface="chdb", path=self._scratch)
        return _connect(self.target, lock_timeout_s=0)

    def set_readonly(self) -> None:
        """Make the engine refuse writes from this connection from now on (the dashboard's
        guard; chDB keeps the setting for the session)."""
        if self.client is None:
            raise StoreError("the store is closed")
        self.client.command("SET readonly = 1")

    def insert_arrow(
        self, table_name: str, table: pa.Table, connection: Client | None = None
    ) -> None:
        """Insert an Arrow table into ``table_name`` as one ArrowStream body (the same call for
        chDB and a server), on ``connection`` (from :meth:`connect_again`) or this store's own."""
        client = connection or self.client
        if client is None:
            raise StoreError("the store is closed")
        # Sized once, written once: a growing buffer costs more than the insert's own parsing.
        mock = pa.MockOutputStream()
        with pa.ipc.new_stream(mock, table.schema) as writer:
            writer.write_table(table, max_chunksize=1 << 20)
        buf = pa.allocate_buffer(mock.size())
        with pa.ipc.new_stream(pa.FixedSizeBufferWriter(buf), table.schema) as writer:
            writer.write_table(table, max_chunksize=1 << 20)
        try:
            client.raw_insert(
                self._table(table_name),
                table.column_names,
                memoryview(buf),  # type: ignore[arg-type]  # any buffer is sent; stubs say bytes
                settings=self._insert_settings,
                fmt="ArrowStream",
            )
        except Exception as exc:
            raise StoreError(
                f"writing {table.num_rows} rows to {table_name} in {self.target.display()} failed: "
                f"{_first_line(exc)}"
            ) from exc

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
                f"writing to {table_name} in {self.target.display()} failed: {_first_line(exc)}"
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
                        f"{_first_line(exc)}"
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
            message = _first_line(exc)
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
                raise StoreError(f"query failed: {_first_line(exc)}") from exc

        def ask(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
            return [tuple(row) for row in self.client.query(sql, parameters=params).result_rows]

        try:
            return query_guard.check(
                query, parameters, ask, database=self.database, databases=self._databases
            )
        except query_guard.QueryRefused as exc:
            raise StoreError(f"gpu-trace sql is read-only: {exc}") from None
