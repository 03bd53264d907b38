"""Training steps local vs forwarded, next to torch.distributed.rpc, on one GPU machine.

    python bench/forward_gpu.py [--rounds 5] [--steps 30] [--models lm,mlp,cnn] [--quick] [--json]

Three models (the issue's targets: forwarded at most 1.5x local):

- ``lm``: the GPT-style language model of ``shared/gpu/README.md`` (token embedding of 8,192
  words, 6 pre-norm ``nn.TransformerEncoderLayer``s, d=512, 8 heads, FFN 2,048, causal, a linear
  head, AdamW, batch 16 x 256), dropout off so that every run computes the same numbers;
- ``mlp``: six 2048-wide Linear+ReLU and a head, batch 512, SGD with momentum;
- ``cnn``: four 3x3 convolutions with batch norm and ReLU, pooling, a head; 64 images of
  3 x 32 x 32, SGD with momentum.

Peers, each in a fresh process per model and round, in an order that turns every round:

- ``local``: the step on this machine's device;
- ``forwarded``: the same program on the ``remote`` device (``runtime.connect``), served by a
  `gpu-trace serve`-equivalent process on the same device, started once and used by every
  forwarded run (each run's session gets a fresh worker process of its own, as with
  `gpu-trace serve`); the client sees the GPU;
- ``forwarded-gpuless``: the same, the client started with ``CUDA_VISIBLE_DEVICES=""``;
- ``rpc``: ``torch.distributed.rpc`` (TensorPipe): the model lives in a worker process on the
  device and each step is one ``rpc_sync`` carrying the batch (CUDA tensors through the device
  map ``{0: 0}``, so they move GPU to GPU) and bringing the loss back; the floor of running a step
  elsewhere: one round trip a step;
- ``rpc-gpuless``: the same with CPU tensors from a client without a GPU.

The forwarding servers run ``--isolation process`` (a worker process per session, as
`gpu-trace serve` does by default) or, with ``--isolation shared``, every session in one process.
With ``process`` a session takes a standby worker and the server makes the next one (a torch
import and a device context: seconds of one CPU, once per session). The server's CPU is its own
and its session's worker's (the bench's server says which worker that is), never the one being
made; on a small machine (the CPU-device variant, or under 8 CPUs) a forwarded peer also waits,
without a step, until that worker is made, which would otherwise take a CPU from the timing. On a
GPU machine of 8 CPUs or more the forwarding server starts beside the first run (local's): its
start (torch, the device's context in each standby worker) is the bench's longest single phase.

It says on stderr what it is doing as it goes (the server's start, each run, each client's
phases, each run's median), so that a run stopped from outside shows where it was; stdout has
only the figures (``--json``: one JSON document at the end).

Each step ends at ``loss.item()`` (a sync point), so its wall time (``perf_counter``) is the
step's time on both sides. A peer's figure for a round is the median of its steps; its ratio is
that over ``local``'s median of the same round; across rounds, the median ratio and the spread
(lowest and highest). Losses are compared bitwise with ``local``'s of the same round.

Without a GPU it says so and runs the CPU-device variant: smaller models (launch-bound: small
tensors, so the per-op overheads dominate as they do on a GPU), every process with one intra-op
thread (the "device" then takes no second CPU from the other process), the server on the CPU,
``rpc`` with CPU tensors, and no ``-gpuless`` peers (they would be the same runs).

On a GPU machine (``shared/gpu-box/README.md``): ``timeout -k 5 900 python bench/forward_gpu.py
--json > forward_gpu.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TOKEN = "bench-forward-gpu-token-0123"
MODELS = ("lm", "mlp", "cnn")
#: Model sizes: on a GPU the issue's; on the CPU small enough to be launch-bound.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "gpu": {
        "lm": {
            "vocab": 8192,
            "d": 512,
            "heads": 8,
            "ffn": 2048,
            "layers": 6,
            "batch": 16,
            "seq": 256,
        },
        "mlp": {"width": 2048, "depth": 6, "batch": 512},
        "cnn": {"channels": 64, "batch": 64, "size": 32},
    },
    "cpu": {
        "lm": {"vocab": 256, "d": 32, "heads": 4, "ffn": 64, "layers": 2, "batch": 4, "seq": 16},
        "mlp": {"width": 64, "depth": 6, "batch": 32},
        "cnn": {"channels": 8, "batch": 8, "size": 16},
    },
}
#: The environment variable that carries ``--connect`` to the forwarded peers' clients.
CONNECT_OPTIONS = "FORWARD_GPU_BENCH_CONNECT"
#: How long a client process or a server start may take, seconds.
PROCESS_TIMEOUT_S = 600
#: The file where the bench's forwarding server says which worker runs each session and how
#: many standby workers are ready (``--isolation process``), for the forwarded peers' clients.
STATUS_ENV = "FORWARD_GPU_BENCH_STATUS"
_T0 = time.monotonic()


def say(what: str) -> None:
    """One line of progress on stderr (stdout has the figures alone)."""
    print(f"forward_gpu {time.monotonic() - _T0:6.1f}s: {what}", file=sys.stderr, flush=True)


# ---- the models and their step ---------------------------------------------------------------------


def build(model: str, size: dict[str, int]) -> tuple[Any, Any, list[Any], Any]:
    """``(module, optimizer factory, batch, loss function)`` on the CPU, seeded: every process
    builds the same parameters and data, then moves them to its device."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if model == "lm":
        v, d, t = size["vocab"], size["d"], size["seq"]

        class LM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(v, d)
                self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
                self.layers = nn.ModuleList(
                    nn.TransformerEncoderLayer(
                        d,
                        size["heads"],
                        size["ffn"],
                        dropout=0.0,
                        batch_first=True,
                        norm_first=True,
                    )
                    for _ in range(size["layers"])
                )
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, v)
                self.register_buffer(
                    "mask", nn.Transformer.generate_square_subsequent_mask(t), persistent=False
                )

            def forward(self, tokens: Any) -> Any:
                h = self.embed(tokens) + self.pos
                for layer in self.layers:
                    h = layer(h, src_mask=self.mask, is_causal=True)
                return self.head(self.norm(h))

        tokens = torch.randint(0, v, (size["batch"], t + 1), generator=g)

        def lm_loss(m: Any, x: Any, y: Any) -> Any:
            return nn.functional.cross_entropy(m(x).reshape(-1, v), y.reshape(-1))

        return LM(), _adamw, [tokens[:, :-1], tokens[:, 1:]], lm_loss
    if model == "mlp":
        w = size["width"]
        layers: list[nn.Module] = []
        for _ in range(size["depth"]):
            layers += [nn.Linear(w, w), nn.ReLU()]
        mlp = nn.Sequential(*layers, nn.Linear(w, 10))
        batch = [
            torch.randn(size["batch"], w, generator=g),
            torch.randint(0, 10, (size["batch"],), generator=g),
        ]
        return mlp, _sgd, batch, _ce
    if model == "cnn":
        c, n, s = size["channels"], size["batch"], size["size"]
        convs: list[nn.Module] = []
        for cin, cout in ((3, c), (c, c), (c, 2 * c), (2 * c, 2 * c)):
            convs += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
            if cout != cin and cin != 3:
                convs.append(nn.MaxPool2d(2))
        cnn = nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10))
        batch = [torch.randn(n, 3, s, s, generator=g), torch.randint(0, 10, (n,), generator=g)]
        return cnn, _sgd, batch, _ce
    raise ValueError(f"unknown model {model!r}; one of {', '.join(MODELS)}")


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=1e-4)


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _ce(m: Any, x: Any, y: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(m(x), y)


class Trainer:
    """One model's training step on one device (a remote one included)."""

    def __init__(self, model: str, size: dict[str, int], device: Any) -> None:
        module, make_opt, batch, loss_fn = build(model, size)
        self.module = module.to(device)
        self.opt = make_opt(self.module.parameters())
        self.batch = [b.to(device) for b in batch]
        self.loss_fn = loss_fn

    def step(self, x: Any = None, y: Any = None) -> Any:
        """One step; returns the loss tensor (not read: the caller syncs)."""
        if x is None:
            x, y = self.batch
        self.opt.zero_grad()
        loss = self.loss_fn(self.module, x, y)
        loss.backward()
        self.opt.step()
        return loss


def timed_steps(
    step: Any, warmup: int, steps: int, server_pid: int = 0, worker_pid: int = 0
) -> dict[str, Any]:
    """``step()`` returns a float (a sync point): its times in ms, its losses (as hex), and the
    CPU time per timed step, ms, of this process (all threads) and of the server's
    (``server_pid``, on this machine; with ``worker_pid``, that process and its session's worker
    alone, else with all its children), which the machine's other load moves less than the
    wall time."""

    def server_ns() -> int | None:
        if not worker_pid:
            return cpu_ns(server_pid)
        front, worker = cpu_ns(server_pid, children=False), cpu_ns(worker_pid)
        return None if front is None or worker is None else front + worker

    losses = []
    for _ in range(warmup):
        losses.append(step())
    say(f"{warmup} warm-up steps done")
    times = []
    cpu0, server0 = time.process_time_ns(), server_ns()
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step())
        times.append((time.perf_counter() - t) * 1e3)
    cpu1, server1 = time.process_time_ns(), server_ns()
    say(f"{steps} timed steps done")
    out: dict[str, Any] = {"times_ms": times, "losses": [float(v).hex() for v in losses]}
    out["client_cpu_ms"] = (cpu1 - cpu0) / 1e6 / max(1, steps)
    if server0 is not None and server1 is not None:
        out["server_cpu_ms"] = (server1 - server0) / 1e6 / max(1, steps)
    return out


