"""Sharing one GPU between tenants: what the sharing runtime's parts cost and what they buy.

    python bench/sharing.py [--part replay|tenants|restore|all] [--out results.json] [options]

Each part prints a table; ``--out`` also writes every part's numbers as JSON.

Part ``replay``: scheduling policies on a production job trace, with simulated execution.
The trace is bench/traces/openb_pod_list_default.csv (Alibaba cluster-trace-gpu-v2023, from the
USENIX ATC 2023 paper "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with
Fragmentation Gradient Descent"; see bench/traces/README.md). Its tasks become jobs:

- kept: GPU tasks (``num_gpu >= 1``, ``gpu_milli > 0``) that were scheduled and ended before the
  trace did (a task still running at the end has no known demand), from where arrivals become
  steady: the trace opens with 9 long tasks created more than a day apart, weeks before the
  rest, holding about 60% of its GPU time; they are left out, as with them the replay would be a
  long quiet start followed by an overload. 6,162 of 8,152 tasks are kept;
- demand: ``(deletion_time - scheduled_time) * num_gpu * gpu_milli / 1000``, the GPU time the task
  held, in trace seconds; divided by ``--time-scale`` (600: ten trace minutes are one simulated
  second of device time, so the median job needs about 0.8 s, the range of the LAS policy's
  default thresholds of 1, 10 and 100 s);
- jobs: ``--jobs`` of them, every (6162 / jobs)-th in order of creation (the arrival pattern is
  kept, thinned);
- arrivals: ``creation_time`` from the first, multiplied by one factor chosen so the offered load
  (total demand over the span of arrivals) on ONE device is ``--load``;
- weight (fair share): each job is a session of its own tenant, of weight ``num_gpu * gpu_milli /
  1000``, the GPUs it asked for (``--weights equal``: 1 each);
- work: at its arrival a job submits its whole demand as work items of ``demand / --items``, but
  no shorter than ``--min-item-ms`` and no longer than ``--max-item-ms`` (a batch's device time
  on a real server; the cap bounds how long one item of a very long job holds the device).

Execution is simulated: a discrete-event loop drives the real
:class:`~gpu_trace.runtime.sharing.scheduler.PolicyScheduler` with each policy of
:mod:`gpu_trace.runtime.sharing.policies`, its clock being the simulated one; the device runs one
item at a time and charges its time. Items are not preempted, as on the server. For each policy: the
job completion time (JCT, completion minus arrival, simulated seconds) mean, median, p95, p99,
the makespan, and FIFO's mean JCT over the policy's. FIFO here serves jobs to completion in order
of arrival (every item of a job is queued at its arrival), the baseline Tiresias (NSDI 2019)
compares with, reporting up to 5.5x lower average JCT for its discretized LAS.

Part ``restore``: how long an idle session paged out to host memory takes to come back
(:mod:`gpu_trace.runtime.sharing.pager`), per GB of tensors. A server in this process
(``--restore-device``, default ``cuda:0`` where there is one, else the CPU device) and the
forwarding client: the session holds ``--restore-gb`` of transformer-like layers (width
``--restore-width``: per layer a QKV, output and two MLP weight matrices, their biases and two layer
norms, 12 tensors of 4 KB to 16 MB), filled with ones. Each round pages the session out
(``page-out``), then reads one element of the first layer's first weight (``probe[0, 0].item()``):
the batch that brings the session back. ``first op`` is the server's time from the restore's start
until that batch's first op could run (its input back), ``all`` until every storage was back, both
from the pager's own figures (CUDA events on a GPU); ``client`` is the probe's round trip as the
client saw it, next to the same probe on the resident session. Pipelined restores (copies in op
order, each op waiting for its own inputs) vs not (everything back before the first op); the median
of ``--restore-reps`` rounds. PipeSwitch (OSDI 2020) reports 3.6-6.6 ms task start-up on a V100
over PCIe 3.0 with pipelined model transmission; on the CPU device paging is a memcpy, so the
figures here are memory bandwidth, not PCIe.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_trace.runtime.sharing.policies import POLICIES, make_policy
from gpu_trace.runtime.sharing.scheduler import PolicyScheduler, Work
from gpu_trace.runtime.sharing.tenants import Tenant

HERE = Path(__file__).resolve().parent
TRACE = HERE / "traces" / "openb_pod_list_default.csv"
SECOND_NS = 1_000_000_000
MS_NS = 1_000_000
#: Leading tasks followed by a gap longer than this before the next one are left out.
LEAD_GAP_S = 86_400


# ---- part: replay --------------------------------------------------------------------------------


@dataclass
class TraceTask:
    """One kept task of the trace, in trace seconds."""

    name: str
    created_s: int
    demand_s: float  # GPU time held: duration x GPUs asked for
    gpus: float  # num_gpu * gpu_milli / 1000


def read_trace(path: Path) -> tuple[list[TraceTask], int]:
    """The kept tasks in order of creation, and how many rows the file has."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    end = max(int(r["deletion_time"]) for r in rows)
    tasks = []
    for r in rows:
        num_gpu, milli = int(r["num_gpu"]), int(r["gpu_milli"])
        if num_gpu < 1 or milli <= 0 or not r["scheduled_time"]:
            continue  # a CPU task, or never scheduled
        deleted, scheduled = int(r["deletion_time"]), int(r["scheduled_time"])
        if deleted >= end or deleted <= scheduled:
            continue  # still running when the trace ends: demand unknown
        gpus = num_gpu * milli / 1000
        tasks.append(
            TraceTask(r["name"], int(r["creation_time"]), (deleted - scheduled) * gpus, gpus)
        )
    tasks.sort(key=lambda t: t.created_s)
    # The trace opens with a few long tasks, created days apart, weeks before the arrivals become
    # steady; they hold about 60% of its GPU time and would make the replay a quiet start and
    # then an overload. The replay starts where arrivals become steady.
    start = 0
    while (
        start + 1 < len(tasks) and tasks[start + 1].created_s - tasks[start].created_s > LEAD_GAP_S
    ):
        start += 1
    return tasks[start:], len(rows)


