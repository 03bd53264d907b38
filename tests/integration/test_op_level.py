"""PyTorch op level's Kineto sessions: quiet stderr, no op lost, conversion off the program.

Op level cycles the profiler's collection every 0.1 s (framework_patches/torch/ops.py); these
tests make every top-level module call cycle it (``HARVEST_INTERVAL_S = 0``), so a short program
runs many sessions without depending on how fast the machine is.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import gpu_trace  # noqa: E402
from gpu_trace.framework_patches.torch import kineto  # noqa: E402
from gpu_trace.framework_patches.torch import ops as torch_ops  # noqa: E402
from tests.conftest import recorded  # noqa: E402


def sessions(rows: list[dict]) -> int:
    """Sessions a run's op spans came from: each session's spans share a random id prefix."""
    return len({r["span_id"] >> 32 for r in rows if r["category"] == "op"})


@pytest.fixture
def op_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPU_TRACE_TORCH", "op")
    monkeypatch.setenv("GPU_TRACE_TORCH_OPS", "kineto")  # these tests are about its sessions
    monkeypatch.setattr(torch_ops, "HARVEST_INTERVAL_S", 0.0)  # every top-level call cycles
    run = tmp_path / "run"
    gpu_trace.start(run)
    yield run
    gpu_trace.stop()


@pytest.mark.skipif("KINETO_LOG_LEVEL" in os.environ, reason="Kineto's level is set outside")
def test_sessions_print_nothing_on_the_programs_stderr(op_level: Path, capfd) -> None:
    model = nn.Linear(4, 4)
    for _ in range(5):  # five sessions and more
        model(torch.randn(2, 4)).sum().backward()
    gpu_trace.stop()
    assert sessions(recorded(op_level)) >= 5
    assert capfd.readouterr().err == ""  # not one of Kineto's lines (written to fd 2 by C++)
    # The program's own profiler logs as PyTorch has it log: gpu-trace put Kineto's level back.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(2).sum()
    lines = capfd.readouterr().err.splitlines()
    assert [ln.rsplit("] ", 1)[-1] for ln in lines] == ["profiler_start", "profiler_stop"]


def test_quietly_puts_kinetos_level_back() -> None:
    level = kineto.threshold()
    assert level is not None, "libkineto's log level not found in this PyTorch build"
    before = level.value
    assert kineto.quietly(lambda: level.value) == kineto.SILENT
    assert level.value == before
    with pytest.raises(KeyError):
        kineto.quietly(lambda: {}["missing"])
    assert level.value == before


def test_no_op_is_lost_across_many_sessions(op_level: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    calls = 40
    for _ in range(calls):
        model(torch.randn(2, 3))  # each call cycles the session
    gpu_trace.stop()
    rows = recorded(op_level)
    names = [r["name"] for r in rows if r["category"] == "op"]
    assert names.count("aten::linear") == calls
    assert names.count("aten::relu") == calls
    assert sessions(rows) >= calls - 1
    modules = [r for r in rows if r["name"] == "Sequential.0"]
    assert len(modules) == calls


def test_sessions_are_converted_on_the_flusher(op_level: Path, monkeypatch) -> None:
    """The program's thread only stops and starts sessions; the flusher makes their spans."""
    threads: list[int] = []
    converted = threading.Event()
    table = torch_ops.OpSource._table

    def watched(self, *args, **kwargs):
        threads.append(threading.get_ident())  # not current_thread(): not a threading.Thread
        if len(threads) >= 3:
            converted.set()
        return table(self, *args, **kwargs)

    monkeypatch.setattr(torch_ops.OpSource, "_table", watched)
    model = nn.Linear(3, 3)
    for _ in range(1000):  # until the flusher has converted three sessions, or give up
        model(torch.randn(2, 3)).sum().backward()
        if converted.wait(0.01):
            break
    before_stop = list(threads)
    gpu_trace.stop()
    assert len(before_stop) >= 3
    assert len(set(before_stop)) == 1 and threading.get_ident() not in before_stop
    rows = recorded(op_level)
    assert len([r for r in rows if r["name"] == "Linear"]) == len(
        [r for r in rows if r["name"] == "aten::linear"]
    )


def test_a_seeded_programs_random_draws_are_its_own(op_level: Path) -> None:
    model = nn.Linear(3, 3)
    model(torch.randn(2, 3))  # the recorder's and patches' set-up is done
    random.seed(7)
    expected = [random.random() for _ in range(3)]
    random.seed(7)
    for _ in range(5):
        model(torch.randn(2, 3))  # sessions cycled
    gpu_trace.stop()  # and the last ones converted, on this thread
    assert [random.random() for _ in range(3)] == expected
    assert sessions(recorded(op_level)) >= 5


def test_the_programs_own_record_function_ranges_are_not_cut(op_level: Path) -> None:
    """A session stopped inside a program's open ``record_function`` range cuts the range, and
    its end lands on another op of the next session: no session is cycled inside one."""
    rf = torch.autograd.profiler.record_function
    assert hasattr(rf.__dict__["__enter__"], "__wrapped__")  # counted while op level is on
    model = nn.Linear(3, 3)
    model(torch.randn(2, 3))
    for _ in range(3):
        with torch.profiler.record_function("own"):
            model(torch.randn(2, 3))  # top-level calls: sessions would cycle here
            model(torch.randn(2, 3))
    gpu_trace.stop()
    assert not hasattr(rf.__dict__["__enter__"], "__wrapped__")  # put back
    assert not hasattr(rf.__dict__["__exit__"], "__wrapped__")
    rows = recorded(op_level)
    by_id = {r["span_id"]: r for r in rows}
    own = [r for r in rows if r["name"] == "own"]
    assert len(own) == 3
    linear = [r for r in rows if r["name"] == "aten::linear"]
    assert len(linear) == 7
    assert sum(by_id.get(r["parent_span_id"], {}).get("name") == "own" for r in linear) == 6
    for r in rows:  # every op lies inside its parent
        parent = by_id.get(r["parent_span_id"])
        if parent is not None and r["category"] == "op":
            assert parent["start_ns"] <= r["start_ns"] <= r["end_ns"] <= parent["end_ns"], r
