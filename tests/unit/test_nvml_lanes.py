"""NVML families, lanes and the watchdog, through sample files whose families have latencies.

A sample file's header may give a family a latency (``"latency_s"``), ``"forever"`` included:
that is how a slow or hung NVML is played here, without a GPU. No test measures time against a
threshold; waits are bounded only so that a hang fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from gpu_trace.collectors.nvml import NvmlSampler, open_sampler
from gpu_trace.collectors.nvml.families import ALL, DEFAULT, parse
from gpu_trace.collectors.nvml.replay import FORMAT, ReplaySource
from tests.conftest import Sink

HANG_S = 60.0  # only a hang gets anywhere near this


def sample_file(path: Path, latency: dict[str, object], polls: int = 50) -> Path:
    header = {
        "format": FORMAT,
        "version": 1,
        "synthetic": True,
        "hz": 10,
        "made_by": "tests",
        "latency_s": latency,
        "devices": [{"index": 0, "name": "Test GPU", "uuid": "GPU-0"}],
    }
    values = {
        "temperature_c": 40,
        "sm_clock_mhz": 1980,
        "pcie_tx_bytes_per_s": 1e6,
        "ecc_corrected_errors": 0,
    }
    lines = [header] + [{"t_ns": i, "device": 0, "values": values} for i in range(polls)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"hung: {what}"
        time.sleep(0.01)


def test_families_parse() -> None:
    assert parse(None) == DEFAULT and parse("default") == DEFAULT
    assert "pcie" not in DEFAULT and "buffers" not in DEFAULT
    assert parse("+pcie,-processes") == DEFAULT - {"processes"} | {"pcie"}
    assert parse("clocks,power") == {"clocks", "power"}
    assert parse("all") == ALL
    with pytest.raises(ValueError, match="unknown NVML family 'sideband'"):
        parse("default,+sideband")


def test_tick_families_keep_their_rate_while_a_slow_family_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PCIe never returns: the tick lane samples on, the stall is reported once, stop() ends."""
    path = sample_file(tmp_path / "hung.jsonl", {"pcie": "forever"})
    sink = Sink()
    sampler = NvmlSampler(
        sink, ReplaySource(path), 100, families=DEFAULT | {"pcie"}, stall_ns=50_000_000
    )
    sampler.start()
    wait_for(lambda: sampler.ticks >= 30, "the tick lane stopped while PCIe blocked")
    wait_for(lambda: "slow" in sampler.stalled, "the stall was never reported")
    stopper = threading.Thread(target=sampler.stop, kwargs={"timeout": 0.2})
    stopper.start()
    stopper.join(HANG_S)
    assert not stopper.is_alive(), "stop() waited for the blocked call"
    temps = sink.counters("temperature_c")
    assert len(temps) >= 30  # one a tick: nothing waited for PCIe
    assert not sink.counters("pcie_tx_bytes_per_s")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "pcie call on gpu0" in warnings[0], warnings
    stalls = [s[4] for b in sink.buffers for s in b.spans if s[4].startswith("nvml stalled")]
    assert stalls == ["nvml stalled: pcie"]


def test_stop_is_bounded_and_says_so_when_a_tick_family_never_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung call on the tick lane, stopped before the watchdog's limit: one line at stop, and
    the source is not closed (closing would wait for the call, as a driver lock does)."""
    path = sample_file(tmp_path / "hung.jsonl", {"clocks": "forever"})
    sampler = NvmlSampler(Sink(), ReplaySource(path), 10)
    sampler.start()
    wait_for(lambda: sampler._inflight["tick"] is not None, "the clocks call never started")
    stopper = threading.Thread(target=sampler.stop, kwargs={"timeout": 0.2})
    stopper.start()
    stopper.join(HANG_S)
    assert not stopper.is_alive(), "stop() hung on the blocked source"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "stopped with its clocks call on gpu0 blocked" in warnings[0]


def test_opening_a_source_that_never_answers_turns_sampling_off(tmp_path: Path) -> None:
    path = sample_file(tmp_path / "hung.jsonl", {"open": "forever"})
    sampler, note = open_sampler(Sink(), ReplaySource(path), 10, timeout_s=0.2)
    assert sampler is None
    assert note == "NVML sampling is off: NVML did not answer within 0.2 s"


def test_each_family_is_timed_and_written_as_a_counter(tmp_path: Path) -> None:
    path = sample_file(tmp_path / "slow.jsonl", {"clocks": 0.002})
    now = [0]
    sink = Sink()
    sampler = NvmlSampler(sink, ReplaySource(path), 10, clock=lambda: now[0])
    for _ in range(12):  # 1.2 simulated seconds: one window of call statistics
        sampler.sample_once()
        now[0] += 100_000_000
    stats = sampler.call_stats()
    assert stats["gpu0/clocks"]["n"] == 12 and stats["gpu0/clocks"]["p50_us"] >= 2000
    assert stats["gpu0/temperature"]["n"] == 12 and stats["gpu0/ecc"]["n"] == 2
    assert "gpu0/pcie" not in stats  # off by default
    assert set(DEFAULT) == {key.split("/")[1] for key in stats}
    written = {c[2] for c in sink.buf.counters if c[2].startswith("call_us.")}
    assert {"call_us.clocks", "call_us.temperature", "call_us.ecc"} <= written
    clocks = sink.counters("call_us.clocks")
    assert clocks and all(c[4] >= 2000 for c in clocks)


def test_a_sample_file_with_a_bad_latency_is_refused_in_one_line(tmp_path: Path) -> None:
    path = sample_file(tmp_path / "bad.jsonl", {"sideband": 1})
    sampler, note = open_sampler(Sink(), ReplaySource(path), 10)
    assert sampler is None and "latency_s: unknown family 'sideband'" in note