def cpu_ns(pid: int, children: bool = True) -> int | None:
    """CPU time of every thread of process ``pid`` and (``children``) of its child processes (a
    server's workers) so far, ns (Linux's schedstat); None where it cannot be read."""
    if not pid:
        return None
    total = 0
    try:
        pids = [pid, *(_children(pid) if children else ())]
        for p in pids:
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                    with open(f"/proc/{p}/task/{task}/schedstat") as f:
                        total += int(f.read().split()[0])
    except OSError:
        return None
    return total


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (Linux's ``/proc/PID/task/*/children``)."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


# ---- the peers' processes --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(kind: str) -> str:
    return "cuda:0" if kind == "gpu" else "cpu"


def worker(
    peer: str, model: str, kind: str, warmup: int, steps: int, address: str, server_pid: int = 0
) -> dict[str, Any]:
    """One peer's run of one model in this process (a fresh one)."""
    size = SIZES[kind][model]
    import torch  # noqa: F401 (its import, said as a phase: seconds with CUDA's libraries)

    say("torch imported")
    if peer == "local":
        trainer = Trainer(model, size, _device(kind))
        say("model and batch on the device")
        return timed_steps(lambda: trainer.step().item(), warmup, steps)
    if peer.startswith("forwarded"):
        from gpu_trace import runtime

        options = json.loads(os.environ.get(CONNECT_OPTIONS, "{}")) if "@" not in peer else {}
        dev = runtime.connect(address, token=TOKEN, **options)
        try:
            session = getattr(runtime.current(), "session_id", 0)
            worker_pid = _worker_of(session) if session else 0
            say(f"connected: session {session}" + (f", worker {worker_pid}" if worker_pid else ""))
            trainer = Trainer(model, size, dev)
            say("model and batch on the device")
            if worker_pid and os.environ.get(SETTLE_ENV):
                # A small machine: the server is making the next standby worker, which would
                # take a CPU from the timed steps; they start once it is made. No step: the
                # losses stay aligned with local's.
                waited = _standby_refilled(float(os.environ[SETTLE_ENV]))
                say(f"the server's next standby worker is made ({waited:.1f} s waited)")
            res = timed_steps(lambda: trainer.step().item(), warmup, steps, server_pid, worker_pid)
            res["runtime"] = os.path.dirname(os.path.dirname(os.path.realpath(runtime.__file__)))
            return res
        finally:
            runtime.disconnect()
    if peer.startswith("rpc"):
        import torch.distributed.rpc as rpc

        _quiet_rpc()
        say("rpc: joining the server")
        cuda = kind == "gpu" and peer == "rpc"
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{address}", rpc_timeout=120)
        if cuda:
            opts.set_device_map("server", {0: 0})
        rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=opts)
        try:
            rpc.rpc_sync("server", _rpc_setup, args=(model, kind, cuda))
            say("model on the server's device")
            _, _, batch, _ = build(model, size)
            if cuda:
                batch = [b.to("cuda:0") for b in batch]
            x, y = batch
            return timed_steps(
                lambda: rpc.rpc_sync("server", _rpc_step, args=(x, y)).item(),
                warmup,
                steps,
                server_pid,
            )
        finally:
            rpc.shutdown()
    raise ValueError(f"unknown peer {peer!r}")


