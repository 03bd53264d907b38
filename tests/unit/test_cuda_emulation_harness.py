"""tests/cuda_build.py: under it, the CPU build answers as a CUDA build on a machine without a GPU,
and removing it restores the CPU build exactly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.conftest import REPO
from tests.cuda_build import NO_DEVICE, NO_DRIVER, NO_GPUS, CudaBuild, cuda_build  # noqa: F401

#: Entry points that lazily initialize CUDA: ``RuntimeError: No CUDA GPUs are available``.
LAZY: dict[str, Callable[[], Any]] = {
    "current_device": torch.cuda.current_device,
    "synchronize": torch.cuda.synchronize,
    "current_stream": torch.cuda.current_stream,
    "default_stream": torch.cuda.default_stream,
    "get_device_name": torch.cuda.get_device_name,
    "get_device_capability": torch.cuda.get_device_capability,
    "get_device_properties": torch.cuda.get_device_properties,
    "mem_get_info": torch.cuda.mem_get_info,
    "get_rng_state": torch.cuda.get_rng_state,
    "set_device": lambda: torch.cuda.set_device(0),
    "device(0)": lambda: torch.cuda.device(0).__enter__(),
    "Event.record": lambda: torch.cuda.Event(enable_timing=True).record(),
    "Event.wait": lambda: torch.cuda.Event().wait(),
    "empty(device=cuda)": lambda: torch.empty(2, device="cuda"),
}

#: Entry points that call the CUDA runtime without initializing: ``torch.AcceleratorError``.
DIRECT: dict[str, Callable[[], Any]] = {
    "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
    "Stream()": torch.cuda.Stream,
    "CUDAGraph()": torch.cuda.CUDAGraph,
    "graph()": lambda: torch.cuda.graph(None),  # makes its capture stream first
}


@pytest.mark.usefixtures("cuda_build")
def test_it_is_a_cuda_build_with_no_device() -> None:
    assert torch.version.cuda and torch.backends.cuda.is_built()
    assert torch.backends.cudnn.is_available()
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    assert not torch.cuda.is_initialized() and not torch.cuda.is_bf16_supported()


@pytest.mark.parametrize("name", sorted(LAZY))
@pytest.mark.usefixtures("cuda_build")
def test_lazily_initializing_calls_find_no_gpu(name: str) -> None:
    with pytest.raises(RuntimeError, match=f"^{NO_GPUS}$"):
        LAZY[name]()


@pytest.mark.parametrize("name", sorted(DIRECT))
@pytest.mark.usefixtures("cuda_build")
def test_direct_runtime_calls_find_no_device(name: str) -> None:
    with pytest.raises(torch.AcceleratorError, match=f"^{NO_DEVICE}"):
        DIRECT[name]()


def test_without_a_driver_the_messages_say_so() -> None:
    with CudaBuild(driver=False):
        with pytest.raises(RuntimeError, match="^Found no NVIDIA driver"):
            torch.cuda.current_device()
        with pytest.raises(torch.AcceleratorError, match="driver version is insufficient"):
            torch.cuda.is_current_stream_capturing()
    assert NO_DRIVER.startswith("Found no NVIDIA driver")


@pytest.mark.usefixtures("cuda_build")
def test_what_works_there_works() -> None:
    """Uninitialized memory queries answer 0, flags are plain globals, seeding is queued."""
    assert torch.cuda.memory_allocated() == torch.cuda.memory_reserved() == 0
    assert torch.cuda.max_memory_allocated() == 0 and torch.cuda.memory_stats() == {}
    torch.cuda.empty_cache()
    torch.cuda.manual_seed(0)
    event = torch.cuda.Event(enable_timing=True)
    assert event.query() is True
    event.synchronize()
    with pytest.raises(ValueError, match="Both events must be recorded"):
        event.elapsed_time(torch.cuda.Event(enable_timing=True))
    with pytest.raises(RuntimeError, match="Invalid device argument -1: did you call init"):
        torch.cuda.reset_peak_memory_stats()
    with torch.cuda.stream(None):
        pass


def test_removing_it_restores_the_cpu_build() -> None:
    before = (
        torch.version.cuda,
        torch.backends.cuda.is_built(),
        torch.cuda._cudart,
        torch.cuda.streams.Stream.__bases__,
        torch.cuda.graphs.CUDAGraph.__bases__,
        hasattr(torch._C, "_cuda_init"),
    )
    with CudaBuild():
        assert torch.backends.cuda.is_built()
    after = (
        torch.version.cuda,
        torch.backends.cuda.is_built(),
        torch.cuda._cudart,
        torch.cuda.streams.Stream.__bases__,
        torch.cuda.graphs.CUDAGraph.__bases__,
        hasattr(torch._C, "_cuda_init"),
    )
    assert after == before and before[0] is None and before[5] is False
    with pytest.raises(RuntimeError, match="torch.cuda.Stream requires CUDA support"):
        torch.cuda.Stream()


def test_a_program_applies_it_in_its_first_lines() -> None:
    program = (
        "from tests.cuda_build import apply; apply()\n"
        "import torch\n"
        "assert torch.backends.cuda.is_built() and not torch.cuda.is_available()\n"
        "try:\n"
        "    torch.cuda.is_current_stream_capturing()\n"
        "except torch.AcceleratorError as exc:\n"
        "    print(str(exc).splitlines()[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == NO_DEVICE
