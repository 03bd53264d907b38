"""A `gpu-trace serve` of its own for tests/gpu: a subprocess (never the test's process, where a
forwarding client's registered backend would break CUDA autograd), and the RESULT line that the
tests' programs print."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

#: cuBLAS's deterministic workspace, for bitwise comparisons between processes.
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

# `gpu-trace serve` as `python -m gpu_trace serve` runs it, with deterministic algorithms turned on
# when it imports torch (after its own start-up, so nothing else about the process changes).
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
    home: Path, token: str, *, deterministic: bool = True, device: str = "cuda:0"
) -> Iterator[tuple[str, dict[str, str]]]:
    """A server on ``device``; yields its address and the environment its clients need (the
    token, ``home`` as GPU_TRACE_HOME, cuBLAS's deterministic workspace)."""
    env = {**os.environ, **DETERMINISTIC, "GPU_TRACE_HOME": str(home)}
    env["GPU_TRACE_REMOTE_TOKEN"] = token
    env.pop("GPU_TRACE_REMOTE", None)
    start = ["-c", _DETERMINISTIC_SERVE] if deterministic else ["-m", "gpu_trace"]
    server = subprocess.Popen(
        [sys.executable, *start, "serve", "--listen", "127.0.0.1:0", "--device", device,
         "--gpu-activity", "off", "--metrics", "off"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    rest: list[str] = []
    try:
        serving = _serving_line(server, 120)
        assert f"serving {device} on" in serving, serving
        # Read what else it says, so a full pipe never blocks it.
        drain = threading.Thread(target=lambda: rest.extend(server.stderr or []), daemon=True)
        drain.start()
        yield serving.split(" on ")[1].split()[0], env
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def _serving_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The server's "serving ..." line (warnings may come first), waiting at most ``timeout_s``
    for each line."""
    assert proc.stderr is not None
    seen = []
    for _ in range(50):
        ready, _, _ = select.select([proc.stderr], [], [], timeout_s)
        assert ready, "the server said nothing: " + "".join(seen)
        line = proc.stderr.readline()
        if not line or line.startswith("gpu-trace: serving"):
            return line or "".join(seen)
        seen.append(line)
    return "".join(seen)


def result(out: subprocess.CompletedProcess) -> dict:
    """What a test program printed on its ``RESULT {json}`` line (it must have exited 0)."""
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])