_rpc_trainer: Trainer | None = None
_rpc_cuda = False


def _rpc_setup(model: str, kind: str, cuda: bool) -> None:
    global _rpc_trainer, _rpc_cuda
    _rpc_trainer = Trainer(model, SIZES[kind][model], _device(kind))
    _rpc_cuda = cuda


def _rpc_step(x: Any, y: Any) -> Any:
    assert _rpc_trainer is not None
    device = _rpc_trainer.batch[0].device
    loss = _rpc_trainer.step(x.to(device), y.to(device)).detach()
    return loss if _rpc_cuda else loss.cpu()


def _quiet_rpc() -> None:
    """rpc's shutdown warns that it uses a deprecated process group itself: not ours to fix."""
    warnings.filterwarnings("ignore", "You are using a Backend", UserWarning)


def _rpc_server(port: int) -> None:
    import torch.distributed.rpc as rpc

    _quiet_rpc()
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    rpc.init_rpc("server", rank=1, world_size=2, rpc_backend_options=opts)
    rpc.shutdown()


#: The forwarding servers' isolation (``--isolation``).
ISOLATION = ["process"]
#: At most how many seconds a forwarded peer waits for the server's next standby worker (set
#: on a small machine, with ``--isolation process``); see the module's docstring.
SETTLE_ENV = "GPU_TRACE_BENCH_SETTLE_S"
SETTLE_S = 30.0
#: Fewer CPUs than this: a small machine, where a worker being made disturbs the timing.
SMALL_MACHINE_CPUS = 8


