"""Transparent mode on a CUDA build of torch without a GPU (tests/cuda_build.py), against a real
server on loopback (CPU device): what training code touches in ``torch.cuda`` works, or fails
with a clear message; the losses are bitwise those of the same loop on the CPU."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpu_trace import runtime
from gpu_trace.runtime.client import cuda, cuda_streams
from gpu_trace.runtime.protocol import backend_flags
from gpu_trace.runtime.protocol.errors import RemoteOpError
from gpu_trace.runtime.server import device_ops
from tests import serving
from tests.conftest import REPO
from tests.cuda_build import NO_DEVICE, CudaBuild

TOKEN = "cuda-emulation-token-0123"
QUOTA = 256 << 20
CAPACITY = 1 << 30


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server whose one tenant has a quota (``mem_get_info``'s total)."""
    home = tmp_path_factory.mktemp("home")
    tenants = home / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "t"\ntoken = "{TOKEN}"\nmemory = {QUOTA}\n')
    args = ("--tenants", str(tenants), "--device-memory", str(CAPACITY))
    with serving.served(home, TOKEN, *args, device="cpu") as (address, _):
        yield address


@pytest.fixture
def transparent(served: str) -> Iterator[None]:
    """A CUDA build without a GPU, in transparent mode (what ``record --remote`` sets up)."""
    with CudaBuild():
        runtime.connect(served, token=TOKEN)
        cuda.patch()
        try:
            yield
        finally:
            cuda.unpatch()
            runtime.disconnect()


