"""PyTorch op level from the native RecordFunction observer (framework_patches/torch/ops_native.py).

The session fixture of tests/conftest.py has built the library next to its source, so op level
picks it without GPU_TRACE_TORCH_OPS; these tests pin the source where it matters.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import gpu_trace  # noqa: E402
from gpu_trace import config  # noqa: E402
from gpu_trace.framework_patches import torch as torch_patches  # noqa: E402
from gpu_trace.framework_patches.torch import ops_native  # noqa: E402
from tests.conftest import recorded  # noqa: E402

pytestmark = pytest.mark.skipif(ops_native.library() is None, reason="no C++ compiler here")


def program() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        with torch.autograd.profiler.record_function("own"):
            model(torch.randn(3, 4)).sum().backward()
        opt.step()


def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, work=program) -> list:
    monkeypatch.setenv("GPU_TRACE_TORCH", "op")
    monkeypatch.setenv("GPU_TRACE_TORCH_OPS", source)
    run = tmp_path / source
    gpu_trace.start(run)
    try:
        assert type(torch_patches._ops).__name__ == (
            "NativeOpSource" if source == "native" else "OpSource"
        )
        work()
    finally:
        gpu_trace.stop()
    return recorded(run)


def shape(rows: list[dict]) -> tuple[collections.Counter, list]:
    """Op spans as (name, depth, parent's name) and module backward ranges with their parents."""
    by_id = {r["span_id"]: r for r in rows}

    def parent(r: dict) -> str | None:
        p = by_id.get(r["parent_span_id"])
        return None if p is None else p["name"]

    ops = collections.Counter(
        (r["name"], r["depth"], parent(r)) for r in rows if r["category"] == "op"
    )
    backward = sorted(
        (r["name"], r["depth"], parent(r), r["start_ns"] <= r["end_ns"])
        for r in rows
        if r["category"] == "module" and r["name"].endswith(".backward")
    )
    return ops, backward


def test_native_spans_are_the_kineto_sessions_spans(tmp_path, monkeypatch, capfd) -> None:
    """Same ops, names, depths and parents, and the same module backward ranges (matched by the
    evaluate_function ranges' sequence numbers, which the observer takes from their nodes)."""
    native = record(tmp_path, monkeypatch, "native")
    assert capfd.readouterr().err == ""
    kineto = record(tmp_path, monkeypatch, "kineto")
    ops, backward = shape(native)
    assert ops == shape(kineto)[0]
    assert backward == shape(kineto)[1]
    assert len(backward) >= 3 * 4  # Sequential, two Linears and the ReLU, three steps
    assert ops[("aten::addmm", 2, "aten::linear")] == 6  # in "own"
    assert {r["lane"] for r in native if r["category"] == "op"} == {"torch/ops"}
    assert {r["tid"] for r in native if r["category"] == "op"} == {threading.get_native_id()}


def test_ops_of_other_threads_are_recorded_on_their_thread(tmp_path, monkeypatch) -> None:
    tids: list[int] = []

    def work() -> None:
        def other() -> None:
            tids.append(threading.get_native_id())
            torch.ones(3).mul(2)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        nn.Linear(2, 2)(torch.ones(1, 2))

    rows = record(tmp_path, monkeypatch, "native", work)
    mul = [r for r in rows if r["name"] == "aten::mul"]
    assert [r["tid"] for r in mul] == tids


def test_the_programs_own_profiler_sees_its_ops_while_op_level_is_on(tmp_path, monkeypatch) -> None:
    def work() -> None:
        cpu = torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[cpu]) as prof:
            nn.Linear(2, 2)(torch.ones(1, 2))
        assert "aten::addmm" in {e.key for e in prof.key_averages()}

    rows = record(tmp_path, monkeypatch, "native", work)
    assert [r["name"] for r in rows if r["name"] == "aten::addmm"] == ["aten::addmm"]


