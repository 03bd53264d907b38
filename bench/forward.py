"""Forwarded-op performance, next to torch.distributed.rpc on the same loopback, in one run.

    python bench/forward.py [--ops 20000] [--quick]

Starts its servers as separate processes (a `gpu-trace serve`-equivalent on the CPU device, with
``--isolation process`` by default, as `gpu-trace serve`, or ``shared``; one
with 0.5 ms held back on every received frame on each side, so 1 ms more round trip) and a
torch.distributed.rpc worker (TensorPipe), then measures:

1. peer: ``rpc_sync`` round trip of a small ``torch.add`` and ``rpc_async`` calls/s (all issued,
   then waited); and the floor of any Python round trip here: a bare TCP ping-pong of 100 bytes
   between two processes (blocking ``recv``, ``TCP_NODELAY``); and the floor of any op on a
   tensor subclass: a ``__torch_dispatch__`` that returns a new wrapper (or a prebuilt tensor);
2. forwarded small ops/s, asynchronous (``x = x + 1`` on a 16-element tensor, then one sync);
3. a synchronous op's round trip: the same op with ``sync=True``, and ``.item()`` of a sum;
4. with 1 ms added round trip: a small MLP training step, asynchronous vs ``sync=True``;
5. on loopback: a training step of an MLP with large matrices, remote (server on the CPU) vs the
   same step run locally on the CPU.

The round trips (the peer's ``rpc_sync``, the bare ping, ours) are measured twice: with the
processes wherever the kernel puts them, and with every process of the measurement pinned to
one CPU (``--one-cpu``, the default where there are several and the OS allows pinning). On the
2-vCPU VM this was built on, waking a process on the other, idle, vCPU costs about 40 µs each
way (the bare ping: 13-14 µs on one vCPU, 88-98 µs across two, same minutes): a round trip
across vCPUs measures the hypervisor's wake-up more than the software.

The machine is shared and noisy: ratios within one run are what mean something.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch

TOKEN = "bench-forward-token-0123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """This process on ``cpu`` (all of its threads, as they are created after), then as before."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _one_cpu() -> int | None:
    """The CPU to pin round-trip measurements to; None where that can't be done."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    return min(os.sched_getaffinity(0))


ISOLATION = ["process"]


def _serve(port: int, delay_ms: float, isolation: str) -> None:
    from gpu_trace.runtime.server.server import Server

    server = Server(
        f"127.0.0.1:{port}", token=TOKEN, delay_ms=delay_ms, isolation=isolation
    ).start()
    print("ready", flush=True)
    server.serve_forever()


def _cpu_args(cpu: int | None) -> list[str]:
    return [] if cpu is None else ["--cpu", str(cpu)]


def _spawn_server(delay_ms: float, cpu: int | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            str(port),
            "--delay-ms",
            str(delay_ms),
            "--isolation",
            ISOLATION[0],
            *_cpu_args(cpu),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, f"127.0.0.1:{port}"


def _rpc_worker(port: int) -> None:
    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("worker1", rank=1, world_size=2)
    rpc.shutdown()


def best(fn: Callable[[], float], repeat: int = 3) -> float:
    return min(fn() for _ in range(repeat))


# ---- peer ----------------------------------------------------------------------------------------


def bench_rpc(n: int, cpu: int | None = None) -> dict[str, float]:
    """The peer, in two processes of its own (its threads never share a process with ours)."""
    import json

    port = _free_port()
    worker = subprocess.Popen(
        [sys.executable, __file__, "--rpc-worker", str(port), *_cpu_args(cpu)]
    )
    out = subprocess.run(
        [sys.executable, __file__, "--rpc-client", str(port), "--ops", str(n), *_cpu_args(cpu)],
        capture_output=True,
        text=True,
        check=True,
    )
    worker.wait(timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rpc_client(port: int, n: int) -> None:
    import json

    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("worker0", rank=0, world_size=2)
    try:
        x = torch.ones(16)
        for _ in range(50):
            rpc.rpc_sync("worker1", torch.add, args=(x, 1))

        def sync_rtt() -> float:
            t = time.perf_counter()
            for _ in range(300):
                rpc.rpc_sync("worker1", torch.add, args=(x, 1))
            return (time.perf_counter() - t) / 300

        def async_rate() -> float:
            t = time.perf_counter()
            futs = [rpc.rpc_async("worker1", torch.add, args=(x, 1)) for _ in range(n)]
            torch.futures.wait_all(futs)
            return n / (time.perf_counter() - t)

        result = {
            "rpc_sync_rtt_us": best(sync_rtt) * 1e6,
            "rpc_async_calls_s": max(async_rate() for _ in range(3)),
        }
    finally:
        rpc.shutdown()
    print(json.dumps(result), flush=True)


def _echo(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := s.recv(65536):
            s.sendall(data)


def bench_ping(cpu: int | None = None) -> dict[str, float]:
    """A bare Python TCP round trip between two processes: the floor for any of ours."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        echo = subprocess.Popen([sys.executable, __file__, "--echo", str(port), *_cpu_args(cpu)])
        conn, _ = srv.accept()
    with conn, pinned(cpu):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = b"x" * 100

        def rtt() -> float:
            t = time.perf_counter()
            for _ in range(1000):
                conn.sendall(msg)
                conn.recv(65536)
            return (time.perf_counter() - t) / 1000

        rtt()
        us = best(rtt) * 1e6
    echo.wait(timeout=10)
    return {"bare_ping_us": us}


