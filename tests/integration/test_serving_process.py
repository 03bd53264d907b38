"""Which processes register the ``remote`` backend (PyTorch's PrivateUse1): clients, early, and
never `gpu-trace serve`'s own process.

A registered PrivateUse1 backend becomes the process's accelerator, and CUDA autograd in that
process then fails inside PyTorch (pytorch/pytorch#161129): a server on a GPU must keep CUDA as
its accelerator. Each case runs in a fresh process, since a registration cannot be undone.
"""

from __future__ import annotations

import os
import subprocess
import sys

from gpu_trace.runtime.server.pseudo_ops import whole_op_refusal

# `gpu-trace serve` exactly as `python -m gpu_trace serve` runs it, plus a thread that, when
# told on stdin (the server is serving by then), prints what this process's torch says and
# stops the server as Ctrl-C would.
SERVE_AND_PROBE = """
import os, signal, sys, threading

def probe():
    sys.stdin.readline()
    import torch
    accelerator = torch.accelerator.current_accelerator()
    print(torch._C._get_privateuse1_backend_name(), getattr(accelerator, "type", None), flush=True)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=probe, daemon=True).start()
from gpu_trace.cli import main
sys.exit(main(["serve", "--listen", "127.0.0.1:0", "--device", "cpu"]))
"""


TOKEN = "serving-process-token-0123"

# A client that runs a backward pass on the CPU before it connects: the autograd engine sizes its
# device queues at the first backward, so the remote device must exist by then (docs/remote.md).
CLIENT = """
import sys
import gpu_trace.runtime as runtime
import torch

x = torch.ones(3, requires_grad=True)
(x * 2).sum().backward()
dev = runtime.connect(sys.argv[1])
w = torch.ones(3).to(dev).requires_grad_()
(w * 3).sum().backward()
print(torch._C._get_privateuse1_backend_name(), w.grad.cpu().tolist(), flush=True)
runtime.disconnect()
"""


def test_serve_keeps_the_accelerator_and_clients_register_before_their_first_backward() -> None:
    env = {**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_AND_PROBE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None and proc.stdin is not None
        line = proc.stderr.readline()
        assert "serving cpu on" in line, line
        address = line.split(" on ")[1].split()[0]
        client = subprocess.run(
            [sys.executable, "-c", CLIENT, address],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        out, rest = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert client.returncode == 0, client.stderr[-2000:]
    assert client.stdout.split() == ["remote", "[3.0,", "3.0,", "3.0]"], client.stdout
    assert proc.returncode == 0, rest
    assert out.split() == ["privateuseone", "None"], out


def test_whole_op_autograd_on_cuda_is_refused_where_another_backend_holds_the_accelerator() -> None:
    # This test process is a client too (it imports the runtime, so `remote` is registered): a
    # server started in it cannot run CUDA autograd, and says why instead of PyTorch's assert.
    from gpu_trace.runtime.client import device

    device.register()
    reason = whole_op_refusal("cuda")
    assert reason is not None
    assert "'remote'" in reason and "gpu-trace serve" in reason
    assert whole_op_refusal("cpu") is None
