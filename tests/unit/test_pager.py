"""The pager's pure parts: which handles an op names, how the memory account follows paging."""

from __future__ import annotations

import torch

from gpu_trace.runtime.sharing.restore import handle_refs
from gpu_trace.runtime.sharing.sessions import HandleTable, MemoryAccount


def test_handle_refs_in_op_order_nested_and_tagged() -> None:
    out: list[int] = []
    args = [
        {"h": 3},
        [{"h": 1}, {"h": 2}, None],
        {"b": 9},  # a blob, not a handle
        {"d": "float32"},
        ["name", [{"h": 7}], {"dim": {"h": 8}}, [True], 5],  # rt::fn's nesting
    ]
    handle_refs(args, out)
    handle_refs({"weight": {"h": 4}, "h": 5}, out)  # kwargs: a key named h is no handle
    assert out == [3, 1, 2, 7, 8, 4]


def test_handle_refs_ignores_junk_and_stops_at_depth() -> None:
    out: list[int] = []
    handle_refs([{"h": "x"}, {"h": 1.5}, "h", 3, {"h": True}], out)
    assert out == []
    deep: list = [{"h": 1}]
    for _ in range(20):
        deep = [deep]
    handle_refs(deep, out)
    assert out == []  # past the scan depth (the decoder refuses it anyway)


def test_account_move_keeps_logical_bytes_and_counts_paged() -> None:
    account = MemoryAccount()
    changes: list[tuple[int, int]] = []
    account.on_change = lambda a: changes.append((a.bytes, a.paged_bytes))
    table = HandleTable(account)
    base = torch.zeros(100)
    table.put(1, base)
    table.put(2, base[10:20])  # shares the storage: counted once
    table.put(3, torch.zeros(50))
    assert (account.bytes, account.paged_bytes, account.resident_bytes) == (600, 0, 600)
    old = base.untyped_storage().data_ptr()
    assert table.moved(old, 12345, [1, 2], paged=True) == 400
    assert (account.bytes, account.paged_bytes, account.resident_bytes) == (600, 400, 200)
    assert table.key(1) == table.key(2) == 12345
    assert changes[-1] == (600, 400)
    table.free(2)  # one of two handles: the storage stays
    assert (account.bytes, account.paged_bytes) == (600, 400)
    table.free(1)  # freed while paged out: out of both counts
    assert (account.bytes, account.paged_bytes) == (200, 0)
    assert table.moved(12345, 999, [1, 2], paged=False) == 0  # nothing holds it any more
    assert (account.bytes, account.paged_bytes, account.peak_bytes) == (200, 0, 600)


def test_account_move_back_in() -> None:
    account = MemoryAccount()
    table = HandleTable(account)
    t = torch.ones(10)
    table.put(1, t)
    key = table.key(1)
    assert key is not None
    assert table.moved(key, 777, [1], paged=True) == 40
    assert table.moved(777, 888, [1], paged=False) == 40
    assert (account.bytes, account.paged_bytes, table.key(1)) == (40, 0, 888)
    table.free(1)
    assert (account.bytes, account.paged_bytes) == (0, 0)
