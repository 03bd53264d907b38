"""GPU activity: what capture costs a launch-bound training step, and how fast records become spans.

    python bench/gpu_activity.py [--scale 150] [--rounds 5]      # any machine: conversion, ingest
    python bench/gpu_activity.py --gpu [--steps 60] [--rounds 3]  # a GPU machine: capture cost
    ... [--capture-rounds N] [--json FILE]                         # rounds of the GPU part; figures

Without a GPU (and always, first): the real H100 records (tests/data/cupti-h100-lm.jsonl.gz,
13,329 records) repeated ``--scale`` times with fresh correlation ids (two million records at 150),
taken the road a live capture takes after CUPTI: activity file bytes -> reader -> conversion to
spans (with the same number of recorder spans as candidate parents as the H100 op-level run has
per API call) -> Arrow spool file. Peers in the same run, interleaved rounds: the conversion alone
and the whole road; records per second, median of the rounds (target: 2 M/s for the conversion).

With ``--gpu``: the launch-bound language model of ../shared/gpu/README.md (6 encoder layers,
d=512, batch 16 x 256, AdamW; about 440 kernels and 19.6 ms per step on an H100) in a fresh
process per mode and round, modes interleaved: plain; with GPU activity (the injection library in
CUDA_INJECTION64_PATH, exactly as ``gpu-trace record`` sets it); under torch.profiler with CPU and
CUDA activities. Per mode: median step, ratio to plain, and the worst window of 5 steps against the
median (a stall shows there). Targets: capture at most +5%, no window above 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "cupti-h100-lm.jsonl.gz"


# ---- conversion and ingest (any machine) ---------------------------------------------------------


def conversion(scale: int, rounds: int) -> dict[str, object]:
    """Print the conversion's rates; return them (records per second per mode, each round)."""
    from gpu_trace.collectors.gpu_activity import activity_file
    from gpu_trace.collectors.gpu_activity.conversion import Parents, convert
    from gpu_trace.collectors.gpu_activity.replay_file import read_replay
    from gpu_trace.tracer.spool import SpoolWriter

    one, names, _ = read_replay(DATA)
    records = np.tile(one, scale)
    step = int(one["correlation"].max()) + 1
    records["correlation"] = np.repeat(
        np.arange(scale, dtype=np.uint32), len(one)
    ) * step + np.tile(one["correlation"], scale)
    span = int(one["end"].max() - one["start"].min()) + 1
    shift = np.repeat(np.arange(scale, dtype=np.int64), len(one)) * span
    records["start"] += shift
    records["end"] += shift
    # candidate parents: one op around each API call on its thread (the op-level run's density)
    api = np.isin(records["kind"], (4, 5))
    n_ops = int(api.sum())
    parents = Parents(
        pid=records["pid"][api].astype(np.int64),
        tid=records["tid"][api].astype(np.uint64),
        lane=np.zeros(n_ops, np.int64),
        span_id=np.arange(1, n_ops + 1, dtype=np.uint64),
        parent_span_id=np.zeros(n_ops, np.uint64),
        start=records["start"][api] - 5,
        end=records["end"][api] + 5,
        depth=np.zeros(n_ops, np.int64),
    )
    blob = activity_file.encode(records, names, [(int(one["start"].min()), 10**9)])
    print(
        f"conversion: {len(records):,} records ({scale} x the H100 file), {n_ops:,} recorder spans;"
        f" {os.cpu_count()} CPUs, shared with other work: figures are this run's only",
        flush=True,
    )
    results: dict[str, list[float]] = {"convert": [], "file -> spans -> spool": []}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "gpu_activity-1-x.bin"
        path.write_bytes(blob)
        for r in range(rounds):
            order = list(results)
            random.shuffle(order)
            for mode in order:
                t0 = time.perf_counter()
                if mode == "convert":
                    convert(
                        records,
                        names,
                        anchors=np.array([[int(one["start"].min()), 10**9]]),
                        parents=parents,
                    )
                else:
                    data = activity_file.read([path])
                    conv = convert(data.records, data.names, anchors=data.anchors, parents=parents)
                    SpoolWriter(Path(d) / f"run{r}", {"pid": "1", "run_id": "b"}).write(
                        "spans", conv.table
                    )
                results[mode].append(len(records) / (time.perf_counter() - t0))
    base = statistics.median(results["convert"])
    for mode, rates in results.items():
        med = statistics.median(rates)
        print(
            f"  {mode:<24} {med / 1e6:6.2f} M records/s (median of {rounds};"
            f" min {min(rates) / 1e6:.2f}, max {max(rates) / 1e6:.2f}; {med / base:.2f}x convert)",
            flush=True,
        )
    return {"records": len(records), "scale": scale, "records_per_s": results}


# ---- capture cost (GPU machine) -------------------------------------------------------------------

