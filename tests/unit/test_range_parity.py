"""The C ``gpu_trace.range`` (tracer/_fastpath.c) and its pure-Python twin record the same spans.

One workload (nesting, attrs, the decorator on functions and methods, exceptions inside ranges,
ranges closed out of order, threads, a full buffer) runs through each implementation into its own
run; the spool files must agree span for span, up to the random per-thread id prefixes and times.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace import _api, _cbuild
from gpu_trace.tracer import fastpath_build, recorder
from gpu_trace.tracer.run import STATS_DIR
from tests.conftest import recorded

NATIVE = gpu_trace.range if gpu_trace.range is not _api.PyRange else None
IMPLS = {"c": NATIVE, "python": _api.PyRange}


def _need_native() -> None:
    if NATIVE is None:
        pytest.skip("the C range could not be built here (no C compiler or Python headers)")


def workload(rng: type) -> None:
    with rng("outer", batch=3, lr=0.5):
        with rng("inner"):
            pass
        with rng("inner", k="v"):
            pass

    @rng("decorated", kind="fn")
    def add(a: int, b: int = 1) -> int:
        with rng("in-decorated"):
            return a + b

    assert add(1, b=2) == 3
    assert add.__name__ == "add"
    assert add.__wrapped__(1) == 2

    class Model:
        @rng("method")
        def forward(self, x: int) -> int:
            return 2 * x

    assert Model().forward(4) == 8

    with pytest.raises(KeyError):
        with rng("raises"):
            with rng("raises-inner"):
                raise KeyError("x")

    @rng("decorated-raises")
    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError):
        boom()

    # closed out of order: the stack still unwinds, parents come from what was open
    a = rng("a").__enter__()
    b = rng("b").__enter__()
    a.__exit__(None, None, None)
    with rng("after-a"):
        pass
    b.__exit__(None, None, None)

    reused = rng("reused")
    for _ in range(2):
        with reused:
            pass

    def worker(i: int) -> None:
        with rng("thread", i=i):
            for k in range(3):
                with rng("thread-step", k=k):
                    pass

    threads = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # fill this thread's buffer (capacity 32): the rest is dropped and counted
    for i in range(40):
        with rng("fill", i=i):
            pass


def record(tmp_path: Path, impl: str) -> tuple[list[tuple], int]:
    run = tmp_path / f"run-{impl}"
    gpu_trace.start(run, nvtx="off", buffer_events=32, flush_interval_s=60)
    try:
        workload(IMPLS[impl])
    finally:
        gpu_trace.stop()
    stats = json.loads((run / STATS_DIR / f"{os.getpid()}.json").read_text())
    threads = stats["threads"]
    rows = recorded(run)
    ids = {r["span_id"] for r in rows}
    for r in rows:
        assert r["start_ns"] <= r["end_ns"]
        assert r["parent_span_id"] == 0 or r["parent_span_id"] in ids
    by_id = {r["span_id"]: r for r in rows}
    for r in rows:
        parent = by_id.get(r["parent_span_id"])
        if parent is not None and r["name"] not in ("after-a", "b"):
            assert parent["start_ns"] <= r["start_ns"] <= r["end_ns"] <= parent["end_ns"]
    shape = sorted(
        (
            threads[str(r["tid"])],
            r["span_id"] & 0xFFFFFFFF,  # the per-thread sequence number; the prefix is random
            r["parent_span_id"] & 0xFFFFFFFF,
            r["lane"],
            r["category"],
            r["name"],
            r["depth"],
            tuple(sorted(dict(r["attrs"] or {}).items())),
        )
        for r in rows
    )
    return shape, stats["dropped"]


def test_c_and_python_ranges_record_the_same_spans(tmp_path: Path) -> None:
    _need_native()
    c_rows, c_dropped = record(tmp_path, "c")
    py_rows, py_dropped = record(tmp_path, "python")
    assert c_rows == py_rows
    assert c_dropped == py_dropped > 0
    names = {row[5] for row in c_rows}
    assert {"outer", "decorated", "method", "raises-inner", "decorated-raises", "thread"} <= names
    assert c_rows[0][3:5] == ("nvtx/gpu_trace", "nvtx")


@pytest.mark.parametrize("impl", ["c", "python"])
def test_construction_errors(impl: str) -> None:
    if impl == "c":
        _need_native()
    rng = IMPLS[impl]

    class Name(str):
        pass

    for bad in (3, None, b"x", Name("x")):
        with pytest.raises(ValueError, match="range name must be a string"):
            rng(bad)
    with pytest.raises(TypeError):
        rng("a", "b")
    assert rng("a", x=1, y="2").attrs == {"x": "1", "y": "2"}
    assert rng("a").attrs is None


@pytest.mark.parametrize("impl", ["c", "python"])
def test_no_recorder_is_a_no_op(impl: str) -> None:
    if impl == "c":
        _need_native()
    rng = IMPLS[impl]
    assert recorder.active is None
    with rng("nothing") as r:
        assert isinstance(r, rng)
    assert rng("f")(lambda x: x + 1)(1) == 2


class _Broken:
    """A recorder whose buffer lookup fails: the range must not raise into the program."""

    @property
    def _local(self) -> object:
        raise RuntimeError("no local")

    def buffer(self) -> object:
        raise RuntimeError("no buffer")


@pytest.mark.parametrize("impl", ["c", "python"])
def test_failures_never_reach_the_program(
    impl: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if impl == "c":
        _need_native()
    rng = IMPLS[impl]
    with monkeypatch.context() as m, caplog.at_level(logging.ERROR, logger="gpu_trace._api"):
        m.setattr(_api._warn_once, "warned", False)
        m.setattr(recorder, "active", _Broken())
        with rng("x"):
            pass
        assert rng("f")(lambda: 5)() == 5
    failures = [r for r in caplog.records if "range enter failed" in r.getMessage()]
    assert len(failures) == 1  # once
    assert failures[0].exc_info is not None


def picklable(x: int) -> int:
    return x * 3


if NATIVE is not None:
    picklable = NATIVE("picklable")(picklable)  # noqa: F811 - what @gpu_trace.range("...") does


def test_decorated_function_pickles_by_reference() -> None:
    _need_native()
    restored = pickle.loads(pickle.dumps(picklable))
    assert restored is picklable
    assert restored(2) == 6


def test_unbuildable_falls_back_to_the_python_twin(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GPU_TRACE_HOME": str(tmp_path / "fresh-home"),
        "GPU_TRACE_CC": str(tmp_path / "no-such-cc"),
    }
    code = "import gpu_trace, gpu_trace._api as a; print(gpu_trace.range is a.PyRange)"
    prebuilt = fastpath_build.SOURCE.with_name(fastpath_build.library_name())
    if prebuilt.is_file():
        pytest.skip("a prebuilt extension sits next to the source")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert proc.stderr == ""  # not an error: only a debug log line


def test_build_error_names_the_compiler(tmp_path: Path) -> None:
    with pytest.raises(_cbuild.BuildError, match="not found"):
        fastpath_build.build(tmp_path / "x.so", cc=str(tmp_path / "no-such-cc"))
