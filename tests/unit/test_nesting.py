"""The nesting rule (query/nesting.py): a span's parent is the one it names, else the innermost
span of its thread containing it. Edge cases as documented there, and the three ways of computing
it (start order, end order, one span's children) against a brute-force reading of the rule."""

from __future__ import annotations

import random
from typing import NamedTuple

import numpy as np
import pytest

from gpu_trace.query.nesting import (
    Adopting,
    Enclosing,
    children,
    contains,
    encloses,
    end_order,
    innermost,
    nests,
    order,
)


class S(NamedTuple):
    span_id: int
    start: int
    end: int
    parent: int = 0
    category: str = "nvtx"
    lane: str = "nvtx/gpu_trace"


def by_start(spans: list[S]) -> dict[int, int]:
    """Parent of each span (by id), fed to Enclosing in start order."""
    enclosing = Enclosing()
    out = {}
    for s in sorted(spans, key=lambda s: order(s.start, s.end, s.span_id)):
        out[s.span_id] = enclosing.parent(
            "t", s.span_id, s.parent, s.category, s.lane, s.start, s.end
        )
    return out


def by_end(spans: list[S]) -> dict[int, int]:
    """Parent of each span, fed to Adopting as the spool gives them: by end, contents first."""
    adopting: Adopting[S] = Adopting()
    out = {}
    for s in sorted(spans, key=lambda s: end_order(s.start, s.end, s.span_id)):
        for child in adopting.adopt("t", s.span_id, s.category, s.lane, s.start, s.end):
            out[child.span_id] = s.span_id
        if s.parent or not nests(s.category):
            out[s.span_id] = s.parent
        else:
            adopting.wait("t", s.start, s.end, s)
    out.update((s.span_id, 0) for s in adopting.drain())
    return out


def by_children(spans: list[S]) -> dict[int, int]:
    """Parent of each span, from every span's children (as the dashboard finds them)."""
    start = np.array([s.start for s in spans])
    end = np.array([s.end for s in spans])
    ids = np.array([s.span_id for s in spans], np.uint64)
    parent = np.array([s.parent for s in spans], np.uint64)
    nested = np.array([nests(s.category) for s in spans])
    holds = np.array([encloses(s.category, s.lane) for s in spans])
    out = {s.span_id: s.parent for s in spans}
    for i, s in enumerate(spans):
        for k in children(i, start, end, ids, parent, nested, holds):
            assert out[spans[k].span_id] == 0, "a span has one parent"
            out[spans[k].span_id] = s.span_id
    return out


def brute(spans: list[S]) -> dict[int, int]:
    """The rule as written: the container that started last (then the shortest, the larger id)."""
    out = {}
    for s in spans:
        found = [
            o
            for o in spans
            if o.span_id
            and encloses(o.category, o.lane)
            and contains(o.start, o.end, s.start, s.end)
        ]
        best = max(found, key=lambda o: order(o.start, o.end, o.span_id), default=None)
        placed = nests(s.category) and best is not None
        out[s.span_id] = s.parent or (best.span_id if placed else 0)  # type: ignore[union-attr]
    return out


def all_ways(spans: list[S]) -> dict[int, int]:
    """The parents, checked to be the same computed every way (end order: nested spans only)."""
    got = by_start(spans)
    assert got == brute(spans) == by_children(spans)
    return got


def test_a_step_holds_its_ranges_a_range_its_modules_a_module_its_ops() -> None:
    spans = [
        S(1, 0, 100, category="step", lane="steps"),
        S(2, 10, 60),  # a top-level range: names no parent
        S(3, 12, 50, parent=2, category="module", lane="nvtx/torch"),
        S(4, 15, 40, category="op", lane="torch/ops"),  # a top-level op, in the module
        S(5, 16, 20, parent=4, category="op", lane="torch/ops"),
        S(6, 70, 90, category="module", lane="nvtx/torch"),
        S(7, 200, 300),  # after the step: top-level
    ]
    assert all_ways(spans) == {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 1, 7: 0}
    assert by_end(spans) == by_start(spans)


def test_equal_starts_the_longer_holds_the_shorter_and_equal_spans_are_siblings() -> None:
    spans = [S(1, 0, 10), S(2, 0, 5), S(3, 0, 5), S(4, 1, 2)]
    assert all_ways(spans) == {1: 0, 2: 1, 3: 1, 4: 3}  # what is in both: the larger id
    assert by_end(spans) == {1: 0, 2: 1, 3: 1, 4: 3}


def test_a_span_ending_when_the_next_starts_is_its_sibling() -> None:
    steps = [
        S(1, 0, 10, category="step", lane="steps"),
        S(2, 10, 20, category="step", lane="steps"),
    ]
    assert all_ways(steps) == {1: 0, 2: 0}
    # A zero-length span at the boundary: under the one starting there, if any.
    assert all_ways([*steps, S(3, 10, 10, category="mark")])[3] == 2
    assert all_ways([steps[0], S(3, 10, 10, category="mark")])[3] == 1


def test_a_zero_length_span_holds_nothing() -> None:
    spans = [S(1, 0, 10), S(2, 5, 5, category="mark"), S(3, 5, 5), S(4, 5, 5)]
    assert all_ways(spans) == {1: 0, 2: 1, 3: 1, 4: 1}
    assert by_end(spans) == {1: 0, 2: 1, 3: 1, 4: 1}


