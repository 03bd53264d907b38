"""What every read of a stored run is asked of: a :class:`Source`.

A source answers one SQL template at a time, with ``{name:Type}`` parameters (values never
formatted into the text) and ``__db__`` for the store's database. Two kinds are in use: a
:class:`~gpu_trace.store.client.Store` (opened for reading by the CLI and ``Run``: ``Store(dsn,
reading=True)``) and the dashboard's :class:`~gpu_trace.dashboard.readonly_store.ReadOnlyStore`
(shared between requests, every template checked to be a read, the embedded store given up while
another process waits for it). Every function in :mod:`gpu_trace.query` takes one and reads
through these two methods only, so a read works the same over either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

if TYPE_CHECKING:
    from clickhouse_connect.driver.query import QueryResult

#: A template's parameters: name -> value (typed by the template's ``{name:Type}``).
Params = Mapping[str, Any]


class Source(Protocol):
    """A store to read from (see the module's docstring)."""

    def query(self, template: str, params: dict[str, Any] | None = None) -> QueryResult:
        """One template's result (rows, column names)."""
        ...

    def query_arrow(self, template: str, params: dict[str, Any] | None = None) -> pa.Table:
        """One template's result as an Arrow table (strings as str)."""
        ...


def rows(
    source: Source, template: str, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One template's rows as dicts by column name."""
    return list(source.query(template, params).named_results())
