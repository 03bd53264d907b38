"""The runtime's rooms and the imports allowed between them, read from the source.

The client runs in the traced program, where no GPU is: it must load without the server (and the
executor, pager and sink it pulls in) or the sharing machinery, so it never imports them. The
protocol is what both sides speak: it imports neither side, so each can be read and changed alone.
Every import counts, ``TYPE_CHECKING`` and function-level ones included: a lazy import is still
a dependency. The server uses sharing (memory, scheduler, pager); sharing names the server's
types (a session, the server it lists) but runs none of its code, so its imports of the server
are type-only. (tests/unit/test_layers.py holds the tracer's rule with the same reader.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.unit.test_layers import imports, modules

RUNTIME = "gpu_trace.runtime"

#: room -> the rooms it must never import.
FORBIDDEN = {
    f"{RUNTIME}.client": (f"{RUNTIME}.server", f"{RUNTIME}.sharing"),
    f"{RUNTIME}.protocol": (f"{RUNTIME}.client", f"{RUNTIME}.server", f"{RUNTIME}.sharing"),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def targets(target: str, names: list[str]) -> list[str]:
    """What an import reaches: the module, and ``module.name`` for each name imported from it
    (``from gpu_trace.runtime import server`` reaches ``gpu_trace.runtime.server``)."""
    return [target, *(f"{target}.{name}" for name in names)]


def violations(
    room: str, forbidden: Iterable[str], found: Iterable[tuple[str, Path]], types_too: bool = True
) -> list[str]:
    """``module:line imports target`` for every import from a module of ``room`` into a
    ``forbidden`` room; with ``types_too=False``, leaving out those under ``if TYPE_CHECKING:``."""
    forbidden = tuple(forbidden)
    out = []
    for module, path in found:
        if not _within(module, room):
            continue
        skip = set() if types_too else type_only_lines(path)
        for target, names, line in imports(module, path):
            bad = [r for r in targets(target, names) if any(_within(r, f) for f in forbidden)]
            if bad and line not in skip:
                out.append(f"{module}:{line} imports {bad[0]}")
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def type_only_lines(path: Path) -> set[int]:
    """Lines of the imports under ``if TYPE_CHECKING:``."""
    return {
        n.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_runtime_room_imports_no_forbidden_room(room: str) -> None:
    assert violations(room, FORBIDDEN[room], modules(RUNTIME)) == []


def test_sharing_imports_the_server_for_types_only() -> None:
    sharing, server = f"{RUNTIME}.sharing", f"{RUNTIME}.server"
    assert violations(sharing, (server,), modules(RUNTIME), types_too=False) == []


@pytest.mark.parametrize(
    ("source", "edges"),
    [
        ("from gpu_trace.runtime.server.sessions import Session\n", 1),
        ("def f():\n    from gpu_trace.runtime.server import sink\n", 1),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from gpu_trace.runtime.server.sessions import Session\n",
            0,
        ),
        (
            "import typing\nif typing.TYPE_CHECKING:\n"
            "    from gpu_trace.runtime.server.server import Server\n",
            0,
        ),
    ],
)
def test_the_type_only_rule_tells_type_imports_from_run_time_ones(
    source: str, edges: int, tmp_path: Path
) -> None:
    path = tmp_path / "bad.py"
    path.write_text(source)
    found = [(f"{RUNTIME}.sharing.bad", path)]
    assert len(violations(f"{RUNTIME}.sharing", (f"{RUNTIME}.server",), found, False)) == edges


def test_every_runtime_module_lives_in_a_room() -> None:
    # A module left at the top of runtime/ would be in no room and under no rule.
    rooms = (*FORBIDDEN, f"{RUNTIME}.server", f"{RUNTIME}.sharing")
    loose = [m for m, _ in modules(RUNTIME) if m != RUNTIME and not m.startswith(rooms)]
    assert loose == []


@pytest.mark.parametrize(
    "source",
    [
        "from gpu_trace.runtime.server.server import Server\n",
        "from gpu_trace.runtime import sharing\n",
        "def f():\n    import gpu_trace.runtime.sharing.pager\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from gpu_trace.runtime.server.sessions import Session\n",
        "from ..server import sink\n",
    ],
)
def test_the_rule_sees_every_kind_of_import(source: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text(source)
    found = [(f"{RUNTIME}.client.bad", path)]
    forbidden = FORBIDDEN[f"{RUNTIME}.client"]
    assert len(violations(f"{RUNTIME}.client", forbidden, found)) == 1