def test_overlapping_spans_are_not_nested_and_what_is_in_both_goes_to_the_later_one() -> None:
    """A range begun before a step and ending inside it: neither holds the other."""
    spans = [S(1, 0, 10), S(2, 5, 15, category="step", lane="steps"), S(3, 6, 7), S(4, 11, 12)]
    assert all_ways(spans) == {1: 0, 2: 0, 3: 2, 4: 2}
    # As they end, the span inside both goes to the one that ended first (came first).
    assert by_end(spans) == {1: 0, 2: 0, 3: 1, 4: 2}


def test_device_work_and_batches_hold_nothing_and_device_work_is_not_placed() -> None:
    spans = [
        S(1, 0, 100, category="step", lane="steps"),
        S(2, 10, 90, category="forward", lane="forward/batch"),
        S(3, 20, 30, parent=2, category="forward", lane="forward/op"),
        S(4, 40, 50),  # a range inside the batch's window: not in the batch
        S(5, 60, 95, category="kernel", lane="gpu0/stream7"),  # names no launch
        S(6, 61, 62, category="kernel", lane="gpu0/stream7"),
        S(7, 32, 38, category="forward", lane="forward/batch/1"),
    ]
    assert all_ways(spans) == {1: 0, 2: 1, 3: 2, 4: 1, 5: 0, 6: 0, 7: 1}
    assert by_end(spans) == by_start(spans)


def test_a_span_naming_a_parent_keeps_it_and_a_span_without_an_id_holds_nothing() -> None:
    remote = 0xABC  # a W3C-linked span's parent, in another process
    spans = [S(1, 0, 100), S(2, 10, 20, parent=remote, category="otel"), S(0, 30, 80), S(3, 40, 50)]
    assert all_ways(spans) == {1: 0, 2: remote, 0: 1, 3: 1}


def test_spans_out_of_start_order_get_an_open_container_and_break_nothing() -> None:
    enclosing = Enclosing()
    assert enclosing.parent("t", 1, 0, "step", "steps", 0, 100) == 0
    assert enclosing.parent("t", 2, 0, "nvtx", "x", 50, 90) == 1
    assert enclosing.parent("t", 3, 0, "nvtx", "x", 20, 30) == 1  # late: not kept as a parent
    assert enclosing.parent("t", 4, 0, "nvtx", "x", 60, 70) == 2
    assert enclosing.parent("other thread", 5, 0, "nvtx", "x", 60, 70) == 0


def test_the_innermost_of_a_spans_candidates() -> None:
    candidates = [
        (0, 100, 1, "step", "steps"),
        (10, 90, 2, "forward", "forward/batch"),  # holds nothing
        (20, 60, 3, "nvtx", "x"),
        (20, 60, 4, "nvtx", "x"),  # as 3: the larger id
        (30, 40, 5, "nvtx", "x"),  # the span itself: not its own container
    ]
    assert innermost(30, 40, candidates) == 3
    assert innermost(0, 100, candidates) is None
    assert innermost(95, 99, candidates) == 0


def test_waiting_spans_are_released_by_their_end_and_the_oldest_first() -> None:
    adopting: Adopting[str] = Adopting()
    adopting.wait("a", 0, 10, "a0")
    adopting.wait("b", 0, 30, "b0")
    adopting.wait("a", 20, 40, "a1")
    assert adopting.count == 3
    assert adopting.release(ended_before=31) == ["a0", "b0"]
    assert adopting.oldest() == "a1" and adopting.count == 0 and adopting.oldest() is None


def test_a_waiting_span_that_came_late_is_still_adopted() -> None:
    """A span reaching the stream after later-ending ones (another drain) is put in its place."""
    adopting: Adopting[str] = Adopting()
    adopting.wait("t", 50, 60, "b")
    adopting.wait("t", 5, 8, "a")  # ended before b, came after it
    assert adopting.adopt("t", 1, "nvtx", "x", 40, 70) == ["b"]
    assert adopting.adopt("t", 2, "nvtx", "x", 0, 10) == ["a"] and adopting.count == 0


@pytest.mark.parametrize("seed", range(4))
def test_every_way_agrees_with_the_rule_on_random_spans(seed: int) -> None:
    """Ties on purpose: starts and ends from a few values, zero-length spans, named parents,
    device work, batch windows."""
    rng = random.Random(seed)
    for _ in range(500):
        n = rng.randint(1, 12)
        ids = rng.sample(range(1, 1000), n)
        spans = []
        for k in range(n):
            start = rng.randint(0, 10)
            category, lane = rng.choice(
                [("nvtx", "x"), ("op", "ops"), ("step", "steps"), ("kernel", "gpu0/stream7")]
                + [("forward", "forward/batch"), ("forward", "forward/op")]
            )
            named = rng.choice(ids) if rng.random() < 0.2 else 0
            end = start + rng.choice([0, 0, 1, 2, 3, 5, 10])
            spans.append(S(ids[k], start, end, named, category, lane))
        all_ways(spans)


def nested_spans(rng: random.Random) -> list[S]:
    """Properly nested spans, as one thread's stack makes them, some naming their parent."""
    spans: list[S] = []

    def fill(start: int, end: int, parent: int, depth: int) -> None:
        t = start
        while t < end and depth < 4 and rng.random() < 0.7:
            s = rng.randint(t, end)
            e = rng.randint(s, end)
            sid = len(spans) + 1
            named = parent if parent and rng.random() < 0.5 else 0
            spans.append(S(sid, s, e, named, rng.choice(["nvtx", "op", "mark"])))
            if e > s:
                fill(s, e, sid, depth + 1)
            t = e + 1

    fill(0, 1000, 0, 0)
    return spans


@pytest.mark.parametrize("seed", range(4))
def test_as_they_end_nested_spans_get_the_same_parents(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        spans = nested_spans(rng)
        assert by_end(spans) == all_ways(spans)
