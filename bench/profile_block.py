"""What a ``gpu_trace.profile()`` block costs: its start, its body, its end, with peers.

    python bench/profile_block.py [--steps 100] [--rounds 7]

The same training steps of a small MLP on the CPU (one torch thread), run five ways in one
process, interleaved, ``--rounds`` times: bare (no recording), then in a ``profile()`` block
without samplers and NVTX, without samplers, with samplers and NVTX off, and with the defaults.
For each it prints the medians of the block's start (``__enter__``), its body (wall and this
process's CPU time, the ratio against bare) and its end (``__exit__``: flush, samplers, ingest).
The samplers run in a process of their own, so their CPU is not in the body's; on a machine with
few cores they still compete for it. GPU_TRACE_HOME is a temporary directory. The machine this
runs on is often shared: read ratios and orders of magnitude.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

VARIANTS: dict[str, dict[str, object] | None] = {
    "bare": None,
    "no samplers, nvtx off": {"nvml": False, "host": False, "nvtx": "off"},
    "no samplers": {"nvml": False, "host": False},
    "samplers, nvtx off": {"nvtx": "off"},
    "default": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    os.environ["GPU_TRACE_HOME"] = tempfile.mkdtemp(prefix="gpu-trace-bench-")

    import torch
    from torch import nn

    import gpu_trace

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def train(n: int) -> None:
        for i in range(n):
            gpu_trace.step(i)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    with gpu_trace.profile():  # first use: builds the C libraries, opens the store
        train(2)
    results: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in VARIANTS}
    for _ in range(args.rounds):
        for name, kwargs in VARIANTS.items():
            if kwargs is None:
                t, c = time.perf_counter(), time.process_time()
                train(args.steps)
                results[name].append((0.0, time.perf_counter() - t, time.process_time() - c, 0.0))
                continue
            t0 = time.perf_counter()
            block = gpu_trace.profile(**kwargs)  # type: ignore[arg-type]
            block.__enter__()
            t1, c = time.perf_counter(), time.process_time()
            train(args.steps)
            cpu, t2 = time.process_time() - c, time.perf_counter()
            block.__exit__(None, None, None)
            results[name].append((t1 - t0, t2 - t1, cpu, time.perf_counter() - t2))
    base = statistics.median(r[2] for r in results["bare"])
    print(
        f"{args.steps} steps, {args.rounds} rounds, medians; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':24} {'enter':>8} {'body wall':>10} {'body cpu':>9} {'x bare':>7} {'exit':>8}")
    for name, rows in results.items():
        enter, wall, cpu, leave = (statistics.median(c) for c in zip(*rows))
        print(f"{name:24} {enter:7.3f}s {wall:9.3f}s {cpu:8.3f}s {cpu / base:7.2f} {leave:7.3f}s")


if __name__ == "__main__":
    main()
