"""Probe: a native RecordFunction observer's cost per op, next to torch.profiler and op level.

    python bench/native_ops_probe.py [--rounds 3] [--steps 40] [--models sine]

The programs are bench/op_level.py's (CPU, one thread). Configurations, each in a fresh process,
interleaved in rounds with the order rotated: ``plain``; ``callback`` (the global observer of
framework_patches/torch/observer.cpp on for the measured steps, its records drained into a NumPy
array after them, the drain counted in ``stop``); ``torch.profiler`` (CPU activity), ``op``
(op level, Kineto sessions) and ``op-native`` (op level from the observer, module ranges and
module backward matching included) as bench/op_level.py runs them. Reported as there: thread-CPU and
whole-process CPU ratios to plain in the same round, medians over rounds. The machine is shared:
compare only figures of one run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import op_level  # noqa: E402

CONFIGS = ("plain", "callback", "torch.profiler", "op", "op-native")


def native_worker(model: str, steps: int, out: str) -> None:
    import numpy as np

    from gpu_trace.framework_patches.torch import ops_native

    lib = ops_native.library()
    if lib is None:
        raise SystemExit("the observer library is not available")
    step = op_level.make_step(model)
    for _ in range(op_level.WARMUP):
        step()
    times, cpu, proc = [], [], []
    lib.gt_start(1)
    for _ in range(steps):
        t, c, p = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        step()
        times.append(time.perf_counter_ns() - t)
        cpu.append(time.thread_time_ns() - c)
        proc.append(time.process_time_ns() - p)
    t, p = time.perf_counter_ns(), time.process_time_ns()
    lib.gt_stop()
    recs = []
    while True:
        buf = np.empty(1 << 16, dtype=ops_native.RECORD)
        n = lib.gt_drain(buf.ctypes.data_as(ctypes.c_void_p), len(buf))
        recs.append(buf[:n])
        if n < len(buf):
            break
    got = np.concatenate(recs)
    stop_ns, stop_cpu = time.perf_counter_ns() - t, time.process_time_ns() - p
    with open(out, "w") as f:
        json.dump(
            {"steps": times, "cpu": cpu, "proc": proc, "stop": [stop_ns, stop_cpu], "n": len(got)},
            f,
        )


def run(model: str, steps: int, config: str, tmp: str) -> dict[str, float]:
    out = os.path.join(tmp, "out.json")
    if config == "callback":
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--models", model]
        cmd += ["--steps", str(steps), "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{config} failed:\n{proc.stderr[-2000:]}")
        with open(out) as f:
            got = json.load(f)
        n = len(got["steps"])
        return {
            "cpu": sum(got["cpu"]) / n / 1e9,
            "step": sum(got["steps"]) / n / 1e9,
            "stop": got["stop"][0] / 1e9,
            "total": (sum(got["proc"]) + got["stop"][1]) / 1e9,
            "ops": got["n"] / n,
        }
    return op_level.run(model, steps, config, tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--models", default="sine")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        native_worker(args.models, args.steps, args.out)
        return
    configs = args.configs.split(",")
    print(f"{args.rounds} rounds, {args.steps} steps each, load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            got: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
            for r in range(args.rounds):
                for config in configs[r % len(configs) :] + configs[: r % len(configs)]:
                    got[config].append(run(model, args.steps, config, tmp))
            plain = got["plain"]
            print(f"\n{model}")
            print(f"{'configuration':15} {'step ms':>8} {'cpu x':>6} {'total x':>8} {'stop s':>7}")
            for c in configs:
                rows = got[c]

                def ratio(
                    key: str, rows: list[dict[str, float]] = rows, plain: list = plain
                ) -> float:
                    return statistics.median(r[key] / p[key] for r, p in zip(rows, plain))

                step = statistics.median(r["step"] for r in rows) * 1e3
                stop = statistics.median(r["stop"] for r in rows)
                print(f"{c:15} {step:8.2f} {ratio('cpu'):6.2f} {ratio('total'):8.2f} {stop:7.2f}")
            ops = [r["ops"] for r in got.get("callback", []) if "ops" in r]
            if ops:
                print(f"ops a step (callback): {statistics.median(ops):.0f}")


if __name__ == "__main__":
    main()
