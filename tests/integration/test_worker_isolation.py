"""`gpu-trace serve --isolation process` (the default): each session in a worker process of its
own. A crash in one tenant's worker ends that session alone, with one clear error naming the op,
while another tenant trains on bitwise as it would alone; no tenant reads bytes another freed;
code run inside a worker (the test-only probes of ``runtime/worker/probes.py``) cannot reach
files, the network, the front or other workers (docs/sharing.md, "Isolation")."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from gpu_trace.runtime.client import admin_requests
from gpu_trace.runtime.protocol.wire import ProtocolError
from tests.integration import test_remote_server
from tests.integration.test_remote_server import Raw

ALICE = "alice-token-isolation-0123"
BOB = "bob-token-isolation-012345"
OPS = "ops-token-isolation-012345"
CAROL = "carol-token-isolation-0123"
TENANTS = f"""\
[[tenant]]
name = "alice"
token = "{ALICE}"
memory = "64MiB"

[[tenant]]
name = "bob"
token = "{BOB}"
memory = "256MiB"

[[tenant]]
name = "ops"
token = "{OPS}"
admin = true
"""
SECRET = 1234.5678

# Bob trains a small MLP on the server: one step, "ready", then (once the test says go) the rest;
# it prints its losses as exact hex floats. With "cpu" as its address it trains locally.
BOB_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if sys.argv[1] == "cpu":
        dev = "cpu"
    else:
        from gpu_trace import runtime
        dev = runtime.connect(sys.argv[1], token=sys.argv[2])
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(32, 64).to(dev), torch.randn(32, 8).to(dev)
    losses = []
    for step in range(12):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
        if step == 0:
            print("ready", flush=True)
            waited = time.monotonic()
            while not os.path.exists(sys.argv[3]):
                if time.monotonic() - waited > 900:  # the test failed before saying go
                    sys.exit("no go within 900 s")
                time.sleep(0.02)
    print(" ".join(losses), flush=True)
    """
)