def _serve(kind: str, isolation: str) -> None:
    from gpu_trace import runtime

    # Before torch loads, as `gpu-trace serve` does: a server's process must not register the
    # remote backend, or CUDA backward passes fail in it (docs/remote.md). A baseline checkout
    # older than this call has none.
    getattr(runtime, "serving_process", lambda: None)()
    from gpu_trace.runtime.server.server import Server

    extra = {"isolation": isolation} if isolation != "shared" else {}  # a baseline has none
    server = Server("127.0.0.1:0", token=TOKEN, device=_device(kind), **extra).start()
    front, status = getattr(server, "front", None), os.environ.get(STATUS_ENV)
    if front is not None and status:
        import threading

        _write_status(front, status, None)  # there before a client can read it
        threading.Thread(target=_tell_workers, args=(front, status), daemon=True).start()
    print(server.address, flush=True)
    server.serve_forever()


def _tell_workers(front: Any, path: str) -> None:
    """Keep ``path`` saying which worker process runs each session, and how many standby
    workers are ready of how many the server keeps (read by :func:`_worker_of` and
    :func:`_standby_refilled` in the clients)."""
    last = None
    while True:
        last = _write_status(front, path, last)
        time.sleep(0.02)


def _write_status(front: Any, path: str, last: dict[str, Any] | None) -> dict[str, Any]:
    with front._lock:
        sessions = {str(sid): link.worker.pid for sid, link in front.links.items()}
    now = {"sessions": sessions, "ready": front.standby.ready_count(), "size": front.standby.size}
    if now != last:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(now))
        os.replace(tmp, path)
    return now


def _status() -> dict[str, Any]:
    path = os.environ.get(STATUS_ENV)
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _worker_of(session: int, timeout_s: float = 10.0) -> int:
    """The process id of the worker that runs ``session`` (0: not said: a shared server)."""
    if not os.environ.get(STATUS_ENV):
        return 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _status()
        if not status and not os.path.exists(os.environ[STATUS_ENV]):
            return 0  # a server that says nothing (shared isolation, a baseline's)
        pid = status.get("sessions", {}).get(str(session))
        if pid:
            return int(pid)
        time.sleep(0.02)
    return 0


