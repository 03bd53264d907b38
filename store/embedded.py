"""Opening a store: a connection to a ClickHouse server, or to an embedded chDB directory under
chDB's one-process lock, or to a chDB directory this process can't write, read-only.

chDB keeps one store directory to one process at a time (ClickHouse locks ``<dir>/status`` while
the engine runs, and the engine runs while a connection to the directory is open). A process that
finds the store held waits up to ``lock_timeout_s`` for it, saying so (:func:`others_waiting`: the
dashboard, which holds the store between requests, gives it up then), and gets
:class:`StoreError` naming the holder if it is not let in (:func:`connect`).

chDB cannot open a directory it cannot write (it writes ``status`` first). Such a store is read
another way (:func:`open_read_only`): an engine in a scratch directory of its own attaches the
store's tables from their files, each on a write-once disk (``local_blob_storage`` with ``plain``
metadata), so they are permanently read-only there (no insert, merge, mutation or cleanup touches
a file), and chDB's lock on the store is neither needed nor taken.
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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_trace import config
from gpu_trace.store.dsn import Target, parse_dsn
from gpu_trace.store.schema import TABLES

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

log = logging.getLogger(__name__)

__all__ = [
    "StoreError",
    "check_writable",
    "read_only_reason",
    "lock_holder",
    "others_waiting",
    "runs_changed_mark",
    "RUNS_CHANGED",
    "connect",
    "open_read_only",
    "first_line",
]


class StoreError(RuntimeError):
    """The store can't be opened, written or asked; the message says why in one line."""


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
        client = connect(target, lock_timeout_s=0)
    except StoreError as exc:
        return str(exc)
    try:
        readonly = client.query("SELECT getSetting('readonly')").result_rows[0][0]
        if str(readonly) != "0":
            return f"{target.display()} is read-only for user {target.username}"
    except Exception as exc:
        return f"cannot ask {target.display()}: {first_line(exc)}"
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


def read_only_reason(target: Target) -> str | None:
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


def first_line(exc: BaseException) -> str:
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
    return first_line(exc)


@contextlib.contextmanager
def _opening(path: str, timeout_s: float) -> Iterator[None]:
    """Only one gpu-trace process at a time tries to open the chDB directory ``path``.

    chDB prints ``Cannot lock file .../status`` to stderr itself when its lock is taken while it
    opens; a process that finds the store in use waits instead (:func:`connect`), but two that
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


def connect(target: Target, *, lock_timeout_s: float) -> Client:
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
                                f"cannot open the store {target.display()}: {first_line(exc)}"
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


def open_read_only(target: Target, database: str) -> tuple[Client, str]:
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
            f"cannot read the store {target.display()} read-only: {first_line(exc)}"
        ) from exc
    return client, scratch
