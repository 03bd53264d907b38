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

Configurations, each in a fresh process: ``plain``; ``module`` (``gpu-trace record --torch
module``); ``op`` (``gpu-trace record --torch op``); ``op-2s`` (op level with 2 s sessions
converted at the flusher's interval, as before sessions were made short: the same code with
``HARVEST_INTERVAL_S = 2`` and ``MAX_WAIT_S = 0``); ``torch.profiler`` (one
``torch.profiler.profile(activities=[CPU])`` around the same steps, record_shapes off). Recording
runs with ``--no-nvml --host-hz 0 --no-ingest`` (the bench looks at the PyTorch side only).

Reported per configuration, as medians over rounds (configurations interleaved in rounds, order
rotated each round; each ratio is to ``plain`` in the same round):

- ``step``: the mean step (wall time of the measured steps / steps), and its ratio to plain;
- ``window max/med``: the steps in windows of 10, the longest window over the median one (a stall
  shows here; 1.5 is the target);
- ``stop s``: what leaving took after the last step (torch.profiler building its results; the
  recorder's last flush, which converts the last sessions), and ``total``: the ratio to plain of
  steps plus leaving, the cost of profiling a fixed amount of work end to end.

The machine is shared: read ratios, not times, and compare only figures of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

WINDOW = 10
WARMUP = 3
CONFIGS = ("plain", "module", "op", "op-2s", "torch.profiler")


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


def worker(model: str, steps: int, config: str, out: str) -> None:
    import contextlib

    import torch

    if config == "op-2s":
        from gpu_trace.framework_patches.torch import ops

        ops.HARVEST_INTERVAL_S, ops.MAX_WAIT_S = 2.0, 0.0
    step = make_step(model)
    for _ in range(WARMUP):
        step()
    ctx: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if config == "torch.profiler":
        cpu = torch.profiler.ProfilerActivity.CPU
        ctx = torch.profiler.profile(activities=[cpu], record_shapes=False)
    times = []
    ctx.__enter__()
    for _ in range(steps):
        t = time.perf_counter_ns()
        step()
        times.append(time.perf_counter_ns() - t)
    t = time.perf_counter_ns()
    ctx.__exit__(None, None, None)
    if config in ("module", "op", "op-2s"):
        import gpu_trace

        gpu_trace.stop()  # the recorder's last flush, timed here rather than at exit
    stop_ns = time.perf_counter_ns() - t
    with open(out, "w") as f:
        json.dump({"steps": times, "stop_ns": stop_ns}, f)


# ---- the driver -----------------------------------------------------------------------------------


def run(model: str, steps: int, config: str, tmp: str) -> dict[str, float]:
    out = os.path.join(tmp, "out.json")
    me = [sys.executable, os.path.abspath(__file__), "--worker", config, "--models", model]
    me += ["--steps", str(steps), "--out", out]
    if config in ("plain", "torch.profiler"):
        cmd = me
    else:
        level = "module" if config == "module" else "op"
        run_dir = os.path.join(tmp, f"run-{time.monotonic_ns()}")
        cmd = ["gpu-trace", "record", "--torch", level, "--no-nvml", "--host-hz", "0"]
        cmd += ["--no-ingest", "--run-dir", run_dir, "--", *me]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"{config} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    with open(out) as f:
        got = json.load(f)
    os.remove(out)
    for d in os.listdir(tmp):
        if d.startswith("run-"):
            subprocess.run(["rm", "-rf", os.path.join(tmp, d)], check=False)
    times = got["steps"]
    windows = [sum(times[i : i + WINDOW]) for i in range(0, len(times) - WINDOW + 1, WINDOW)]
    return {
        "step": sum(times) / len(times) / 1e9,
        "window": max(windows) / statistics.median(windows) if windows else float("nan"),
        "stop": got["stop_ns"] / 1e9,
        "total": (sum(times) + got["stop_ns"]) / 1e9,
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
    args = ap.parse_args()
    if args.worker:
        worker(args.models, args.steps, args.worker, args.out)
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
        f"{'configuration':16} {'step ms':>8} {'x plain':>8} {'window max/med':>15} "
        f"{'stop s':>7} {'total x':>8} {'stderr lines':>13}"
    )
    for c in configs:
        rows = got[c]

        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        ratio = total = float("nan")
        if plain:
            ratio = statistics.median(r["step"] / p["step"] for r, p in zip(rows, plain))
            total = statistics.median(r["total"] / p["total"] for r, p in zip(rows, plain))
        print(
            f"{c:16} {med('step') * 1e3:8.2f} {ratio:8.2f} {max(r['window'] for r in rows):15.2f} "
            f"{med('stop'):7.2f} {total:8.2f} {max(r['stderr_lines'] for r in rows):13.0f}"
        )


if __name__ == "__main__":
    main()