def _standby_refilled(timeout_s: float) -> float:
    """Wait (at most ``timeout_s``) until the server's standby pool is full again; the seconds
    waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        status = _status()
        if not status or status.get("ready", 0) >= status.get("size", 0):
            break
        time.sleep(0.05)
    return time.monotonic() - t0


#: ``--baseline``'s import path (a folder whose ``gpu_trace`` is the baseline checkout's).
_BASELINE: dict[str, str] = {}


def baseline_path(root: Path, into: Path) -> Path:
    """A folder to put first on ``PYTHONPATH`` so that ``gpu_trace`` is ``root``'s (a checkout
    laid out by its pyproject's ``package-dir``: the package's folders live beside it)."""
    import tomllib

    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    pkg = into / "gpu_trace"
    pkg.mkdir(parents=True)
    for entry in (root / dirs["gpu_trace"]).iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        if name.startswith("gpu_trace."):
            (pkg / name.split(".", 1)[1]).symlink_to(root / folder)
    return into


def _env(kind: str, gpuless: bool, base: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if base:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [_BASELINE["path"], env.get("PYTHONPATH")])
        )
    if kind == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # see the module docstring
    if gpuless:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _spawn(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], env=env, **kw)


class Servers:
    """The forwarding servers, one for the runs of this checkout and one for the baseline's
    (``@base``), each started at most once (:meth:`start`, or at its first forwarded run) and
    stopped at the end (:meth:`close`)."""

    def __init__(self, kind: str, folder: Path) -> None:
        self.kind = kind
        self.folder = folder
        self.running: dict[bool, tuple[subprocess.Popen, str]] = {}  # by base: process, status
        self.addresses: dict[bool, str] = {}

    def start(self, base: bool) -> None:
        """Start the server (its address is read at :meth:`get`): on a big machine while the
        first local run goes on, which a torch import and a device context beside it barely
        disturb."""
        if base in self.running:
            return
        isolation = "shared" if base else ISOLATION[0]  # a baseline has one
        env = _env(self.kind, False, base)
        status = ""
        if isolation == "process":
            status = str(self.folder / ("status-base.json" if base else "status.json"))
            env[STATUS_ENV] = status
        say(f"starting the forwarding server ({isolation} isolation{', baseline' * base})")
        proc = _spawn(
            ["--serve", self.kind, "--isolation", isolation], env, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.running[base] = (proc, status)

    def get(self, base: bool) -> tuple[str, int, str]:
        """``(address, process id, status file)`` of the server (status "": it says none)."""
        self.start(base)
        proc, status = self.running[base]
        if base not in self.addresses:
            assert proc.stdout is not None
            self.addresses[base] = proc.stdout.readline().strip()
            if self.addresses[base]:
                say(f"the forwarding server serves on {self.addresses[base]}")
        if not self.addresses[base]:
            raise RuntimeError("the forwarding server did not start")
        return self.addresses[base], proc.pid, status

    def close(self) -> None:
        for proc, _ in self.running.values():
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self.running:
            say("the forwarding servers stopped")
        self.running.clear()


@contextlib.contextmanager
def peer_of(peer: str, kind: str, servers: Servers) -> Iterator[tuple[str, int, str]]:
    """The server side of ``peer`` (none for ``local``; the forwarding server of ``servers``;
    a fresh process for ``rpc``): yields its address, process id and status file."""
    env = _env(kind, False, peer.endswith("@base"))
    if peer == "local":
        yield "", 0, ""
        return
    if peer.startswith("forwarded"):
        yield servers.get(peer.endswith("@base"))
        return
    port = _free_port()
    proc = _spawn(["--rpc-server", str(port)], env)
    try:
        yield f"127.0.0.1:{port}", proc.pid, ""
    finally:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_peer(
    peer: str, model: str, kind: str, warmup: int, steps: int, servers: Servers
) -> dict[str, Any]:
    """One peer's run of one model: its processes, its result (or the error it ended with).
    The client's stderr (its phases) goes on to this process's as it comes."""
    try:
        with peer_of(peer, kind, servers) as (address, pid, status):
            args = ["--worker", peer, "--model", model, "--kind", kind, "--server-pid", str(pid)]
            args += ["--warmup", str(warmup), "--steps", str(steps), "--address", address]
            env = _env(kind, "gpuless" in peer, peer.endswith("@base"))
            if status:
                env[STATUS_ENV] = status
                if kind == "cpu" or (os.cpu_count() or 1) < SMALL_MACHINE_CPUS:
                    env[SETTLE_ENV] = str(SETTLE_S)
            with tempfile.TemporaryFile("w+") as out:
                proc = _spawn(args, env, stdout=out, stderr=subprocess.PIPE, text=True)
                tail = _relay(proc, f"  {peer}: ")
                try:
                    proc.wait(timeout=PROCESS_TIMEOUT_S)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    tail.join(10)
                out.seek(0)
                lines = out.read().strip().splitlines()
    except (subprocess.TimeoutExpired, RuntimeError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if proc.returncode != 0 or not lines:
        said = [line for line in getattr(tail, "lines", []) if line.strip()]
        last = said[-1:] or [f"exit status {proc.returncode}"]
        return {"error": last[0][:300]}
    return json.loads(lines[-1])


def _relay(proc: subprocess.Popen, prefix: str) -> Any:
    """A thread that copies ``proc``'s stderr to this process's, line by line, ``prefix``
    first, keeping the lines it saw (``.lines``) for the error a failed run ends with."""
    import threading

    seen: list[str] = []

    def copy() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line.rstrip("\n"))
            del seen[:-50]
            sys.stderr.write(prefix + line)
            sys.stderr.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.lines = seen  # type: ignore[attr-defined]
    thread.start()
    return thread


# ---- rounds and figures ----------------------------------------------------------------------------


def peers(kind: str) -> list[str]:
    if kind == "gpu":
        return ["local", "forwarded", "forwarded-gpuless", "rpc", "rpc-gpuless"]
    return ["local", "forwarded", "rpc"]


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per peer: the median of its rounds' medians (ms), the ratios to ``local`` of the same
    round (median, lowest, highest), whether every loss was bitwise ``local``'s, the median CPU
    ms per step of the client and of the server (where measured), and errors."""
    out: dict[str, dict[str, Any]] = {}
    names = [p for p in rounds[0]] if rounds else []
    for name in names:
        medians, ratios, same, errors = [], [], True, []
        for r in rounds:
            res, local = r.get(name, {}), r.get("local", {})
            if "error" in res:
                errors.append(res["error"])
                continue
            m = statistics.median(res["times_ms"])
            medians.append(m)
            if "times_ms" in local:
                ratios.append(m / statistics.median(local["times_ms"]))
                same = same and res["losses"] == local["losses"]
        row: dict[str, Any] = {"rounds": len(medians), "errors": errors}
        if medians:
            row["median_ms"] = statistics.median(medians)
        for side in ("client_cpu_ms", "server_cpu_ms"):
            cpu = [r[name][side] for r in rounds if side in r.get(name, {})]
            if cpu:
                row[side] = statistics.median(cpu)
        if ratios:
            row.update(ratio=statistics.median(ratios), low=min(ratios), high=max(ratios))
            row["bitwise"] = same
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--peers", help="comma-separated subset of the peers")
    parser.add_argument("--quick", action="store_true", help="one round of a few steps")
    parser.add_argument("--cpu", action="store_true", help="the CPU-device variant even on a GPU")
    parser.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    parser.add_argument(
        "--connect",
        metavar="JSON",
        help="options for runtime.connect in the forwarded peers (not @base), e.g. '{\"hold_us\": 250}'",
    )
    parser.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also run the forwarded peers with this checkout's runtime (client and server), as"
        " PEER@base: before/after in one run (e.g. a `git worktree add` of an earlier commit)",
    )
    parser.add_argument(
        "--isolation",
        choices=("process", "shared"),
        default="process",
        help="the forwarding server's isolation (default process, as gpu-trace serve's)",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--rpc-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    ISOLATION[0] = args.isolation
    if args.serve:
        _serve(args.serve, args.isolation)
        return
    if args.rpc_server:
        _rpc_server(args.rpc_server)
        return
    if args.worker:
        res = worker(
            args.worker,
            args.model,
            args.kind,
            args.warmup,
            args.steps,
            args.address,
            args.server_pid,
        )
        print(json.dumps(res), flush=True)
        return

    import torch

    kind = "gpu" if torch.cuda.is_available() and not args.cpu else "cpu"
    note = (
        f"GPU: {torch.cuda.get_device_name(0)}"
        if kind == "gpu"
        else "no GPU here: the CPU-device variant (small models, server and rpc on the CPU)"
    )
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 5, 2
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; one of {', '.join(MODELS)}")
    chosen = peers(kind)
    if args.connect:
        os.environ[CONNECT_OPTIONS] = json.dumps(json.loads(args.connect))
    if args.baseline:
        _BASELINE["path"] = str(
            baseline_path(Path(args.baseline).resolve(), Path(tempfile.mkdtemp()))
        )
        chosen += [f"{p}@base" for p in chosen if p.startswith("forwarded")]
    if args.peers:
        chosen = ["local", *(p for p in args.peers.split(",") if p in chosen and p != "local")]
    if not args.json:
        print(note, flush=True)
    say(f"{note}; models {', '.join(models)}; peers {', '.join(chosen)}; {args.rounds} rounds"
        f" of {args.warmup} + {args.steps} steps")  # fmt: skip
    results: dict[str, Any] = {"device": kind, "note": note, "models": {}}
    servers = Servers(kind, Path(tempfile.mkdtemp(prefix="forward-gpu-")))
    try:
        if kind == "gpu" and (os.cpu_count() or 1) >= SMALL_MACHINE_CPUS:
            for base in (False, True):  # beside the first run, local's (see Servers.start)
                if any(p.startswith("forwarded") and p.endswith("@base") == base for p in chosen):
                    servers.start(base)
        for model in models:
            rounds = []
            for i in range(args.rounds):
                k = i % len(chosen)
                order = chosen[k:] + chosen[:k]  # a different peer goes first each round
                r = {}
                for p in order:
                    say(f"{model}, round {i + 1}/{args.rounds}: {p}")
                    r[p] = run_peer(p, model, kind, args.warmup, args.steps, servers)
                    say(f"{model}, round {i + 1}/{args.rounds}: {p}: {_outcome(r[p])}")
                rounds.append({p: r[p] for p in chosen})
            results["models"][model] = {
                "size": SIZES[kind][model],
                "rounds": rounds,
                "summary": summarize(rounds),
            }
            if not args.json:
                print(table(model, results["models"][model]["summary"]), flush=True)
    finally:
        servers.close()
        shutil.rmtree(servers.folder, ignore_errors=True)
    if args.json:
        print(json.dumps(results))
    say("done")


def _outcome(res: dict[str, Any]) -> str:
    if "error" in res:
        return f"failed: {res['error']}"
    return f"median {statistics.median(res['times_ms']):.2f} ms of {len(res['times_ms'])} steps"


def table(model: str, summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{model}: peer, median step ms, ratio to local (lowest-highest), CPU ms a step"
        " (client/server), losses bitwise local's"
    ]
    for name, row in summary.items():
        if "median_ms" not in row:
            lines.append(f"  {name:<18} failed: {row['errors'][0] if row['errors'] else '?'}")
            continue
        ratio = (
            f"{row['ratio']:.2f}x ({row['low']:.2f}-{row['high']:.2f})" if "ratio" in row else ""
        )
        bitwise = (
            "" if name == "local" or "bitwise" not in row else ("yes" if row["bitwise"] else "NO")
        )
        failed = (
            f"  {len(row['errors'])} round(s) failed: {row['errors'][0]}" if row["errors"] else ""
        )
        cpu = f"{row.get('client_cpu_ms', 0):.2f}/" + (
            f"{row['server_cpu_ms']:.2f}" if "server_cpu_ms" in row else "-"
        )
        lines.append(
            f"  {name:<18} {row['median_ms']:9.2f}  {ratio:<22} {cpu:<13} {bitwise}{failed}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
