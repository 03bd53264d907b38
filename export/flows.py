"""Flow arrows from a span to its parent in another process, for the Chrome exporter.

A forwarded call's server spans have their parent (the client's ``forward`` span) in another
process; Chrome draws that link as a flow, an ``s`` event at the parent's start and an ``f`` event
at the child's. Spans arrive in start order and memory is bounded, so parents are looked up in two
windows: the most recent ``window`` spans of any category plus the most recent ``window`` spans of
category ``forward``; a parent older than both is not linked.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.export.json_fragments import micros
from gpu_trace.tracer.records import FORWARD
from gpu_trace.tracer.trace_format import (
    BACKWARD_CATEGORY,
    FLOW_CATEGORY,
    LAUNCH_CATEGORY,
)

#: Span ids (sorted) with their Chrome pid, tid and relative start, in matching order.
Chunk = tuple[np.ndarray, ...]


class FlowLinker:
    """Remembers recent spans and formats the flow events of spans whose parent is elsewhere."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: list[Chunk] = []
        self._forward: list[Chunk] = []
        self._next_flow = 1

    def link(
        self,
        sid: np.ndarray,
        parent: np.ndarray,
        has_parent: np.ndarray,
        cpid: np.ndarray,
        ctid: np.ndarray,
        rel: np.ndarray,
        categories: np.ndarray | None,
        launched: np.ndarray | None = None,
        backward_of: np.ndarray | None = None,
    ) -> tuple[pa.Array, pa.Array] | None:
        """Remember one chunk of spans; return the ``s`` and ``f`` events of its flows, or None.

        Per row: span id, parent id (0 for none), whether it has one, Chrome pid and tid, start
        relative to the time base (ns) and category (None: no ``forward`` spans). ``launched``
        marks device work, whose flow from its parent (the CUDA call that launched it) is
        PyTorch's profiler's ``ac2g`` arrow. ``backward_of`` is, per row, the span id of the
        forward op a backward op belongs to (0: none), drawn as a ``fwdbwd`` arrow wherever the
        two are (an imported trace's).
        """
        if self.window == 0:
            return None
        order = np.argsort(sid, kind="stable")
        chunk = (sid[order], cpid[order], ctid[order], rel[order])
        _push(self._recent, chunk, self.window)
        if categories is not None:
            fwd = categories == FORWARD
            if fwd.any():
                sel = order[fwd[order]]
                _push(self._forward, (sid[sel], cpid[sel], ctid[sel], rel[sel]), self.window)
        parts: list[tuple[pa.Array, pa.Array]] = []
        rows = np.flatnonzero(has_parent)
        found, p_pid, p_tid, p_ts = self._find(parent[rows])
        cross = found & (p_pid != cpid[rows])
        if cross.any():
            child = rows[cross]
            common: str | pa.Array = f',"cat":"{FLOW_CATEGORY}","name":"parent"'
            if launched is not None and launched[child].any():
                common = pc.if_else(
                    pa.array(launched[child]), f',"cat":"{LAUNCH_CATEGORY}","name":"ac2g"', common
                )
            ends = (cpid[child], ctid[child], rel[child])
            parts.append(self._events((p_pid[cross], p_tid[cross], p_ts[cross]), ends, common))
        if backward_of is not None:
            rows = np.flatnonzero(backward_of)
            found, f_pid, f_tid, f_ts = self._find(backward_of[rows])
            if found.any():
                child = rows[found]
                ends = (cpid[child], ctid[child], rel[child])
                starts = (f_pid[found], f_tid[found], f_ts[found])
                common = f',"cat":"{BACKWARD_CATEGORY}","name":"fwdbwd"'
                parts.append(self._events(starts, ends, common))
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return (
            pa.concat_arrays([p[0] for p in parts]),
            pa.concat_arrays([p[1] for p in parts]),
        )

    def _find(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Whether each span id is remembered, and its Chrome pid, tid and relative start."""
        found = np.zeros(len(want), dtype=bool)
        p_pid = np.zeros(len(want), dtype=np.int64)
        p_tid = np.zeros(len(want), dtype=np.int64)
        p_ts = np.zeros(len(want), dtype=np.int64)
        for ids, c_pid, c_tid, c_ts in reversed(self._recent + self._forward):
            todo = np.flatnonzero(~found)
            if len(todo) == 0:
                break
            pos = np.searchsorted(ids, want[todo])
            pos_ok = np.minimum(pos, len(ids) - 1)
            hit = (pos < len(ids)) & (ids[pos_ok] == want[todo])
            at, src = todo[hit], pos_ok[hit]
            found[at] = True
            p_pid[at], p_tid[at], p_ts[at] = c_pid[src], c_tid[src], c_ts[src]
        return found, p_pid, p_tid, p_ts

    def _events(
        self,
        starts: tuple[np.ndarray, np.ndarray, np.ndarray],
        ends: tuple[np.ndarray, np.ndarray, np.ndarray],
        common: str | pa.Array,
    ) -> tuple[pa.Array, pa.Array]:
        """The ``s`` events at ``starts`` and ``f`` events at ``ends`` (pid, tid, relative ns)."""
        k = len(starts[0])
        ids = pa.array(np.arange(self._next_flow, self._next_flow + k, dtype=np.int64)).cast(
            pa.string()
        )
        self._next_flow += k

        def events(head: str, where: tuple[np.ndarray, np.ndarray, np.ndarray]) -> pa.Array:
            pid, tid, ts = where
            return pc.binary_join_element_wise(
                head,
                ids,
                common,
                ',"pid":',
                pa.array(pid).cast(pa.string()),
                ',"tid":',
                pa.array(tid).cast(pa.string()),
                ',"ts":',
                micros(ts),
                "}",
                "",
            )

        return events(',\n{"ph":"s","id":', starts), events(',\n{"ph":"f","bp":"e","id":', ends)

    def clear(self) -> None:
        """Forget the remembered spans (the exporter is done)."""
        self._recent.clear()
        self._forward.clear()


def _push(chunks: list[Chunk], chunk: Chunk, limit: int) -> None:
    """Append a chunk and drop the oldest rows beyond ``limit``."""
    if len(chunk[0]) == 0:
        return
    chunks.append(chunk)
    total = sum(len(c[0]) for c in chunks)
    while total - len(chunks[0][0]) >= limit and len(chunks) > 1:
        total -= len(chunks.pop(0)[0])