class SimClock:
    """The scheduler's clock: simulated nanoseconds, moved by the event loop."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


class Job:
    """A job of the replay: a session (``id``, ``tenant``) with its demand cut into items."""

    def __init__(
        self, ident: int, arrival_ns: int, demand_ns: int, weight: float, item_ns: int
    ) -> None:
        self.id = ident
        self.tenant = Tenant(name=f"job{ident}", token="", weight=weight)
        self.arrival_ns = arrival_ns
        self.demand_ns = demand_ns
        self.item_ns = item_ns
        self.items = math.ceil(demand_ns / item_ns)
        self.left = self.items
        self.done_ns = 0

    def work(self) -> list[int]:
        """The device time of each item: full ones, then the remainder."""
        last = self.demand_ns - (self.items - 1) * self.item_ns
        return [self.item_ns] * (self.items - 1) + [last]


def make_jobs(tasks: list[TraceTask], args: argparse.Namespace) -> tuple[list[Job], float]:
    """``args.jobs`` jobs thinned from ``tasks``, scaled; and the factor applied to arrivals."""
    n = min(args.jobs, len(tasks))
    picked = [tasks[i * len(tasks) // n] for i in range(n)]
    demands = [max(1, round(t.demand_s / args.time_scale * SECOND_NS)) for t in picked]
    first = picked[0].created_s
    span_s = picked[-1].created_s - first
    # offered load = total demand / span of arrivals (both simulated): choose the arrival factor
    factor = sum(demands) / (args.load * span_s * SECOND_NS) if span_s else 0.0
    jobs = []
    for i, (task, demand) in enumerate(zip(picked, demands)):
        item = min(max(demand // args.items, round(args.min_item_ms * MS_NS)), demand)
        item = min(item, round(args.max_item_ms * MS_NS)) or 1
        weight = task.gpus if args.weights == "gpus" else 1.0
        arrival = round((task.created_s - first) * factor * SECOND_NS)
        jobs.append(Job(i + 1, arrival, demand, weight, item))
    return jobs, factor


def simulate(jobs: list[Job], policy_name: str, policy_options: dict[str, Any]) -> dict[str, Any]:
    """Run ``jobs`` on one simulated device under a policy; their completion times."""
    clock = SimClock()
    policy = make_policy(policy_name, **policy_options)
    sched = PolicyScheduler(policy, clock=clock)
    for job in jobs:
        job.left, job.done_ns = job.items, 0
    order = sorted(jobs, key=lambda j: (j.arrival_ns, j.id))
    nxt, done, busy_ns = 0, 0, 0

    def arrive(until_ns: int) -> int:
        i = nxt
        while i < len(order) and order[i].arrival_ns <= until_ns:
            job = order[i]
            clock.now = job.arrival_ns
            for service in job.work():
                sched.submit(job, Work("batch", head=service))
            i += 1
        return i

    while done < len(order):
        if not sched.depth():  # idle device: jump to the next arrival
            clock.now = max(clock.now, order[nxt].arrival_ns)
            nxt = arrive(clock.now)
        got = sched.take(0)
        assert got is not None
        job, work = got
        end = clock.now + work.head
        nxt = arrive(end)  # arrivals while the item runs queue at their own times
        clock.now = end
        busy_ns += work.head
        sched.charge(job, work.head)
        job.left -= 1
        if job.left == 0:
            job.done_ns = end
            done += 1
            sched.forget(job)
    jct = sorted((j.done_ns - j.arrival_ns) / SECOND_NS for j in jobs)
    cuts = statistics.quantiles(jct, n=100, method="inclusive")
    makespan = (max(j.done_ns for j in jobs) - min(j.arrival_ns for j in jobs)) / SECOND_NS
    result = {
        "policy": policy_name,
        "mean_s": statistics.fmean(jct),
        "median_s": statistics.median(jct),
        "p95_s": cuts[94],
        "p99_s": cuts[98],
        "makespan_s": makespan,
        "busy_s": busy_ns / SECOND_NS,
    }
    promotions = getattr(policy, "promotions", None)
    if promotions is not None:
        result["promotions"] = promotions
    return result


def part_replay(args: argparse.Namespace) -> dict[str, Any]:
    """Every policy on the same scaled trace; FIFO's mean JCT over each policy's."""
    tasks, rows = read_trace(args.trace)
    jobs, factor = make_jobs(tasks, args)
    demand = sorted(j.demand_ns / SECOND_NS for j in jobs)
    items = sum(j.items for j in jobs)
    results = []
    for name in args.policies:
        t0 = time.perf_counter()
        options = {"starve_factor": args.las_starve_factor} if name == "las" else {}
        result = simulate(jobs, name, options)
        result["wall_s"] = time.perf_counter() - t0
        results.append(result)
    base = next((r["mean_s"] for r in results if r["policy"] == "fifo"), None)
    for r in results:
        r["fifo_over_this"] = base / r["mean_s"] if base else None
    header = (
        f"replay: {len(jobs):,} jobs of {len(tasks):,} kept ({rows:,} tasks in "
        f"{args.trace.name}), {items:,} work items, one device at offered load {args.load:g}; "
        f"demand / {args.time_scale:g} (median {statistics.median(demand):.2f} s, "
        f"max {demand[-1]:,.0f} s), arrivals x {factor:.3g}, weights {args.weights}"
    )
    columns = ["policy", "mean JCT", "median", "p95", "p99", "makespan", "FIFO/this"]
    table = [
        [
            r["policy"],
            f"{r['mean_s']:,.1f} s",
            f"{r['median_s']:,.2f} s",
            f"{r['p95_s']:,.1f} s",
            f"{r['p99_s']:,.0f} s",
            f"{r['makespan_s']:,.0f} s",
            f"{r['fifo_over_this']:.2f}x" if r["fifo_over_this"] else "-",
        ]
        for r in results
    ]
    return {
        "title": header,
        "columns": columns,
        "rows": table,
        "config": {
            "trace": args.trace.name,
            "jobs": len(jobs),
            "kept": len(tasks),
            "load": args.load,
            "time_scale": args.time_scale,
            "arrival_factor": factor,
            "weights": args.weights,
            "items": items,
            "item_split": args.items,
            "min_item_ms": args.min_item_ms,
            "max_item_ms": args.max_item_ms,
            "las_starve_factor": args.las_starve_factor,
        },
        "results": results,
    }


def positive(kind: Callable[[str], Any], least: float = 0) -> Callable[[str], Any]:
    """An argparse type: ``kind`` of the text, above ``least``."""

    def convert(text: str) -> Any:
        value = kind(text)
        if not value > least:
            raise argparse.ArgumentTypeError(f"must be more than {least:g}, got {text}")
        return value

    return convert


def add_replay_options(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("replay")
    g.add_argument("--trace", type=Path, default=TRACE, help="the job trace (default: %(default)s)")
    g.add_argument(
        "--jobs", type=positive(int, 1), default=1000, help="jobs replayed (default %(default)s)"
    )
    g.add_argument(
        "--load",
        type=positive(float),
        default=0.9,
        help="offered load on one device (default %(default)s)",
    )
    g.add_argument(
        "--time-scale",
        type=positive(float),
        default=600.0,
        help="trace seconds per simulated second of demand (default %(default)s)",
    )
    g.add_argument(
        "--weights",
        choices=("gpus", "equal"),
        default="gpus",
        help="fair-share weight of a job: the GPUs it asked for, or 1 (default %(default)s)",
    )
    g.add_argument(
        "--items",
        type=positive(int),
        default=100,
        help="a job's demand in this many items (default 100)",
    )
    g.add_argument(
        "--min-item-ms", type=positive(float), default=10.0, help="shortest item (default 10)"
    )
    g.add_argument(
        "--max-item-ms", type=positive(float), default=1000.0, help="longest item (default 1000)"
    )
    g.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help="policies to replay (default: all)",
    )
    g.add_argument(
        "--las-starve-factor",
        type=positive(float),
        default=10.0,
        help="LAS starvation limit, in multiples of attained service (default %(default)s)",
    )


# ---- part: tenants -------------------------------------------------------------------------------

TENANT_TOKEN = "bench-sharing-tenant-{}-0123456789"


def _tenant_job(address: str, token: str, steps: int, seed: int) -> None:
    """A client: a small CNN's training steps on the server; prints its JSON line and exits."""
    import torch

    from gpu_trace import runtime

    dev = runtime.connect(address, token=token)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 7 * 7, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 1, 28, 28).to(dev)
    y = torch.randint(0, 10, (64,)).to(dev)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # go
    t0, wall0 = time.perf_counter(), time.time()
    loss = 0.0
    for _ in range(steps):
        opt.zero_grad()
        out = torch.nn.functional.cross_entropy(model(x), y)
        out.backward()
        opt.step()
        loss = out.item()
    elapsed = time.perf_counter() - t0
    print(json.dumps({"s": elapsed, "start": wall0, "end": wall0 + elapsed, "loss": loss}))
    runtime.disconnect()


