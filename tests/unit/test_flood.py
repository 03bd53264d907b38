"""One thread emitting ranges as fast as it can: the flusher keeps up (flushes early, transposes in
one C pass, gets the GIL when the buffer is over half full), and what is dropped is counted."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu_trace
from gpu_trace import _api
from gpu_trace.tracer import buffer, columns, fastpath_build, recorder
from gpu_trace.tracer.run import STATS_DIR
from gpu_trace.tracer.spool import list_spool
from tests.conftest import recorded

NATIVE_COLUMNS = columns._native
IMPLS = {
    "c": gpu_trace.range if gpu_trace.range is not _api.PyRange else None,
    "python": _api.PyRange,
}


def _impl(name: str) -> type:
    impl = IMPLS[name]
    if impl is None:
        pytest.skip("the C range could not be built here (no C compiler or Python headers)")
    return impl


def _flood(rng: type, n: int) -> None:
    for _ in range(n):
        with rng("flood"):
            pass


# ---- the transposition: C and Python agree ------------------------------------------------------

_u64 = st.integers(0, (1 << 64) - 1)
_i64 = st.integers(-(1 << 63), (1 << 63) - 1)
_text = st.sampled_from(["nvtx/gpu_trace", "step", "é", "", "x" * 300, "a\x00b"]) | st.text()
_attrs = st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)
_span = st.tuples(_u64, _u64, _text, _text, _text, _i64, _i64, st.integers(0, 65535), _attrs)


@pytest.mark.skipif(NATIVE_COLUMNS is None, reason="the C extension could not be built here")
@settings(max_examples=200, deadline=None)
@given(st.lists(_span, max_size=50))
def test_c_and_python_transpose_spans_alike(spans: list[tuple]) -> None:
    assert NATIVE_COLUMNS is not None
    assert NATIVE_COLUMNS(spans) == columns.span_columns_py(spans)
    native = columns.span_columns(spans)
    columns.use_native(None)
    try:
        python = columns.span_columns(spans)
    finally:
        columns.use_native(NATIVE_COLUMNS)
    assert native.keys() == python.keys()
    for name in native:
        assert native[name].equals(python[name]), name
        assert native[name].to_pylist() == [_column(s, name) for s in spans]


def _column(span: tuple, name: str) -> object:
    sid, parent, lane, category, label, start, end, depth, attrs = span
    row = {
        "span_id": sid,
        "parent_span_id": parent,
        "lane": lane,
        "category": category,
        "name": label,
        "start_ns": start,
        "end_ns": end,
        "depth": depth,
        "attrs": list((attrs or {}).items()),
    }
    return row[name]


@pytest.mark.skipif(NATIVE_COLUMNS is None, reason="the C extension could not be built here")
@pytest.mark.parametrize(
    "bad",
    [
        [(1, 2, "l", "c", "n", 3, 4, 0)],  # 8 fields
        [(1, 2, "l", "c", "n", 3, 4, 70000, None)],  # depth past uint16
        [(-1, 2, "l", "c", "n", 3, 4, 0, None)],  # a negative id
        [(1, 2, "l", "c", "n", None, 4, 0, None)],  # a time that is not a number
        [(1, 2, ["l"], "c", "n", 3, 4, 0, None)],  # an unhashable lane
    ],
)
def test_a_malformed_span_is_an_error_in_both(bad: list) -> None:
    assert NATIVE_COLUMNS is not None
    with pytest.raises((ValueError, TypeError, OverflowError, IndexError)):
        NATIVE_COLUMNS(bad)
    with pytest.raises((ValueError, TypeError, OverflowError, IndexError)):
        columns.span_columns_py(bad)


# ---- flushing early, giving way -----------------------------------------------------------------


def test_a_filling_buffer_is_flushed_before_the_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    capacity = 4 * recorder.FILL_MIN_EVENTS
    gpu_trace.start(run, nvtx="off", buffer_events=capacity, flush_interval_s=60)
    try:
        _flood(gpu_trace.range, recorder.FILL_MIN_EVENTS)  # a quarter of the buffer
        deadline = time.monotonic() + 30
        while not list_spool(run):  # the interval is a minute away: only the fill level flushes
            assert time.monotonic() < deadline, "nothing flushed"
            time.sleep(0.02)
    finally:
        gpu_trace.stop()
    assert len(recorded(run)) == recorder.FILL_MIN_EVENTS


def test_a_small_buffer_waits_for_the_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    gpu_trace.start(run, nvtx="off", buffer_events=1024, flush_interval_s=60)
    try:
        _flood(gpu_trace.range, 1024)  # full, but too small to be worth a file of its own
        time.sleep(3 * recorder.FILL_CHECK_S)
        assert not list_spool(run)
    finally:
        gpu_trace.stop()
    assert len(recorded(run)) == 1024


@pytest.mark.parametrize("impl", ["c", "python"])
def test_a_thread_over_half_its_buffer_gives_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, impl: str
) -> None:
    rng = _impl(impl)
    calls: list[int] = []
    monkeypatch.setattr(buffer, "give_way", lambda: calls.append(1))
    native = sys.modules.get(fastpath_build.MODULE)
    before = native.gave_way() if native is not None else 0
    gpu_trace.start(tmp_path / "run", nvtx="off", buffer_events=8192, flush_interval_s=60)
    try:
        _flood(rng, 10_000)  # below FILL_MIN_EVENTS: nothing is flushed meanwhile
    finally:
        gpu_trace.stop()
    gave_way = len(calls) if impl == "python" else native.gave_way() - before
    # past half (4096), every 1024 appended: at 5120, 6144, 7168; then every 1024 dropped (1808)
    assert gave_way == 4


# ---- what is dropped is counted -----------------------------------------------------------------


@pytest.mark.parametrize("impl", ["c", "python"])
def test_every_range_is_stored_or_counted_as_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, impl: str
) -> None:
    rng = _impl(impl)
    run = tmp_path / "run"
    emitted = 60_000
    # A small buffer flushed often: how many are dropped depends on timing; the sum does not.
    gpu_trace.start(run, nvtx="off", buffer_events=2048, flush_interval_s=0.005)
    try:
        with caplog.at_level(logging.WARNING, logger="gpu_trace.tracer.recorder"):
            _flood(rng, emitted)
            dropped = recorder.active.dropped()
    finally:
        gpu_trace.stop()
    stored = len(recorded(run))
    stats = json.loads((run / STATS_DIR / f"{os.getpid()}.json").read_text())
    assert stored + dropped == emitted
    assert stats["dropped"] == dropped and stats["events"] == stored
    warnings = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == (1 if dropped else 0)