def train(device: str, timed: bool) -> tuple[list[float], dict[str, Any]]:
    """An ordinary training loop: AdamW (default: foreach on an accelerator), CUDA events for
    timing, a side stream, device queries (``timed``: the CUDA-only parts)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    x, y = torch.randn(64, 16).to(device), torch.randn(64, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen: dict[str, Any] = {"ms": []}
    if timed:
        seen["name"] = torch.cuda.get_device_name(0)
        seen["capability"] = torch.cuda.get_device_capability()
        seen["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        seen["mem"] = torch.cuda.mem_get_info()
        side = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    losses = []
    for _ in range(4):
        if timed:
            start.record()
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if timed else contextlib.nullcontext():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        if timed:
            torch.cuda.current_stream().wait_stream(side)
            end.record()
            end.synchronize()
            seen["ms"].append(start.elapsed_time(end))
        losses.append(loss.item())
    return losses, seen


@pytest.mark.usefixtures("transparent")
def test_an_unmodified_training_loop_runs_and_its_losses_are_the_cpus() -> None:
    losses, seen = train("cuda", timed=True)
    assert seen["name"].startswith("cpu (") and seen["capability"] == (0, 0)
    assert seen["sms"] == os.cpu_count()
    assert seen["mem"][1] == QUOTA and 0 < seen["mem"][0] <= QUOTA
    assert len(seen["ms"]) == 4 and all(ms >= 0.0 for ms in seen["ms"])
    cuda.unpatch()
    runtime.disconnect()
    expected, _ = train("cpu", timed=False)
    assert losses == expected


def torch_2_11_capture_check(self: torch.optim.Optimizer) -> None:
    """The optimizers' graph-capture check before torch 2.12 (torch/optim/optimizer.py, which
    torch 2.11 on the GPU machine ran): the call that failed in issue 16."""
    if torch.backends.cuda.is_built() and torch.cuda.is_available():
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and not all(group["capturable"] for group in self.param_groups):
            raise RuntimeError("Attempting CUDA graph capture of step() ...")


def test_the_harness_reproduces_the_adamw_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """What issue 16 saw, without the emulation: the graph-capture check of ``AdamW.step()``
    asks the runtime, and a CUDA build without a device raises."""
    monkeypatch.setattr(
        torch.optim.Optimizer, "_accelerator_graph_capture_health_check", torch_2_11_capture_check
    )
    with CudaBuild():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as transparent mode says
        opt = torch.optim.AdamW([nn.Parameter(torch.ones(2))])
        with pytest.raises(torch.AcceleratorError, match=NO_DEVICE):
            opt.step()


@pytest.mark.usefixtures("transparent")
def test_adamw_steps_through_the_graph_capture_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        torch.optim.Optimizer, "_accelerator_graph_capture_health_check", torch_2_11_capture_check
    )
    values = []
    for device in ("cuda", "cpu"):
        p = nn.Parameter(torch.ones(2, device=device))
        opt = torch.optim.AdamW([p], lr=0.5)
        p.sum().backward()
        opt.step()
        values.append(p.detach().cpu().tolist())
    assert values[0] == values[1]


def _stream_context() -> bool:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        inside = torch.cuda.current_stream()
    return inside == s and torch.cuda.current_stream() == torch.cuda.default_stream()


def _event_timing() -> bool:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.ones(8, device="cuda").sum()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) >= 0.0 and end.query()


def _stream_events() -> bool:
    s = torch.cuda.Stream()
    event = s.record_event()
    s.wait_event(event)
    torch.cuda.current_stream().wait_stream(s)
    event.wait()
    s.synchronize()
    return s.query() and event.query()


def _memory_reserved() -> bool:
    held = torch.ones(1024, device="cuda")  # the session's bytes on the server
    return torch.cuda.memory_reserved() >= held.untyped_storage().nbytes() > 0


def _set_stream() -> bool:
    s = torch.cuda.Stream()
    torch.cuda.set_stream(s)
    try:
        return torch.cuda.current_stream() == s
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())


#: Each emulated entry point: a call and whether its answer is right. Each fails without its
#: emulation (the harness raises there).
ENTRY_POINTS: dict[str, Callable[[], bool]] = {
    "is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing() is False,
    "graphs.is_current_stream_capturing": lambda: (
        not torch.cuda.graphs.is_current_stream_capturing()
    ),
    "Stream": lambda: isinstance(torch.cuda.Stream(), torch.cuda.Stream),
    "stream()": _stream_context,
    "stream events": _stream_events,
    "Event timing": _event_timing,
    "current_stream": lambda: torch.cuda.current_stream().device.type == "remote",
    "default_stream": lambda: torch.cuda.default_stream() == torch.cuda.current_stream(),
    "get_device_name": lambda: (
        torch.cuda.get_device_name() == f"cpu ({platform.processor() or platform.machine()})"
    ),
    "get_device_capability": lambda: torch.cuda.get_device_capability(0) == (0, 0),
    "get_device_properties": lambda: torch.cuda.get_device_properties().total_memory == CAPACITY,
    "mem_get_info": lambda: torch.cuda.mem_get_info()[1] == QUOTA,
    "memory_reserved": _memory_reserved,
    "set_stream": _set_stream,
    "device(0)": lambda: torch.cuda.device(0).__enter__() is None,
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.usefixtures("transparent")
def test_each_entry_point_is_emulated(name: str) -> None:
    assert ENTRY_POINTS[name]()


@pytest.mark.parametrize(
    "call",
    [
        lambda: torch.cuda.CUDAGraph(),
        lambda: torch.cuda.graph(None),
        lambda: torch.cuda.make_graphed_callables(nn.Linear(2, 2), (torch.ones(1, 2),)),
    ],
    ids=["CUDAGraph", "graph", "make_graphed_callables"],
)
@pytest.mark.usefixtures("transparent")
def test_cuda_graphs_fail_with_a_message_naming_gpu_trace(call: Callable[[], Any]) -> None:
    with pytest.raises(RuntimeError, match="CUDA graphs .* cannot run in gpu-trace's transparent"):
        call()


@pytest.mark.usefixtures("transparent")
def test_event_errors_are_cudas() -> None:
    timed = torch.cuda.Event(enable_timing=True)
    with pytest.raises(ValueError, match="Both events must be recorded"):
        timed.elapsed_time(torch.cuda.Event(enable_timing=True))
    untimed = torch.cuda.Event()
    untimed.record()
    with pytest.raises(ValueError, match="enable_timing=True"):
        untimed.elapsed_time(timed)
    assert torch.cuda.Event().query()  # never recorded: nothing to wait for
    torch.cuda.empty_cache()  # the server keeps its cache: a no-op, as without a device


@pytest.mark.usefixtures("transparent")
def test_a_session_keeps_its_last_events_and_says_when_one_is_gone() -> None:
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    for _ in range(device_ops.MAX_MARKS):
        torch.cuda.Event(enable_timing=True).record()
    last.record()
    with pytest.raises(RemoteOpError, match="older than the session's last 1024"):
        first.elapsed_time(last)
    first.record()  # recorded again: kept again
    assert first.elapsed_time(last) <= 0.0


def server_flags() -> dict[str, Any]:
    return dict(cuda_streams._call("rt::flags", [], wait="flags"))


def test_backend_settings_apply_on_the_server_per_session(served: str) -> None:
    """The program's TF32 / cuDNN / precision / determinism settings are those its ops run
    under on the server, and another session's ops run under their own."""
    other = (
        "from tests.cuda_build import apply; apply()\n"
        "import json\n"
        "import torch\n"
        "from gpu_trace import runtime\n"
        "from gpu_trace.runtime.client import cuda, cuda_streams\n"
        f"runtime.connect({served!r}, token={TOKEN!r})\n"
        "cuda.patch()\n"
        "print(json.dumps(cuda_streams._call('rt::flags', [], wait='flags')))\n"
    )
    before = backend_flags.read(torch)
    with CudaBuild():
        runtime.connect(served, token=TOKEN)
        cuda.patch()
        try:
            defaults = server_flags()
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
            torch.backends.cudnn.deterministic = True
            torch.use_deterministic_algorithms(True)
            torch.set_float32_matmul_precision("medium")
            mine = server_flags()
            out = subprocess.run(
                [sys.executable, "-c", other], cwd=REPO, capture_output=True, text=True,
                timeout=120,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            again = server_flags()
            # Deterministic algorithms fill new tensors with NaN: on the server, so it is set there.
            filled = torch.empty(4, device="cuda").isnan().all().item()
        finally:
            cuda.unpatch()
            runtime.disconnect()
            backend_flags.apply(torch, before)
    assert mine["matmul_precision"] == "medium" and mine["fp32:cuda:matmul"] == "tf32"
    assert mine["cudnn_benchmark"] and mine["cudnn_deterministic"] and mine["deterministic"]
    assert not defaults["cudnn_benchmark"] and defaults["matmul_precision"] == "highest"
    assert again == mine and filled
    assert json.loads(out.stdout) == defaults  # the other session ran under the server's own


PROGRAM = """
{harness}
import torch
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
x, y = torch.randn(32, 8), torch.randn(32, 1)
model, x, y = model.to(device), x.to(device), y.to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
timed = device == "cuda"
if timed:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print("DEVICE", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for step in range(3):
    if timed:
        start.record()
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    if timed:
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) >= 0.0
    print("LOSS", repr(loss.item()))
"""


def test_record_remote_runs_a_program_on_a_cuda_build_without_a_gpu(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpu-trace record --remote`` end to end, the harness applied in the program's first
    lines: the AdamW loop with CUDA events runs, with the CPU's losses (the same program run
    here, where no CUDA is available)."""
    exec(PROGRAM.format(harness=""), {})
    expected = [line for line in capsys.readouterr().out.splitlines() if line.startswith("LOSS")]
    env = {**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    harness = "from tests.cuda_build import apply; apply()"
    remote = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", "--remote", served, "--", sys.executable,
         "-c", PROGRAM.format(harness=harness)],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    assert remote.returncode == 0, remote.stderr
    assert "DEVICE cpu (" in remote.stdout
    losses = [line for line in remote.stdout.splitlines() if line.startswith("LOSS")]
    assert len(expected) == 3 and losses == expected


def test_settings_a_peer_lacks_stay_the_servers_own(served: str) -> None:
    """A client whose torch lacks some settings sends the others: its session runs under the
    server's own for the rest, never under another session's."""
    other = (  # another session, in force before this one's next batch
        "import torch\n"
        "from gpu_trace import runtime\n"
        "from gpu_trace.runtime.client import cuda_streams\n"
        f"runtime.connect({served!r}, token={TOKEN!r})\n"
        "cuda_streams._call('rt::flags', [{'matmul_precision': 'medium'}], wait='flags')\n"
        "assert cuda_streams._call('rt::flags', [], wait='flags')['matmul_precision'] == 'medium'\n"
    )
    runtime.connect(served, token=TOKEN)  # explicit mode: no settings sent
    try:
        own = server_flags()
        flipped = not own["cudnn_benchmark"]
        cuda_streams._call("rt::flags", [{"cudnn_benchmark": flipped}])
        assert server_flags() == {**own, "cudnn_benchmark": flipped}
        out = subprocess.run(
            [sys.executable, "-c", other], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert server_flags() == {**own, "cudnn_benchmark": flipped}
    finally:
        runtime.disconnect()


@pytest.mark.parametrize("isolation", ["process", "shared"])
def test_the_servers_own_settings_are_its_workers_own(tmp_path: Path, isolation: str) -> None:
    """Settings made in the server's process (deterministic algorithms, as tests/serving's
    deterministic server sets them when it imports torch) are those a session's ops run under
    when it sets none, in a worker process (``--isolation process``) as in the server's own."""
    with serving.served(
        tmp_path, TOKEN, "--isolation", isolation, device="cpu", deterministic=True
    ) as (address, _):
        dev = runtime.connect(address, token=TOKEN)  # explicit mode: no settings sent
        try:
            own = server_flags()
            # Deterministic algorithms fill new tensors with NaN: so they are on where ops run.
            filled = torch.empty(4, device=dev).isnan().all().item()
        finally:
            runtime.disconnect()
    assert own["deterministic"] and filled