def test_the_observer_is_removed_when_recording_stops(tmp_path, monkeypatch) -> None:
    record(tmp_path, monkeypatch, "native", lambda: torch.ones(2).add(1))
    lib = ops_native.library()
    assert lib is not None
    torch.ones(2).add(1)  # no observer: nothing recorded
    buf = np.empty(16, dtype=ops_native.RECORD)
    assert lib.gt_drain(buf.ctypes.data_as(ctypes.c_void_p), len(buf)) == 0


def test_a_failed_build_falls_back_to_the_sessions(tmp_path, monkeypatch, caplog) -> None:
    """A source with no build anywhere and no compiler: one warning, the sessions' op spans."""
    source = tmp_path / "observer.cpp"
    source.write_text(ops_native.SOURCE.read_text() + "// another build\n")
    monkeypatch.setattr(ops_native, "SOURCE", source)
    monkeypatch.setattr(ops_native, "_lib", None)
    monkeypatch.setattr(ops_native, "_failed", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("GPU_TRACE_TORCH", "op")
    monkeypatch.setenv("GPU_TRACE_TORCH_OPS", "native")
    with caplog.at_level(logging.WARNING):
        gpu_trace.start(tmp_path / "run")
        try:
            assert type(torch_patches._ops).__name__ == "OpSource"
            nn.Linear(2, 2)(torch.ones(1, 2))
        finally:
            gpu_trace.stop()
    warned = [r.getMessage() for r in caplog.records if "native op observer" in r.getMessage()]
    assert len(warned) == 1 and "no-such-compiler" in warned[0]
    assert "aten::addmm" in [r["name"] for r in recorded(tmp_path / "run")]


def test_building_leaves_the_programs_sys_path_alone(tmp_path) -> None:
    """The build may run inside the program (in the background): torch.utils.cpp_extension
    would import setuptools, which extends sys.path."""
    code = (
        "import sys, pathlib\n"
        "from gpu_trace.framework_patches.torch import ops_native\n"
        "before = list(sys.path)\n"
        f"ops_native.build(pathlib.Path({str(tmp_path / 'lib.so')!r}))\n"
        "assert sys.path == before, sys.path[len(before):]\n"
        "assert 'setuptools' not in sys.modules\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "lib.so").is_file()


def test_a_bad_source_setting_is_one_clear_message() -> None:
    with pytest.raises(ValueError, match="GPU_TRACE_TORCH_OPS") as err:
        config.parse("GPU_TRACE_TORCH_OPS", "cupti")
    assert "native" in str(err.value) and "kineto" in str(err.value)


@pytest.mark.parametrize("level", ["op", "module"])
def test_record_builds_the_observer_before_the_program(tmp_path, monkeypatch, home, level):
    """`gpu-trace record --torch op` (and `module`, the default) builds it into the cache, so
    the program's first run uses it rather than the sessions (op level) or Python hooks on the
    autograd nodes (module level) while it builds in the program."""
    from gpu_trace import launch

    source = tmp_path / "observer.cpp"
    source.write_text(ops_native.SOURCE.read_text() + "// another build\n")
    monkeypatch.setattr(ops_native, "SOURCE", source)
    built = home / "lib" / ops_native.library_name()
    got = launch.prepare(
        [sys.executable, "-c", "pass"],
        run_dir=tmp_path / "run",
        torch=level,
        nvml_hz=0,
        host_hz=0,
        gpu_activity="off",
    )
    if got.samplers is not None:
        got.samplers.stop()  # prepared, never started
    assert built.is_file()


def test_a_forked_child_records_its_own_ops_not_the_parents(tmp_path, monkeypatch) -> None:
    import os

    from gpu_trace.tracer.spool import list_spool, read_spool_file

    monkeypatch.setenv("GPU_TRACE_TORCH", "op")
    monkeypatch.setenv("GPU_TRACE_TORCH_OPS", "native")
    run = gpu_trace.start(tmp_path / "run")
    try:
        torch.ones(1).add(1)  # recorded, not yet drained when the child is made
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                torch.ones(1).mul(2)
                gpu_trace.stop()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        torch.ones(1).sub(1)
    finally:
        gpu_trace.stop()
    by_pid: dict[int, set[str]] = {}
    for p in list_spool(run):
        f = read_spool_file(p)
        if f.kind == "spans":
            by_pid.setdefault(int(f.meta["pid"]), set()).update(f.table.column("name").to_pylist())
    assert {"aten::add", "aten::sub"} <= by_pid[os.getpid()]
    assert "aten::mul" not in by_pid[os.getpid()]
    assert "aten::mul" in by_pid[pid] and "aten::add" not in by_pid[pid]


def test_with_no_build_a_run_uses_the_sessions_and_builds_it_for_the_next(
    tmp_path, monkeypatch, home
) -> None:
    source = tmp_path / "observer.cpp"
    source.write_text(ops_native.SOURCE.read_text() + "// another build\n")
    monkeypatch.setattr(ops_native, "SOURCE", source)
    for name in ("_lib", "_failed", "_building"):
        monkeypatch.setattr(ops_native, name, None)
    monkeypatch.setenv("GPU_TRACE_TORCH", "op")
    gpu_trace.start(tmp_path / "run")
    try:
        assert type(torch_patches._ops).__name__ == "OpSource"  # not waiting for the build
        nn.Linear(2, 2)(torch.ones(1, 2))
    finally:
        gpu_trace.stop()
    assert "aten::addmm" in [r["name"] for r in recorded(tmp_path / "run")]
    building = ops_native._building
    assert building is not None
    building.join(120)
    assert (home / "lib" / ops_native.library_name()).is_file()
    assert ops_native.available()


def test_a_pass_ending_while_the_flusher_drains_is_matched_whole(tmp_path, monkeypatch) -> None:
    """The flusher takes a pass's first nodes, and before it reads the cuts the pass ends and the
    next forward cuts (a flusher preempted on a loaded machine, made certain here: its take waits
    for that cut). Every module call still gets one backward range, under its pass's range: the
    pass's last nodes are matched with its cut, not a later one (where they made second,
    parentless ranges: 181 ``lstm2.backward`` for 180 calls, 4 ``Sequence.backward`` for 3)."""
    taken, cut = threading.Event(), threading.Event()
    armed: list[bool] = []

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = self.a(x)
            if not armed:  # the first pass stops after b's nodes, before a's

                def pause(grad):
                    armed.append(True)
                    assert taken.wait(30), "the flusher never drained"
                    return grad

                h.register_hook(pause)
            return self.b(h)

    def work() -> None:
        source = torch_patches._ops
        take = source._take

        def take_then_wait():
            got = take()
            if armed and not taken.is_set():
                taken.set()  # the owner finishes the pass and cuts at the next forward
                assert cut.wait(30), "the owner never cut"
            return got

        monkeypatch.setattr(source, "_take", take_then_wait)
        model = Net()
        for step in range(3):
            time.sleep(0.05)  # a cut at each forward (they are made 20 ms apart at most)
            loss = model(torch.randn(3, 4)).sum()
            if step == 1:
                cut.set()  # the second forward made its cut
            loss.backward()

    monkeypatch.setenv("GPU_TRACE_FLUSH_INTERVAL", "0.01")
    rows = record(tmp_path, monkeypatch, "native", work)
    assert taken.is_set() and cut.is_set()
    modules = [r for r in rows if r["category"] == "module"]
    counts = collections.Counter(r["name"] for r in modules)
    assert counts["Net"] == counts["Net.a"] == counts["Net.b"] == 3
    assert {n: counts[n + ".backward"] for n in ("Net", "Net.a", "Net.b")} == {
        "Net": 3,
        "Net.a": 3,
        "Net.b": 3,
    }
    ids = {r["span_id"]: r["name"] for r in modules}
    assert {ids.get(r["parent_span_id"]) for r in modules if r["name"] == "Net.backward"} == {
        "Tensor.backward"
    }
