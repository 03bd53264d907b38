"""Sample files: the recording mode writes what replay plays back; the real source says why it is off."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_trace.collectors.nvml import NvmlSampler, NvmlUnavailable, Reading
from gpu_trace.collectors.nvml.families import ALL
from gpu_trace.collectors.nvml.live import PynvmlSource, error_name
from gpu_trace.collectors.nvml.replay import RecordingSource, ReplaySource, to_record
from tests.conftest import Sink

REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = REPO / "tests" / "data" / "nvml-synthetic-h100.jsonl"


def _replayed(source, now: list[int], ticks: int = 200) -> list[tuple]:
    sink = Sink()
    sampler = NvmlSampler(sink, source, 10, clock=lambda: now[0], families=ALL)
    for _ in range(ticks):
        sampler.sample_once()
        now[0] += 100_000_000
    sampler.stop()
    return sorted(
        (c[1], c[2], c[3], c[4]) for b in sink.buffers for c in b.counters if "call_us" not in c[2]
    )


def test_recording_a_replay_plays_back_the_same_counters(tmp_path: Path) -> None:
    """Record mode over the replay source writes a file (one line per lane and tick) that plays
    back exactly the counters the original file gives."""
    out = io.StringIO()
    now = [5_000_000_000]
    source = RecordingSource(
        ReplaySource(SYNTHETIC, root_pid=lambda: 77, loop=False),
        out,
        hz=10,
        made_by="test",
        root_pid=77,
        clock=lambda: now[0],
    )
    original = _replayed(source, now)
    copy = tmp_path / "copy.jsonl"
    copy.write_text(out.getvalue())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["synthetic"] is False and {r.get("lane") for r in lines[1:]} == {None, "slow"}
    now = [5_000_000_000]
    again = _replayed(ReplaySource(copy, root_pid=lambda: 77, loop=False), now)
    assert original and again == original


def test_to_record_makes_sample_times_relative_and_names_the_root() -> None:
    reading = Reading(
        values={"power_w": 1.0},
        samples={"gpu_util_pct": [(990, 5.0), (1000, 6.0)]},
        processes=[(42, 10), (43, 20)],
        events=[("xid", "13")],
    )
    rec = to_record(reading, 0, 7, 1000, root=42)
    assert rec["samples"] == {"gpu_util_pct": [[-10, 5.0], [0, 6.0]]}
    assert rec["processes"] == [["root", 10], [43, 20]]
    assert rec["events"] == [["xid", "13"]] and "errors" not in rec


def test_replay_without_a_root_yet_leaves_root_processes_out(tmp_path: Path) -> None:
    src = ReplaySource(SYNTHETIC)
    src.open()
    readings = [src.poll(0, {"processes"}, 0) for _ in range(30)]
    assert all(pid != "root" for r in readings for pid, _ in r.processes or [])


def test_the_real_source_is_unavailable_here_with_a_reason() -> None:
    try:
        devices = PynvmlSource().open()
    except NvmlUnavailable as exc:
        msg = str(exc)
        assert msg and "\n" not in msg
        assert "gpu-trace[nvml]" in msg or "NVML" in msg
        return
    pytest.skip(f"NVML works here ({len(devices)} devices): tests/gpu covers it")


def test_error_names_drop_the_pynvml_prefix() -> None:
    class NVMLError_GpuIsLost(Exception):  # noqa: N801 - pynvml's naming
        pass

    assert error_name(NVMLError_GpuIsLost()) == "GpuIsLost"
    assert error_name(ValueError()) == "ValueError"


def test_record_mode_without_nvml_says_so(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace.collectors.nvml", "record", str(tmp_path / "x.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode == 0:
        pytest.skip("NVML works here: tests/gpu covers recording")
    assert out.returncode == 1
    assert out.stderr.startswith("gpu-trace: cannot record: "), out.stderr


def test_the_real_h100_recording_plays_through_the_default_families() -> None:
    """sample_traces/nvml-h100.jsonl is a real H100's: not synthetic, and at the default families
    (no buffers asked for) its buffered utilization and power still play with their own times."""
    real = REPO / "sample_traces" / "nvml-h100.jsonl"
    header = json.loads(real.read_text().splitlines()[0])
    assert header["synthetic"] is False and header["devices"][0]["name"] == "NVIDIA H100 80GB HBM3"
    now = [0]
    sink = Sink()
    sampler = NvmlSampler(sink, ReplaySource(real, loop=False), 10, clock=lambda: now[0])
    for _ in range(251):
        sampler.sample_once()
        now[0] += 100_000_000
    power = sink.counters("power_w")
    util = sink.counters("gpu_util_pct")
    assert len(power) > 251 and len({c[3] for c in power}) == len(power)  # several a poll
    assert max(c[4] for c in util) > 90 and max(c[4] for c in power) > 300  # it trained
    assert len(sink.counters("temperature_c")) == 251
    assert not sink.counters("pcie_tx_bytes_per_s")  # off by default
