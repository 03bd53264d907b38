"""`gpu-trace sql` and Store.sql stop a read at its limits (rows, bytes, time, memory) on a real
chDB: one line naming the flag that raises it, exit 1, no row printed. Before, `SELECT
arrayJoin(range(100000000))` ran to the end: 10^8 rows into the process (about 10 GiB) and onto
the terminal; chDB applies neither max_result_rows nor max_execution_time to that one block."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_trace.store.client import LimitExceeded, Store
from gpu_trace.store.guard import Limits

HUGE = "SELECT arrayJoin(range(100000000))"
# 10^10 pairs, each hashed: minutes of work in blocks the engine's clock sees, in little memory.
LONG = (
    "SELECT count() FROM (SELECT arrayJoin(range(100000)) AS x) AS a"
    " CROSS JOIN (SELECT arrayJoin(range(100000)) AS y) AS b WHERE sipHash64(x, y) = 0"
)


def sql(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", "sql", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_HOME": str(home)},
        timeout=240,
    )


def stopped(out: subprocess.CompletedProcess) -> str:
    """The one line a limit ends `sql` with (exit 1, nothing on stdout)."""
    assert out.returncode == 1, out.stderr
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("gpu-trace: stopped ")
    return lines[0]


def test_a_huge_result_stops_at_the_row_limit(tmp_path: Path) -> None:
    line = stopped(sql(tmp_path, HUGE, "--max-rows", "1000"))
    assert "stopped at 1,000 rows" in line and "--max-rows" in line
    # The defaults stop it too (100,000 rows), with nothing but the query given.
    assert "stopped at 100,000 rows" in stopped(sql(tmp_path, HUGE))


def test_a_large_result_stops_at_the_byte_limit(tmp_path: Path) -> None:
    out = sql(tmp_path, "SELECT arrayJoin(range(10000000))", "--max-rows", "0", "--max-bytes", "1M")
    line = stopped(out)
    assert "stopped at 1 MiB of result" in line and "--max-bytes" in line


def test_a_long_query_stops_at_the_time_limit(tmp_path: Path) -> None:
    line = stopped(sql(tmp_path, LONG, "--timeout", "1"))
    assert "stopped after 1 s" in line and "--timeout" in line


def test_a_query_needing_more_memory_stops_at_the_memory_limit(tmp_path: Path) -> None:
    line = stopped(sql(tmp_path, HUGE, "--max-rows", "0", "--max-memory", "100M"))
    assert "stopped at 100 MiB of memory" in line and "--max-memory" in line


def test_limits_that_are_not_reached_change_nothing(tmp_path: Path) -> None:
    out = sql(tmp_path, "--json", "SELECT arrayJoin(range(5)) AS x", "--max-rows", "5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f'{{"x": {i}}}' for i in range(5)]


def test_bad_limit_flags_are_usage_errors(tmp_path: Path) -> None:
    for flag, value in (("--max-rows", "-1"), ("--timeout", "soon"), ("--max-bytes", "lots")):
        out = sql(tmp_path, "SELECT 1", flag, value)
        assert out.returncode == 2 and f"argument {flag}: not " in out.stderr, out.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with Store(f"chdb://{tmp_path_factory.mktemp('limits') / 'store'}") as s:
        yield s


def test_the_row_limit_counts_the_top_level_result_only(store: Store) -> None:
    five = Limits(max_rows=5)
    assert len(store.sql("SELECT arrayJoin(range(5))", limits=five)[1]) == 5
    with pytest.raises(LimitExceeded, match="stopped at 5 rows") as exc:
        store.sql("SELECT arrayJoin(range(6))", limits=five)
    assert (exc.value.what, exc.value.limit) == ("rows", 5)
    # Subqueries, joins and IN are whole; a UNION's branches count together.
    inner = "SELECT count() FROM (SELECT arrayJoin(range(5000)) AS x) WHERE x IN (SELECT arrayJoin(range(4000)))"
    assert store.sql(inner, limits=five)[1] == [(4000,)]
    with pytest.raises(LimitExceeded):
        store.sql("SELECT arrayJoin(range(3)) UNION ALL SELECT arrayJoin(range(3))", limits=five)
    # The query's own LIMIT and OFFSET still apply under it.
    rows = store.sql("SELECT arrayJoin(range(30)) AS x LIMIT 5 OFFSET 20", limits=five)[1]
    assert rows == [(x,) for x in range(20, 25)]
    # SHOW, DESCRIBE, EXISTS and EXPLAIN are held to it too (chDB does not stream them).
    assert len(store.sql("SHOW TABLES", limits=Limits(max_rows=100))[1]) == 6
    with pytest.raises(LimitExceeded):
        store.sql("SHOW TABLES", limits=Limits(max_rows=2))


def test_without_limits_a_read_is_whole(store: Store) -> None:
    """Store.sql's default (the Python API's) sets no limit: a notebook's large read stays whole."""
    columns, rows = store.sql("SELECT arrayJoin(range(300000)) AS x, toString(x) AS s")
    assert columns == ["x", "s"] and len(rows) == 300000 and rows[-1] == (299999, "299999")


def test_the_hard_stop_ends_the_process_with_its_line() -> None:
    """What ends a query the engine does not stop (one long function call): the line, exit 1."""
    program = (
        "import time\n"
        "from gpu_trace.commands.runs import _hard_stop\n"
        "_hard_stop(0.1, 'stopped after 0.1 s: raise with --timeout')\n"
        "time.sleep(120)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stderr == "gpu-trace: stopped after 0.1 s: raise with --timeout\n"
