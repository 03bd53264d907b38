"""What the server's GPU activity capture costs (runtime/server/device_activity.py), in one run.

    python bench/server_gpu_activity.py [--rounds 5] [--steps 30] [--ops-per-batch 20]

1. The executor's side, on the CPU device (no GPU needed): traced forwarded training steps of a
   small MLP (a real server on loopback, a real client recording a run), with capture off and
   on (on: op span ids at record time and one append per batch; the source has no records, so
   this is what every batch pays whatever the GPU does). Interleaved rounds, alternating which
   goes first; median step time of each and their ratio.
2. The conversion thread: synthetic activity records laid in executed ops (a CUDA call in each
   op and its kernel, as a CUDA server's would be), read from the activity file, converted under
   the ops and routed to their sessions (``DeviceActivity.poll``), beside the conversion alone
   (``conversion.convert``) on the same records: records per second of each.

The machine may be shared and loaded: ratios within one run are what mean something.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers' way

TOKEN = "bench-gpu-activity-token-01"


def _steps(activity_on: bool, steps: int, tmp: Path) -> float:
    """Median seconds of one traced forwarded training step."""
    import torch

    import gpu_trace
    from gpu_trace import runtime
    from gpu_trace.runtime.server.activity_tail import FileSource
    from gpu_trace.runtime.server.device_activity import DeviceActivity
    from gpu_trace.runtime.server.server import Server

    activity = DeviceActivity(FileSource(tmp / "act")) if activity_on else None
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    times = []
    with Server("127.0.0.1:0", token=TOKEN, gpu_activity=activity) as server:
        gpu_trace.start(run_dir)
        try:
            dev = runtime.connect(server.address, token=TOKEN)
            try:
                model = torch.nn.Sequential(
                    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
                ).to(dev)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                x, y = torch.randn(64, 32).to(dev), torch.zeros(64, 1).to(dev)
                for i in range(steps + 3):
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    loss.item()
                    if i >= 3:  # warm-up
                        times.append(time.perf_counter() - t0)
            finally:
                runtime.disconnect()
        finally:
            gpu_trace.stop()
    return statistics.median(times)


def _laid(n_batches: int, ops: int, pid: int) -> tuple[list, np.ndarray]:
    """Executed batches (the executor's view) and records inside their ops."""
    from gpu_trace.collectors.gpu_activity import activity as act

    batches = []
    records = act.empty(2 * n_batches * ops)
    t, corr = 1_000_000, 0
    for b in range(n_batches):
        op_spans = []
        start = t
        for o in range(ops):
            op_id = (b + 1) * 1000 + o + 1
            op_spans.append((op_id, t, t + 10_000))
            api, kernel = records[2 * corr], records[2 * corr + 1]
            api["kind"], api["pid"], api["tid"] = act.RUNTIME, pid, threading.get_native_id()
            api["start"], api["end"], api["correlation"], api["code"] = (
                t + 2000,
                t + 6000,
                corr + 1,
                211,
            )
            kernel["kind"], kernel["pid"], kernel["stream"] = act.CONCURRENT_KERNEL, pid, 7
            kernel["start"], kernel["end"], kernel["correlation"] = t + 7000, t + 12_000, corr + 1
            corr += 1
            t += 10_000
        batches.append(((b + 1) * 1000, start, t, op_spans))
        t += 5_000
    return batches, records


def _peer_parents(batches: list, pid: int) -> object:
    """The same parents the server builds, for the conversion alone."""
    from gpu_trace.collectors.gpu_activity.conversion import Parents

    rows = []
    for b in batches:
        rows.append((b.tid, 1, b.execute_id, 0, b.start, b.end, 1))
        rows += [(b.tid, 0, i, b.execute_id, t0, t1, 2) for i, t0, t1 in b.ops]
    a = np.array(rows, np.int64)
    u = np.uint64
    return Parents(
        np.full(len(a), pid, np.int64), a[:, 0].astype(u), a[:, 1], a[:, 2].astype(u),
        a[:, 3].astype(u), a[:, 4], a[:, 5], a[:, 6],
    )  # fmt: skip


def _conversion(n_batches: int, ops: int, rounds: int) -> tuple[float, float, int]:
    from gpu_trace.collectors.gpu_activity import activity_file
    from gpu_trace.collectors.gpu_activity.conversion import convert
    from gpu_trace.runtime.server.activity_tail import FileSource
    from gpu_trace.runtime.server.device_activity import DeviceActivity
    from gpu_trace.runtime.sharing.sessions import Session

    pid = os.getpid()
    batches, records = _laid(n_batches, ops, pid)
    blob = activity_file.encode(records, {0: "gemm"})
    routed, alone = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as d:
            session = Session({"host": "bench", "trace": "1"}, lambda *a: None)
            activity = DeviceActivity(FileSource(d), pid=pid)
            for execute_id, t0, t1, op_spans in batches:
                named = [("aten::mm", a, b) for _, a, b in op_spans]
                activity.batch(session, execute_id, t0, t1, named, [i for i, _, _ in op_spans])
            path = Path(d) / "spool" / f"{activity_file.PREFIX}{pid}-b{activity_file.SUFFIX}"
            activity_file.write(path, blob)
            t = time.perf_counter()
            made = activity.poll()
            routed.append(time.perf_counter() - t)
            assert made == len(records), (made, len(records), activity.counts)
            parents = _peer_parents(activity.batches(), pid)
            t = time.perf_counter()
            convert(records, {0: "gemm"}, parents=parents)
            alone.append(time.perf_counter() - t)
    n = len(records)
    return n / statistics.median(routed), n / statistics.median(alone), n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--ops-per-batch", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("GPU_TRACE_NVTX", "off")
    off, on = [], []
    with tempfile.TemporaryDirectory() as d:
        os.environ["GPU_TRACE_HOME"] = d
        for i in range(args.rounds):  # interleaved, alternating which goes first
            for activity_on in (False, True) if i % 2 == 0 else (True, False):
                (on if activity_on else off).append(_steps(activity_on, args.steps, Path(d)))
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(
        f"traced forwarded step, capture off: median {m_off * 1e3:.2f} ms "
        f"(rounds {', '.join(f'{x * 1e3:.2f}' for x in off)})"
    )
    print(
        f"traced forwarded step, capture on:  median {m_on * 1e3:.2f} ms "
        f"(rounds {', '.join(f'{x * 1e3:.2f}' for x in on)})"
    )
    print(f"  on/off: {m_on / m_off:.3f}")
    routed, alone, n = _conversion(args.batches, args.ops_per_batch, args.rounds)
    print(
        f"{n} records: read, converted under ops and routed to sessions: {routed / 1e6:.2f} M/s; "
        f"conversion alone: {alone / 1e6:.2f} M/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
