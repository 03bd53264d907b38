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

from gpu_trace.tracer.json_fragments import micros
from gpu_trace.tracer.records import FORWARD

FLOW_CATEGORY = "flow"
#: Kineto's flow from a CUDA call to the kernel, copy or memset it launched.
LAUNCH_CATEGORY = "ac2g"

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
    ) -> tuple[pa.Array, pa.Array] | None:
        """Remember one chunk of spans; return the ``s`` and ``f`` events of its flows, or None.

        Per row: span id, parent id (0 for none), whether it has one, Chrome pid and tid, start
        relative to the time base (ns) and category (None: no ``forward`` spans). ``launched``
        marks device work, whose flow from its parent (the CUDA call that launched it) is
        PyTorch's profiler's ``ac2g`` arrow.
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
        rows = np.flatnonzero(has_parent)
        if len(rows) == 0:
            return None
        want = parent[rows]
        found = np.zeros(len(rows), dtype=bool)
        p_pid = np.zeros(len(rows), dtype=np.int64)
        p_tid = np.zeros(len(rows), dtype=np.int64)
        p_ts = np.zeros(len(rows), dtype=np.int64)
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
        cross = found & (p_pid != cpid[rows])
        if not cross.any():
            return None
        child = rows[cross]
        k = len(child)
        ids = pa.array(np.arange(self._next_flow, self._next_flow + k, dtype=np.int64)).cast(
            pa.string()
        )
        self._next_flow += k
        common: str | pa.Array = f',"cat":"{FLOW_CATEGORY}","name":"parent"'
        if launched is not None and launched[child].any():
            common = pc.if_else(
                pa.array(launched[child]), f',"cat":"{LAUNCH_CATEGORY}","name":"ac2g"', common
            )
        starts = pc.binary_join_element_wise(
            ',\n{"ph":"s","id":',
            ids,
            common,
            ',"pid":',
            pa.array(p_pid[cross]).cast(pa.string()),
            ',"tid":',
            pa.array(p_tid[cross]).cast(pa.string()),
            ',"ts":',
            micros(p_ts[cross]),
            "}",
            "",
        )
        ends = pc.binary_join_element_wise(
            ',\n{"ph":"f","bp":"e","id":',
            ids,
            common,
            ',"pid":',
            pa.array(cpid[child]).cast(pa.string()),
            ',"tid":',
            pa.array(ctid[child]).cast(pa.string()),
            ',"ts":',
            micros(rel[child]),
            "}",
            "",
        )
        return starts, ends

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
