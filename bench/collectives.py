"""What recording costs a collective: a loop of ``all_reduce`` under torchrun (gloo, 2 ranks),
plain, under ``gpu-trace record`` at module level (the default) and at op level, in one run.

    python bench/collectives.py [--rounds 5] [--iters 300] [--floats 1024]

Each configuration is a whole torchrun job of two local ranks (``python -m
torch.distributed.run --standalone --nproc-per-node 2``); the jobs are interleaved in rounds, the
order rotated each round, so the machine's other load falls on all of them alike. In each job
every rank runs ``--warmup`` all_reduces, a barrier, then ``--iters`` all_reduces of ``--floats``
float32s, each timed with ``time.perf_counter_ns`` around the call (which returns once the
collective is done on gloo); a rank's figure is the median over its iterations, a job's the
slower rank's. Figures: per configuration, the median over rounds of the job's median, its
p25-p75 over rounds, and the ratio to plain of the same round (median [p25-p75] over rounds).
Recording goes to a temporary GPU_TRACE_HOME, without NVML or host sampling and without ingest
(the spool is left: ingest happens after the program and costs it nothing). No thresholds:
the figures are for reading, beside the machine's load (``uptime``) printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROGRAM = """
import json, os, sys, time
import torch
import torch.distributed as dist

iters, warmup, floats, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo")
t = torch.ones(floats)
for _ in range(warmup):
    dist.all_reduce(t)
dist.barrier()
times = []
for _ in range(iters):
    t0 = time.perf_counter_ns()
    dist.all_reduce(t)
    times.append(time.perf_counter_ns() - t0)
times.sort()
with open(os.path.join(out, f"rank-{dist.get_rank()}.json"), "w") as f:
    json.dump(times[len(times) // 2], f)
dist.destroy_process_group()
"""

CONFIGS = ("plain", "module", "op")


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """p25, median, p75 (linear between the nearest ranks)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def job(config: str, prog: Path, args: argparse.Namespace, home: Path, out: Path) -> int:
    """One torchrun job of ``config``; the slower rank's median all_reduce in ns."""
    out.mkdir(parents=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(prog), str(args.iters), str(args.warmup),
                str(args.floats), str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
    env.update(OMP_NUM_THREADS="1")
    if config == "plain":
        argv = torchrun
    else:
        env["GPU_TRACE_HOME"] = str(home)
        argv = [sys.executable, "-m", "gpu_trace", "record", "--torch", config, "--no-nvml",
                "--host-hz", "0", "--no-ingest", "--", *torchrun]  # fmt: skip
    ran = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if ran.returncode != 0:
        raise SystemExit(f"{config} job failed ({ran.returncode}):\n{ran.stderr[-3000:]}")
    return max(json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--floats", type=int, default=1024)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-trace-bench-collectives-"))
    prog = work / "allreduce.py"
    prog.write_text(PROGRAM)
    got: dict[str, list[int]] = {c: [] for c in CONFIGS}
    for i in range(args.rounds):
        order = CONFIGS[i % len(CONFIGS) :] + CONFIGS[: i % len(CONFIGS)]
        for config in order:
            got[config].append(job(config, prog, args, work / "home", work / f"{config}-{i}"))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"all_reduce of {args.floats} float32 ({4 * args.floats} bytes), gloo, 2 local ranks: "
        f"{args.rounds} interleaved rounds of {args.iters} calls (after {args.warmup}); "
        f"per call, the slower rank's median"
    )
    print(f"load: {load}")
    print(f"{'CONFIG':<8} {'MEDIAN':>10} {'P25-P75':>20} {'RATIO TO PLAIN [P25-P75]':>28}")
    for config in CONFIGS:
        lo, mid, hi = quartiles([v / 1e3 for v in got[config]])
        ratios = [v / p for v, p in zip(got[config], got["plain"])]
        rlo, rmid, rhi = quartiles(ratios)
        print(
            f"{config:<8} {mid:>8.1f}µs {f'{lo:.1f}-{hi:.1f} µs':>20} "
            f"{f'{rmid:.2f} [{rlo:.2f}-{rhi:.2f}]':>28}"
        )


if __name__ == "__main__":
    main()
