"""The recorder's flusher thread (tracer/background.py): no Python frame between its steps, no
profile function inside them, not one of the program's threads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace.tracer import recorder
from gpu_trace.tracer.background import BackgroundThread


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_steps_on_wake_and_interval_then_stops() -> None:
    calls: list[bool] = []
    t = BackgroundThread(lambda woken: calls.append(woken) or True, "test-bg", 0.02)
    t.start()
    try:
        assert wait_for(lambda: False in calls), "no step when the interval passed"
        n = len(calls)
        t.wake()
        assert wait_for(lambda: True in calls[n:]), "no step when woken"
        assert t.is_alive()
    finally:
        t.stop()
    assert t.join(10) and not t.is_alive()
    n = len(calls)
    time.sleep(0.1)
    assert len(calls) == n, "stepped after stop()"


def test_a_step_returning_false_ends_it() -> None:
    t = BackgroundThread(lambda woken: False, "test-bg", 0.01)
    t.start()
    assert t.join(10) and not t.is_alive()


def test_a_failing_step_is_logged_and_the_thread_goes_on() -> None:
    """In a process of its own: the log record asks threading.current_thread(), which registers
    this thread as Dummy-N (the one thing of it a program can see, when recording fails), and
    that would stay in this test session's threading.enumerate()."""
    code = textwrap.dedent(
        """
        import logging, time
        from gpu_trace.tracer.background import BackgroundThread

        calls = []
        def step(woken):
            calls.append(woken)
            if len(calls) == 1:
                raise RuntimeError("boom")
            return True

        t = BackgroundThread(step, "test-bg", 0.01)
        t.start()
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        t.stop()
        print(len(calls) >= 3, t.join(10))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr
    assert "a step failed" in out.stderr and "RuntimeError: boom" in out.stderr


def test_hold_waits_for_the_step_in_progress_and_starts_none() -> None:
    """While the program's profiler starts, the flusher runs no Python (program_profiler.py)."""
    inside = threading.Event()
    go_on = threading.Event()
    steps: list[bool] = []

    def step(woken: bool) -> bool:
        steps.append(woken)
        if len(steps) == 1:
            inside.set()
            go_on.wait(10)
        return True

    t = BackgroundThread(step, "test-bg", 0.01)
    t.start()
    try:
        assert inside.wait(10)
        held = threading.Thread(target=t.hold)
        held.start()
        held.join(0.2)
        assert held.is_alive(), "hold() returned while a step was running"
        go_on.set()
        held.join(10)
        assert not held.is_alive() and t.held
        n = len(steps)
        t.wake()
        time.sleep(0.2)
        assert len(steps) == n, "stepped while held"
        assert wait_for(lambda: t.ident not in sys._current_frames())
        t.release()
        assert wait_for(lambda: len(steps) > n), "no step after release()"
        t.hold()
        t.hold()  # idempotent
    finally:
        t.stop()  # releases a hold
    assert t.join(10)


def test_no_python_frame_between_steps_and_not_a_threading_thread() -> None:
    """A profiler that starts while the thread waits (torch.profiler's Python tracer walks every
    thread's frames) finds nothing to record; the program's threading.enumerate() lacks it."""
    seen: list[int] = []
    t = BackgroundThread(lambda woken: seen.append(threading.get_ident()) or True, "test-bg", 60)
    before = threading.enumerate()
    t.start()
    try:
        t.wake()
        assert wait_for(lambda: seen)
        ident = seen[0]
        assert t.ident == ident
        # between steps: no frame of this thread (sys._current_frames lists those with one)
        assert wait_for(lambda: ident not in sys._current_frames())
        assert threading.enumerate() == before
    finally:
        t.stop()
        t.join(10)


def test_a_profile_function_set_on_the_thread_is_gone_before_the_next_step() -> None:
    """PyTorch's Python tracer sets its profile function on every thread; the thread clears it
    before its next step runs any Python, so the steps are not in the program's profile."""
    profiled: list[str] = []
    state: dict[str, object] = {}

    def profiler(frame, event, arg):  # noqa: ANN001
        if event == "call":  # the first step's own returns are seen: it set the function
            profiled.append(frame.f_code.co_name)

    def step(woken: bool) -> bool:
        if "set" not in state:
            sys.setprofile(profiler)  # as another thread's profiler does to this one
            state["set"] = True
        else:
            state.setdefault("seen", sys.getprofile())
        return True

    t = BackgroundThread(step, "test-bg", 0.01)
    t.start()
    try:
        assert wait_for(lambda: "seen" in state)
    finally:
        t.stop()
        t.join(10)
    assert state["seen"] is None
    assert profiled == []


def test_the_recorders_flusher_is_one(tmp_path: Path) -> None:
    gpu_trace.start(tmp_path / "run", flush_interval_s=0.01)
    try:
        rec = recorder.active
        assert rec is not None
        assert [t.name for t in threading.enumerate() if t.name == "gpu-trace-flusher"] == []
        with gpu_trace.range("flushed"):
            pass
        rec.wake()
        assert wait_for(lambda: any((tmp_path / "run" / "spool").glob("spans-*")))
    finally:
        gpu_trace.stop()


def test_bad_interval() -> None:
    with pytest.raises(ValueError):
        BackgroundThread(lambda woken: True, "x", 0)
