"""Where the dashboard's data comes from: one store, opened lazily, asked one query at a time.

The dashboard is read-only. Every query it sends is one of its own ``SELECT`` templates with
``{name:Type}`` parameters (:mod:`gpu_trace.query`'s), held to the rule `gpu-trace sql`
is (:mod:`gpu_trace.store.guard`: ClickHouse's parser, reads of the store's tables only),
checked once per template; and with ``enforce_readonly`` (what ``gpu-trace ui`` uses) the engine
itself is switched to ``readonly=1`` for this process once the store is open.

The web server answers requests on several threads, so one connection is shared behind a lock.
chDB lets one process at a time open a store directory (docs/schema.md), and the dashboard stays
open for hours while `record`, `ls`, `import` and the rest come and go: so the dashboard keeps an
embedded store open only until another gpu-trace process asks for it (a process waiting for the
store says so: :func:`~gpu_trace.store.client.others_waiting`). A watcher thread sees that within
:data:`YIELD_POLL_S`, waits for the query running, and closes the store; the next request opens
it again, after whoever was waiting (docs/dashboard.md, "A dashboard that stays open"). Each open
counts in :attr:`ReadOnlyStore.opens`: while it is unchanged nobody else has written, so
:meth:`ReadOnlyStore.runs_stamp` answers without a query. A store that can't be opened (a server
that is down, a directory another process holds too long) is retried on the next request; the
message says why in one line, and the page shows it.

A :class:`ReadOnlyStore` is a :class:`~gpu_trace.query.source.Source`: the dashboard reads through
the functions of :mod:`gpu_trace.query` like the CLI and ``Run`` do, each query taken under the
lock and checked; there is no way to call a store method by name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from gpu_trace import config
from gpu_trace.query import reads
from gpu_trace.store.client import (
    Store,
    StoreError,
    others_waiting,
    parse_dsn,
    runs_changed_mark,
)

if TYPE_CHECKING:
    from clickhouse_connect.driver.query import QueryResult

log = logging.getLogger(__name__)

__all__ = ["ReadOnlyStore", "StoreError"]

T = TypeVar("T")

#: Seconds between attempts to open a store that failed to open.
RETRY_S = 2.0
#: Seconds between the watcher's looks for another process waiting for an embedded store.
YIELD_POLL_S = 0.05


class ReadOnlyStore:
    """A lazily opened, shared, read-only store. ``ReadOnlyStore(store=...)`` wraps an open one.

    An embedded (chDB) store it opens itself is given up whenever another gpu-trace process waits
    to open it (see the module's docstring); one passed in is never closed here.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        store: Store | None = None,
        enforce_readonly: bool = False,
        lock_timeout_s: float = 2.0,
    ) -> None:
        self.dsn = dsn
        self._store = store
        self._enforce = enforce_readonly
        self._lock_timeout_s = lock_timeout_s
        self._lock = threading.RLock()
        self._failed_at = 0.0
        self._problem = ""
        self.cache: dict[tuple, Any] = {}
        self._checked: set[str] = set()  # templates that passed the read-only check
        #: How many times the store was opened here (a change means it was given up between).
        self.opens = 0
        #: How many times it was given up to another process.
        self.yields = 0
        # The last runs_stamp: (opens then, the stamp, runs_changed_mark before it was asked).
        self._stamp: tuple[int, str, str] | None = None
        self._path = _chdb_path(dsn) if store is None else None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def display(self) -> str:
        if self._store is not None:
            return self._store.target.display()
        return self.dsn or "the default store"

    def store(self, timeout_s: float | None = None) -> Store:
        """The open store; StoreError (one line) if it can't be opened. ``timeout_s``: how long
        to wait for another process holding an embedded store (default: ``lock_timeout_s``); an
        embedded store found busy by a shorter wait is not remembered as its problem."""
        with self._lock:
            if self._store is not None:
                return self._store
            now = time.monotonic()
            if self._problem and now - self._failed_at < RETRY_S:
                raise StoreError(self._problem)
            wait = self._lock_timeout_s if timeout_s is None else timeout_s
            try:
                if self._path:
                    # Whoever made us give the store up goes first (else each request of ours
                    # would take it back before the waiting process looks again).
                    while others_waiting(self._path):
                        if time.monotonic() - now >= wait:
                            raise StoreError(
                                f"the store {self._path} is in use by another gpu-trace process"
                            )
                        time.sleep(YIELD_POLL_S)
                left = max(0.0, wait - (time.monotonic() - now))
                store = Store(self.dsn, lock_timeout_s=left)
            except StoreError as exc:
                if timeout_s is None or not self._path:
                    self._problem, self._failed_at = str(exc), time.monotonic()
                raise
            if self._enforce:
                # From here on the engine refuses writes from this process (chDB keeps the setting
                # for the session; a server applies it per query below).
                store.set_readonly()
            self._store, self._problem = store, ""
            self.opens += 1
            if self._path and self._watcher is None:
                self._stop = threading.Event()
                self._watcher = threading.Thread(
                    target=self._watch, args=(self._stop,), name="gpu-trace-ui-store", daemon=True
                )
                self._watcher.start()
            return store

    def _watch(self, stop: threading.Event) -> None:
        """Give the embedded store up whenever another process waits for it (until ``stop``)."""
        assert self._path
        while not stop.wait(YIELD_POLL_S):
            if self._store is None or not others_waiting(self._path):
                continue
            with self._lock:  # after the query running
                if self._store is None:
                    continue
                self._store.close()
                self._store = None
                self.yields += 1
            log.debug("gpu-trace: store %s given up to a waiting process", self._path)

    def runs_stamp(self, timeout_s: float | None = None) -> str:
        """:func:`~gpu_trace.query.reads.runs_stamp`: changes
        when runs are stored, updated or removed. For an embedded store, the same answer without
        a query (or opening it again) while nobody else has changed runs since the last one:
        held all along, or given up only to processes that changed no run
        (:func:`~gpu_trace.store.client.runs_changed_mark`; each engine start costs the
        process memory that chDB does not give back)."""
        with self._lock:
            mark = runs_changed_mark(self._path) if self._path else ""
            if self._path and self._stamp is not None:
                opens, stamp, seen = self._stamp
                if (self._store is not None and opens == self.opens) or seen == mark:
                    return stamp
            store = self.store(timeout_s)
            stamp = reads.runs_stamp(store)
            self._stamp = (self.opens, stamp, mark)
            return stamp

    def _check(self, store: Store, template: str, params: dict[str, Any] | None) -> None:
        """Refuse a template that is not a read of the store's tables (once per template: a
        template's values are typed parameters, so its parse does not depend on them)."""
        if template in self._checked:
            return
        try:
            store.check_read(store.render(template), params)
        except StoreError as exc:
            reason = str(exc).removeprefix("gpu-trace sql is read-only: ")
            raise StoreError(f"the dashboard is read-only: {reason}") from None
        self._checked.add(template)

    def query(self, template: str, params: dict[str, Any] | None = None) -> QueryResult:
        """One parameterized SELECT (``__db__`` is the database), checked, under the lock."""
        with self._lock:
            store = self.store()
            self._check(store, template, params)
            return store.query(template, params)

    def query_arrow(self, template: str, params: dict[str, Any] | None = None) -> pa.Table:
        """One parameterized SELECT as an Arrow table (strings as str), checked, under the lock."""
        with self._lock:
            store = self.store()
            self._check(store, template, params)
            return store.query_arrow(template, params)

    # ---- pages read whole ----------------------------------------------------------------------

    def spans(
        self, run_id: str, start_ns: int | None = None, end_ns: int | None = None
    ) -> list[pa.Table]:
        """Span batches of a run overlapping ``[start_ns, end_ns)``, read whole under the lock."""
        with self._lock:
            return list(reads.iter_spans(self, run_id, start_ns=start_ns, end_ns=end_ns))

    def counters(
        self, run_id: str, start_ns: int | None = None, end_ns: int | None = None
    ) -> list[pa.Table]:
        """Counter batches of a run within ``[start_ns, end_ns)``, read whole under the lock."""
        with self._lock:
            return list(reads.iter_counters(self, run_id, start_ns=start_ns, end_ns=end_ns))

    def cached(self, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()`` once per key (runs don't change once ingested; bounded to 64 entries)."""
        with self._lock:
            if key in self.cache:
                return self.cache[key]
        value = compute()
        with self._lock:
            if len(self.cache) >= 64:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = value
        return value

    def close(self) -> None:
        """Close the store (a later read opens it again) and stop the watcher."""
        self._stop.set()
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
            watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=5)


def _chdb_path(dsn: str | None) -> str | None:
    """The directory of an embedded store's DSN (None for a server, memory or a bad DSN)."""
    try:
        target = parse_dsn(config.store_dsn(dsn))
    except ValueError:
        return None
    return target.path if target.kind == "chdb" and target.path else None
