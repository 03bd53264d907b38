"""The benches that time this tree against another (``--baseline``/``--before``) run end to end
on a tiny input, with this tree as the other one (bench/checkout.py imports it from there): a
bench that rots (bench/executor_overhead.py looked for a function that had moved) fails here,
not on the day its figures are wanted. No figure is checked: only that each bench measures both
trees and prints its comparison."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CASES = {
    "ingest": (
        ["--spans", "20000", "--file-rows", "5000", "--rounds", "1", "--baseline", "."],
        ["before: ingest", "after: ingest", "ingest speed after / before"],
    ),
    "dashboard": (
        ["--spans", "20000", "--lanes", "4", "--rounds", "1", "--no-browser", "--baseline", "."],
        ["first figure", "baseline", "this checkout"],
    ),
    "executor_overhead": (
        ["--steps", "2", "--rounds", "1", "--before", ".", "--models", "mlp"],
        ["op stream decode (expand)", "overhead after / before"],
    ),
}


@pytest.mark.parametrize("bench", sorted(CASES))
def test_a_before_and_after_bench_runs_both_trees(bench: str) -> None:
    if bench == "executor_overhead":
        pytest.importorskip("torch")
    args, expected = CASES[bench]
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{bench}.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in expected:
        assert text in done.stdout, (text, done.stdout[-3000:])
