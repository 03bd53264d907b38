"""Native NVTX times are CLOCK_MONOTONIC ns on Python's perf_counter_ns clock, whichever clock the
injection library reads on its hot path (the TSC, converted at drain time, or clock_gettime).

Python readings are interleaved with NVTX pushes and pops across many flushes (so many calibration
segments), and every range must lie where the readings around it say it happened.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import recorded
from tests.integration.test_nvtx_native import _need_compiler, run_script

#: How far a TSC-stamped time may sit outside the Python readings around it. The conversion is
#: exact at each calibration point; between points it follows a straight line, off by however much
#: CLOCK_MONOTONIC's rate against the TSC changed in between (NTP slewing: well under 1 us here).
TOLERANCE_NS = 2_000

WORKLOAD = """
import json, sys, threading, time
import gpu_trace
from gpu_trace.tracer import recorder
gpu_trace.start({run!r}, nvtx="native", flush_interval_s=0.02)
clock = [s.clock for s in recorder.active._sources if s.name == "nvtx"]
import nvtx

now = time.perf_counter_ns
domain = nvtx.get_domain("clock")

def work(tag, rounds, out):
    attrs = [domain.get_event_attributes(message=f"{{tag}}-{{i}}") for i in range(rounds)]
    inner = domain.get_event_attributes(message=f"{{tag}}-inner")
    for i in range(rounds):
        a = now(); domain.push_range(attrs[i]); b = now()
        domain.push_range(inner); domain.pop_range()
        c = now(); domain.pop_range(); d = now()
        out[f"{{tag}}-{{i}}"] = (a, b, c, d)
        if i % 10 == 0:
            time.sleep(0.002)  # several flushes, so several calibration segments, per thread

readings = {{}}
threads = [threading.Thread(target=work, args=(f"t{{k}}", 300, readings)) for k in range(2)]
for t in threads: t.start()
work("main", 300, readings)
for t in threads: t.join()
gpu_trace.stop()
print(json.dumps({{"clock": clock, "readings": readings}}))
"""


@pytest.mark.parametrize("clock", ["auto", "monotonic"])
def test_nvtx_times_agree_with_perf_counter_ns(tmp_path: Path, clock: str) -> None:
    _need_compiler()
    run = tmp_path / "run"
    proc = run_script(tmp_path, WORKLOAD.format(run=str(run)), env={"GPU_TRACE_NVTX_CLOCK": clock})
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (used,) = out["clock"]
    if clock == "monotonic":
        assert used == "monotonic"
    readings = out["readings"]
    rows = {r["name"]: r for r in recorded(run) if r["lane"] == "nvtx/clock"}
    assert len(rows) == len(readings) + 3  # and one "-inner" name per thread
    # clock_gettime is the same clock as perf_counter_ns: exact; the TSC path: within TOLERANCE_NS
    tol = TOLERANCE_NS if used == "tsc" else 0
    worst = 0
    for name, (a, b, c, d) in readings.items():
        r = rows[name]
        assert a - tol <= r["start_ns"] <= b + tol, (name, a, r["start_ns"], b)
        assert c - tol <= r["end_ns"] <= d + tol, (name, c, r["end_ns"], d)
        worst = max(worst, a - r["start_ns"], r["start_ns"] - b, c - r["end_ns"], r["end_ns"] - d)
    print(f"clock {used}: worst excursion outside the Python readings {worst} ns")
