"""Which span encloses which: a span's parent by time, on its thread.

Most producers name a span's parent where they know it (a range's enclosing range, an op's
enclosing op, a forwarded op's batch, a W3C-linked span's remote parent), but not across them: a
step names nothing, and neither does a top-level range, module or op, though each runs inside
whatever was open on its thread. One rule places them, for every reader (the OTLP export and
stream, the dashboard's parent and children):

- A span that names a parent (``parent_span_id`` not 0) keeps it.
- Otherwise its parent is the *innermost* span of the same thread (``host, pid, tid``) that
  *contains* it, if any. ``A`` contains ``B`` when ``A.start <= B.start`` and ``B.end <= A.end``,
  the two are not the same interval, and ``A`` can hold spans at all (:func:`encloses`).
- Innermost: the container that started last; among those starting together the shortest, then
  the largest span id. This is the stack of one pass over the thread's spans sorted by start
  (:class:`Enclosing`).

Edge cases, decided:

- Equal start times: the longer span contains the shorter (``[0, 10]`` holds ``[0, 5]``).
- Two spans with the same start and end are siblings (neither holds the other, so no cycle can
  come from ties).
- A span ending exactly when the next starts: siblings, ``[0, 10]`` and ``[10, 20]``. A zero-length
  span at 10 goes under ``[10, 20]`` (the one that started last), under ``[0, 10]`` when nothing
  starts at 10.
- A zero-length span (a mark, an instant) holds nothing.
- Spans that overlap without nesting (``[0, 10]`` and ``[5, 15]``, e.g. a step begun inside a
  range): neither is the other's parent; what lies inside both goes under the one that started
  last (``[5, 15]``).
- Device work (kernels, copies, memsets) runs on a stream after its launch, not inside what is open
  on a thread: it is never placed by time (it names its launching call) and holds nothing. A
  forwarded batch (lane ``forward/batch``) collects ops across calls: it may sit inside a step but
  holds nothing by time (its ops and the server's spans name it).
- A span without an id can be placed but holds nothing (nothing could name it).

:class:`Adopting` is the same rule for spans that come as they *end* (the spool, while a run goes,
sorted by :func:`end_order`): a span waits until one that contains it comes. It agrees with
:class:`Enclosing` on properly nested spans; with spans overlapping without nesting, a span inside
both goes under the one that *ended* first, which is the one that came first.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from gpu_trace.tracer.records import KERNEL, MEMCPY, MEMSET

#: Categories that run on a GPU stream: never placed by time, never holding anything.
DEVICE_CATEGORIES = frozenset({KERNEL, MEMCPY, MEMSET})
#: Lanes of spans that collect work across calls: placed by time, holding nothing.
WINDOW_LANE = "forward/batch"

T = TypeVar("T")


def nests(category: str) -> bool:
    """Whether a span of ``category`` without a parent of its own is placed by time."""
    return category not in DEVICE_CATEGORIES


def encloses(category: str, lane: str) -> bool:
    """Whether a span of ``category`` on ``lane`` can hold others (when not zero-length)."""
    return category not in DEVICE_CATEGORIES and not (
        lane == WINDOW_LANE or lane.startswith(WINDOW_LANE + "/")
    )


def contains(outer_start: int, outer_end: int, start: int, end: int) -> bool:
    """Whether ``[outer_start, outer_end]`` contains ``[start, end]`` (see the module docstring)."""
    return (
        outer_start <= start
        and end <= outer_end
        and outer_end > outer_start
        and (outer_start != start or outer_end != end)
    )


def order(start: int, end: int, span_id: int) -> tuple[int, int, int]:
    """The sort key of the start-order pass: by start, longer first, then by span id."""
    return (start, -end, span_id)


def end_order(start: int, end: int, span_id: int) -> tuple[int, int, int]:
    """The sort key of the end-order pass, the reverse of :func:`order` among spans ending
    together: contents before what contains them, the innermost container first."""
    return (end, -start, -span_id)


class _Open(NamedTuple):
    start: int
    end: int
    span_id: int


class Enclosing:
    """Parents of spans given in start order (:func:`order`), one pass with a stack per thread.

    Memory is the deepest nesting of a thread. A span given out of order (starting before the last
    one of its thread) gets the innermost container still on the stack and is not kept as a
    possible parent.
    """

    def __init__(self) -> None:
        self._stacks: dict[Hashable, list[_Open]] = {}
        self._last: dict[Hashable, int] = {}

    def parent(
        self,
        thread: Hashable,
        span_id: int,
        parent: int,
        category: str,
        lane: str,
        start: int,
        end: int,
    ) -> int:
        """The span's parent: its own when it names one, else its innermost container (0: none).

        The span is kept as a possible parent of those that follow."""
        if not nests(category):
            return parent
        stack = self._stacks.get(thread)
        if stack is None:
            stack = self._stacks[thread] = []
        in_order = start >= self._last.get(thread, start)
        holds = in_order and span_id != 0 and end > start and encloses(category, lane)
        if holds:
            self._last[thread] = start
            # What does not contain this span contains nothing that starts after it either.
            while stack and not contains(stack[-1].start, stack[-1].end, start, end):
                stack.pop()
            found = parent or (stack[-1].span_id if stack else 0)
            stack.append(_Open(start, end, span_id))
            return found
        if in_order:
            self._last[thread] = start
        if parent:
            return parent
        for o in reversed(stack):
            if contains(o.start, o.end, start, end):
                return o.span_id
        return 0


class Adopting(Generic[T]):
    """Spans that come as they end: each waits, per thread, for a span that contains it.

    :meth:`adopt` gives a span that has just come the waiting ones it contains (its children);
    :meth:`wait` puts a span without a parent among the waiting; :meth:`release` and
    :meth:`drain` give up on the ones that waited long enough, or all (they are top-level).
    """

    def __init__(self) -> None:
        # per thread: (end, arrival number, start, span), sorted (a straggler is put in place)
        self._threads: dict[Hashable, list[tuple[int, int, int, T]]] = {}
        self._seq = 0
        self.count = 0

    def adopt(
        self, thread: Hashable, span_id: int, category: str, lane: str, start: int, end: int
    ) -> list[T]:
        """The waiting spans of ``thread`` that this span contains, no longer waiting."""
        waiting = self._threads.get(thread)
        if not waiting or span_id == 0 or end <= start or not encloses(category, lane):
            return []
        taken: list[T] = []
        kept: list[tuple[int, int, int, T]] = []
        # Those that ended before this span started are not in it, nor those before them.
        while waiting and waiting[-1][0] >= start:
            w = waiting.pop()
            if contains(start, end, w[2], w[0]):
                taken.append(w[3])
            else:
                kept.append(w)
        waiting.extend(reversed(kept))
        self.count -= len(taken)
        taken.reverse()
        return taken

    def wait(self, thread: Hashable, start: int, end: int, item: T) -> None:
        waiting = self._threads.setdefault(thread, [])
        entry = (end, self._seq, start, item)
        if waiting and waiting[-1][:2] > entry[:2]:
            bisect.insort(waiting, entry, key=_by_arrival)
        else:
            waiting.append(entry)
        self._seq += 1
        self.count += 1

    def release(self, ended_before: int) -> list[T]:
        """The waiting spans that ended before ``ended_before``, by end per thread."""
        out: list[T] = []
        for waiting in self._threads.values():
            n = bisect.bisect_left(waiting, ended_before, key=_end)
            out += [w[3] for w in waiting[:n]]
            del waiting[:n]
        self.count -= len(out)
        return out

    def oldest(self) -> T | None:
        """The waiting span that ended first, no longer waiting (None when none waits)."""
        heads = [w for w in self._threads.values() if w]
        if not heads:
            return None
        first = min(heads, key=lambda w: _by_arrival(w[0]))
        self.count -= 1
        return first.pop(0)[3]

    def drain(self) -> list[T]:
        """Every waiting span, by end; then none waits."""
        out = sorted((w for ws in self._threads.values() for w in ws), key=_by_arrival)
        self._threads.clear()
        self.count = 0
        return [w[3] for w in out]


def _by_arrival(w: tuple[int, int, int, object]) -> tuple[int, int]:
    return w[0], w[1]


def _end(w: tuple[int, int, int, object]) -> int:
    return w[0]


# ---- one span's neighbours, for a reader that holds a thread's spans around it ---------------


def innermost(start: int, end: int, candidates: list[tuple[int, int, int, str, str]]) -> int | None:
    """Index into ``candidates`` (``start, end, span_id, category, lane`` of spans of the same
    thread) of the innermost one containing ``[start, end]``; None when none does."""
    best: int | None = None
    best_key: tuple[int, int, int] | None = None
    for i, (s, e, sid, category, lane) in enumerate(candidates):
        if sid and encloses(category, lane) and contains(s, e, start, end):
            key = order(s, e, sid)
            if best_key is None or key > best_key:
                best, best_key = i, key
    return best


def children(
    span: int,
    start: np.ndarray,
    end: np.ndarray,
    span_id: np.ndarray,
    parent: np.ndarray,
    nested: np.ndarray,
    holds: np.ndarray,
) -> np.ndarray:
    """Indices of the spans whose parent by time is ``span`` (an index), in start order.

    The arrays hold spans of one thread, at least every one starting within ``span`` (those
    starting elsewhere cannot be its children nor come between it and them); ``nested``:
    :func:`nests` of each, ``holds``: :func:`encloses` of each. A span's own parent (``parent``
    not 0) is not looked at beyond excluding it. Vectorized: a span is ``span``'s child when no
    span that can hold others comes after ``span`` and before it in :func:`order` ending later
    (or as late, starting earlier), which is a running maximum.
    """
    start = np.asarray(start, np.int64)
    end = np.asarray(end, np.int64)
    span_id = np.asarray(span_id, np.uint64)
    by = np.lexsort((span_id, -end, start))
    pos = int(np.flatnonzero(by == span)[0])
    after = by[pos + 1 :]
    if not len(after) or end[span] <= start[span] or not holds[span] or span_id[span] == 0:
        return np.empty(0, np.int64)
    s, e = start[after], end[after]
    # Rank by (end, -start): a span that comes before another ranking above it contains it.
    lex = np.lexsort((-s, e))
    step = np.ones(len(after), np.int64)
    step[0] = 0
    same = (e[lex][1:] == e[lex][:-1]) & (s[lex][1:] == s[lex][:-1])
    step[1:][same] = 0
    rank = np.empty(len(after), np.int64)
    rank[lex] = np.cumsum(step)
    can = holds[after] & (e > s) & (span_id[after] != 0)
    running = np.maximum.accumulate(np.where(can, rank, -1))
    before = np.concatenate(([-1], running[:-1]))
    inside = (s >= start[span]) & (e <= end[span]) & ((s != start[span]) | (e != end[span]))
    mine = inside & (before <= rank) & (parent[after] == 0) & nested[after]
    return np.asarray(after[mine], np.int64)
