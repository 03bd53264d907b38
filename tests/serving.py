"""A `gpu-trace serve` of a test's own, in a subprocess (its random generator and thread count are
its own; on CUDA it must not share the test's process, where a forwarding client's registered
backend breaks CUDA autograd), and the RESULT line that tests' programs print."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

#: cuBLAS's deterministic workspace, for bitwise comparisons between processes.
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

# `gpu-trace serve` as `python -m gpu_trace serve` runs it, with deterministic algorithms turned on
# when it imports torch (after its own start-up, so nothing else about the process changes). With
# `--isolation process` its workers take its settings with their session (runtime/server/front.py).
_DETERMINISTIC_SERVE = textwrap.dedent(
    """
    import sys
    from gpu_trace._imports import when_imported
    when_imported("torch", lambda torch: torch.use_deterministic_algorithms(True))
    from gpu_trace.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@contextlib.contextmanager
def served(
    home: Path,
    token: str,
    *args: str,
    device: str = "cuda:0",
    deterministic: bool = False,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, dict[str, str]]]:
    """A server on ``device`` (``args``: more of serve's options; ``deterministic``: torch's
    deterministic algorithms on in it; ``env``: more of its environment); yields its address and
    the environment its clients need (the token, ``home`` as GPU_TRACE_HOME, cuBLAS's
    deterministic workspace)."""
    env = {**os.environ, **DETERMINISTIC, "GPU_TRACE_HOME": str(home), **(env or {})}
    env["GPU_TRACE_REMOTE_TOKEN"] = token
    env.pop("GPU_TRACE_REMOTE", None)
    start = ["-c", _DETERMINISTIC_SERVE] if deterministic else ["-m", "gpu_trace"]
    server = subprocess.Popen(
        [sys.executable, *start, "serve", "--listen", "127.0.0.1:0", "--device", device,
         "--gpu-activity", "off", "--metrics", "off", *args],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    # Every line it says goes through a queue, read from the start by a thread of its own: the
    # serving line may come after warnings, and a full pipe would block the server.
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in server.stderr or []:
            lines.put(line)
        lines.put("")  # it ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        serving = _serving_line(lines, 120)
        assert f"serving {device} on" in serving, serving
        yield serving.split(" on ")[1].split()[0], env
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        reader.join(10)  # it ends with the server's stderr
        if server.stderr is not None:
            server.stderr.close()


def _serving_line(lines: queue.Queue[str], timeout_s: float) -> str:
    """The server's "serving ..." line, waiting at most ``timeout_s`` for each line."""
    seen = []
    for _ in range(50):
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError("the server said nothing more: " + "".join(seen)) from None
        if not line:
            raise AssertionError("the server ended: " + "".join(seen))
        if line.startswith("gpu-trace: serving"):
            return line
        seen.append(line)
    return "".join(seen)


def result(out: subprocess.CompletedProcess) -> dict:
    """What a test program printed on its ``RESULT {json}`` line (it must have exited 0)."""
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


#: The token of :func:`cpu_server`'s servers.
CPU_TOKEN = "forwarding-unit-tests-token-0123"


@contextlib.contextmanager
def cpu_server(home: Path) -> Iterator[str]:
    """A server on the CPU device running one intra-op thread (``OMP_NUM_THREADS=1``: CPU
    reductions split the same way as a test's one-thread reference), what the forwarding unit
    tests share; yields its address (clients use :data:`CPU_TOKEN`)."""
    with served(home, CPU_TOKEN, device="cpu", env={"OMP_NUM_THREADS": "1"}) as (address, _):
        yield address


@contextlib.contextmanager
def connected(address: str) -> Iterator[object]:
    """This process connected to a :func:`cpu_server` (explicit mode): yields the remote
    ``torch.device``; disconnected after."""
    from gpu_trace import runtime

    device = runtime.connect(address, token=CPU_TOKEN)
    try:
        yield device
    finally:
        runtime.disconnect()
