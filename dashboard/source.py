"""Where the dashboard's data comes from: one store, opened lazily, asked one query at a time.

The dashboard is read-only. Every query it sends is one of its own ``SELECT`` templates with
``{name:Type}`` parameters (:mod:`gpu_trace.dashboard.queries`), held to the rule `gpu-trace sql`
is (:mod:`gpu_trace.tracer.query_guard`: ClickHouse's parser, reads of the store's tables only),
checked once per template; and with ``enforce_readonly`` (what ``gpu-trace ui`` uses) the engine
itself is switched to ``readonly=1`` for this process once the store is open.

chDB lets one process open a store directory (docs/schema.md), and the web server answers requests
on several threads, so one connection is shared behind a lock. A store that can't be opened (a
server that is down, a directory another process holds) is retried on the next request; the
message says why in one line, and the page shows it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pyarrow as pa

from gpu_trace.tracer.store import Store, StoreError

log = logging.getLogger(__name__)

__all__ = ["Source", "StoreError"]

#: Seconds between attempts to open a store that failed to open.
RETRY_S = 2.0


class Source:
    """A lazily opened, shared, read-only store. ``Source(store=...)`` wraps an open one."""

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

    def display(self) -> str:
        if self._store is not None:
            return self._store.target.display()
        return self.dsn or "the default store"

    def store(self) -> Store:
        """The open store; StoreError (one line) if it can't be opened."""
        with self._lock:
            if self._store is not None:
                return self._store
            if self._problem and time.monotonic() - self._failed_at < RETRY_S:
                raise StoreError(self._problem)
            try:
                store = Store(self.dsn, lock_timeout_s=self._lock_timeout_s)
            except StoreError as exc:
                self._problem, self._failed_at = str(exc), time.monotonic()
                raise
            if self._enforce:
                # From here on the engine refuses writes from this process (chDB keeps the setting
                # for the session; a server applies it per query below).
                store.client.command("SET readonly = 1")
            self._store, self._problem = store, ""
            return store

    def _check(self, store: Store, template: str, params: dict[str, Any] | None) -> None:
        """Refuse a template that is not a read of the store's tables (once per template: a
        template's values are typed parameters, so its parse does not depend on them)."""
        if template in self._checked:
            return
        try:
            store.check_read(store._sql(template), params)
        except StoreError as exc:
            reason = str(exc).removeprefix("gpu-trace sql is read-only: ")
            raise StoreError(f"the dashboard is read-only: {reason}") from None
        self._checked.add(template)

    def rows(self, template: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows of one parameterized SELECT as dicts (``__db__`` is the database)."""
        with self._lock:
            store = self.store()
            self._check(store, template, params)
            return list(store._query(template, params).named_results())

    def arrow(self, template: str, params: dict[str, Any] | None = None) -> pa.Table:
        """One parameterized SELECT as an Arrow table (strings as str)."""
        with self._lock:
            store = self.store()
            self._check(store, template, params)
            return store._query_arrow(template, params)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A read method of :class:`Store` (``runs``, ``summary``, ``forwarding``...) under the lock."""
        if method not in _STORE_READS:
            raise StoreError(f"the dashboard does not call Store.{method}")
        with self._lock:
            result = getattr(self.store(), method)(*args, **kwargs)
            if method.startswith("iter_"):
                return list(result)
            return result

    def cached(self, key: tuple, compute: Any) -> Any:
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
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


_STORE_READS = frozenset(
    {
        "runs",
        "run",
        "resolve_run",
        "summary",
        "forwarding",
        "threads",
        "clock_sync",
        "counts",
        "iter_spans",
        "iter_counters",
    }
)
