"""tests/gpu runs only where NVML answers with at least one NVIDIA GPU; elsewhere every test skips."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _no_gpu_reason() -> str:
    try:
        import pynvml
    except ImportError:
        return "pynvml is not installed (pip install 'gpu-trace[nvml]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no NVML here ({exc})"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return "NVML found no GPU"
    finally:
        pynvml.nvmlShutdown()
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    for item in items:
        if "tests/gpu/" not in item.nodeid.replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if reason is None:
            reason = _no_gpu_reason()
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"needs an NVIDIA GPU: {reason}"))
