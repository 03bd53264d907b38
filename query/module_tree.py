"""Module spans aggregated by their path of enclosing modules (the Summary's module tree).

A plain function of a :class:`~gpu_trace.query.source.Source`.
"""

from __future__ import annotations

from typing import Any, TypedDict

from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows


class ModuleNode(TypedDict):
    """One path of enclosing modules: its spans' count and total time."""

    path: str  # names joined with ``/``
    name: str
    parent: str  # the parent's path ("" at the top)
    depth: int
    count: int
    total_ns: int


class ModuleTree(TypedDict):
    nodes: list[ModuleNode]  # by path
    spans: int  # module spans read
    truncated: bool  # the run has more than were read


def module_tree(source: Source, run_id: str, limit: int = 300_000) -> ModuleTree:
    """Module spans aggregated by their path of enclosing modules.

    Returns ``{"nodes": [{"path", "name", "parent", "depth", "count", "total_ns"}], "spans",
    "truncated"}``; ``path`` joins names with ``/``. At most ``limit`` spans are read (the page says
    when a run has more).
    """
    rows = query_rows(
        source,
        """
        SELECT span_id, parent_span_id, name, end_ns - start_ns AS dur FROM __db__.spans
        WHERE run_id = {run:String} AND category = 'module' ORDER BY start_ns LIMIT {n:UInt32}
        """,
        {"run": run_id, "n": limit + 1},
    )
    truncated = len(rows) > limit
    rows = rows[:limit]
    by_id = {r["span_id"]: r for r in rows}
    paths: dict[int, str] = {}

    def path(r: dict[str, Any]) -> str:
        sid = r["span_id"]
        if sid not in paths:
            chain: list[dict[str, Any]] = []
            cur: dict[str, Any] | None = r
            while cur is not None and cur["span_id"] not in paths and len(chain) < 64:
                chain.append(cur)
                cur = by_id.get(cur["parent_span_id"])
            prefix = paths[cur["span_id"]] if cur is not None and cur["span_id"] in paths else ""
            for c in reversed(chain):
                prefix = f"{prefix}/{c['name']}" if prefix else c["name"]
                paths[c["span_id"]] = prefix
        return paths[sid]

    nodes: dict[str, ModuleNode] = {}
    for r in rows:
        p = path(r)
        node = nodes.setdefault(
            p,
            {
                "path": p,
                "name": r["name"],
                "parent": p.rsplit("/", 1)[0] if "/" in p else "",
                "depth": p.count("/"),
                "count": 0,
                "total_ns": 0,
            },
        )
        node["count"] += 1
        node["total_ns"] += int(r["dur"])
    ordered = sorted(nodes.values(), key=lambda n: n["path"])
    return {"nodes": ordered, "spans": len(rows), "truncated": truncated}
