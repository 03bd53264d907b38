"""What a worker process per session costs, and what it buys: `serve --isolation process` next to
`--isolation shared`, in one run, interleaved.

    python bench/isolation.py [--rounds 3] [--ops 3000] [--quick] [--device cpu] [--las] [--stall-only]
                              [--probe-after 2] [--json FILE]

Two `gpu-trace serve` processes on the same device (CPU by default; ``--device cuda:0`` on a GPU
machine), one per isolation, up for the whole run. Each figure is measured by a fresh client
process per round, the two servers' rounds interleaved (order turned every round):

- ``session``: seconds from ``runtime.connect`` to its first op's result (with ``process``, a
  standby worker takes the session; the next one is made meanwhile, and each client waits
  ``--settle`` seconds after its first op, in both modes, so that the figures below do not
  measure that one-time start on a 2-CPU machine);
- ``ops``: small forwarded ops per second (``x = x + 1`` on 16 floats, issued asynchronously,
  one sync at the end);
- ``sync``: a synchronous round trip (``.item()`` of a sum), median of 200, microseconds;
- ``step``: a small MLP training step (SGD, loss read every step), median, milliseconds;
- ``two``: two tenants training that MLP at once, steps per second of both together;
- ``stall``: tenant B's synchronous round trip while tenant A's batches of 20
  ``mm.out`` of 2048 x 2048 run (the issue's probe), B's median under load over B's median
  alone (``process``: the workers are scheduled by the OS side by side; ``shared``: B's op waits
  for A's batch). B starts probing ``--probe-after`` seconds after A's first batch, as a
  developer's session meets a training job that has been running.

``--las`` adds a third server, ``process`` isolation under ``--policy las --las-thresholds 1``:
A's worker sinks to nice 10 once its session has attained 1 s of device time, and B's probe
meets it there (``process+las``).

Figures: per isolation, the median over rounds and the [min-max] spread; ``process / shared``.
The machine is shared and noisy: only ratios within one run mean something.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

TOKEN_A = "bench-isolation-alice-0123"
TOKEN_B = "bench-isolation-bobby-0123"
TENANTS = f"""\
[[tenant]]
name = "alice"
token = "{TOKEN_A}"

