"""The recording clock: integer nanoseconds of CLOCK_MONOTONIC, plus a wall-clock anchor.

``time.perf_counter_ns`` reads CLOCK_MONOTONIC on Linux, the same clock the NVTX injection library
reads with ``clock_gettime``, so spans from Python and from native code share one time base.
"""

from __future__ import annotations

import time
from typing import NamedTuple

now_ns = time.perf_counter_ns


class Anchor(NamedTuple):
    """A pair of simultaneous readings: monotonic and Unix-epoch nanoseconds."""

    mono_ns: int
    wall_ns: int

    def to_wall(self, mono_ns: int) -> int:
        return mono_ns - self.mono_ns + self.wall_ns


def anchor() -> Anchor:
    """Read both clocks, keeping the pair with the tightest bracket of three tries."""
    best: tuple[int, int, int] | None = None
    for _ in range(3):
        a = time.perf_counter_ns()
        w = time.time_ns()
        b = time.perf_counter_ns()
        if best is None or b - a < best[0]:
            best = (b - a, (a + b) // 2, w)
    assert best is not None
    return Anchor(best[1], best[2])
