"""The runtime's rooms and the imports allowed between them, read from the source.

The client runs in the traced program, where no GPU is: it must load without the server (and the
executor, pager and sink it pulls in), sharing, the workers or their channel, so it never imports
them. The protocol is what both sides speak: it imports no other room, so each side can be read
and changed alone. The server uses sharing and the channel; sharing runs below it and names none
of its types (what it needs of a session is in sharing itself). The channel is what the front and
its workers say to each other, below both; a worker is the top, and the server starts workers by
module name, never by import. Every import counts, ``TYPE_CHECKING`` and function-level ones
included: a lazy import is still a dependency.

Neither the modules nor the rooms import each other in a circle: each can be read knowing only
what is below it. (tests/unit/test_layers.py holds the tracer's rule with the same reader.)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.unit.test_layers import imports, modules

RUNTIME = "gpu_trace.runtime"

PROTOCOL, CLIENT, SERVER, SHARING, CHANNEL, WORKER = (
    f"{RUNTIME}.{room}" for room in ("protocol", "client", "server", "sharing", "channel", "worker")
)
#: Every room of the runtime (``gpu_trace.runtime`` itself, the user's door, is above them all).
ROOMS = (PROTOCOL, CLIENT, SERVER, SHARING, CHANNEL, WORKER)

#: room -> the rooms it must never import.
FORBIDDEN = {
    CHANNEL: (CLIENT, SERVER, SHARING, WORKER),
    CLIENT: (SERVER, SHARING, WORKER, CHANNEL),
    PROTOCOL: (CLIENT, SERVER, SHARING, CHANNEL, WORKER),
    SERVER: (WORKER,),
    SHARING: (SERVER, WORKER),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def targets(target: str, names: list[str]) -> list[str]:
    """What an import reaches: the module, and ``module.name`` for each name imported from it
    (``from gpu_trace.runtime import server`` reaches ``gpu_trace.runtime.server``)."""
    return [target, *(f"{target}.{name}" for name in names)]


def violations(room: str, forbidden: Iterable[str], found: Iterable[tuple[str, Path]]) -> list[str]:
    """``module:line imports target`` for every import from a module of ``room`` into a
    ``forbidden`` room."""
    forbidden = tuple(forbidden)
    out = []
    for module, path in found:
        if not _within(module, room):
            continue
        for target, names, line in imports(module, path):
            bad = [r for r in targets(target, names) if any(_within(r, f) for f in forbidden)]
            if bad:
                out.append(f"{module}:{line} imports {bad[0]}")
    return out


# ---- cycles --------------------------------------------------------------------------------------

#: module (or room) -> {what it imports: ``module:line`` of the first such import}.
Graph = dict[str, dict[str, str]]


def _owner(name: str, known: set[str]) -> str | None:
    """The module ``name`` is, or is in (``pkg.mod.Class`` -> ``pkg.mod``); None: not one of
    ``known``."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def module_graph(found: Iterable[tuple[str, Path]]) -> Graph:
    """Which of ``found`` imports which, every import counted (module level, in a function,
    under ``TYPE_CHECKING``). ``from pkg import mod`` reaches ``pkg`` (its ``__init__``) and
    ``pkg.mod``; the parent packages Python runs on the way are not counted."""
    found = list(found)
    known = {module for module, _ in found}
    graph: Graph = {}
    for module, path in found:
        edges = graph.setdefault(module, {})
        for target, names, line in imports(module, path):
            for reached in targets(target, names):
                owner = _owner(reached, known)
                if owner is not None and owner != module:
                    edges.setdefault(owner, f"{module}:{line}")
    return graph


def room_of(module: str) -> str:
    """``gpu_trace.runtime.server.executor`` -> ``gpu_trace.runtime.server``; the runtime's own
    ``__init__`` is a room of its own."""
    return ".".join(module.split(".")[:3])


def room_graph(modules_graph: Graph) -> Graph:
    """Which room imports which: an edge for each import that crosses from one room to another."""
    graph: Graph = {}
    for module, edges in modules_graph.items():
        room = graph.setdefault(room_of(module), {})
        for target, where in edges.items():
            if room_of(target) != room_of(module):
                room.setdefault(room_of(target), where)
    return graph


