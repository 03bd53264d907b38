"""A worker's containment, in real processes: a child imports torch, contains itself (all layers,
one layer, or none), then tries what the code of a hostile session would, and reports each try;
the test holds what it tries to reach (a TCP listener, an abstract UNIX socket, a sibling
process, a file outside the allowed paths) and checks from outside too (the listener saw no
connection; a process of the worker's uid cannot read its environment).

The uncontained run shows that every try succeeds without containment, and the runs with one
layer which tries each layer refuses alone, so no assertion holds by accident of another.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_trace.runtime.worker import sandbox

if importlib.util.find_spec("torch") is None:
    pytest.skip("the worker's tries use torch (the torch extra)", allow_module_level=True)
if sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"):
    pytest.skip("worker containment is for Linux on x86_64 and aarch64", allow_module_level=True)

ROOT = os.geteuid() == 0
ALLOWANCE = 256 << 20

# The worker: setup first (torch, a thread count), then containment, then the tries. Everything
# it uses after a uid drop is imported before (the uid may not read Python's install).
CHILD = r"""
import json, os, socket, subprocess, sys, threading
from concurrent.futures import ThreadPoolExecutor

from gpu_trace import runtime

runtime.serving_process()
import torch

from gpu_trace.runtime.worker import sandbox, syscalls

args = json.loads(sys.argv[1])
torch.set_num_threads(2)
torch.manual_seed(0)
a, b = torch.randn(64, 64), torch.randn(64, 64)
expected = a @ b
control = socket.socket(fileno=args["control"])
c = sandbox.Containment(
    host_memory_bytes=args["allowance"], uid=args["uid"], writable=(args["scratch"],)
)
sandbox._apply(c, args["first"])
if args["dumpable_again"]:
    # As a worker that never was root is: a change of uid makes a process undumpable.
    syscalls.prctl(syscalls.PR_SET_DUMPABLE, 1)
contained = sandbox.contain(c) if args["layers"] is None else sandbox._apply(c, args["layers"])
results = {"layers": contained.layers}


def attempt(name, fn):
    try:
        fn()
    except BaseException as e:
        results[name] = f"refused: {type(e).__name__}: {e}"
    else:
        results[name] = "allowed"


def read(path):
    with open(path, "rb") as f:
        f.read(1)


def in_new_thread(fn):
    def run():
        attempt("outside_file_new_thread", fn)

    t = threading.Thread(target=run)
    t.start()
    t.join()


def tcp():
    socket.create_connection(("127.0.0.1", args["tcp_port"]), timeout=10).close()


def abstract():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect("\0" + args["abstract"])


def write_scratch():
    with open(os.path.join(args["scratch"], f"{os.getpid()}.txt"), "w") as f:
        f.write("ok")


def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def torch_work():
    assert torch.equal(a @ b, expected)
    big = torch.randn(512, 512)
    (big @ big).sum().item()  # big enough for the intra-op threads
    lin = torch.nn.Linear(64, 8)
    lin(a).pow(2).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    with ThreadPoolExecutor(2) as pool:
        sums = list(pool.map(lambda m: (m @ m).sum().item(), [a, b]))
    assert len(sums) == 2 and torch.get_num_threads() == 2


attempt("outside_file", lambda: read(args["outside"]))
in_new_thread(lambda: read(args["outside"]))
attempt("scratch_write", write_scratch)
attempt("tcp_connect", tcp)
attempt("abstract_unix_connect", abstract)
attempt("kill_parent", lambda: os.kill(os.getppid(), 0))
attempt("kill_sibling", lambda: os.kill(args["sibling"], 0))
attempt("sibling_mem", lambda: open(f"/proc/{args['sibling']}/mem", "rb").close())  # opening checks
attempt("parent_environ", lambda: read(f"/proc/{os.getppid()}/environ"))
attempt("memory", lambda: bytearray(2 * args["allowance"]))
attempt("fork", fork)
attempt("subprocess", lambda: subprocess.run(["true"], check=True))
attempt("torch", torch_work)

