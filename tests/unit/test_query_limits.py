"""The parts of `gpu-trace sql`'s limits that need no engine: the settings each limit becomes, the
engine's errors read back as the limit hit, result sizes, and the flags' values."""

from __future__ import annotations

import argparse
from array import array

import pytest

from gpu_trace.commands.runs import count_arg, seconds_arg, size_arg
from gpu_trace.store.guard import Limits, column_bytes, exceeded


def test_each_limit_is_a_standard_setting_and_none_is_no_setting() -> None:
    assert Limits().settings() == {}
    assert Limits(max_rows=10, max_bytes=100, timeout_s=1.5, max_memory=1 << 30).settings() == {
        "limit": 11,  # one more row than allowed says there were more
        "max_result_bytes": 100,
        "result_overflow_mode": "throw",
        "max_execution_time": 1.5,
        "timeout_overflow_mode": "throw",
        "max_memory_usage": 1 << 30,
    }
    with pytest.raises(ValueError, match="max_rows"):
        Limits(max_rows=-1)


# The engine's own messages (chDB 4.4, ClickHouse 26.9), first lines.
TIMEOUT = "Code: 159. DB::Exception: Timeout exceeded: elapsed 2690.851 ms, maximum: 1000.000 ms. (TIMEOUT_EXCEEDED)"
ROWS = "Code: 396. DB::Exception: Limit for result exceeded, max rows: 1.00 thousand, current rows: 65.41 thousand. (TOO_MANY_ROWS_OR_BYTES)"
BYTES = "Code: 396. DB::Exception: Limit for result exceeded, max bytes: 97.66 KiB, current bytes: 511.01 KiB. (TOO_MANY_ROWS_OR_BYTES)"
MEMORY = "Code: 241. DB::Exception: Query memory limit exceeded: would use 381.53 MiB (attempt to allocate chunk of 381.53 MiB), maximum: 95.37 MiB. (MEMORY_LIMIT_EXCEEDED)"


def test_the_engines_errors_name_the_limit_hit() -> None:
    every = Limits(max_rows=1, max_bytes=1, timeout_s=1, max_memory=1)
    assert [exceeded(m, every) for m in (TIMEOUT, ROWS, BYTES, MEMORY)] == [
        "time",
        "rows",
        "bytes",
        "memory",
    ]
    # A limit not set is not what stopped it (a server's own limit, say): a plain failure.
    assert [exceeded(m, Limits()) for m in (TIMEOUT, ROWS, BYTES, MEMORY)] == [None] * 4
    assert exceeded("Code: 47. Unknown expression identifier `nope`", every) is None


def test_result_sizes_count_widths_lengths_and_contents() -> None:
    assert column_bytes(array("Q", [1, 2, 3])) == 24
    assert column_bytes(array("B", [1, 2, 3])) == 3
    assert column_bytes(("ab", "cde")) == 3 + 4
    assert column_bytes([[1, 2], None]) == (8 + 16) + 8
    assert column_bytes([{"k": "vv"}]) == 8 + 2 + 3


def test_the_limit_flags_take_counts_seconds_and_sizes() -> None:
    assert count_arg("0") == 0 and count_arg("1000") == 1000
    assert seconds_arg("0.5") == 0.5 and seconds_arg("60") == 60.0
    assert size_arg("0") == 0 and size_arg("1000") == 1000
    assert size_arg("64K") == 64 << 10 and size_arg("100M") == 100 << 20
    assert (
        size_arg("4G") == 4 << 30 and size_arg("1.5GiB") == 3 << 29 and size_arg("2mb") == 2 << 20
    )
    for bad, parse in (("-1", count_arg), ("x", count_arg), ("-1", seconds_arg)):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    for bad in ("inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            seconds_arg(bad)
    for bad in ("-1M", "4X", "", "M"):
        with pytest.raises(argparse.ArgumentTypeError):
            size_arg(bad)
