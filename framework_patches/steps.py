"""Detected training steps: ``ProfilerStep#N`` ranges where the program does not number its own.

A framework patch says where an iteration starts (a DataLoader wait, a top-level module or layer
call, a gradient tape) and where it ends (``optimizer.step``, a Keras batch end); each iteration
becomes a range on the ``steps`` lane, named as the PyTorch profiler names steps, so step-based
analyses (HTA) find the iterations. Nothing is detected while the program calls
``gpu_trace.step`` itself.
"""

from __future__ import annotations

from gpu_trace.framework_patches import spans
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.records import STEP, STEP_LANE

DOMAIN = spans.Domain("steps")
DOMAIN.lane = STEP_LANE


def user_steps() -> bool:
    """Whether the program numbers steps itself (``gpu_trace.step``): then none is detected."""
    rec = _recorder.active
    return rec is None or getattr(rec, "_step_number", -1) >= 0


class Steps:
    """One framework's detected steps: the start of the iteration in progress and the next number."""

    __slots__ = ("start_ns", "number")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start_ns: int | None = None
        self.number = 0

    def iteration_starts(self) -> None:
        """Something that begins an iteration happened; the first such since the last step counts."""
        if self.start_ns is None:
            self.start_ns = now_ns()

    def end(self) -> None:
        """The iteration in progress, if one started, is step ``number``."""
        now = now_ns()
        start, self.start_ns = self.start_ns, None
        if start is not None and not user_steps():
            spans.add(DOMAIN, STEP, f"ProfilerStep#{self.number}", start, now)
            self.number += 1
