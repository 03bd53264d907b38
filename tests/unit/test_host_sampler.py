"""The host sampler and the process tree, on real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_trace.collectors.host import HostSampler
from gpu_trace.collectors.processes import ProcessTree
from gpu_trace.tracer.records import MARK
from tests.conftest import Sink

SECOND = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = SECOND

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def family(tmp_path: Path):
    """A child process with a grandchild; yields (child, grandchild pid)."""
    pidfile = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(g.pid))\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()):
        assert time.monotonic() < deadline, "the grandchild did not start"
        time.sleep(0.02)
    grandchild = int(pidfile.read_text())
    yield child, grandchild
    for pid in (grandchild, child.pid):
        try:
            import os
            import signal

            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.wait()


def by(sink: Sink, metric: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for c in sink.buf.counters:
        if c[2] == metric:
            out.setdefault(c[1], []).append(c[4])
    return out


def test_process_tree_finds_descendants_and_forgets_the_dead(family) -> None:
    child, grandchild = family
    tree = ProcessTree(child.pid, refresh_s=0)
    assert tree.pids() == {child.pid, grandchild}
    assert tree.labels(grandchild) == {"pid": str(grandchild)}
    assert tree.labels(1) is None
    child.kill()
    child.wait()
    assert child.pid not in tree.pids()
    assert ProcessTree().pids() == frozenset()


def test_host_sampler_records_machine_and_run_processes(family) -> None:
    child, grandchild = family
    sink, clock = Sink(), Clock()
    sampler = HostSampler(sink, 2, tree=ProcessTree(child.pid, refresh_s=0), clock=clock)
    for _ in range(3):
        sampler.sample_once()
        clock.now += SECOND // 2
    assert {c[0] for c in sink.buf.counters} == {"host"}
    assert set(by(sink, "process_rss_bytes")) == {f"pid{child.pid}", f"pid{grandchild}"}
    assert len(by(sink, "process_cpu_pct")[f"pid{child.pid}"]) == 2  # the first tick is a baseline
    assert len(by(sink, "cpu_util_pct")[""]) == 3
    assert len(by(sink, "net_sent_bytes_per_s")[""]) == 2  # rates need two ticks
    assert by(sink, "run_rss_bytes")[""][0] > 0
    labels = next(c[5] for c in sink.buf.counters if c[2] == "process_rss_bytes")
    assert labels and labels["pid"] in (str(child.pid), str(grandchild))

    # the grandchild exits: it is no longer sampled, nothing breaks
    import os
    import signal

    os.kill(grandchild, signal.SIGKILL)
    time.sleep(0.2)
    sink.buf.counters.clear()
    sampler.sample_once()
    assert set(by(sink, "process_rss_bytes")) == {f"pid{child.pid}"}
    assert sampler.failures == 0


def test_a_failing_group_stops_with_a_mark_and_the_rest_go_on() -> None:
    class NoDisk(HostSampler):
        def _disk(self, now: int) -> None:
            raise RuntimeError("no disk counters")

    sink, clock = Sink(), Clock()
    sampler = NoDisk(sink, 2, clock=clock)
    for _ in range(3):
        sampler.sample_once()
        clock.now += SECOND
    marks = [s[4] for s in sink.buf.spans if s[3] == MARK]
    assert marks == ["host error: disk RuntimeError"]
    assert len(by(sink, "cpu_util_pct")[""]) == 3
    assert "disk" not in sampler.enabled
    # no root process: no per-process counters, no failure
    assert not by(sink, "process_rss_bytes") and sampler.failures == 0
