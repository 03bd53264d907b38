"""The periodic sampler base: rates, the error boundary, start/stop, marks and counters."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from gpu_trace.collectors.periodic import NICE, Sampler, sampler_cpus
from gpu_trace.tracer.records import MARK
from tests.conftest import Sink


class Counting(Sampler):
    source = "test"

    def __init__(self, sink: Sink, hz: float = 100.0, fail: bool = False) -> None:
        super().__init__(sink, hz, clock=self.tick_clock)
        self.t = 0
        self.fail = fail
        self.seen = threading.Event()
        self.closed = 0

    def tick_clock(self) -> int:
        self.t += 1
        return self.t

    def sample(self, now: int) -> None:
        self.seen.set()
        if self.fail:
            raise RuntimeError("source broke")
        self.counter("dev", "things", now, 1.5, {"k": "v"})
        self.mark("lane", "something", now, {"a": "b"})

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("hz", [0, -1, 1e6])
def test_bad_rates_are_value_errors(hz: float) -> None:
    with pytest.raises(ValueError, match="sampling rate"):
        Counting(Sink(), hz)


def test_sample_once_records_counters_and_marks() -> None:
    sink = Sink()
    s = Counting(sink)
    s.sample_once()
    buf = sink.buffer()
    assert buf.counters == [("test", "dev", "things", 1, 1.5, {"k": "v"})]
    (span,) = buf.spans
    assert span[2:8] == ("lane", MARK, "something", 1, 1, 0)
    assert span[8] == {"a": "b"}
    assert s.ticks == 1


def test_failures_are_logged_once_and_never_raise(caplog: pytest.LogCaptureFixture) -> None:
    s = Counting(Sink(), fail=True)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            s.sample_once()
    assert s.failures == 3 and s.ticks == 0
    assert sum("keeps sampling" in r.getMessage() for r in caplog.records) == 1


def test_start_stop_on_a_thread() -> None:
    sink = Sink()
    s = Counting(sink)
    s.start()
    assert s.seen.wait(10)
    with pytest.raises(ValueError, match="already started"):
        s.start()
    s.stop()
    s.stop()  # idempotent
    assert not s.running
    assert s.closed == 2  # close() runs on every stop; sources make it idempotent
    counters = [c for b in sink.buffers for c in b.counters]
    assert counters and all(c[0] == "test" for c in counters)


def test_the_sampling_thread_runs_nicer_than_the_process() -> None:
    """A sampler must never take a core from the program's launch thread: its thread is niced
    (per thread: the record process itself, which ingests afterwards, keeps its priority)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    niced: list[int] = []

    class Nice(Counting):
        def sample(self, now: int) -> None:
            niced.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            super().sample(now)

    s = Nice(Sink())
    s.start()
    assert s.seen.wait(10)
    s.stop()
    assert niced and niced[0] == min(19, base + NICE) and s.calmed.startswith(f"nice+{NICE}")
    assert os.getpriority(os.PRIO_PROCESS, 0) == base


def test_pinned_to_the_last_cpu_only_where_there_are_spare_ones() -> None:
    assert sampler_cpus({0, 1}) is None and sampler_cpus({0, 1, 2}) is None
    assert sampler_cpus(set(range(16))) == {15} and sampler_cpus({2, 5, 9, 11}) == {11}
