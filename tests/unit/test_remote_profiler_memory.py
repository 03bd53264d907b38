"""A program's own ``torch.profiler`` (``profile_memory=True``) sees remote tensors' memory as it
sees a GPU's (runtime/client/profiler_memory.py): one ``[memory]`` event per storage made and
freed on ``remote:0``, device bytes per op, views and in-place results adding nothing. Against a
real server on loopback (CPU device); tests/thirdparty's profiled program found it missing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gpu_trace.runtime.client import profiler_memory
from tests import serving

TOKEN = serving.CPU_TOKEN


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving.cpu_server(tmp_path_factory.mktemp("home")) as address:
        yield address


@pytest.fixture
def dev(served: str) -> Iterator[torch.device]:
    with serving.connected(served) as device:
        yield device


def _memory_events(prof: profile, path: Path) -> list[dict]:
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    device = int(torch._C._autograd.DeviceType.PrivateUse1)  # type: ignore[attr-defined]
    return [e for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == device]


def test_remote_storages_are_device_memory_to_the_profiler(
    dev: torch.device, tmp_path: Path
) -> None:
    x = torch.ones(256, 256, device=dev)  # made before: only what the block does is seen
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("make"):
            y = x * 2  # 256 KiB of its own
        with record_function("view"):
            v = y.view(-1)[:10]  # a view: nothing
        with record_function("inplace"):
            y.add_(1)  # in place: nothing
        with record_function("free"):
            del y, v
        torch.remote.synchronize()  # type: ignore[attr-defined]
    usage = {e.name: e.device_memory_usage for e in prof.events() if e.name in (
        "make", "view", "inplace", "free")}  # fmt: skip
    assert usage == {"make": 256 * 256 * 4, "view": 0, "inplace": 0, "free": -256 * 256 * 4}
    memory = _memory_events(prof, tmp_path / "trace.json")
    assert [e["args"]["Bytes"] for e in memory] == [256 * 256 * 4, -256 * 256 * 4]
    assert memory[0]["args"]["Addr"] == memory[1]["args"]["Addr"]  # one storage, made and freed
    assert memory[0]["args"]["Total Allocated"] >= 2 * 256 * 256 * 4  # x's bytes too


def test_a_training_step_shows_device_memory(dev: torch.device) -> None:
    """What the thirdparty profiled program prints: some event has device memory."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(dev)
    x = torch.randn(8, 16).to(dev)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).sum().backward()
    assert any(e.device_memory_usage > 0 for e in prof.events())
    assert all(e.cpu_memory_usage == 0 for e in prof.events() if e.name == "aten::addmm")


def test_nothing_is_reported_without_a_profiler(dev: torch.device, monkeypatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(profiler_memory, "_fn", lambda *a: calls.append(a))
    monkeypatch.setattr(profiler_memory, "_resolved", True)
    y = torch.ones(64, device=dev) + 1
    del y
    assert calls == []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        y = torch.ones(64, device=dev) + 1
        del y
    assert [a[1] for a in calls] == [256, 256, -256, -256]  # ones, the sum; freed


@pytest.mark.parametrize(
    ("shape", "stride", "offset", "nbytes"),
    [
        ((4, 4), (4, 1), 0, 64),
        ((4, 4), (1, 4), 0, 64),
        ((2, 3), (6, 2), 1, 4 * 12),
        ((0, 5), (5, 1), 0, 0),
    ],
)
def test_storage_bytes(shape: tuple, stride: tuple, offset: int, nbytes: int) -> None:
    assert profiler_memory.storage_bytes(torch.float32, shape, stride, offset) == nbytes