def _serve_tenants(port: int, tenants: int, policy: str) -> None:
    from gpu_trace.runtime.server.server import Server
    from gpu_trace.runtime.sharing.policies import make_policy
    from gpu_trace.runtime.sharing.scheduler import PolicyScheduler

    server = Server(
        f"127.0.0.1:{port}",
        tenants=[Tenant(name=f"t{i}", token=TENANT_TOKEN.format(i)) for i in range(tenants)],
        scheduler=PolicyScheduler(make_policy(policy)),
    ).start()
    print("ready", flush=True)
    server.serve_forever()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_jobs(address: str, tokens: list[str], steps: int) -> tuple[list[float], float]:
    """Start one client per token, let them go together; each one's time and the makespan
    (first start to last end of the training loops, as the clients timed them)."""
    import subprocess

    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--tenant-job", address, token, str(steps), str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, token in enumerate(tokens)
    ]
    for p in procs:
        assert p.stdout is not None and json.loads(p.stdout.readline())["ready"]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    done = []
    for p in procs:
        assert p.stdout is not None
        done.append(json.loads(p.stdout.readline()))
        p.wait(timeout=600)
    makespan = max(d["end"] for d in done) - min(d["start"] for d in done)
    return [d["s"] for d in done], makespan


def part_tenants(args: argparse.Namespace) -> dict[str, Any]:
    """N tenants training at once on one server vs the same jobs one after the other."""
    import subprocess

    rows, results = [], []
    for n in args.tenant_counts:
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve-tenants", str(port), str(n), args.tenant_policy],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            address = f"127.0.0.1:{port}"
            tokens = [TENANT_TOKEN.format(i) for i in range(n)]
            alone = [_run_jobs(address, [t], args.tenant_steps)[0][0] for t in tokens]
            together, makespan = _run_jobs(address, tokens, args.tenant_steps)
        finally:
            server.terminate()
            server.wait(timeout=30)
        sequential = sum(alone)
        slowdowns = [c / a for c, a in zip(together, alone)]
        result = {
            "tenants": n,
            "alone_s": alone,
            "together_s": together,
            "sequential_s": sequential,
            "makespan_s": makespan,
            "throughput_gain": sequential / makespan,
            "slowdowns": slowdowns,
        }
        results.append(result)
        rows.append(
            [
                str(n),
                f"{sequential:.2f} s",
                f"{makespan:.2f} s",
                f"{makespan / sequential:.2f}",
                f"{sequential / makespan:.2f}x",
                " ".join(f"{s:.2f}" for s in slowdowns),
            ]
        )
    return {
        "title": (
            f"tenants: each a client process training a small CNN (batch 64, 28x28) for "
            f"{args.tenant_steps} steps on one server (CPU device, policy {args.tenant_policy}); "
            "one after the other vs all at once"
        ),
        "columns": [
            "tenants",
            "one after another",
            "all at once",
            "at once / after",
            "aggregate throughput",
            "each tenant's slowdown",
        ],
        "rows": rows,
        "results": results,
    }


