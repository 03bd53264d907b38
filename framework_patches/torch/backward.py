"""Module backward ranges made from collected backward ops (op level), instead of hooks.

At op level the profiler's collection records every autograd node as it runs
(``autograd::engine::evaluate_function: AddmmBackward0``) with the sequence number of the
forward op that created the node, and the module wrapper notes the sequence numbers each module
call's forward took on that thread (``[first, end)``). A backward node therefore belongs to the
innermost module call whose range holds its number, and to every call around that one.

Ranges are made like the hook-based ones of module level: walking a thread's backward nodes in
time order, a module call's range opens at the start of the first node that belongs to it and
ends at the end of the last node of the run of nodes that belong to it (nodes created outside
any module, like a loss computed with functions, end the runs of those they are not in). Nodes
with no forward op (``AccumulateGrad``) extend the ranges open around them; other ops don't
(the optimizer's, the gradient sums between nodes), and a forward op made with grad on (the next
forward's) ends them all. A module's forward called several times (a shared layer, a loop) gets
a backward range per call. A call's range is opened at most once per pass: where another
call's node runs between two of its nodes, its later nodes go to the calls around it (as at
module level: no second range, none overlapping its neighbour). A call made inside a backward
node (checkpointing's recomputation) nests under that node's calls (see :func:`owners`).

Ranges of a ``Tensor.backward`` on the collected thread go under its range (its span id and
depth, noted when it began); other passes' ranges are roots. At module level (nodes only), a
pass noted as having opened a range from Python inside a node (its sixth item True) gets no
ranges: made later, they could not hold that range, a child of the pass (op level notes the same).
A module call still running when a pass began (``backward`` called inside a module's forward)
has no backward range in that pass: its forward is not over, so its output's gradient is not
what the pass computes.

What the ranges are made from is decided by what the engine did, never by when the flusher
looked: the sources match a pass's nodes only once the pass is over (at the next top-level
module call of the recording thread, where no pass of it runs, or when recording stops), so a
pass of any length is walked whole, once; and the calls a node may belong to are kept by count
(:class:`Kept`, the last :data:`KEEP_CALLS`), not for a time, so a graph's backward finds its
forward's calls however long after the forward it runs, on a loaded machine as on an idle one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # modules imports this module
    from gpu_trace.framework_patches.torch.modules import ModuleRef

#: Name prefix of the profiler's event for an autograd node.
EVALUATE = "autograd::engine::evaluate_function: "

#: A backward-node event: (thread, start_ns, end_ns, seq) with seq >= 0 for a node with a
#: forward op, -1 for one without; seq None marks any other op (it ends the open ranges).
Event = tuple[int, int, int, "int | None"]
#: A made range: (span id, parent span id, thread, call index, start_ns, end_ns, depth).
Range = tuple[int, int, int, int, int, int, int]


#: Module calls of the recording thread kept for matching backward nodes to (see :class:`Kept`):
#: a graph whose backward runs after this many later module calls gets no module backward ranges.
#: About 130 bytes a call (8 MiB); a program calling 60 modules a step keeps a thousand steps.
KEEP_CALLS = 1 << 16
#: A module call as the sources note it: (first, end) sequence numbers, module, anchor.
Call = tuple[int, int, "ModuleRef", int]


class Kept:
    """The recording thread's module calls ``(first, end, module, anchor)``, in batches as they
    were cut (one per cut or op session, in order), kept until :data:`KEEP_CALLS` newer calls were
    made: by count, so whether a graph's backward finds its forward's calls does not depend on
    how long after the forward it runs (a REINFORCE episode's policy calls, a GAN's generator
    between the discriminator's passes) or on the machine's load.

    Sequence numbers grow on a thread, so each batch's numbers ``[lo, hi)`` come after the ones
    before it: :meth:`select` finds the batches a set of nodes' numbers fall in by bisection, and
    the walk indexes only those (usually the last one or two), not every kept call."""

    def __init__(self, limit: int = KEEP_CALLS) -> None:
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit!r}")
        self.limit = limit
        # Batches from index _head on (the ones before are forgotten, removed in bulk): their
        # numbers' bounds, calls, and the anchors of their recomputed calls (None until needed).
        self._los: list[int] = []
        self._his: list[int] = []
        self._calls: list[Sequence[Call]] = []
        self._anchors: list[list[int] | None] = []
        self._head = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, calls: Sequence[Call]) -> None:
        """Keep one batch of calls, listed as they returned; forget the oldest batches past the
        limit (a batch larger than it is kept whole until the next one comes)."""
        if not calls:
            return
        self._los.append(min(c[0] for c in calls))
        self._his.append(max(c[1] for c in calls))
        self._calls.append(calls)
        self._anchors.append(None)
        self._count += len(calls)
        while self._count - len(self._calls[self._head]) >= self.limit:
            self._count -= len(self._calls[self._head])
            self._calls[self._head] = ()
            self._head += 1
        if self._head > 64 and 2 * self._head > len(self._calls):
            for kept in (self._los, self._his, self._calls, self._anchors):
                del kept[: self._head]
            self._head = 0

    def clear(self) -> None:
        for kept in (self._los, self._his, self._calls, self._anchors):
            kept.clear()
        self._head = self._count = 0

    def select(self, seqs: np.ndarray) -> list[Call]:
        """The kept calls that nodes numbered ``seqs`` may belong to: the batches holding those
        numbers and, for calls recomputed inside a backward node (checkpointing), the batches
        holding their anchors (whose calls they nest in), in the order they were made."""
        if self._count == 0 or not len(seqs):
            return []
        found: set[int] = set()
        seqs = np.asarray(seqs, dtype=np.int64)
        while len(seqs):
            # only the batches between the lowest and the highest number are looked at
            a = max(bisect_right(self._los, int(seqs.min()), self._head) - 1, self._head)
            b = bisect_right(self._los, int(seqs.max()), a)
            if a >= b:
                break
            los = np.asarray(self._los[a:b], dtype=np.int64)
            his = np.asarray(self._his[a:b], dtype=np.int64)
            k = np.searchsorted(los, seqs, side="right") - 1
            k = k[(k >= 0) & (seqs < his[np.maximum(k, 0)])] + a
            new = set(np.unique(k).tolist()) - found
            found |= new
            anchors: list[int] = []
            for i in new:
                got = self._anchors[i]
                if got is None:
                    got = self._anchors[i] = [c[3] for c in self._calls[i] if c[3] >= 0]
                anchors.extend(got)
            seqs = np.asarray(anchors, dtype=np.int64)
        out: list[Call] = []
        for i in sorted(found):
            out.extend(self._calls[i])
        return out


def owners(calls: Sequence[Sequence[Any]]) -> tuple[list[int], list[int], list[int]]:
    """Index the calls ``(first, end, module, anchor)``, listed as they returned: ``starts``
    (sorted firsts), ``order`` (call index per start) and ``parent`` (enclosing call index per
    call, -1 at the top).

    Of two calls with the same numbers (a module whose forward only calls another), the one
    that returned later is the outer one. An outermost call run inside a backward node
    (checkpointing's recomputation) has that node's sequence number as ``anchor`` (else -1):
    its parent is the innermost call holding the anchor, so its backward nests in theirs."""
    order = sorted(range(len(calls)), key=lambda i: (calls[i][0], -calls[i][1], -i))
    parent = [-1] * len(calls)
    open_: list[int] = []
    anchored = False
    for i in order:
        first, end = calls[i][0], calls[i][1]
        while open_ and calls[open_[-1]][1] <= first:
            open_.pop()
        if open_ and end <= calls[open_[-1]][1]:
            parent[i] = open_[-1]
        open_.append(i)
        anchored = anchored or calls[i][3] >= 0
    index = [calls[i][0] for i in order], order, parent
    if anchored:  # in order: an anchor's calls were made, and anchored, before the call
        for i in order:
            if parent[i] < 0 and calls[i][3] >= 0:
                found = chain(calls[i][3], calls, index)
                if found:
                    parent[i] = found[-1]
    return index


def chain(seq: int, calls: Sequence[Sequence[Any]], index: tuple) -> list[int]:
    """Call indexes holding ``seq``, outermost first (empty: made outside any module).

    Calls on one thread nest, and so do their ranges of numbers: the innermost call holding
    ``seq`` is the call starting last at or before it, or the nearest of its enclosing calls
    that holds it (none holds it if none of those does)."""
    return outwards(innermost(seq, calls, index), index[2])


def innermost(seq: int, calls: Sequence[Sequence[int]], index: tuple) -> int:
    """The innermost call index holding ``seq`` (-1: none; a call's first two items are its
    numbers, first and end); see :func:`chain`."""
    starts, order, parent = index
    k = bisect_right(starts, seq) - 1
    i = order[k] if k >= 0 else -1
    while i >= 0 and calls[i][1] <= seq:
        i = parent[i]
    return i


def outwards(i: int, parent: Sequence[int]) -> list[int]:
    """Call ``i`` and the calls around it, outermost first (empty for -1)."""
    out = []
    while i >= 0:
        out.append(i)
        i = parent[i]
    out.reverse()
    return out


def _first(p: Sequence) -> int:
    return p[0]


def ranges(
    events: Sequence[Event],
    calls: Sequence[Sequence[Any]],
    passes: Sequence[Sequence[Any]],
    next_id: Callable[[], int],
    index: tuple | None = None,
) -> list[Range]:
    """The module backward ranges the backward-node ``events`` make (see the module docstring);
    ``index``: :func:`owners` of ``calls`` where the caller has it."""
    if not calls:
        return []
    by_thread: dict[int, list[Event]] = {}
    for e in events:
        by_thread.setdefault(e[0], []).append(e)
    walk = _Walk(calls, passes, next_id, index)
    for tid, evs in by_thread.items():
        evs.sort(key=lambda e: e[1])
        walk.thread(tid, evs)
    return walk.out


class _Walk:
    """One thread's nodes at a time, in time order, with the ranges open so far."""

    def __init__(
        self,
        calls: Sequence,
        passes: Sequence[Sequence[Any]],
        next_id: Callable,
        index: tuple | None = None,
    ) -> None:
        self.calls = calls
        self.index = owners(calls) if index is None else index
        self.windows = sorted(((p[0], p[1] or (1 << 62), *p[2:]) for p in passes), key=_first)
        self.starts = [w[0] for w in self.windows]
        self.next_id = next_id
        self.cache: dict[tuple[int, int], list[int]] = {}  # (innermost call, pass) -> chain
        self.out: list[Range] = []
        #: [call, start, last end, span id, parent, depth, pass key]
        self.open: list[list[Any]] = []
        #: The pass key each call's range closed in: it is not opened again in that pass.
        self.closed: dict[int, tuple[int, int]] = {}
        self.gen = 0  # counts the forward ops seen: those between two passes tell them apart
        self.tid = 0

    def close(self, keep: int) -> None:
        open_ = self.open
        while len(open_) > keep:
            call, start, last, sid, parent, depth, key = open_.pop()
            self.out.append((sid, parent, self.tid, call, start, last, depth))
            self.closed[call] = key

    def chain(self, seq: int, start: int) -> tuple[list[int], Any, int]:
        """The calls a node belongs to, and the pass it runs in (None: not a recorded one) and
        its index (-1)."""
        k = bisect_right(self.starts, start) - 1
        p = self.windows[k] if k >= 0 and self.windows[k][1] >= start else None
        if p is None:
            k = -1
        # the nodes of one module call share its chain: cached by the innermost call
        key = (innermost(seq, self.calls, self.index), k)
        c = self.cache.get(key)
        if c is None:
            c = outwards(key[0], self.index[2])
            if p is not None and p[4]:  # calls running when the pass began are not in it
                c = [i for i in c if self.calls[i][2] not in p[4]]
            if p is not None and len(p) > 5 and p[5] is True:  # a Python range ran inside
                c = []
            self.cache[key] = c
        return c, p, k

    def thread(self, tid: int, events: list[Event]) -> None:
        self.tid, open_, closed = tid, self.open, self.closed
        self.gen += 1
        for _, start, end, seq in events:
            if seq is None:
                self.close(0)
                self.gen += 1
                continue
            if seq >= 0:
                c, p, k = self.chain(seq, start)
                key = (k, self.gen)
                keep = 0
                while keep < len(open_) and keep < len(c) and open_[keep][0] == c[keep]:
                    keep += 1
                self.close(keep)
                if len(c) > keep:
                    if open_:
                        parent, depth = open_[-1][3], open_[-1][5] + 1
                    elif p is not None:
                        parent, depth = p[2], p[3]
                    else:
                        parent, depth = 0, 0
                    for call in c[keep:]:
                        if closed.get(call) == key:  # closed in this pass: not a second range
                            break
                        sid = self.next_id()
                        open_.append([call, start, end, sid, parent, depth, key])
                        parent, depth = sid, depth + 1
            for o in open_:  # a node of the open ranges, or one with no forward op
                if end > o[2]:
                    o[2] = end
        self.close(0)
