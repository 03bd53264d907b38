"""A device's busy time in `gpu-trace show`: the union of its work intervals, overlaps once."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gpu_trace.query.gpu import busy_ns


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200)), max_size=40))
def test_busy_time_is_the_union_of_the_intervals(pairs: list[tuple[int, int]]) -> None:
    starts = np.array(sorted(s for s, _ in pairs), np.int64)
    by_start = sorted(pairs)
    ends = np.array([s + d for s, d in by_start], np.int64)
    covered = set()
    for s, d in by_start:
        covered.update(range(s, s + d))
    assert busy_ns(starts, ends) == len(covered)


def test_overlapping_streams_count_once() -> None:
    # Two streams: [0, 10) and [5, 20) overlap by 5; [30, 31) stands alone.
    assert busy_ns(np.array([0, 5, 30]), np.array([10, 20, 31])) == 21
    assert busy_ns(np.array([], np.int64), np.array([], np.int64)) == 0
