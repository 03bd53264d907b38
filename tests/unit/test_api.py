"""The public API: a pinned surface, and what each call records."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import gpu_trace
from tests.conftest import recorded


def test_public_surface_is_pinned() -> None:
    assert sorted(gpu_trace.__all__) == [
        "Run",
        "__version__",
        "counter",
        "mark",
        "profile",
        "range",
        "run",
        "runs",
        "start",
        "step",
        "stop",
    ]


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    return tmp_path / "run"


def test_nothing_is_recorded_or_raised_without_a_recording() -> None:
    with gpu_trace.range("idle", a=1):
        gpu_trace.mark("m")
        gpu_trace.counter("c", 1)
        with gpu_trace.step(3) as s:
            assert s.number == 3

    @gpu_trace.range("f")
    def f(x: int) -> int:
        return x + 1

    assert f(1) == 2


def test_ranges_nest_with_parents_depth_and_attrs(run_dir: Path) -> None:
    gpu_trace.start(run_dir)
    try:
        with gpu_trace.range("outer", batch=3, lr=0.1):
            with gpu_trace.range("inner"):
                gpu_trace.mark("here", why="test")
    finally:
        gpu_trace.stop()
    spans = {s["name"]: s for s in recorded(run_dir)}
    outer, inner, mark = spans["outer"], spans["inner"], spans["here"]
    assert outer["parent_span_id"] == 0 and outer["depth"] == 0
    assert inner["parent_span_id"] == outer["span_id"] and inner["depth"] == 1
    assert mark["parent_span_id"] == inner["span_id"] and mark["depth"] == 2
    assert mark["category"] == "mark" and mark["start_ns"] == mark["end_ns"]
    assert dict(outer["attrs"]) == {"batch": "3", "lr": "0.1"}
    assert dict(mark["attrs"]) == {"why": "test"}
    assert outer["start_ns"] <= inner["start_ns"] <= inner["end_ns"] <= outer["end_ns"]
    assert {s["lane"] for s in spans.values()} == {"nvtx/gpu_trace"}


def test_decorator_and_exceptions_propagate_unchanged(run_dir: Path) -> None:
    @gpu_trace.range("work", kind="decorated")
    def work(x: int) -> int:
        if x < 0:
            raise KeyError(x)
        return x * 2

    gpu_trace.start(run_dir)
    try:
        assert work(2) == 4
        assert work.__name__ == "work"
        with pytest.raises(KeyError):
            work(-1)
        with pytest.raises(ZeroDivisionError), gpu_trace.range("raising"):
            1 / 0  # noqa: B018
        with gpu_trace.range("after"):
            pass
    finally:
        gpu_trace.stop()
    spans = recorded(run_dir)
    assert [s["name"] for s in spans].count("work") == 2
    after = next(s for s in spans if s["name"] == "after")
    assert after["depth"] == 0, "a raising range still closed"


def test_steps_counters_and_threads(run_dir: Path) -> None:
    gpu_trace.start(run_dir)
    try:
        for i in range(3):
            gpu_trace.step(i)
            gpu_trace.counter("loss", 1.0 / (i + 1), device="cuda:0", phase="train")
        with gpu_trace.step() as s:
            assert s.number == 3

        def worker() -> None:
            with gpu_trace.range("in-thread"):
                pass

        t = threading.Thread(target=worker, name="side")
        t.start()
        t.join()
    finally:
        gpu_trace.stop()
    spans = recorded(run_dir)
    steps = sorted((s for s in spans if s["category"] == "step"), key=lambda s: s["start_ns"])
    assert [s["name"] for s in steps] == [f"ProfilerStep#{i}" for i in range(4)]
    assert all(a["end_ns"] <= b["start_ns"] for a, b in zip(steps, steps[1:]))
    assert {s["lane"] for s in steps} == {"steps"}
    counters = recorded(run_dir, "counters")
    assert [c["value"] for c in counters] == [1.0, 0.5, 1.0 / 3]
    assert counters[0]["device"] == "cuda:0" and dict(counters[0]["labels"]) == {"phase": "train"}
    thread_span = next(s for s in spans if s["name"] == "in-thread")
    assert thread_span["tid"] != steps[0]["tid"]


@pytest.mark.parametrize("bad", [None, 3, b"bytes"])
def test_range_name_must_be_a_string(bad: object) -> None:
    with pytest.raises(ValueError, match="range name must be a string"):
        gpu_trace.range(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_step_number_must_be_a_non_negative_int(bad: object) -> None:
    with pytest.raises(ValueError, match="step number"):
        gpu_trace.step(bad)  # type: ignore[arg-type]


def test_start_twice_is_an_error(run_dir: Path, tmp_path: Path) -> None:
    gpu_trace.start(run_dir)
    try:
        with pytest.raises(ValueError, match="already recording"):
            gpu_trace.start(tmp_path / "other")
    finally:
        assert gpu_trace.stop() == run_dir
    assert gpu_trace.stop() is None