def bench_floor(n: int) -> dict[str, float]:
    """The floor of any tensor subclass here: ``x + 1`` through a ``__torch_dispatch__`` that
    only returns a new ``_make_wrapper_subclass`` tensor (or a prebuilt one), no forwarding."""
    meta = torch.device("meta")

    class New(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
            return torch.Tensor._make_wrapper_subclass(cls, (16,), dtype=torch.float32, device=meta)

    class Same(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
            return prebuilt

    out = {}
    for name, cls in (("floor_new_ops_s", New), ("floor_same_ops_s", Same)):
        x = torch.Tensor._make_wrapper_subclass(cls, (16,), dtype=torch.float32, device=meta)
        prebuilt = x

        def rate(x: torch.Tensor = x) -> float:
            t = time.perf_counter()
            for _ in range(n):
                x + 1
            return n / (time.perf_counter() - t)

        out[name] = max(rate() for _ in range(3))
    return out


# ---- ours ----------------------------------------------------------------------------------------


def bench_small_ops(address: str, n: int) -> dict[str, float]:
    from gpu_trace import runtime

    dev = runtime.connect(address, token=TOKEN)
    try:
        x = torch.ones(16, device=dev)

        def rate() -> float:
            y = x
            t = time.perf_counter()
            for _ in range(n):
                y = y + 1
            y.sum().item()
            return n / (time.perf_counter() - t)

        rate()
        ops_s = max(rate() for _ in range(3))

    finally:
        runtime.disconnect()
    return {"ops_s": ops_s}


def bench_round_trips(address: str) -> dict[str, float]:
    """A synchronous op's round trip (``sync=True``) and ``.item()``'s in asynchronous mode."""
    from gpu_trace import runtime

    dev = runtime.connect(address, token=TOKEN)
    try:
        x = torch.ones(16, device=dev)

        def item_rtt() -> float:
            s = x.sum()
            t = time.perf_counter()
            for _ in range(300):
                s.item()
            return (time.perf_counter() - t) / 300

        item_rtt()
        item_us = best(item_rtt) * 1e6
    finally:
        runtime.disconnect()
    dev = runtime.connect(address, token=TOKEN, sync=True)
    try:
        x = torch.ones(16, device=dev)

        def sync_rtt() -> float:
            t = time.perf_counter()
            for _ in range(300):
                x.add_(1)
            return (time.perf_counter() - t) / 300

        sync_rtt()
        sync_us = best(sync_rtt) * 1e6
    finally:
        runtime.disconnect()
    return {"sync_op_rtt_us": sync_us, "item_rtt_us": item_us}


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _step_time(device: torch.device | str, width: int, depth: int, batch: int, steps: int) -> float:
    torch.manual_seed(0)
    model = _mlp(width, depth).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, width).to(device)
    y = torch.randint(0, 10, (batch,)).to(device)

    def step() -> float:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    step()
    step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_delay(address: str, quick: bool) -> dict[str, float]:
    from gpu_trace import runtime

    out = {}
    for mode, sync in (("async", False), ("sync", True)):
        dev = runtime.connect(address, token=TOKEN, sync=sync, delay_ms=0.5)
        try:
            out[f"delay_step_{mode}_ms"] = _step_time(dev, 64, 3, 32, 3 if quick else 8) * 1e3
        finally:
            runtime.disconnect()
    return out


def bench_big_step(address: str, quick: bool) -> dict[str, float]:
    from gpu_trace import runtime

    width, depth, batch = 1024, 3, 512
    local = _step_time("cpu", width, depth, batch, 3 if quick else 8)
    dev = runtime.connect(address, token=TOKEN)
    try:
        remote = _step_time(dev, width, depth, batch, 3 if quick else 8)
    finally:
        runtime.disconnect()
    return {"big_step_local_ms": local * 1e3, "big_step_remote_ms": remote * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--isolation",
        choices=("process", "shared"),
        default="process",
        help="the servers' isolation (default process, as gpu-trace serve's)",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--rpc-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rpc-client", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--echo", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-one-cpu", action="store_true", help="skip the round trips pinned to one CPU"
    )
    args = parser.parse_args()
    ISOLATION[0] = args.isolation
    _pin(args.cpu)
    if args.echo:
        _echo(args.echo)
        return
    if args.rpc_client:
        _rpc_client(args.rpc_client, args.ops)
        return
    if args.serve:
        _serve(args.serve, args.delay_ms, args.isolation)
        return
    if args.rpc_worker:
        _rpc_worker(args.rpc_worker)
        return

    n = 2000 if args.quick else args.ops
    results: dict[str, float] = {}
    results.update(bench_rpc(n))
    results.update(bench_ping())
    results.update(bench_floor(n))
    plain, address = _spawn_server(0.0)
    delayed, delayed_address = _spawn_server(0.5)
    try:
        results.update(bench_small_ops(address, n))
        results.update(bench_round_trips(address))
        results.update(bench_delay(delayed_address, args.quick))
        results.update(bench_big_step(address, args.quick))
    finally:
        for proc in (plain, delayed):
            proc.terminate()
            proc.wait(timeout=20)
    cpu = None if args.no_one_cpu else _one_cpu()
    if cpu is not None:
        one = {f"one_{k}": v for k, v in bench_rpc(n, cpu).items()}
        one.update({f"one_{k}": v for k, v in bench_ping(cpu).items()})
        pinned_server, pinned_address = _spawn_server(0.0, cpu)
        try:
            with pinned(cpu):
                one.update({f"one_{k}": v for k, v in bench_round_trips(pinned_address).items()})
        finally:
            pinned_server.terminate()
            pinned_server.wait(timeout=20)
        results.update(one)

    r = results
    rows = [
        ("peer rpc_sync round trip", f"{r['rpc_sync_rtt_us']:.0f} µs", ""),
        ("peer rpc_async calls/s", f"{r['rpc_async_calls_s']:,.0f}", ""),
        ("bare Python TCP ping (floor)", f"{r['bare_ping_us']:.0f} µs", ""),
        ("floor: no-op subclass, new wrapper, ops/s", f"{r['floor_new_ops_s']:,.0f}", ""),
        ("floor: no-op subclass, same tensor, ops/s", f"{r['floor_same_ops_s']:,.0f}", ""),
        (
            "forwarded small ops/s (async)",
            f"{r['ops_s']:,.0f}",
            f"{r['ops_s'] / r['rpc_async_calls_s']:.1f}x rpc_async (target >= 10x)",
        ),
        (
            "sync op round trip (sync=True)",
            f"{r['sync_op_rtt_us']:.0f} µs",
            f"{r['rpc_sync_rtt_us'] / r['sync_op_rtt_us']:.1f}x faster than rpc_sync (target < 150 µs)",
        ),
        (".item() round trip (async mode)", f"{r['item_rtt_us']:.0f} µs", ""),
        ("+1 ms RTT: MLP step async", f"{r['delay_step_async_ms']:.1f} ms", ""),
        (
            "+1 ms RTT: MLP step sync",
            f"{r['delay_step_sync_ms']:.1f} ms",
            f"async {r['delay_step_sync_ms'] / r['delay_step_async_ms']:.1f}x faster (target >= 2x)",
        ),
        ("1024x1024 MLP step, local CPU", f"{r['big_step_local_ms']:.1f} ms", ""),
        (
            "1024x1024 MLP step, remote (loopback)",
            f"{r['big_step_remote_ms']:.1f} ms",
            f"{r['big_step_remote_ms'] / r['big_step_local_ms']:.2f}x local (target <= 1.5x)",
        ),
    ]
    if "one_sync_op_rtt_us" in r:
        rows += [
            ("round trips, every process pinned to one CPU:", "", ""),
            ("  peer rpc_sync round trip", f"{r['one_rpc_sync_rtt_us']:.0f} µs", ""),
            ("  bare Python TCP ping (floor)", f"{r['one_bare_ping_us']:.0f} µs", ""),
            (
                "  sync op round trip (sync=True)",
                f"{r['one_sync_op_rtt_us']:.0f} µs",
                f"{r['one_rpc_sync_rtt_us'] / r['one_sync_op_rtt_us']:.1f}x faster than"
                " rpc_sync (target < 150 µs)",
            ),
            ("  .item() round trip (async mode)", f"{r['one_item_rtt_us']:.0f} µs", ""),
        ]
    width = max(len(a) for a, _, _ in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
