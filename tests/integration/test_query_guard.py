"""`gpu-trace sql`, Store.sql and the dashboard read only the store's tables (a real chDB).

Each attack is refused with one line and touches nothing: no file read, created, appended to or
truncated; the queries in docs/schema.md and the README still run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.query.source import rows as query_rows
from gpu_trace.store import guard as query_guard
from gpu_trace.store.client import Store, StoreError

REPO = Path(__file__).resolve().parents[2]
SECRET = "top-secret-7f3a"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with Store(f"chdb://{tmp_path_factory.mktemp('guard') / 'store'}") as s:
        yield s


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret.txt"
    path.write_text(SECRET + "\n")
    return path


def refused(store: Store, query: str, params: dict | None = None) -> str:
    with pytest.raises(StoreError, match=r"^gpu-trace sql is read-only: ") as exc:
        store.sql(query, params)
    message = str(exc.value)
    assert "\n" not in message and SECRET not in message
    return message


def test_file_functions_read_nothing(store: Store, secret: Path) -> None:
    assert "function file()" in refused(store, f"SELECT file('{secret}')")
    assert "function FILE()" in refused(store, f"SELECT FILE('{secret}')")
    assert "table function file()" in refused(
        store, f"SELECT * FROM file('{secret}', 'LineAsString')"
    )
    assert "table function file()" in refused(store, f"DESCRIBE file('{secret}', 'LineAsString')")
    # Hidden in a subquery, a join, a CTE, an IN, a combinator's argument, an EXPLAIN:
    for query in (
        f"SELECT * FROM (SELECT * FROM file('{secret}', 'LineAsString'))",
        f"SELECT * FROM runs JOIN file('{secret}', 'LineAsString') AS f ON 1",
        f"WITH x AS (SELECT file('{secret}') AS v) SELECT * FROM x",
        f"SELECT 1 WHERE 'a' IN (SELECT file('{secret}'))",
        f"SELECT countIf(file('{secret}') != '')",
        f"EXPLAIN SELECT * FROM file('{secret}', 'LineAsString')",
        f"EXPLAIN AST SELECT file('{secret}')",
    ):
        assert "file()" in refused(store, query)


@pytest.mark.parametrize("mode", ["", " APPEND", " TRUNCATE"])
def test_into_outfile_creates_appends_and_truncates_nothing(
    store: Store, tmp_path: Path, mode: str
) -> None:
    new = tmp_path / "new.tsv"
    kept = tmp_path / "kept.tsv"
    kept.write_text("keep me\n")
    for target in (new, kept):
        message = refused(store, f"SELECT 42 INTO OUTFILE '{target}'{mode}")
        assert "INTO OUTFILE is not allowed" in message
    assert not new.exists() and kept.read_text() == "keep me\n"


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM url('http://127.0.0.1:9/x', CSV, 'a String')",
        "SELECT * FROM s3('http://127.0.0.1:9/b/k', CSV)",
        "SELECT * FROM remote('127.0.0.1', system.one)",
        "SELECT * FROM executable('id', TSV, 'a String')",
        "SELECT * FROM input('a String')",
        "SELECT * FROM mysql('127.0.0.1:9', 'd', 't', 'u', 'p')",
        "SELECT * FROM postgresql('127.0.0.1:9', 'd', 't', 'u', 'p')",
        "SELECT * FROM jdbc('x', 'y')",
        "SELECT * FROM odbc('x', 'y')",
        "SELECT * FROM hdfs('hdfs://127.0.0.1:9/x', CSV)",
        "SELECT * FROM azureBlobStorage('http://127.0.0.1:9', 'c', 'b')",
        "SELECT * FROM numbers(10)",
        "SELECT * FROM merge('system', '.*')",
    ],
)
def test_table_functions_are_refused(store: Store, query: str) -> None:
    assert "table function" in refused(store, query)


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("SELECT count() FROM spans SETTINGS readonly = 0", "SETTINGS"),
        ("SELECT * FROM (SELECT 1 SETTINGS max_threads = 1)", "SETTINGS"),
        ("SELECT * FROM system.users", "table system.users"),
        ("SELECT query FROM system.processes", "table system.processes"),
        ("SELECT query FROM system.query_log", "table system.query_log"),
        ("SELECT sum(number) FROM system.numbers", "table system.numbers"),
        ("SELECT 1 WHERE 'default' IN system.users", "table system.users"),
        ("SELECT system.users.name FROM runs", "table system.users"),
        ("SELECT dictGet('d', 'a', toUInt64(1))", "function dictGet()"),
        ("SELECT joinGet('t', 'a', 1)", "function joinGet()"),
        ("SELECT sleepEachRow(3) FROM runs", "function sleepEachRow()"),
        ("SELECT hasColumnInTable('system', 'users', 'name')", "function hasColumnInTable()"),
        ("SELECT 1; DROP TABLE spans", "more than one statement"),
        ("SELECT 1 /* ; */ ; DROP TABLE spans", "more than one statement"),
        ("SELECT 1 -- ;\n; INSERT INTO runs (run_id) VALUES ('x')", "more than one statement"),
        ("/* SELECT */ DROP TABLE spans", "DROP"),
        ("INSERT INTO spans (run_id) VALUES ('x')", "INSERT"),
        ("ALTER TABLE spans DELETE WHERE 1", "ALTER"),
        ("SET readonly = 0", "SET"),
        ("SHOW PROCESSLIST", "SHOW PROCESSLIST"),
        ("SELECT 1 FORMAT TSV", "FORMAT"),
        # a newline in a name would let EXPLAIN AST's one-node-a-line text hide nodes
        ("SELECT 1 AS `x)\n Function file`", "control characters"),
        ("SELECT * FROM spans WHERE name IN {t:Identifier}", "Identifier"),
        ("", "empty"),
    ],
)
def test_other_attacks_are_refused(store: Store, query: str, says: str) -> None:
    params = {"t": "system.users"} if "{t:" in query else None
    assert says in refused(store, query, params)


def test_nothing_was_changed_by_the_attacks(store: Store) -> None:
    tables = {r[0] for r in store.sql("SHOW TABLES")[1]}
    assert {"runs", "spans", "counters", "clock_sync", "threads", "ingest_log"} <= tables
    assert store.sql("SELECT count() FROM runs")[1] == [(0,)]


def _doc_queries() -> list[str]:
    text = (REPO / "docs" / "schema.md").read_text()
    section = text.split("## Example queries", 1)[1]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


def test_the_documented_queries_still_run(store: Store) -> None:
    queries = _doc_queries()
    assert len(queries) >= 8
    for query in queries:
        store.sql(query, {"run": "r1"} if "{run:" in query else None)
    readme = (REPO / "README.md").read_text()
    (example,) = re.findall(r'gpu-trace sql "(.*?)"', readme)
    store.sql(example)
    for query in (
        "SHOW TABLES",
        "DESCRIBE spans",
        "EXISTS TABLE gpu_trace.spans",
        "EXPLAIN SELECT count() FROM spans",
        "SELECT name FROM system.tables WHERE database = 'gpu_trace' ORDER BY name",
        "SELECT x, row_number() OVER (ORDER BY x) FROM (SELECT arrayJoin([3, 1]) AS x)",
        "SELECT countIf(depth > 0), quantilesExact(0.5, 0.9)(end_ns), uniqExact(name) FROM spans",
        "SELECT 1 /* a comment */ -- another\n",
        "SELECT count() FROM spans;",
    ):
        store.sql(query)


def test_the_checked_text_is_what_runs(store: Store) -> None:
    checked = store.check_read("SELECT 1 -- ; DROP TABLE spans\n")
    assert checked.text == "SELECT 1"


def test_a_plain_query_error_is_not_called_a_refusal(store: Store) -> None:
    """ClickHouse's message for an unknown column quotes the query with its `readonly = '1'`
    setting: it was reported as "gpu-trace sql is read-only: Unknown expression identifier"."""
    with pytest.raises(StoreError) as exc:
        store.sql("SELECT nosuchcol FROM spans")
    assert str(exc.value).startswith("query failed: Unknown expression identifier `nosuchcol`")


def test_function_families_allow_no_reader() -> None:
    for name in ("toString", "arrayMap", "countIf", "quantileExactIf", "sumArray", "uniqMerge"):
        assert query_guard.allowed_function(name), name
    for name in ("file", "url", "fileIf", "dictGetString", "addressToSymbol", "hasColumnInTable"):
        assert not query_guard.allowed_function(name), name


def test_the_dashboard_is_held_to_the_same_rule(store: Store, secret: Path) -> None:
    source = ReadOnlyStore(store=store)
    assert query_rows(source, "SELECT count() AS n FROM __db__.spans") == [{"n": 0}]
    with pytest.raises(StoreError, match="dashboard is read-only.*file"):
        query_rows(source, f"SELECT file('{secret}') AS f")
    with pytest.raises(StoreError, match="dashboard is read-only.*OUTFILE"):
        source.query_arrow(f"SELECT 1 INTO OUTFILE '{secret}' TRUNCATE")
    assert secret.read_text() == SECRET + "\n"


def test_cli_refuses_in_one_line(tmp_path: Path, secret: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "sql", f"SELECT file('{secret}')"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_STORE": f"chdb://{tmp_path / 'cli-store'}"},
        timeout=120,
    )
    assert out.returncode == 1 and out.stdout == "" and SECRET not in out.stderr
    assert out.stderr.splitlines() == [
        "gpu-trace: gpu-trace sql is read-only: function file() is not allowed in a read-only query"
    ]