def add_tenants_options(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("tenants")
    g.add_argument("--tenant-counts", type=int, nargs="+", default=[2, 4])
    g.add_argument("--tenant-steps", type=positive(int), default=30)
    g.add_argument("--tenant-policy", choices=POLICIES, default="fair")


# ---- part: restore -------------------------------------------------------------------------------

RESTORE_TOKEN = "bench-sharing-restore-0123456789"


def _layer_shapes(d: int) -> list[tuple[int, ...]]:
    """One transformer layer's parameters: QKV, output, two MLP matrices, biases, layer norms."""
    matrices = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return matrices + [(d,)] * 4  # two layer norms' weights and biases


def part_restore(args: argparse.Namespace) -> dict[str, Any]:
    """Restore latency of an idle, paged-out session, pipelined vs not, per GB of tensors."""
    import torch

    from gpu_trace import runtime
    from gpu_trace.runtime.server.server import Server

    device = args.restore_device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    where = "CPU device" if device == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})"
    clock = time.perf_counter_ns
    ms = 1e-6
    rows, results = [], []
    for gb in args.restore_gb:
        target = int(gb * (1 << 30))
        with Server("127.0.0.1:0", token=RESTORE_TOKEN, device=device, idle_s=None) as server:
            dev = runtime.connect(server.address, token=RESTORE_TOKEN)
            try:
                tensors, total = [], 0
                while total < target:
                    for shape in _layer_shapes(args.restore_width):
                        tensors.append(torch.ones(shape, device=dev))
                        total += tensors[-1].numel() * 4
                runtime.synchronize()
                (session,) = server.sessions.values()
                pager = server.pager
                probe = tensors[0]
                resident = []
                for _ in range(args.restore_reps + 1):  # the first one warms the client's caches
                    t0 = clock()
                    probe[0, 0].item()
                    resident.append(clock() - t0)
                resident_ms = statistics.median(resident[1:]) * ms
                for pipelined in (True, False):
                    pager.pipelined = pipelined
                    rounds = []
                    for _ in range(args.restore_reps):
                        runtime.synchronize()
                        t0 = clock()
                        freed = pager.request_page_out(session, reason="bench")
                        out_ns = clock() - t0
                        t0 = clock()
                        probe[0, 0].item()
                        client_ns = clock() - t0
                        with server.executor.lock:
                            pager.settle(session, wait=True)
                        stats = pager.restores[-1]
                        rounds.append((out_ns, stats.first_op_ns, stats.all_ns, client_ns))
                        assert freed > 0 and stats.bytes == freed, (freed, stats)
                    out, first, every, client = (
                        statistics.median(r[i] for r in rounds) for i in range(4)
                    )
                    result = {
                        "gb": gb,
                        "bytes": total,
                        "tensors": len(tensors),
                        "pipelined": pipelined,
                        "page_out_ms": out * ms,
                        "first_op_ms": first * ms,
                        "all_ms": every * ms,
                        "all_ms_per_gb": every * ms / (total / (1 << 30)),
                        "client_ms": client * ms,
                        "client_resident_ms": resident_ms,
                        "rounds": rounds,
                    }
                    results.append(result)
                    rows.append(
                        [
                            f"{total / (1 << 30):.2f} GB",
                            str(len(tensors)),
                            "pipelined" if pipelined else "all first",
                            f"{out * ms:.1f} ms",
                            f"{first * ms:.2f} ms",
                            f"{every * ms:.1f} ms",
                            f"{result['all_ms_per_gb']:.1f} ms",
                            f"{client * ms:.2f} ms",
                            f"{resident_ms:.2f} ms",
                        ]
                    )
                # Paging must not change a value: every tensor is still all ones.
                assert all(bool((t == 1).all()) for t in tensors)
            finally:
                runtime.disconnect()
    return {
        "title": (
            f"restore: an idle session paged out to host memory and back, {where}; transformer-"
            f"like layers (width {args.restore_width}), median of {args.restore_reps} rounds. "
            "PipeSwitch (OSDI 2020): 3.6-6.6 ms task start-up on a V100, PCIe 3.0"
        ),
        "columns": [
            "held",
            "tensors",
            "restore",
            "page-out",
            "first op",
            "all",
            "all per GB",
            "client",
            "client, resident",
        ],
        "rows": rows,
        "results": results,
    }


def add_restore_options(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("restore")
    g.add_argument("--restore-gb", type=positive(float), nargs="+", default=[0.25, 0.5, 1.0])
    g.add_argument("--restore-width", type=positive(int), default=1024)
    g.add_argument("--restore-reps", type=positive(int), default=3)
    g.add_argument("--restore-device", help="default: cuda:0 where there is one, else cpu")


# ---- driver --------------------------------------------------------------------------------------

#: The parts, by name, in the order ``all`` runs them.
PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "replay": part_replay,
    "tenants": part_tenants,
    "restore": part_restore,
}


def print_table(result: dict[str, Any]) -> None:
    print(result["title"])
    rows = [result["columns"], *result["rows"]]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        print("  " + "  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=[*PARTS, "all"], default="all", help="default: all")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    add_replay_options(ap)
    add_tenants_options(ap)
    add_restore_options(ap)
    args = ap.parse_args(argv)
    names = list(PARTS) if args.part == "all" else [args.part]
    results = {}
    for name in names:
        results[name] = PARTS[name](args)
        print_table(results[name])
        print()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tenant-job"]:
        _tenant_job(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1:2] == ["--serve-tenants"]:
        _serve_tenants(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(main())
