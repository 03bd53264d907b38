"""Op level on programs of many small ops: step cost and stalls, next to torch.profiler, in one run.

    python bench/op_level.py [--rounds 3] [--steps 60] [--models sine,transformer] [--quick]

The programs (CPU, ``torch.set_num_threads(1)``):

- ``sine``: PyTorch's time-sequence-prediction example made small: two ``nn.LSTMCell`` and a
  ``nn.Linear`` called in a Python loop over the time steps (here 100 steps of a batch of 3,
  hidden size 51), trained with SGD (the example's LBFGS evaluates its closure a varying number
  of times per step, which would make step windows differ for reasons of its own). About 30,000
  ops a step, each a few microseconds.
- ``transformer``: a two-layer ``nn.TransformerEncoder`` (width 32, 4 heads) on 8 sequences of
  16 tokens with a linear head, Adam.

Configurations, each in a fresh process: ``plain``; ``module`` (recording at ``--torch module``);
``op`` (recording at ``--torch op`` from the profiler's collection in sessions,
``GPU_TRACE_TORCH_OPS=kineto``); ``op-native`` (op level from the native RecordFunction observer,
``GPU_TRACE_TORCH_OPS=native``: framework_patches/torch/ops_native.py); ``op-2s`` (op level with 2 s sessions
converted at the flusher's interval, as before sessions were made short: the same code with
``HARVEST_INTERVAL_S = 2``, ``MAX_WAIT_S = 0`` and ``PAUSE_S = 0``); ``op-eager`` (op level
whose flusher converts straight on instead of waiting for the program's next stop, ``PAUSE_S =
0``: what that wait saves); ``torch.profiler`` (one
``torch.profiler.profile(activities=[CPU])`` around the same steps, record_shapes off). The
worker records in its own process (``gpu_trace.start`` with ``GPU_TRACE_TORCH``, as ``gpu-trace
record`` has its program do), NVML and host sampling off: the bench looks at the PyTorch side.

Reported per configuration, as medians over rounds (configurations interleaved in rounds, order
rotated each round; each ratio is to ``plain`` in the same round):

- ``step ms`` and ``x plain``: the mean step (wall time of the measured steps / steps) and its
  ratio to plain; ``cpu x``: the same ratio in CPU time of the training thread (PyTorch runs
  with one thread: its ops, the autograd engine and PyTorch's processing at a session's stop run
  there; not counted: waiting for the GIL or for a core);
- ``window`` and ``cpu window``: the steps in windows of 10, the longest window over the median
  one, in wall and in thread CPU time, the largest over rounds (a stall shows here; the target
  is 1.5);
- ``stop s``: what leaving took after the last step (torch.profiler building its results; the
  recorder's last flush, which converts the last sessions);
- ``total x``: CPU time of the whole process (the flusher's conversion included) for the steps
  plus leaving, to plain's: the cost of profiling a fixed amount of work end to end, which the
  machine's load does not move as much as wall time.

The machine is shared: read ratios, not times, and compare only figures of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

WINDOW = 10
WARMUP = 3
CONFIGS = ("plain", "module", "op", "op-native", "op-eager", "op-2s", "torch.profiler")


# ---- the worker: one configuration, one process ---------------------------------------------------


def make_step(name: str) -> Callable[[], None]:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "sine":

        class Sequence(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm1 = nn.LSTMCell(1, 51)
                self.lstm2 = nn.LSTMCell(51, 51)
                self.linear = nn.Linear(51, 1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h1 = c1 = h2 = c2 = torch.zeros(x.size(0), 51)
                outs = []
                for t in x.split(1, dim=1):
                    h1, c1 = self.lstm1(t, (h1, c1))
                    h2, c2 = self.lstm2(h1, (h2, c2))
                    outs.append(self.linear(h2))
                return torch.cat(outs, dim=1)

        model: nn.Module = Sequence()
        x = torch.sin(torch.arange(300.0).reshape(3, 100) / 8)
        y = torch.roll(x, -1, dims=1)
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn: nn.Module = nn.MSELoss()
    elif name == "transformer":
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 2), nn.Flatten(), nn.Linear(16 * 32, 4))
        x = torch.randn(8, 16, 32)
        y = torch.randint(0, 4, (8,))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss_fn = nn.CrossEntropyLoss()
    else:
        raise SystemExit(f"unknown model {name!r}")

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def worker(model: str, steps: int, config: str, out: str, run_dir: str) -> None:
    import contextlib

    import torch

    import gpu_trace

    recording = config in ("module", "op", "op-native", "op-eager", "op-2s")
    if recording:
        os.environ["GPU_TRACE_TORCH"] = "module" if config == "module" else "op"
        os.environ["GPU_TRACE_TORCH_OPS"] = "native" if config == "op-native" else "kineto"
        os.environ["GPU_TRACE_NVML_HZ"] = os.environ["GPU_TRACE_HOST_HZ"] = "0"
        gpu_trace.start(run_dir)
    if config in ("op-2s", "op-eager"):
        from gpu_trace.framework_patches.torch import ops

        ops.PAUSE_S = 0.0
        if config == "op-2s":
            ops.HARVEST_INTERVAL_S, ops.MAX_WAIT_S = 2.0, 0.0
    step = make_step(model)
    for _ in range(WARMUP):
        step()
    ctx: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if config == "torch.profiler":
        cpu = torch.profiler.ProfilerActivity.CPU
        ctx = torch.profiler.profile(activities=[cpu], record_shapes=False)
    times, cpu, proc = [], [], []
    ctx.__enter__()
    for _ in range(steps):
        t, c, p = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        step()
        times.append(time.perf_counter_ns() - t)
        cpu.append(time.thread_time_ns() - c)
        proc.append(time.process_time_ns() - p)
    t, p = time.perf_counter_ns(), time.process_time_ns()
    ctx.__exit__(None, None, None)
    if recording:
        gpu_trace.stop()  # the recorder's last flush
    stop_ns, stop_cpu = time.perf_counter_ns() - t, time.process_time_ns() - p
    with open(out, "w") as f:
        json.dump({"steps": times, "cpu": cpu, "proc": proc, "stop": [stop_ns, stop_cpu]}, f)


# ---- the driver -----------------------------------------------------------------------------------


def run(model: str, steps: int, config: str, tmp: str) -> dict[str, float]:
    out = os.path.join(tmp, "out.json")
    run_dir = os.path.join(tmp, "run")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--models", model]
    cmd += ["--steps", str(steps), "--out", out, "--run-dir", run_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"{config} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    shutil.rmtree(run_dir, ignore_errors=True)
    with open(out) as f:
        got = json.load(f)
    os.remove(out)

    def windows(times: list[int]) -> float:
        w = [sum(times[i : i + WINDOW]) for i in range(0, len(times) - WINDOW + 1, WINDOW)]
        return max(w) / statistics.median(w) if w else float("nan")

    n = len(got["steps"])
    return {
        "step": sum(got["steps"]) / n / 1e9,
        "cpu": sum(got["cpu"]) / n / 1e9,
        "window": windows(got["steps"]),
        "window_cpu": windows(got["cpu"]),
        "stop": got["stop"][0] / 1e9,
        "total": (sum(got["proc"]) + got["stop"][1]) / 1e9,
        "stderr_lines": len([ln for ln in proc.stderr.splitlines() if "profiler_st" in ln]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--models", default="sine,transformer")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="one round of 20 steps: a smoke run")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.models, args.steps, args.worker, args.out, args.run_dir)
        return
    if args.quick:
        args.rounds, args.steps = 1, 20
    configs = args.configs.split(",")
    print(f"{args.rounds} rounds, {args.steps} steps each, load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            got: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
            for r in range(args.rounds):
                order = configs[r % len(configs) :] + configs[: r % len(configs)]
                for config in order:
                    got[config].append(run(model, args.steps, config, tmp))
            report(model, configs, got)


def report(model: str, configs: list[str], got: dict[str, list[dict[str, float]]]) -> None:
    plain = got.get("plain")
    print(f"\n{model}")
    print(
        f"{'configuration':15} {'step ms':>8} {'x plain':>8} {'cpu x':>6} {'window':>7} "
        f"{'cpu window':>10} {'stop s':>7} {'total x':>8} {'stderr':>6}"
    )
    for c in configs:
        rows = got[c]

        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        def ratio(key: str, rows: list[dict[str, float]] = rows) -> float:
            if not plain:
                return float("nan")
            return statistics.median(r[key] / p[key] for r, p in zip(rows, plain))

        print(
            f"{c:15} {med('step') * 1e3:8.2f} {ratio('step'):8.2f} {ratio('cpu'):6.2f} "
            f"{max(r['window'] for r in rows):7.2f} {max(r['window_cpu'] for r in rows):10.2f} "
            f"{med('stop'):7.2f} {ratio('total'):8.2f} {max(r['stderr_lines'] for r in rows):6.0f}"
        )


if __name__ == "__main__":
    main()