WORKER = r"""
import json, sys, time, torch, torch.nn as nn
mode, steps, warmup = sys.argv[1], int(sys.argv[2]), 10
count = sys.argv[3:4] == ["count"]
torch.manual_seed(0)
dev = "cuda"
class LM(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(8192, 512)
        layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, norm_first=True)
        s.enc = nn.TransformerEncoder(layer, 6)
        s.head = nn.Linear(512, 8192)
    def forward(s, x):
        return s.head(s.enc(s.emb(x)))
model = LM().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, 8192, (16, 256), device=dev)
y = torch.randint(0, 8192, (16, 256), device=dev)
def step():
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
for _ in range(warmup):
    step()
torch.cuda.synchronize()
times = []
out = {}
def timed():
    out["t0"] = time.monotonic_ns()
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter_ns() - t0)
    out["t1"] = time.monotonic_ns()
if mode == "profiler":
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed()
    if count:
        out["kernels"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA"
                             and "Memcpy" not in e.name and "Memset" not in e.name)
else:
    timed()
out["times"] = times
print(json.dumps(out))
"""


def captured_kernels(run_dir: Path, t0: int, t1: int) -> tuple[int, int]:
    """Kernel records in ``run_dir``'s activity files that start within ``[t0, t1]``
    (CLOCK_MONOTONIC), and the records CUPTI said it dropped."""
    from gpu_trace.collectors.gpu_activity import activity, activity_file
    from gpu_trace.collectors.gpu_activity.conversion import to_monotonic
    from gpu_trace.tracer.spool import spool_dir

    data = activity_file.read(activity_file.activity_files(spool_dir(run_dir)))
    kernels = data.records[data.records["kind"] == activity.CONCURRENT_KERNEL]
    start = to_monotonic(kernels["start"], data.anchors)
    return int(((start >= t0) & (start <= t1)).sum()), int(data.dropped)


def capture_cost(
    steps: int, rounds: int, report: dict[str, object], save: Callable[[], None]
) -> None:
    """The GPU part: interleaved rounds of the three modes; figures into ``report["capture"]``,
    ``save()`` after every round."""
    from gpu_trace import config
    from gpu_trace.collectors.gpu_activity import library

    inject, why = library.injection_env(config.home() / "lib", cc=config.c_compiler())
    if not inject:
        print(f"capture cost: not measured: {why}")
        report["capture"] = {"skipped": f"not measured: {why}"}
        save()
        return
    modes = ["plain", "gpu activity", "profiler"]
    times: dict[str, list[int]] = {m: [] for m in modes}
    windows: dict[str, list[float]] = {m: [] for m in modes}
    medians: dict[str, list[float]] = {m: [] for m in modes}
    kernels: dict[str, int] = {}
    capture: dict[str, object] = {
        "steps": steps,
        "rounds": 0,
        "round_median_ms": medians,
        "worst_window": windows,
        "kernels": kernels,
    }
    report["capture"] = capture
    for r in range(rounds):
        order = modes[:]
        random.shuffle(order)
        for mode in order:
            count = r == 0 and mode != "plain"
            with tempfile.TemporaryDirectory() as run_dir:
                env = dict(os.environ)
                if mode == "gpu activity":
                    env.update(inject)
                    env["GPU_TRACE_RUN_DIR"] = run_dir
                arg = "profiler" if mode == "profiler" else "plain"
                out = subprocess.run(
                    [sys.executable, "-c", WORKER, arg, str(steps), *(["count"] if count else [])],
                    capture_output=True, text=True, env=env, timeout=600, check=True,
                )  # fmt: skip
                res = json.loads(out.stdout.strip().splitlines()[-1])
                if count and mode == "gpu activity":
                    kernels[mode], kernels["dropped"] = captured_kernels(
                        Path(run_dir), res["t0"], res["t1"]
                    )
            if count and mode == "profiler":
                kernels[mode] = res["kernels"]
            t = res["times"]
            times[mode] += t
            med = statistics.median(t)
            medians[mode].append(med / 1e6)
            windows[mode].append(
                max(statistics.mean(t[i : i + 5]) for i in range(len(t) - 4)) / med
            )
        capture["rounds"] = r + 1
        save()
    plain = statistics.median(times["plain"])
    print(f"capture cost: {steps} steps x {rounds} rounds per mode, interleaved")
    for mode in modes:
        med = statistics.median(times[mode])
        print(
            f"  {mode:<13} median step {med / 1e6:7.2f} ms  {med / plain:5.2f}x plain"
            f"  worst 5-step window {max(windows[mode]):.2f}x median"
        )
    if "gpu activity" in kernels and "profiler" in kernels:
        print(
            f"  kernels in the {steps} timed steps: captured {kernels['gpu activity']:,},"
            f" torch.profiler {kernels['profiler']:,}; CUPTI dropped {kernels['dropped']:,} records"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--capture-rounds", type=int, help="the GPU part's (default: rounds//2+1)")
    parser.add_argument("--json", type=Path, help="also write the figures here, as JSON")
    args = parser.parse_args()
    report: dict[str, object] = {}

    def save() -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1))

    report["conversion"] = conversion(args.scale, args.rounds)
    save()
    if args.gpu:
        rounds = args.capture_rounds or max(1, args.rounds // 2 + 1)
        capture_cost(args.steps, rounds, report, save)
    else:
        print("capture cost: not measured (no --gpu; it needs an NVIDIA GPU and CUDA PyTorch)")
        report["capture"] = {"skipped": "not measured (no --gpu)"}
        save()


if __name__ == "__main__":
    main()
