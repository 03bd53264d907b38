"""Arrow inserts into embedded chDB, read where the table lies.

An ArrowStream insert through clickhouse-connect's chDB backend serialises the table to IPC, writes
it to a temporary file and has the engine parse it back. chDB's ``Python()`` table function reads
the Arrow columns in memory instead: ``INSERT ... SELECT * FROM Python(table)`` on a handle of the
same engine took about half the time at a million spans (docs/schema.md, "Ingest"). It finds the
table by the name of a local variable of the function that runs the query.

:class:`~gpu_trace.store.client.Store` decides which way a table goes (:func:`reads_in_place`);
this module knows only chDB's side.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    from chdb.state.sqlitelike import Connection as Engine
    from clickhouse_connect.driver.client import Client

__all__ = [
    "InsertConnection",
    "insert_in_place",
    "open_engine",
    "python_fn_refused",
    "reads_in_place",
]


def open_engine(path: str) -> Engine:
    """A new handle on the chDB engine at ``path`` ("" for the in-memory one), spelled as
    clickhouse-connect spells it (chDB compares engine paths literally; one engine a process)."""
    from chdb.state import connect

    return connect(os.path.realpath(path) if path else ":memory:")


class InsertConnection:
    """Another connection to a store (:meth:`~gpu_trace.store.client.Store.connect_again`), for
    inserts beside the store's own queries: pass it to ``Store.insert_arrow``; close it after.

    On an embedded store it is a handle on the same chDB engine (an insert reads the Arrow table
    where it lies); on a server, or a store read read-only, a clickhouse-connect client.
    """

    def __init__(self, *, client: Client | None = None, engine: Engine | None = None) -> None:
        self.client = client
        self.engine = engine

    def close(self) -> None:
        """Close the connection. Idempotent."""
        client, self.client = self.client, None
        engine, self.engine = self.engine, None
        for handle in (client, engine):
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.close()


def reads_in_place(column: pa.ChunkedArray) -> bool:
    """Whether chDB's ``Python()`` table function reads ``column`` as an ArrowStream body's would
    be read: integers, floats, strings, dictionary strings, string maps without a null value (a
    NULL there fails Python()'s cast, where ArrowStream stores the default). A table with another
    column goes as ArrowStream."""
    t = column.type
    if pa.types.is_dictionary(t):
        return bool(pa.types.is_integer(t.index_type) and pa.types.is_string(t.value_type))
    if pa.types.is_map(t):
        return bool(
            pa.types.is_string(t.key_type)
            and pa.types.is_string(t.item_type)
            and all(chunk.items.null_count == 0 for chunk in column.chunks)
        )
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_string(t))


def _declared(column: pa.ChunkedArray, field: pa.Field) -> pa.Field:
    """``field``, non-nullable if ``column`` has no nulls (a map: nor its values)."""
    t = field.type
    if pa.types.is_map(t):  # reads_in_place: no null values
        t = pa.map_(
            pa.field("key", t.key_type, nullable=False),
            pa.field("value", t.item_type, nullable=False),
        )
    return pa.field(field.name, t, nullable=column.null_count > 0)


def python_fn_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is chDB refusing its ``Python()`` table function itself, before any row:
    switched off (``allow_python_table_function=0``: ``FUNCTION_NOT_ALLOWED``) or missing from the
    build (``Unknown table function``)."""
    text = str(exc)
    return "FUNCTION_NOT_ALLOWED" in text or (
        "Unknown table function" in text and "python" in text.lower()
    )


def insert_in_place(engine: Engine, table_ref: str, table: pa.Table) -> None:
    """``INSERT ... SELECT * FROM Python(table)`` on a chDB handle: the engine reads the Arrow
    columns in memory, by the local variable's name."""
    # Columns without nulls are declared so: Python() then reads them as non-Nullable types,
    # which the insert need not convert (about a tenth of its time).
    declared = pa.schema([_declared(c, f) for c, f in zip(table.columns, table.schema)])
    gpu_trace_insert_rows = table.cast(declared)  # noqa: F841 - Python() finds it by this name
    columns = ", ".join(f"`{name}`" for name in table.column_names)
    engine.query(f"INSERT INTO {table_ref} ({columns}) SELECT * FROM Python(gpu_trace_insert_rows)")
