"""`gpu-trace record` with the samplers in the record process: replayed NVML, real host, real store."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_trace.collectors.nvml import NvmlUnavailable
from gpu_trace.collectors.nvml.live import PynvmlSource
from gpu_trace.collectors.nvml.replay import FORMAT

REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = REPO / "tests" / "data" / "nvml-synthetic-h100.jsonl"


def gpu_trace(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=240,
    )


def program(tmp_path: Path, seconds: float = 1.2) -> Path:
    """A program that writes its pid, starts a child and keeps a core busy for a while."""
    path = tmp_path / "prog.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys, time
            open({str(tmp_path / "pid")!r}, "w").write(str(os.getpid()))
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep({seconds})"])
            end = time.monotonic() + {seconds}
            while time.monotonic() < end:
                pass
            child.wait()
            """
        )
    )
    return path


def nvml_works() -> bool:
    source = PynvmlSource()
    try:
        source.open()
    except NvmlUnavailable:
        return False
    source.close()
    return True


def test_without_nvml_one_line_says_so_and_the_run_goes_on(tmp_path: Path) -> None:
    if nvml_works():
        pytest.skip("NVML works on this machine")
    out = gpu_trace("record", "--", sys.executable, "-c", "import sys; sys.exit(4)")
    assert out.returncode == 4, out.stderr
    lines = out.stderr.strip().splitlines()
    nvml_lines = [line for line in lines if "NVML" in line]
    assert len(nvml_lines) == 1, out.stderr
    assert nvml_lines[0].startswith("gpu-trace: NVML sampling is off: ")
    assert "stored in chdb://" in lines[-1]
    shown = json.loads(gpu_trace("show", "last", "--json").stdout)
    assert shown["run"]["attrs"]["nvml"] == "off"
    assert {c["source"] for c in shown["summary"]["counters"]} == {"host"}


def test_replayed_nvml_and_host_counters_reach_show_and_chrome(tmp_path: Path) -> None:
    prog = program(tmp_path)
    out = gpu_trace(
        "record",
        "--nvml-replay",
        str(SYNTHETIC),
        "--nvml-hz",
        "20",
        "--host-hz",
        "5",
        "--",
        sys.executable,
        str(prog),
    )
    assert out.returncode == 0, out.stderr
    assert "NVML" not in out.stderr, out.stderr
    pid = (tmp_path / "pid").read_text()

    shown = json.loads(gpu_trace("show", "last", "--json").stdout)
    run = shown["run"]
    assert run["attrs"]["nvml"] == "replay:nvml-synthetic-h100.jsonl"
    assert "synthetic" in run["attrs"]["gpus"]
    stats = {(c["source"], c["device"], c["metric"]): c for c in shown["summary"]["counters"]}
    util = stats[("nvml", "gpu0", "gpu_util_pct")]
    assert util["count"] > 5 and 0 <= util["min"] <= util["mean"] <= util["max"] <= 100
    assert ("nvml", "gpu0", "power_w") in stats and ("nvml", "gpu0", "sm_clock_mhz") in stats
    assert ("host", "", "cpu_util_pct") in stats
    assert ("host", f"pid{pid}", "process_rss_bytes") in stats
    # the synthetic file's root process is attributed to the program (after its first second)
    assert ("nvml", f"gpu0/pid{pid}", "process_mem_used_bytes") in stats

    text = gpu_trace("show", "last").stdout
    assert "gpu_util_pct" in text and "process_rss_bytes" in text

    trace = tmp_path / "t.json.gz"
    exported = gpu_trace("export", "last", "-o", str(trace))
    assert exported.returncode == 0, exported.stderr
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    c_events = [e for e in events if e.get("ph") == "C" and e.get("name") == "gpu_util_pct"]
    assert len(c_events) == util["count"]
    assert all(set(e["args"]) == {"gpu0"} for e in c_events)
    spans = [e for e in events if e.get("ph") == "X"]
    # counters and the program's spans are on one clock: the samples fall inside the run
    t0 = min(e["ts"] for e in spans + c_events)
    assert all(e["ts"] >= t0 for e in c_events)


