"""``Any`` may only go down: each source folder's count of ``Any`` is held at or below its budget.

An ``Any`` switches the type checker off for what flows through it, so a new one where the type
is known undoes what mypy (``scripts/typecheck.py``) checks. The count is of ``Any`` used as a
name in the code (annotations included; imports and strings not), per folder; when a change
removes some, lower that folder's budget here to the new count so they cannot come back.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: folder (relative to the checkout) -> most ``Any`` names its modules may hold.
BUDGET = {
    "collectors": 0,
    "collectors/gpu_activity": 0,
    "collectors/nvml": 11,
    "collectors/nvtx": 11,
    "dashboard": 49,  # -96: its reads to query/ (+20 there), its figures and charts to plots/ (27);
    # +1: the Ranks tab's callback returns a component or dash.no_update, as its siblings do
    "framework_patches": 62,
    "framework_patches/torch": 68,
    "gpu_trace": 15,  # +2: a run's row from the store as JSON (_summary_text)
    "gpu_trace/_boot": 0,
    "gpu_trace/commands": 6,
    "runtime": 1,
    "runtime/channel": 3,  # +1: the front's backend settings as JSON (Assign.flags)
    "runtime/client": 135,  # +2: rt:: results are JSON (cuda_streams)
    "runtime/protocol": 115,  # +2: backend settings as JSON (backend_flags); +2: a span's owner from a
    # session (protocol cannot import sharing) and from a TRACE message
    "runtime/server": 252,  # -26 +12: sessions.py to sharing/, admin.py and metrics.py from it; +5:
    # the batch's JSON parts at its sync (_finish_ops, as _after_ops); +1: the front's own flags
    "runtime/sharing": 76,  # +26 -12: sessions.py from server/, admin.py and metrics.py to it
    "runtime/worker": 8,  # +1: the front's backend settings as JSON (_adopt_flags)
    "plots": 27,  # from dashboard/: the timeline figure and the charts (plotly's dicts)
    "export": 13,  # from tracer/ (the exporters moved out with their counts)
    "query": 36,  # from tracer/: RunSummary.as_dict (JSON for show --json), query parameters; +20:
    # the dashboard's reads (windows' bars, span details: rows of the store as read)
    "store": 16,  # from tracer/: the store client, ingest, import; -4: ingest's insert connections
    "tracer": 22,  # -50: the store, query and export modules moved to their own folders
}
PACKAGE_ROOTS = (
    "gpu_trace",
    "tracer",
    "store",
    "query",
    "export",
    "collectors",
    "framework_patches",
    "runtime",
    "dashboard",
    "plots",
)


def count_any(source: str) -> int:
    """How many times ``Any`` (or ``typing.Any``) is used as a name in ``source``."""
    return sum(
        1
        for node in ast.walk(ast.parse(source))
        if (isinstance(node, ast.Name) and node.id == "Any")
        or (isinstance(node, ast.Attribute) and node.attr == "Any")
    )


@functools.cache
def any_per_folder() -> dict[str, int]:
    counts: dict[str, int] = {}
    for top in PACKAGE_ROOTS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            folder = path.parent.relative_to(ROOT).as_posix()
            counts[folder] = counts.get(folder, 0) + count_any(path.read_text(encoding="utf-8"))
    return counts


def test_count_any_counts_names_not_imports_or_strings() -> None:
    source = (
        "from typing import Any\n"
        "import typing\n"
        "x: Any = 1\n"
        "def f(a: dict[str, Any]) -> typing.Any: ...\n"
        "s = 'Any'\n"
    )
    assert count_any(source) == 3


@pytest.mark.parametrize("folder", sorted(BUDGET))
def test_any_within_budget(folder: str) -> None:
    count = any_per_folder().get(folder, 0)
    assert count <= BUDGET[folder], (
        f"{folder}/ uses Any {count} times, its budget is {BUDGET[folder]}: give the new ones "
        "their types (or, where none can be said, raise the budget in this test and say why)"
    )


def test_every_folder_has_a_budget() -> None:
    missing = sorted(set(any_per_folder()) - set(BUDGET))
    assert not missing, f"folders without an Any budget in {__file__}: {missing}"