class Served:
    """A `gpu-trace serve --isolation process` with the tenants above; its stderr in a file."""

    def __init__(self, tmp: Path, extra: str = "", args: tuple[str, ...] = ()) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "tenants.toml").write_text(TENANTS + extra)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
        env.update(GPU_TRACE_HOME=str(tmp / "home"), GPU_TRACE_WORKER_PROBES="1")
        env["OMP_NUM_THREADS"] = "1"
        self.log = tmp / "serve.log"
        argv = [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0"]
        argv += ["--device", "cpu", "--tenants", str(tmp / "tenants.toml"), "--metrics", "off"]
        argv += ["--isolation", "process", *args]
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(argv, stderr=err, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while "serving cpu on" not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.1)
        line = next(ln for ln in self.text().splitlines() if "serving cpu on" in ln)
        self.address = line.split(" on ")[1].split()[0]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[int]:
        return [p.pid for p in psutil.Process(self.proc.pid).children() if p.is_running()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("isolation"))
    yield s
    while test_remote_server._open:
        test_remote_server._open.pop().close()
    s.close()
    assert s.proc.returncode == 0, s.text()[-3000:]


def _bob(address: str, go: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
    return subprocess.Popen(
        [sys.executable, "-c", BOB_SCRIPT, address, BOB, str(go)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _losses(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Bob's losses trained locally, alone."""
    go = tmp_path_factory.mktemp("alone") / "go"
    go.touch()
    return _losses(_bob("cpu", go))


@pytest.mark.parametrize(
    ("probe", "how"),
    [("segv", "SIGSEGV"), ("fpe", "SIGFPE"), ("abort", "SIGABRT")],
)
def test_a_crash_ends_only_its_own_session(
    server: Served, alone: str, tmp_path: Path, probe: str, how: str
) -> None:
    go = tmp_path / "go"
    bob = _bob(server.address, go)
    assert bob.stdout is not None and bob.stdout.readline().strip() == "ready"
    alice = Raw(server.address, token=ALICE)
    assert alice.batch([["aten::ones.default", [[1024]], {}, [1]]])["ok"]
    with pytest.raises(ProtocolError) as gone:
        alice.batch([["rt::worker_probe", [probe], {}, None]])
    message = str(gone.value)
    assert f"worker process died (killed by {how}) while running rt::worker_probe" in message
    go.touch()  # bob trains on, after the crash
    assert _losses(bob) == alone
    deaths = [ln for ln in server.text().splitlines() if f"died (killed by {how})" in ln]
    assert len(deaths) == 1 and "tenant alice" in deaths[0], server.text()[-2000:]
    again = Raw(server.address, token=ALICE)  # the server takes new sessions
    assert again.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
    assert torch.equal(again.fetch(1), torch.ones(4))
    listing = admin_requests.list_sessions(server.address, OPS)
    assert listing["server"]["worker_deaths"] >= 1
    # The workers' batches, as they report them (every 100 ms at most, and an ended session's
    # when the front has seen its worker end): asked again until one came, not at a set time.
    deadline = time.monotonic() + 60
    while listing["server"]["batches"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        listing = admin_requests.list_sessions(server.address, OPS)
    assert listing["server"]["batches"] > 0


@pytest.mark.parametrize("where", ["op", "sync"])
def test_a_failed_device_context_ends_only_its_own_session(
    server: Served, alone: str, tmp_path: Path, where: str
) -> None:
    """On CUDA an out-of-range index fails the process's context, reported by the op or, as a
    rule, at the batch's sync (tests/gpu/test_tenant_isolation_gpu.py does it for real; the
    first H100 check found the sync's error sent as "internal error in the server"). Here a
    probe stands for it: the batch's reply carries the error as the batch's own, the session's
    next batch is told its context failed, and the other tenant trains on bitwise as alone."""
    go = tmp_path / "go"
    bob = _bob(server.address, go)
    assert bob.stdout is not None and bob.stdout.readline().strip() == "ready"
    alice = Raw(server.address, token=ALICE)
    done = alice.batch(
        [["aten::ones.default", [[4]], {}, [1]], ["rt::context_fault", [where], {}, None]]
    )
    assert not done["ok"]
    error = done["error"]
    assert "device-side assert" in error["message"], error
    assert error["index"] == 1
    assert error["op"] == ("rt::context_fault" if where == "op" else "(the batch, at its sync)")
    with pytest.raises(ProtocolError, match="CUDA context failed"):
        alice.batch([["aten::ones.default", [[1]], {}, [5]]])
    go.touch()
    assert _losses(bob) == alone
    assert "internal error" not in server.text()
    again = Raw(server.address, token=ALICE)  # a new session, a new worker and context
    assert again.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
    assert torch.equal(again.fetch(1), torch.ones(4))


def test_memory_another_tenant_freed_is_never_read(server: Served) -> None:
    bob = Raw(server.address, token=BOB)
    n = 4 << 20  # 16 MiB of float32
    assert bob.batch([["aten::full.default", [[n], SECRET], {"dtype": {"d": "float32"}}, [1]]])[
        "ok"
    ]
    assert bob.batch([["aten::sum.default", [{"h": 1}], {}, [2]]], free=[1])["ok"]
    bob.sock.close()
    alice = Raw(server.address, token=ALICE)
    done = alice.batch(
        [
            ["aten::empty.memory_format", [[n]], {"dtype": {"d": "float32"}}, [1]],
            ["aten::empty_strided.default", [[n], [1]], {"dtype": {"d": "float32"}}, [2]],
        ]
    )
    assert done["ok"], done
    for handle in (1, 2):
        assert not (alice.fetch(handle) == SECRET).any()


def test_cross_tenant_reads_and_writes_reach_nothing(server: Served) -> None:
    """The issue's two attacks: segment_reduce with offsets past its data (a read of the heap)
    and a pooling backward scattering at indices far outside its grad_input (a write). Each
    ends refused, in an error, or in the attacker's own dead worker; the victim is intact."""
    bob = Raw(server.address, token=BOB)
    assert bob.batch([["aten::full.default", [[4096], SECRET], {"dtype": {"d": "float32"}}, [1]]])[
        "ok"
    ]
    alice = Raw(server.address, token=ALICE)
    offsets = torch.arange(0, 1 << 22, 1 << 12, dtype=torch.int64)
    setup = [
        ["aten::ones.default", [[16]], {}, [1]],
        ["aten::arange.start_step", [0, 1 << 22, 1 << 12], {"dtype": {"d": "int64"}}, [2]],
    ]
    assert alice.batch(setup)["ok"]
    read = ["aten::segment_reduce.default", [{"h": 1}, "sum"], {"offsets": {"h": 2}}, [3]]
    try:
        done = alice.batch([read])
        if done["ok"]:
            assert not (alice.fetch(3) == SECRET).any()
    except ProtocolError as exc:  # the attacker's own worker died
        assert "worker process died" in str(exc)
    assert len(offsets) == 1024
    alice = Raw(server.address, token=ALICE)
    ops = [
        ["aten::ones.default", [[1, 1, 2, 2]], {}, [1]],
        ["aten::zeros.default", [[1, 1, 4, 4]], {}, [2]],
        ["aten::full.default", [[1, 1, 2, 2], 1 << 40], {"dtype": {"d": "int64"}}, [3]],
        [
            "aten::max_pool2d_with_indices_backward.grad_input",
            [{"h": 1}, {"h": 2}, [2, 2], [2, 2], [0, 0], [1, 1], False, {"h": 3}],
            {"grad_input": {"h": 2}},
            [None],
        ],
    ]
    try:
        alice.batch(ops)
    except ProtocolError as exc:
        assert "worker process died" in str(exc)
    assert (bob.fetch(1) == SECRET).all()
    assert bob.batch([["aten::sum.default", [{"h": 1}], {}, [2]]])["ok"]


def test_code_run_inside_a_worker_is_contained(server: Served, tmp_path: Path) -> None:
    """What an attacker who got code running in their worker tries: each is refused."""
    private = tmp_path / "private.txt"
    private.write_text("another's file")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    bob = Raw(server.address, token=BOB)  # another tenant's worker
    assert bob.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
    alice = Raw(server.address, token=ALICE)
    assert alice.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
    mine = alice.batch([["rt::worker_probe", ["pid"], {}, [1]]])["results"]["0"]
    others = [pid for pid in server.workers() if pid != mine]
    assert len(others) >= 2  # bob's, and the standby workers
    tries = [
        ["open", str(private)],
        ["open", "/etc/hostname"] if os.path.exists("/etc/hostname") else ["open", str(private)],
        ["connect", f"127.0.0.1:{port}"],
        ["signal", str(server.proc.pid)],
        ["spawn", ""],
        ["alloc", str(8 << 30)],
    ]
    tries += [["signal", str(pid)] for pid in others]
    tries += [["read-mem", str(pid)] for pid in others]
    for probe in tries:
        done = alice.batch([["rt::worker_probe", probe, {}, [1]]])
        assert done["ok"], done
        said = done["results"]["0"]
        assert said.startswith("refused"), (probe, said)
    with pytest.raises(TimeoutError):
        listener.accept()  # nothing connected
    listener.close()
    assert bob.batch([["aten::sum.default", [{"h": 1}], {}, [2]]])["ok"]


def test_a_killed_front_leaves_no_workers(tmp_path: Path) -> None:
    served = Served(tmp_path)
    alice = Raw(served.address, token=ALICE)
    assert alice.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
    workers = served.workers()
    assert workers
    served.proc.kill()
    served.proc.wait()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in workers], timeout=60)
    assert not alive, [p.pid for p in alive]
    alice.sock.close()


@pytest.mark.parametrize(
    "op",
    [
        ["aten::mvlgamma.default", [{"h": 1}, 1 << 25], {}, [2]],  # 1.2 GB of temporaries
        ["aten::eye.default", [17000], {}, [2]],  # 1.2 GB, no device given
        ["aten::arange.start_step", [0, 10**8, 1], {"dtype": {"d": "int64"}}, [2]],
        ["aten::randperm.default", [10**9], {}, [2]],
    ],
    ids=["mvlgamma", "eye", "arange", "randperm"],
)
def test_what_a_quota_misses_stops_at_the_workers_allowance(server: Served, op: list) -> None:
    """Kernels' temporaries and factories sized only after they allocate: within a worker they
    stop at its host-memory allowance (alice: 64 MiB + 1 GiB), and its session goes on."""
    alice = Raw(server.address, token=ALICE)
    alice.sock.settimeout(120)
    assert alice.batch([["aten::ones.default", [[8]], {}, [1]]])["ok"]
    done = alice.batch([op])
    assert not done["ok"], done
    assert torch.equal(alice.fetch(1), torch.ones(8))


def test_a_batch_past_its_tenants_limit_ends_its_session(tmp_path: Path) -> None:
    """carol's batch_s is 1 s: twenty 2048 x 2048 products in one batch run longer. (Her
    priority class is below the others': her worker runs at a higher nice.)"""
    carol_tenant = f'\n[[tenant]]\nname = "carol"\ntoken = "{CAROL}"\nbatch_s = 1\npriority = -1\n'
    served = Served(tmp_path, extra=carol_tenant)
    try:
        carol = Raw(served.address, token=CAROL)
        carol.sock.settimeout(120)
        setup = [
            ["aten::ones.default", [[2048, 2048]], {}, [1]],
            ["aten::empty.memory_format", [[2048, 2048]], {}, [2]],
        ]
        assert carol.batch(setup)["ok"]
        pid = carol.batch([["rt::worker_probe", ["pid"], {}, [3]]])["results"]["0"]
        assert _nices(pid) == {11}  # a lower priority class: nice 10 + 1, on every thread
        mm = ["aten::mm.out", [{"h": 1}, {"h": 1}], {"out": {"h": 2}}, [None]]
        with pytest.raises(ProtocolError, match=r"limit of 1 s \(running aten::mm.out\)"):
            carol.batch([mm] * 20)
        bob = Raw(served.address, token=BOB)
        assert bob.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
        assert [ln for ln in served.text().splitlines() if "ran past" in ln] != []
    finally:
        served.close()


def _nices(pid: int) -> set[int]:
    """The nice values of process ``pid``'s threads (Linux keeps one per thread)."""
    return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_under_las_a_worker_sinks_as_its_session_attains_service(tmp_path: Path) -> None:
    """`--policy las --las-thresholds 0.2`: a session past 0.2 s of device time sinks to the
    second queue, its worker's threads to nice 10; a new session's worker starts at the top."""
    served = Served(tmp_path, args=("--policy", "las", "--las-thresholds", "0.2"))
    try:
        alice = Raw(served.address, token=ALICE)
        alice.sock.settimeout(120)
        setup = [
            ["aten::ones.default", [[1024, 1024]], {}, [1]],
            ["aten::empty.memory_format", [[1024, 1024]], {}, [2]],
        ]
        assert alice.batch(setup)["ok"]
        pid = alice.batch([["rt::worker_probe", ["pid"], {}, [3]]])["results"]["0"]
        assert _nices(pid) == {0}
        mm = ["aten::mm.out", [{"h": 1}, {"h": 1}], {"out": {"h": 2}}, [None]]
        deadline = time.monotonic() + 120
        while _nices(pid) != {10}:  # each batch is service attained; a report carries it
            assert time.monotonic() < deadline, _nices(pid)
            assert alice.batch([mm] * 4)["ok"]
        bob = Raw(served.address, token=BOB)
        bob.sock.settimeout(120)
        assert bob.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
        bob_pid = bob.batch([["rt::worker_probe", ["pid"], {}, [2]]])["results"]["0"]
        assert _nices(bob_pid) == {0}
        assert "policy las (thresholds 0.2 s)" in served.text()
    finally:
        served.close()
