"""Write tests/data/nvml-synthetic-h100.jsonl: a SYNTHETIC NVML sample file, for tests.

No GPU was available when this file was made, so its values are invented, shaped like one H100
SXM running a training loop (idle, warm-up, steady steps with input-pipeline dips, a brief
power-cap throttle). It is written through the real recording path: the NVML sampler polls a
synthetic source wrapped in ``RecordingSource``, exactly as
``python -m gpu_trace.collectors.nvml record FILE`` does with the real one, on a simulated clock.

Tests that need a controlled shape (a throttle at a known time, errors, a known root process) use
it; the product (the demo, the bench) plays the real H100 recording, sample_traces/nvml-h100.jsonl.

    python tests/data/make_nvml_synthetic.py [OUT]
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Collection
from pathlib import Path

from gpu_trace.collectors.nvml import EVENTS, PROCESSES, DeviceInfo, NvmlSampler, Reading
from gpu_trace.collectors.nvml.families import ALL
from gpu_trace.collectors.nvml.replay import RecordingSource, _Discard

HZ = 10.0
SECONDS = 20.0
SEED = 4
BUFFER_HZ = 50.0  # invented: how often the driver fills its utilization/power buffers here
GIB = 1 << 30
ROOT_PID = 1000  # recorded as "root": the traced program
OTHER_PID = 4_194_400  # above any default pid_max: someone else's process, never attributed
T0 = 1_000_000_000_000  # the simulated monotonic clock's start


class SyntheticSource:
    """An H100-shaped device that never existed."""

    description = "synthetic"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def open(self) -> list[DeviceInfo]:
        return [DeviceInfo(0, "NVIDIA H100 80GB HBM3 (synthetic)", "GPU-00000000-synthetic-h100")]

    def close(self) -> None:
        pass

    def _load(self, t: float) -> float:
        """0 idle, 1 busy: 1.5 s idle, ramp, then steps with a dip every 2 s (input pipeline)."""
        if t < 1.5:
            return 0.0
        if t < 2.5:
            return t - 1.5
        return 0.25 if (t % 2.0) < 0.2 else 1.0

    def poll(self, index: int, metrics: Collection[str], now: int) -> Reading:
        rng = self.rng
        t = (now - T0) / 1e9
        load = self._load(t)
        throttled = 12.0 <= t < 13.0
        out = Reading()
        step = int(1e9 / BUFFER_HZ)
        for k in range(int(BUFFER_HZ / HZ), 0, -1):
            ts = now - (k - 1) * step
            lt = self._load((ts - T0) / 1e9)
            util = min(100.0, round(100 * lt + rng.uniform(-3, 0))) if lt else 0.0
            if "gpu_util_pct" in metrics:
                out.samples.setdefault("gpu_util_pct", []).append((ts, max(0.0, util)))
            if "mem_util_pct" in metrics:
                out.samples.setdefault("mem_util_pct", []).append((ts, round(0.55 * util)))
            if "power_w" in metrics:
                watts = 72 + 560 * lt * (0.8 if throttled else 1.0) + rng.uniform(-8, 8)
                out.samples.setdefault("power_w", []).append((ts, round(watts, 3)))
        used = (0.5 + min(1.0, t / 3.0) * 38.0) * GIB if t >= 1.0 else 0.5 * GIB
        values = {
            "mem_used_bytes": float(int(used) + int(0.5 * GIB)),
            "mem_total_bytes": 80.0 * GIB,
            "sm_clock_mhz": 345.0 if load == 0 else (1755.0 if throttled else 1980.0),
            "mem_clock_mhz": 2619.0,
            "temperature_c": round(33 + 28 * (1 - math.exp(-max(0.0, t - 1.5) / 6)), 0),
            "pcie_tx_bytes_per_s": float(int(load * 1.8e9 + rng.uniform(0, 2e7))),
            "pcie_rx_bytes_per_s": float(int(load * 6.5e9 + rng.uniform(0, 2e7))),
            "throttle_reasons": 0x1 if load == 0 else (0x4 if throttled else 0x0),
            "ecc_corrected_errors": 0.0,
            "ecc_uncorrected_errors": 0.0,
        }
        out.values = {m: v for m, v in values.items() if m in metrics}
        if PROCESSES in metrics:
            procs = [(OTHER_PID, 512 << 20)]
            if t >= 1.0:
                procs.insert(0, (ROOT_PID, int(used)))
            out.processes = procs
        if EVENTS in metrics:
            out.events = []
        return out


def main(out_path: Path) -> None:
    clock_now = [T0]
    with out_path.open("w") as out:
        source = RecordingSource(
            SyntheticSource(SEED),
            out,
            hz=HZ,
            made_by=f"tests/data/make_nvml_synthetic.py (seed {SEED}): SYNTHETIC, not "
            "recorded from a GPU; replace with python -m gpu_trace.collectors.nvml record FILE",
            synthetic=True,
            note="SYNTHETIC: invented values shaped like one H100 SXM in a training loop "
            "(no GPU was available); not a measurement",
            root_pid=ROOT_PID,
            clock=lambda: clock_now[0],
        )
        sampler = NvmlSampler(_Discard(), source, HZ, clock=lambda: clock_now[0], families=ALL)
        for _ in range(int(SECONDS * HZ)):
            sampler.sample_once()
            clock_now[0] += int(1e9 / HZ)
    print(f"wrote {source.polls} synthetic polls to {out_path}", file=sys.stderr)


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "nvml-synthetic-h100.jsonl")