def test_faults_in_the_nvml_source_become_marks_and_the_run_goes_on(tmp_path: Path) -> None:
    header = {
        "format": FORMAT,
        "version": 1,
        "synthetic": True,
        "hz": 10,
        "made_by": "test",
        "devices": [
            {"index": 0, "name": "Test GPU 0", "uuid": "GPU-0"},
            {"index": 1, "name": "Test GPU 1", "uuid": "GPU-1"},
        ],
    }
    records = [
        {"device": 0, "values": {"temperature_c": 40}, "events": [["xid", "79"]]},
        {"device": 1, "values": {"temperature_c": 50, "power_w": 100}},
        {"device": 0, "errors": {"temperature_c": "GpuIsLost"}},
        {"device": 1, "values": {"temperature_c": 51}, "errors": {"power_w": "NotSupported"}},
    ]
    path = tmp_path / "faulty.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")
    out = gpu_trace(
        "record",
        "--nvml-replay",
        str(path),
        "--host-hz",
        "0",
        "--",
        sys.executable,
        str(program(tmp_path, 0.6)),
        env={"GPU_TRACE_NVML_FAMILIES": "default,+events"},
    )
    assert out.returncode == 0, out.stderr
    rows = gpu_trace(
        "sql",
        "--json",
        "SELECT lane, name FROM gpu_trace.spans WHERE category = 'mark' ORDER BY start_ns",
    )
    marks = [json.loads(line) for line in rows.stdout.splitlines()]
    names = [(m["lane"], m["name"]) for m in marks]
    assert ("nvml/gpu0", "xid 79") in names
    assert ("nvml/gpu0", "nvml error: gpu0 lost (GpuIsLost)") in names
    assert ("nvml/gpu1", "nvml error: power_w NotSupported") in names
    shown = json.loads(gpu_trace("show", "last", "--json").stdout)
    stats = {(c["device"], c["metric"]): c for c in shown["summary"]["counters"]}
    assert stats[("gpu0", "temperature_c")]["count"] == 1  # lost after its first poll
    assert stats[("gpu1", "temperature_c")]["count"] > 2  # the other device went on


def test_a_hung_nvml_never_holds_up_record_or_the_program(tmp_path: Path) -> None:
    """PCIe never returns and closing waits for it (as a driver lock does): the program runs to
    its end, record ingests and exits with its status, and one line names the stuck call."""
    header = {
        "format": FORMAT,
        "version": 1,
        "synthetic": True,
        "hz": 10,
        "made_by": "test",
        "latency_s": {"pcie": "forever"},
        "devices": [{"index": 0, "name": "Test GPU 0", "uuid": "GPU-0"}],
    }
    record = {"device": 0, "values": {"temperature_c": 40, "pcie_tx_bytes_per_s": 1e6}}
    path = tmp_path / "hung.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, record]) + "\n")
    out = gpu_trace(  # its timeout only catches a hang
        "record",
        "--nvml-replay",
        str(path),
        "--host-hz",
        "0",
        "--",
        sys.executable,
        "-c",
        "import time, sys; time.sleep(0.8); sys.exit(3)",
        env={"GPU_TRACE_NVML_FAMILIES": "default,+pcie"},
    )
    assert out.returncode == 3, out.stderr
    lines = out.stderr.strip().splitlines()
    stuck = [line for line in lines if "NVML" in line]
    assert len(stuck) == 1 and "pcie call on gpu0" in stuck[0], out.stderr
    assert "stored in chdb://" in lines[-1]
    shown = json.loads(gpu_trace("show", "last", "--json").stdout)
    stats = {(c["device"], c["metric"]): c for c in shown["summary"]["counters"]}
    assert stats[("gpu0", "temperature_c")]["count"] >= 2  # the tick families went on
    assert ("gpu0", "pcie_tx_bytes_per_s") not in stats
    assert shown["run"]["attrs"]["nvml_families"].split(",") == sorted(
        ["clocks", "ecc", "memory", "memory_total", "pcie", "power"]
        + ["processes", "temperature", "throttle", "utilization"]
    )
