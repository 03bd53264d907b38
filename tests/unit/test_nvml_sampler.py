"""The NVML sampler's policy, driven by replayed and fault-injecting sample files (no GPU)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import pytest

from gpu_trace.collectors.nvml import (
    METRICS,
    DeviceInfo,
    NvmlSampler,
    NvmlUnavailable,
    Reading,
    open_sampler,
)
from gpu_trace.collectors.nvml.families import ALL, DEFAULT
from gpu_trace.collectors.nvml.replay import FORMAT, ReplaySource
from gpu_trace.tracer.records import MARK
from tests.conftest import Sink

SYNTHETIC = Path(__file__).resolve().parents[2] / "tests" / "data" / "nvml-synthetic-h100.jsonl"
SECOND = 1_000_000_000


class Clock:
    def __init__(self, step: int = SECOND // 10) -> None:
        self.now = 10 * SECOND
        self.step = step

    def __call__(self) -> int:
        return self.now


def write_samples(path: Path, records: list[dict], devices: int = 1) -> Path:
    header = {
        "format": FORMAT,
        "version": 1,
        "synthetic": True,
        "hz": 10,
        "made_by": "tests",
        "devices": [
            {"index": i, "name": f"Test GPU {i}", "uuid": f"GPU-{i}"} for i in range(devices)
        ],
    }
    lines = [json.dumps(header)] + [json.dumps({"t_ns": 0, "device": 0, **r}) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(sampler: NvmlSampler, clock: Clock, ticks: int) -> None:
    for _ in range(ticks):
        sampler.sample_once()
        clock.now += clock.step


def counters(sink: Sink, metric: str | None = None, device: str | None = None) -> list[tuple]:
    return [
        c
        for c in sink.buf.counters
        if (metric is None or c[2] == metric) and (device is None or c[1] == device)
    ]


def marks(sink: Sink) -> list[str]:
    return [s[4] for s in sink.buf.spans if s[3] == MARK]


def test_synthetic_file_is_marked_and_plays_every_metric() -> None:
    header = json.loads(SYNTHETIC.read_text().splitlines()[0])
    assert header["synthetic"] is True and "SYNTHETIC" in header["note"]
    assert "synthetic" in SYNTHETIC.name and "synthetic" in header["devices"][0]["name"]
    sink, clock = Sink(), Clock()
    sampler = NvmlSampler(
        sink,
        ReplaySource(SYNTHETIC, root_pid=lambda: 4242),
        10,
        attribute=lambda pid: {"pid": str(pid)} if pid == 4242 else None,
        clock=clock,
        families=ALL,
    )
    run(sampler, clock, 200)
    assert {c[2] for c in sink.buf.counters} >= set(METRICS)
    assert all(c[0] == "nvml" for c in sink.buf.counters)
    # buffered utilization keeps its own times, up to and including the poll's
    util = counters(sink, "gpu_util_pct")
    assert len(util) == 5 * 200 and len({c[3] for c in util}) == len(util)
    # slow families on their own periods: ECC every second, PCIe every 5, memory total every 10
    assert len(counters(sink, "ecc_corrected_errors")) == 20
    assert len(counters(sink, "pcie_tx_bytes_per_s")) == 4
    assert len(counters(sink, "mem_total_bytes")) == 2
    # the recorded "root" process is the run's root now
    mine = counters(sink, "process_mem_used_bytes")
    assert mine and {c[1] for c in mine} == {"gpu0/pid4242"}
    assert mine[0][5] == {"pid": "4242", "gpu": "gpu0"}
    assert "throttle: sw_power_cap" in marks(sink)
    assert not [m for m in marks(sink) if m.startswith("nvml error")]


def test_a_failing_metric_stops_with_a_mark_and_the_rest_go_on(tmp_path: Path) -> None:
    path = write_samples(
        tmp_path / "f.jsonl",
        [
            {"values": {"power_w": 100, "temperature_c": 50}},
            {"values": {"temperature_c": 51}, "errors": {"power_w": "Unknown"}},
            {"values": {"power_w": 300, "temperature_c": 52}},
        ],
    )
    sink, clock = Sink(), Clock()
    sampler = NvmlSampler(sink, ReplaySource(path, loop=False), 10, clock=clock)
    run(sampler, clock, 3)
    assert [c[4] for c in counters(sink, "power_w")] == [100.0]  # never asked again
    assert [c[4] for c in counters(sink, "temperature_c")] == [50.0, 51.0, 52.0]
    assert marks(sink) == ["nvml error: power_w Unknown"]
    (mark,) = [s for s in sink.buf.spans if s[3] == MARK]
    assert mark[2] == "nvml/gpu0" and mark[8]["error"] == "Unknown"


def test_a_lost_device_stops_and_the_other_goes_on(tmp_path: Path) -> None:
    header_devices = 2
    records = [
        {"device": 0, "values": {"temperature_c": 50}},
        {"device": 1, "values": {"temperature_c": 60}},
        {"device": 0, "errors": {"temperature_c": "GpuIsLost"}},
        {"device": 1, "values": {"temperature_c": 61}},
        {"device": 0, "values": {"temperature_c": 99}},
        {"device": 1, "values": {"temperature_c": 62}},
    ]
    path = write_samples(tmp_path / "f.jsonl", records, devices=header_devices)
    sink, clock = Sink(), Clock()
    sampler = NvmlSampler(sink, ReplaySource(path, loop=False), 10, clock=clock)
    run(sampler, clock, 3)
    assert [c[4] for c in counters(sink, "temperature_c", "gpu0")] == [50.0]
    assert [c[4] for c in counters(sink, "temperature_c", "gpu1")] == [60.0, 61.0, 62.0]
    assert marks(sink) == ["nvml error: gpu0 lost (GpuIsLost)"]


class Exploding:
    """A source whose device 1 raises: the sampler must contain it to that device."""

    description = "test"

    def open(self) -> list[DeviceInfo]:
        return [DeviceInfo(0, "a", "GPU-a"), DeviceInfo(1, "b", "GPU-b")]

    def poll(self, index: int, metrics: Collection[str], now: int) -> Reading:
        if index == 1:
            raise OSError("driver went away")
        return Reading(values={"temperature_c": 40.0} if "temperature_c" in metrics else {})

    def close(self) -> None:
        pass


def test_a_source_that_raises_loses_only_that_device() -> None:
    sink, clock = Sink(), Clock()
    sampler = NvmlSampler(sink, Exploding(), 10, clock=clock)
    run(sampler, clock, 3)
    assert len(counters(sink, "temperature_c", "gpu0")) == 3
    assert marks(sink) == ["nvml error: gpu1 lost (OSError)"]
    assert sampler.failures == 0


def test_attribution_stops_when_the_process_exits(tmp_path: Path) -> None:
    path = write_samples(
        tmp_path / "f.jsonl",
        [
            {"processes": [[101, 1000], [999, 5]]},
            {"processes": [[101, 2000], [102, 300], [999, 5]]},
            {"processes": [[999, 5]]},  # both of ours exited
        ],
    )
    ours = {101, 102}
    sink, clock = Sink(), Clock()
    sampler = NvmlSampler(
        sink,
        ReplaySource(path, loop=False),
        10,
        attribute=lambda pid: {"pid": str(pid)} if pid in ours else None,
        clock=clock,
    )
    run(sampler, clock, 3)
    per_pid = [(c[1], c[4]) for c in counters(sink, "process_mem_used_bytes")]
    assert per_pid == [("gpu0/pid101", 1000.0), ("gpu0/pid101", 2000.0), ("gpu0/pid102", 300.0)]
    assert [c[4] for c in counters(sink, "run_mem_used_bytes")] == [1000.0, 2300.0, 0.0]


def test_xid_events_and_new_ecc_errors_are_marks(tmp_path: Path) -> None:
    path = write_samples(
        tmp_path / "f.jsonl",
        [
            {"values": {"ecc_uncorrected_errors": 0}},
            {"values": {}, "events": [["xid", "79"]]},
        ]
        + [{"values": {}}] * 8
        + [{"values": {"ecc_uncorrected_errors": 2}}],
    )
    sink, clock = Sink(), Clock()
    sampler = NvmlSampler(
        sink, ReplaySource(path, loop=False), 10, clock=clock, families=DEFAULT | {"events"}
    )
    run(sampler, clock, 11)
    assert sorted(marks(sink)) == ["ecc: 2 new uncorrected errors", "xid 79"]


def test_not_a_sample_file_turns_the_sampler_off_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hello": 1}\n')
    sampler, note = open_sampler(Sink(), ReplaySource(bad), 10)
    assert sampler is None and note.startswith("NVML sampling is off: ") and "\n" not in note
    with pytest.raises(NvmlUnavailable, match="cannot read"):
        ReplaySource(tmp_path / "missing.jsonl").open()


def test_no_devices_is_off() -> None:
    class Empty(Exploding):
        def open(self) -> list[DeviceInfo]:
            return []

    sampler, note = open_sampler(Sink(), Empty(), 10)
    assert sampler is None and note == "NVML sampling is off: no GPU found"
