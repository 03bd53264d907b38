"""The store's seam: ingest sits above the store, and nobody reaches into another module's privates.

Ingest, the dashboard and the CLI use :class:`~gpu_trace.store.client.Store`'s public methods; the
store never imports ingest (they used to call each other); the dashboard asks its
:class:`~gpu_trace.dashboard.readonly_store.ReadOnlyStore` through typed methods, never by a method's name
in a string. Read from the source, so a new caller breaking a rule fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Modules that talk to the store: the store itself, its reads, ingest, export, the dashboard and
#: the CLI's store commands.
CALLERS = [
    *sorted((ROOT / "store").glob("*.py")),
    *sorted((ROOT / "query").glob("*.py")),
    *(ROOT / "export" / f for f in ("exporter.py", "chrome.py")),
    *sorted((ROOT / "dashboard").glob("*.py")),
    *(
        ROOT / "gpu_trace" / "commands" / f
        for f in ("runs.py", "ui.py", "record.py", "removal.py", "imports.py")
    ),
]
#: Private names of other projects we must reach (Dash keeps its script list there), and
#: ``os._exit``, Python's documented way to end a process at once (`sql`'s hard time limit).
ALLOWED = {"_js_dist_dependencies", "_exit"}


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def foreign_privates(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls``: a private name of another object."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in ALLOWED
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


def test_the_store_does_not_import_ingest() -> None:
    for path in (ROOT / "store" / "client.py", *sorted((ROOT / "query").glob("*.py"))):
        assert not any("ingest" in m for m in imported(path)), path.name


def test_no_caller_reaches_into_another_objects_private_names() -> None:
    found = [hit for path in CALLERS for hit in foreign_privates(path)]
    assert found == []


def test_the_dashboard_asks_the_store_by_typed_methods() -> None:
    from gpu_trace.dashboard.readonly_store import ReadOnlyStore

    assert not hasattr(ReadOnlyStore, "call")
    for path in sorted((ROOT / "dashboard").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                first = node.args[0] if node.args else None
                assert not (
                    node.func.attr in ("call", "getattr")
                    and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                ), f"{path.name}:{node.lineno}"
