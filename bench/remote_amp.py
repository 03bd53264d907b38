"""What CUDA's autocast costs a forwarded op on the client (runtime/client/autocast.py), in one run.

    python bench/remote_amp.py [--ops 200] [--rounds 31]

Starts `gpu-trace serve` on the CPU device and times, per op, the client's issue of forwarded ops
with autocast off and on (``torch.autocast("remote", float16)``), in interleaved rounds of
``--ops`` ops (below the send window, so the server's speed is not measured), synchronized
between rounds; medians, ratios and differences:

- ``mm`` of float16 tensors: the Python autocast kernel alone (nothing to cast, the same op is
  forwarded);
- ``linear`` of float32 tensors: the kernel and its three casts (three more forwarded ops; a
  weight's cast would be cached, these are not leaves);
- ``add`` (in no autocast list: falls through, no kernel): the floor, off vs on.

The machine is shared and noisy: ratios within one run are what mean something.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

TOKEN = "bench-remote-amp-token-01"


def _serve() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0", "--device", "cpu"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if "serving cpu on" not in line:
        raise SystemExit(f"the server did not start: {line}")
    return proc, line.split(" on ")[1].split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=200, help="ops per round (default 200)")
    parser.add_argument("--rounds", type=int, default=31, help="rounds per case (default 31)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from gpu_trace import runtime

    proc, address = _serve()
    try:
        dev = runtime.connect(address, token=TOKEN)
        h16 = torch.randn(8, 8).to(dev).half()
        x, w, b = torch.randn(8, 8).to(dev), torch.randn(8, 8).to(dev), torch.randn(8).to(dev)
        cases: dict[str, Callable[[], object]] = {
            "mm fp16 (kernel only)": lambda: torch.mm(h16, h16),
            "linear fp32 (kernel + 3 casts)": lambda: F.linear(x, w, b),
            "add (no kernel)": lambda: torch.add(x, x),
        }

        def per_op_us(fn: Callable[[], object], on: bool) -> float:
            with torch.autocast("remote", dtype=torch.float16, enabled=on):
                t0 = time.perf_counter_ns()
                for _ in range(args.ops):
                    fn()
                t1 = time.perf_counter_ns()
            runtime.synchronize()
            return (t1 - t0) / args.ops / 1000

        for fn in cases.values():  # plans and templates made before timing
            per_op_us(fn, False)
            per_op_us(fn, True)
        times: dict[tuple[str, bool], list[float]] = {(n, on): [] for n in cases for on in (0, 1)}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                for on in (False, True):
                    times[(name, on)].append(per_op_us(fn, on))
        print(f"client issue time per forwarded op, median of {args.rounds} rounds of {args.ops}")
        for name in cases:
            off = statistics.median(times[(name, False)])
            on_ = statistics.median(times[(name, True)])
            print(
                f"  {name:32s} off {off:6.2f} us  autocast {on_:6.2f} us  "
                f"ratio {on_ / off:4.2f}  +{on_ - off:5.2f} us"
            )
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (shared machine)")
    finally:
        runtime.disconnect()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


if __name__ == "__main__":
    main()