def _reachable(graph: Graph, start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one node (each sorted): the nodes that
    reach each other, so none of them can be read without the others."""
    reach = {node: _reachable(graph, node) for node in graph}
    components = {
        frozenset({node, *(other for other in reach[node] if node in reach.get(other, ()))})
        for node in graph
    }
    return sorted(sorted(c) for c in components if len(c) > 1)


def cycle_edges(graph: Graph) -> list[str]:
    """``module:line imports b`` for each edge inside a cycle of ``graph`` (what to break)."""
    return [
        f"{graph[a][b]} imports {b}"
        for component in cycles(graph)
        for a in component
        for b in sorted(graph[a])
        if b in component
    ]


# ---- the rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_runtime_room_imports_no_forbidden_room(room: str) -> None:
    assert violations(room, FORBIDDEN[room], modules(RUNTIME)) == []


def test_no_import_cycle_between_runtime_modules() -> None:
    assert cycle_edges(module_graph(modules(RUNTIME))) == []


def test_no_import_cycle_between_runtime_rooms() -> None:
    assert cycle_edges(room_graph(module_graph(modules(RUNTIME)))) == []


def test_every_runtime_module_lives_in_a_room() -> None:
    # A module left at the top of runtime/ would be in no room and under no rule.
    loose = [m for m, _ in modules(RUNTIME) if m != RUNTIME and not m.startswith(ROOMS)]
    assert loose == []


# ---- the readers find what they are for ----------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "from gpu_trace.runtime.server.server import Server\n",
        "from gpu_trace.runtime import sharing\n",
        "def f():\n    import gpu_trace.runtime.sharing.pager\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from gpu_trace.runtime.sharing.sessions import Session\n",
        "from ..server import sink\n",
        "from gpu_trace.runtime.worker import process\n",
    ],
)
def test_the_rule_sees_every_kind_of_import(source: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text(source)
    found = [(f"{CLIENT}.bad", path)]
    assert len(violations(CLIENT, FORBIDDEN[CLIENT], found)) == 1


def _plant(tmp_path: Path, sources: dict[str, str]) -> list[tuple[str, Path]]:
    found = []
    for module, source in sources.items():
        path = tmp_path / f"{module.replace('.', '_')}.py"
        path.write_text(source)
        found.append((f"{RUNTIME}.{module}", path))
    return found


@pytest.mark.parametrize(
    "back",
    [
        "from gpu_trace.runtime.server.executor import Executor\n",
        "def f():\n    from gpu_trace.runtime.server import executor\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from gpu_trace.runtime.server.executor import Executor\n",
        "import typing\nif typing.TYPE_CHECKING:\n    from .executor import Executor\n",
    ],
)
def test_a_planted_module_cycle_is_found(back: str, tmp_path: Path) -> None:
    found = _plant(
        tmp_path,
        {
            "server.executor": "from gpu_trace.runtime.server.plan import Plan\n",
            "server.plan": "from gpu_trace.runtime.server import sizing\n",
            "server.sizing": back,
            "server.sink": "from gpu_trace.runtime.server.executor import Executor\n",
        },
    )
    graph = module_graph(found)
    trio = [f"{SERVER}.executor", f"{SERVER}.plan", f"{SERVER}.sizing"]
    assert cycles(graph) == [trio]
    assert len(cycle_edges(graph)) == 3


def test_a_planted_room_cycle_is_found_where_no_module_cycle_is(tmp_path: Path) -> None:
    found = _plant(
        tmp_path,
        {
            "server.executor": "from gpu_trace.runtime.sharing.memory import Memory\n",
            "sharing.memory": "from gpu_trace.runtime.sharing.usage import Usage\n",
            "sharing.usage": "def f():\n    from gpu_trace.runtime.server import sessions\n",
            "server.sessions": "",
        },
    )
    graph = module_graph(found)
    assert cycles(graph) == []
    assert cycles(room_graph(graph)) == [[SERVER, SHARING]]
    assert cycle_edges(room_graph(graph)) == [
        f"{SERVER}.executor:1 imports {SHARING}",
        f"{SHARING}.usage:2 imports {SERVER}",
    ]


def test_no_cycle_is_found_in_layers(tmp_path: Path) -> None:
    found = _plant(
        tmp_path,
        {
            "client.tensor": "from gpu_trace.runtime.client import connection\n",
            "client.connection": "from gpu_trace.runtime.protocol.wire import frame\n",
            "protocol.wire": "import struct\nfrom gpu_trace.tracer import records\n",
        },
    )
    graph = module_graph(found)
    assert graph[f"{CLIENT}.tensor"] == {f"{CLIENT}.connection": f"{CLIENT}.tensor:1"}
    assert cycles(graph) == [] and cycles(room_graph(graph)) == []
