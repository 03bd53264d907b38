"""The pager's bandwidth, page-out and restore, against a plain copy of the same bytes in the same
run.

    python bench/paging.py [--mb 64 256] [--tensor-mb 16] [--rounds 5] [--device cuda:0|cpu]
                          [--out results.json]

A server in this process (``cuda:0`` where there is a GPU, else the CPU device, which the title
says) and the forwarding client; the session holds ``--mb`` MiB in tensors of ``--tensor-mb`` MiB.
Each round, interleaved:

- **plain**: every one of those storages copied device to host into pinned buffers made once
  before the rounds (the best case: no allocation), then host to device into a scratch buffer, on
  a stream of its own; CUDA event times. On the CPU device: the same copies between host buffers.
- **pager**: ``request_page_out`` (its copies' time from the pager's CUDA events, and the whole
  call by the wall clock: the pinned buffers' allocation, the copies, re-pointing the tensors),
  then one op of the session, which brings everything back, and the restore's own time.

It prints the median bandwidth of each (GB/s, bytes over time) and the pager's over the plain
copy's. The first round's page-out is reported apart: it allocates its pinned buffers with
``cudaHostAlloc``; later ones reuse PyTorch's cached pinned blocks (the pager's buffers go back to
that cache when a restore drops them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TOKEN = "bench-pager-token-0123456789"


def _plain_round(torch: Any, storages: list[Any], hosts: list[Any], scratch: Any, cuda: bool):
    """Plain copies of ``storages``: (device to host ns, host to device ns)."""
    sources = [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s) for s in storages]
    if not cuda:
        t0 = time.perf_counter_ns()
        for src, host in zip(sources, hosts):
            host.copy_(src)
        t1 = time.perf_counter_ns()
        for host in hosts:
            scratch[: host.numel()].copy_(host)
        return t1 - t0, time.perf_counter_ns() - t1
    side = torch.cuda.Stream(scratch.device)
    side.wait_stream(torch.cuda.current_stream(scratch.device))
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    marks[0].record(side)
    with torch.cuda.stream(side):
        for src, host in zip(sources, hosts):
            host.copy_(src, non_blocking=True)
        marks[1].record(side)
        for host in hosts:
            scratch[: host.numel()].copy_(host, non_blocking=True)
        marks[2].record(side)
    marks[2].synchronize()
    ms = 1e6
    return int(marks[0].elapsed_time(marks[1]) * ms), int(marks[1].elapsed_time(marks[2]) * ms)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gpu_trace import runtime
    from gpu_trace.runtime.server.server import Server

    cuda = torch.cuda.is_available()
    device = args.device or ("cuda:0" if cuda else "cpu")
    cuda = device.startswith("cuda")
    where = (
        f"{device} ({torch.cuda.get_device_name(device)})"
        if cuda
        else "no GPU here: the CPU device (paging is a host copy there, never pinned)"
    )
    gb = 1e9
    rows, results = [], []
    for mb in args.mb:
        with Server("127.0.0.1:0", token=TOKEN, device=device, idle_s=None) as server:
            dev = runtime.connect(server.address, token=TOKEN)
            try:
                n = max(1, mb // args.tensor_mb)
                numel = args.tensor_mb * (1 << 20) // 4
                tensors = [torch.full((numel,), float(i)).to(dev) for i in range(n)]
                runtime.synchronize()
                (session,) = server.sessions.values()
                pager = server.pager
                storages = [session.handles.get(t._rt.id).untyped_storage() for t in tensors]
                nbytes = sum(s.nbytes() for s in storages)
                hosts = [
                    torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=cuda) for s in storages
                ]
                scratch = torch.empty(max(s.nbytes() for s in storages), dtype=torch.uint8,
                                      device=device)  # fmt: skip
                del storages
                plain_out, plain_in, out_copy, out_all, back = [], [], [], [], []
                for _ in range(args.rounds):
                    with server.executor.lock:
                        live = [session.handles.get(t._rt.id).untyped_storage() for t in tensors]
                        d2h, h2d = _plain_round(torch, live, hosts, scratch, cuda)
                        del live
                    plain_out.append(d2h)
                    plain_in.append(h2d)
                    runtime.synchronize()
                    assert pager.request_page_out(session, reason="bench") > 0
                    stats = pager.page_outs[-1]
                    out_copy.append(stats.copy_ns)
                    out_all.append(stats.all_ns)
                    tensors[0].add_(0.0)  # brings the session back
                    runtime.synchronize()
                    with server.executor.lock:
                        pager.settle(session, wait=True)
                    back.append(pager.restores[-1].all_ns)
                assert all(t[-1].item() == float(i) for i, t in enumerate(tensors))
            finally:
                runtime.disconnect()

        def bw(ns: list[int], nbytes: int = nbytes) -> float:
            return nbytes / (statistics.median(ns) / 1e9) / gb

        result = {
            "mb": nbytes / (1 << 20),
            "tensors": n,
            "plain_out_gbps": bw(plain_out),
            "plain_in_gbps": bw(plain_in),
            "page_out_copy_gbps": bw(out_copy),
            "page_out_call_gbps": bw(out_all[1:] or out_all),
            "page_out_first_call_gbps": nbytes / (out_all[0] / 1e9) / gb,
            "restore_gbps": bw(back),
            "rounds_ns": {
                "plain_out": plain_out,
                "plain_in": plain_in,
                "page_out_copy": out_copy,
                "page_out_call": out_all,
                "restore": back,
            },
        }
        result["page_out_over_plain"] = result["page_out_copy_gbps"] / result["plain_out_gbps"]
        result["restore_over_plain"] = result["restore_gbps"] / result["plain_in_gbps"]
        results.append(result)
        rows.append(
            [
                f"{result['mb']:.0f} MiB / {n}",
                f"{result['plain_out_gbps']:.2f}",
                f"{result['page_out_copy_gbps']:.2f} ({result['page_out_over_plain']:.2f}x)",
                f"{result['page_out_call_gbps']:.2f}",
                f"{result['page_out_first_call_gbps']:.2f}",
                f"{result['plain_in_gbps']:.2f}",
                f"{result['restore_gbps']:.2f} ({result['restore_over_plain']:.2f}x)",
            ]
        )
    return {
        "title": (
            f"pager bandwidth, {where}; GB/s, median of {args.rounds} interleaved rounds "
            "(ratios: pager over the plain copy)"
        ),
        "columns": [
            "held / tensors",
            "plain D2H",
            "page-out copies",
            "page-out call",
            "first page-out call",
            "plain H2D",
            "restore",
        ],
        "rows": rows,
        "results": results,
    }


def _print(table: dict[str, Any]) -> None:
    cols = table["columns"]
    widths = [max(len(c), *(len(r[i]) for r in table["rows"])) for i, c in enumerate(cols)]
    print(table["title"])
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in table["rows"]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, nargs="+", default=[64, 256], help="MiB the session holds")
    ap.add_argument("--tensor-mb", type=int, default=16, help="MiB per tensor")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", help="default: cuda:0 where there is a GPU, else cpu")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.tensor_mb < 1 or min(args.mb) < 1:
        ap.error("--rounds, --tensor-mb and --mb must be at least 1")
    table = run(args)
    _print(table)
    if args.out is not None:
        args.out.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
