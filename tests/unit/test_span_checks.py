"""tests/span_checks.py finds what it is for: partial overlaps, negative self times, strays."""

from __future__ import annotations

from tests.span_checks import overlaps, problems, self_times, siblings


def span(sid: int, parent: int, start: int, end: int, tid: int = 1, lane: str = "a") -> dict:
    return {
        "span_id": sid,
        "parent_span_id": parent,
        "tid": tid,
        "lane": lane,
        "name": f"s{sid}",
        "start_ns": start,
        "end_ns": end,
    }


def test_nested_and_adjacent_spans_are_fine() -> None:
    rows = [
        span(1, 0, 0, 10),
        span(2, 1, 0, 4),
        span(3, 1, 4, 10),
        span(4, 3, 5, 5),
        span(5, 0, 10, 20),
    ]
    assert problems(rows) == []


def test_a_span_ending_after_the_one_it_started_in_is_a_partial_overlap() -> None:
    rows = [span(1, 0, 0, 10), span(2, 0, 5, 15)]
    (found,) = overlaps(rows)
    assert "'s2' [5, 15] starts inside 's1' [0, 10] and ends 5 ns after it" in found
    # on another thread or another lane they do not stack
    assert overlaps([span(1, 0, 0, 10), span(2, 0, 5, 15, tid=2)]) == []
    assert overlaps([span(1, 0, 0, 10), span(2, 0, 5, 15, lane="b")]) == []


def test_children_overrunning_or_overlapping_give_a_negative_self_time() -> None:
    # two children that overlap each other sum to more than their parent
    rows = [span(1, 0, 0, 10), span(2, 1, 0, 6, lane="b"), span(3, 1, 4, 10, lane="c")]
    assert self_times(rows) == ["'s1' [0, 10] has a negative self time: -2 ns"]
    # a child outside its parent, and children on another thread do not count against it
    rows = [span(1, 0, 0, 10), span(2, 1, 5, 12, lane="b"), span(3, 1, 0, 10, tid=2)]
    assert self_times(rows) == ["'s2' [5, 12] lies outside its parent 's1' [0, 10]"]


def test_overlapping_children_of_one_parent_are_reported_on_any_lane() -> None:
    # a range made after the fact beside a live one it holds in time: self time counts both
    rows = [span(1, 0, 0, 100), span(2, 1, 10, 60, lane="b"), span(3, 1, 20, 30, lane="c")]
    assert siblings(rows) == ["'s3' [20, 30] overlaps its sibling 's2' [10, 60]"]
    assert siblings([span(1, 0, 0, 100), span(2, 1, 10, 60), span(3, 1, 60, 70)]) == []