[[tenant]]
name = "bob"
token = "{TOKEN_B}"
"""

# Each client prints one JSON line. argv: address, token, what, n, settle seconds (after its first
# op: with process isolation the worker taken from the pool is being replaced meanwhile, a torch
# import that takes a CPU for seconds; a session pays it once, not per op, so it is left out).
CLIENT = textwrap.dedent(
    """
    import json, statistics, sys, time, torch
    from gpu_trace import runtime
    address, token, what, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    settle = float(sys.argv[5])
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dev = runtime.connect(address, token=token)
    x = torch.zeros(16).to(dev)
    (x + 1).sum().item()
    session = time.perf_counter() - t0
    out = {"session": session}
    time.sleep(settle)
    if what == "ops":
        t = time.perf_counter()
        for _ in range(n):
            x = x + 1
        x.sum().item()
        out["ops"] = n / (time.perf_counter() - t)
    elif what in ("sync", "probe"):
        times = []
        for _ in range(n):
            t = time.perf_counter_ns()
            x.sum().item()
            times.append(time.perf_counter_ns() - t)
        out["sync"] = statistics.median(times) / 1e3
    elif what in ("step", "train"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        ).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        a, b = torch.randn(64, 256).to(dev), torch.randn(64, 10).to(dev)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            opt.zero_grad()
            loss = (model(a) - b).square().mean()
            loss.backward()
            opt.step()
            loss.item()
            times.append(time.perf_counter() - t)
        out["step"] = statistics.median(times[3:] or times) * 1e3
        out["steps_per_s"] = len(times) / sum(times)
    elif what == "hog":
        m = torch.randn(2048, 2048).to(dev)
        o = torch.empty(2048, 2048).to(dev)
        print("hogging", flush=True)
        end = time.monotonic() + n
        while time.monotonic() < end:
            for _ in range(20):
                torch.mm(m, m, out=o)
            o.sum().item()
    print(json.dumps(out), flush=True)
    """
)


@contextlib.contextmanager
def serving(mode: str, device: str, home: Path) -> Iterator[str]:
    isolation, policy = MODES[mode]
    home.mkdir(parents=True, exist_ok=True)
    (home / "tenants.toml").write_text(TENANTS)
    log = home / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
    env.update(GPU_TRACE_HOME=str(home), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0"]
    argv += ["--device", device, "--tenants", str(home / "tenants.toml"), "--metrics", "off"]
    argv += ["--isolation", isolation, "--gpu-activity", "off", "--policy", policy]
    if policy == "las":
        argv += ["--las-thresholds", "1"]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stderr=err, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 180
        while "serving" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {mode} server did not start: {log.read_text()}")
            time.sleep(0.1)
        line = next(ln for ln in log.read_text().splitlines() if " on " in ln)
        yield line.split(" on ")[1].split()[0]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


SETTLE = [6.0]
#: Each server of the run: its isolation and policy.
MODES = {
    "process": ("process", "fair"),
    "shared": ("shared", "fair"),
    "process+las": ("process", "las"),
}


def client(address: str, token: str, what: str, n: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, address, token, what, str(n), str(SETTLE[0])],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def result(proc: subprocess.Popen[str], timeout: float = 600) -> dict[str, float]:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"a client failed ({proc.returncode}): {out[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def one_round(address: str, args: argparse.Namespace) -> dict[str, float]:
    fig: dict[str, float] = {}
    if args.stall_only:
        fig["stall"] = stall(address, args)
        return fig
    r = result(client(address, TOKEN_A, "ops", args.ops))
    fig["session"], fig["ops"] = r["session"], r["ops"]
    fig["sync"] = result(client(address, TOKEN_A, "sync", 200))["sync"]
    fig["step"] = result(client(address, TOKEN_A, "step", args.steps))["step"]
    a = client(address, TOKEN_A, "train", args.steps)
    b = client(address, TOKEN_B, "train", args.steps)
    ra, rb = result(a), result(b)
    fig["two"] = ra["steps_per_s"] + rb["steps_per_s"]
    fig["stall"] = stall(address, args)
    return fig


def stall(address: str, args: argparse.Namespace) -> float:
    """B's median round trip under A's batches over B's median alone."""
    alone = result(client(address, TOKEN_B, "probe", 100))["sync"]
    hog = client(address, TOKEN_A, "hog", args.hog_s)
    assert hog.stdout is not None
    hog.stdout.readline()  # hogging
    time.sleep(args.probe_after)
    loaded = result(client(address, TOKEN_B, "probe", 30))["sync"]
    result(hog)
    return loaded / alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hog-s", type=int, default=8, help="seconds tenant A's mm batches run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="one short round (a smoke run)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--settle", type=float, default=6.0, help="seconds a client waits after its first op"
    )
    ap.add_argument(
        "--probe-after",
        type=float,
        default=2.0,
        help="seconds tenant A's batches have run when B starts probing (stall)",
    )
    ap.add_argument(
        "--stall-only",
        action="store_true",
        help="measure the stall alone (more rounds in the same time: it is the noisiest figure)",
    )
    ap.add_argument(
        "--las",
        action="store_true",
        help="a third server: process isolation under --policy las (--las-thresholds 1)",
    )
    args = ap.parse_args()
    SETTLE[0] = args.settle
    if args.quick:
        args.rounds, args.ops, args.steps, args.hog_s = 1, 300, 8, 4
    if args.probe_after + 1 >= args.hog_s:
        ap.error("--probe-after must leave tenant A's batches running a second more (--hog-s)")
    modes: tuple[str, ...] = (
        ("process", "shared", "process+las") if args.las else ("process", "shared")
    )
    figures: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        addresses = {m: stack.enter_context(serving(m, args.device, Path(tmp) / m)) for m in modes}
        for i in range(args.rounds):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                figures[mode].append(one_round(addresses[mode], args))
                print(f"round {i + 1} {mode}: {figures[mode][-1]}", file=sys.stderr, flush=True)
    keys = ("stall",) if args.stall_only else ("session", "ops", "sync", "step", "two", "stall")
    units = {"session": "s", "ops": "ops/s", "sync": "µs", "step": "ms", "two": "steps/s"}
    summary: dict[str, dict[str, object]] = {}
    print(f"device {args.device}, {args.rounds} rounds; median [min-max]")
    heads = "".join(f" {m:>24}" for m in modes)
    print(f"{'figure':<8}{heads} {'process/shared':>15}")
    for key in keys:
        row: dict[str, object] = {}
        cells = []
        medians = {}
        for mode in modes:
            vals = [f[key] for f in figures[mode]]
            med = medians[mode] = statistics.median(vals)
            row[mode] = {"median": med, "min": min(vals), "max": max(vals)}
            cells.append(f" {f'{med:.3g} [{min(vals):.3g}-{max(vals):.3g}]':>24}")
        ratio = medians["process"] / medians["shared"]
        row["ratio"] = ratio
        summary[key] = row
        unit = units.get(key, "x alone")
        print(f"{key:<8}{''.join(cells)} {ratio:>14.2f}x  ({unit})")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"device": args.device, "probe_after_s": args.probe_after, "figures": summary},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