# The front hands a client's connection over as the worker waits: receive it, talk on it.
control.sendall(b"ready")
try:
    _, fds, _, _ = socket.recv_fds(control, 16, 1)
    with socket.socket(fileno=fds[0]) as conn:
        conn.sendall(b"pong:" + conn.recv(4))
    results["fd_passing"] = "allowed"
except BaseException as e:
    results["fd_passing"] = f"refused: {type(e).__name__}: {e}"
print(json.dumps(results), flush=True)
try:
    os.execv("/bin/echo", ["echo", "EXECVE-RAN"])
except BaseException as e:
    print(json.dumps({"execve": f"refused: {type(e).__name__}: {e}"}), flush=True)
"""

TRIES = (
    "outside_file",
    "outside_file_new_thread",
    "tcp_connect",
    "abstract_unix_connect",
    "kill_parent",
    "kill_sibling",
    "sibling_mem",
    "parent_environ",
    "memory",
    "fork",
    "subprocess",
    "execve",
)


def _landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1)))


def _has_seccomp() -> bool:
    return "Seccomp:" in Path("/proc/self/status").read_text()


ABI = _landlock_abi()


@dataclass
class World:
    """What the test holds that a worker must not reach."""

    folder: Path
    outside: Path
    scratch: Path
    sibling: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    # Not under pytest's tmp_path: its folders are the test uid's alone, and the outside file must
    # be one that a dropped uid may read, so that only Landlock refuses it.
    folder = Path(tempfile.mkdtemp(prefix="gpu-trace-sandbox-"))
    folder.chmod(0o755)
    outside = folder / "outside.txt"
    outside.write_text("not for workers")
    outside.chmod(0o644)
    scratch = folder / "scratch"
    scratch.mkdir()
    scratch.chmod(0o777)
    sibling = subprocess.Popen(["sleep", "600"])
    try:
        yield World(folder, outside, scratch, sibling)
    finally:
        sibling.kill()
        sibling.wait()
        shutil.rmtree(folder)


def _observe(pid: int, as_uid: int | None) -> str:
    """Whether a process of ``as_uid`` (this test's uid: None) reads the worker's environment."""
    extra = {} if as_uid is None else {"user": as_uid, "group": as_uid, "extra_groups": []}
    done = subprocess.run(
        ["cat", f"/proc/{pid}/environ"], capture_output=True, timeout=30, check=False, **extra
    )
    return "allowed" if done.returncode == 0 else f"refused: {done.stderr.decode().strip()}"


def run_worker(
    world: World,
    layers: tuple[str, ...] | None,
    *,
    uid: int | None = None,
    first: tuple[str, ...] = (),
    dumpable_again: bool = False,
    observer_uid: int | None = None,
) -> dict[str, object]:
    """Run a worker contained with ``layers`` (None: :func:`contain`, all of them), after
    ``first``; what each try gave, what the test saw from outside (``observer``,
    ``tcp_listener``), and ``fd_passing``."""
    abstract = f"gpu-trace-sandbox-{uuid.uuid4().hex}"
    front, worker_end = socket.socketpair()
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix_listener,
        front,
    ):
        unix_listener.bind("\0" + abstract)
        unix_listener.listen()
        args = {
            "control": worker_end.fileno(),
            "allowance": ALLOWANCE,
            "uid": uid,
            "first": list(first),
            "dumpable_again": dumpable_again,
            "layers": None if layers is None else list(layers),
            "scratch": str(world.scratch),
            "outside": str(world.outside),
            "tcp_port": listener.getsockname()[1],
            "abstract": abstract,
            "sibling": world.sibling.pid,
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            pass_fds=(worker_end.fileno(),),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker_end.close()
        try:
            front.settimeout(60)
            if front.recv(5) != b"ready":
                out, err = proc.communicate(timeout=60)
                pytest.fail(f"the worker ended before it was ready:\n{out}\n{err}")
            observer = _observe(proc.pid, observer_uid)
            # A client's connection, handed over as the front does.
            with socket.create_server(("127.0.0.1", 0)) as clients:
                client = socket.create_connection(clients.getsockname(), timeout=30)
                accepted, _ = clients.accept()
            with client, accepted:
                socket.send_fds(front, [b"c"], [accepted.fileno()])
                accepted.close()
                client.sendall(b"ping")
                reply = client.recv(16)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        listener.setblocking(False)
        try:
            listener.accept()[0].close()
            tcp_listener = "saw a connection"
        except BlockingIOError:
            tcp_listener = "saw none"
    results: dict[str, object] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    if "torch" not in results:
        pytest.fail(f"the worker reported nothing:\n{out}\n{err}")
    results["execve"] = "allowed" if "EXECVE-RAN" in out else results.get("execve", "missing")
    results["observer"] = observer
    results["tcp_listener"] = tcp_listener
    if reply != b"pong:ping":
        results["fd_passing"] = f"refused: replied {reply!r}"
    return results


def _not_refused(results: dict[str, object], tries: set[str]) -> dict[str, object]:
    """Those of ``tries`` that were not refused, with what they gave (``{}``: all were)."""
    return {t: results[t] for t in sorted(tries) if not str(results[t]).startswith("refused")}


# ---- without the kernel ------------------------------------------------------------------------


def test_importable_without_torch() -> None:
    code = (
        "import sys; import gpu_trace.runtime.worker.sandbox as s; "
        "assert 'torch' not in sys.modules, 'torch'; print(s.LAYERS)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_misuse_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="host_memory_bytes"):
        sandbox.Containment(host_memory_bytes=-1)
    with pytest.raises(ValueError, match="absolute"):
        sandbox.Containment(host_memory_bytes=None, writable=("scratch",))
    with pytest.raises(ValueError, match="open_files"):
        sandbox.Containment(host_memory_bytes=None, open_files=0)
    with pytest.raises(ValueError, match="unknown layers"):
        sandbox._apply(sandbox.Containment(host_memory_bytes=None), ["network"])


def test_for_worker_writes_the_nvidia_nodes_on_cuda_only() -> None:
    cuda = sandbox.for_worker("cuda:0", host_memory_bytes=1 << 30, writable=("/srv/spans",))
    assert "/dev/nvidia*" in cuda.writable and "/srv/spans" in cuda.writable
    assert cuda.host_memory_bytes == 1 << 30 and cuda.uid is None
    assert not any("nvidia" in p for p in sandbox.for_worker("cpu").writable)
    paths = sandbox.default_paths()
    assert sys.prefix in paths and "/proc" in paths and "/usr" in paths


# ---- in real processes -------------------------------------------------------------------------


def test_without_containment_every_try_succeeds(world: World) -> None:
    """What makes the other tests mean something: uncontained, each try reaches its target."""
    r = run_worker(world, ())
    assert r["layers"] == {}
    assert {t: r[t] for t in TRIES if r[t] != "allowed"} == {}
    assert r["tcp_listener"] == "saw a connection"
    assert r["torch"] == "allowed" and r["fd_passing"] == "allowed"


def test_a_contained_worker_reaches_nothing_and_still_works(world: World) -> None:
    r = run_worker(world, None, uid=sandbox.NOBODY, observer_uid=sandbox.NOBODY if ROOT else None)
    layers = r["layers"]
    assert isinstance(layers, dict)
    assert layers["uid"].startswith("held" if ROOT else "skipped: not root")
    assert layers["rlimits"].startswith("held") and layers["dumpable"] == "held"
    if ABI:
        assert layers["landlock"].startswith(f"held (ABI {ABI}: fs")
    if _has_seccomp():
        assert layers["seccomp"].startswith("held")
    tries = set(TRIES) | {"observer"}
    if ABI < 6:
        tries.discard("abstract_unix_connect")  # Landlock's scopes only see abstract sockets
    assert _not_refused(r, tries) == {}
    assert r["tcp_listener"] == "saw none"
    assert r["scratch_write"] == "allowed"
    assert r["torch"] == "allowed", r["torch"]
    assert r["fd_passing"] == "allowed", r["fd_passing"]


def _alone(layer: str) -> set[str]:
    """What ``layer`` refuses alone, with the kernel features this machine has."""
    if layer == "rlimits":
        return {"memory"}
    if layer == "seccomp":
        return {"tcp_connect", "kill_parent", "kill_sibling", "fork", "subprocess", "execve"}
    if layer == "uid":  # another uid's process, and root's files outside the allowed paths
        return {"kill_parent", "kill_sibling", "sibling_mem", "parent_environ"}
    refused = {"outside_file", "outside_file_new_thread", "sibling_mem"}
    if not ROOT:  # root's CAP_PERFMON reads environ past Landlock: see the next test
        refused.add("parent_environ")
    if ABI >= 4:
        refused.add("tcp_connect")
    if ABI >= 6:
        refused |= {"abstract_unix_connect", "kill_parent", "kill_sibling"}
    return refused


@pytest.mark.parametrize("layer", ["rlimits", "uid", "landlock", "seccomp"])
def test_each_layer_refuses_its_share_alone(world: World, layer: str) -> None:
    if layer == "uid" and not ROOT:
        pytest.skip("dropping the uid needs root")
    if layer == "landlock" and not ABI:
        pytest.skip("the kernel has no Landlock (or it is not in lsm=)")
    if layer == "seccomp" and not _has_seccomp():
        pytest.skip("the kernel has no seccomp")
    r = run_worker(world, (layer,), uid=sandbox.NOBODY)
    layers = r["layers"]
    assert isinstance(layers, dict) and list(layers) == [layer]
    assert layers[layer].startswith("held"), layers
    assert _not_refused(r, _alone(layer)) == {}
    if "tcp_connect" in _alone(layer):
        assert r["tcp_listener"] == "saw none"
    assert r["torch"] == "allowed", r["torch"]
    assert r["fd_passing"] == "allowed", r["fd_passing"]


@pytest.mark.skipif(not ROOT or not ABI, reason="needs root, and Landlock")
def test_a_worker_that_stays_root_has_no_capabilities(world: World) -> None:
    """Without a uid to drop to, root keeps uid 0 but no capability: Landlock then refuses
    reading another process's environment, which CAP_PERFMON (or CAP_SYS_ADMIN) may otherwise
    read past it; and killing the test, which CAP_KILL otherwise may."""
    r = run_worker(world, ("uid", "landlock"), uid=None)
    layers = r["layers"]
    assert isinstance(layers, dict) and layers["uid"].startswith("held (stays root")
    tries = {"parent_environ", "sibling_mem", "outside_file"}
    if ABI >= 6:
        tries |= {"kill_parent", "kill_sibling"}
    assert _not_refused(r, tries) == {}
    assert r["torch"] == "allowed" and r["fd_passing"] == "allowed"


def test_undumpable_worker_is_out_of_reach_of_its_own_uid(world: World) -> None:
    """Another process of the worker's uid (outside its Landlock domain, as the front is) may read
    its memory and environment unless the worker is undumpable. As root, the worker drops to
    nobody first and is made dumpable again, as one that never was root is; root itself may read
    any process's, so the reader is nobody too."""
    first = ("uid",) if ROOT else ()
    reader = sandbox.NOBODY if ROOT else None
    for layers, seen in (((), "allowed"), (("dumpable",), "refused")):
        r = run_worker(
            world,
            layers,
            uid=sandbox.NOBODY,
            first=first,
            dumpable_again=ROOT,
            observer_uid=reader,
        )
        assert str(r["observer"]).startswith(seen), (layers, r["observer"])
