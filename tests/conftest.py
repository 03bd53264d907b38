"""Shared fixtures: an isolated GPU_TRACE_HOME, a real chDB store, and leak checks; and what many
tests read a run or a sampler's output with (:func:`recorded`, :class:`Sink`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest

from gpu_trace.tracer import recorder
from gpu_trace.tracer.buffer import ThreadBuffer
from gpu_trace.tracer.spool import list_spool, read_spool_file

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the user's data directory, store or an inherited run."""
    monkeypatch.setenv("GPU_TRACE_HOME", str(tmp_path / "home"))
    for name in list(os.environ):
        # GPU_TRACE_RECORD_OPS stays: scripts/make_allowlist.py runs tests with it set.
        if name.startswith("GPU_TRACE_") and name not in ("GPU_TRACE_HOME", "GPU_TRACE_RECORD_OPS"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("TRACEPARENT", raising=False)
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)


@pytest.fixture(scope="session", autouse=True)
def _native_ops_library() -> None:
    """Op level's native observer (framework_patches/torch/observer.cpp) built once, next to its
    source as a wheel carries it, so each test's fresh GPU_TRACE_HOME finds it: op level uses it
    then, as it does where the user's cache holds it (the Kineto sessions' tests ask for those).
    Without torch or a C++ compiler op level uses the sessions, as it would for a user."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return
    from gpu_trace import _cbuild
    from gpu_trace.framework_patches.torch import ops_native

    out = ops_native.SOURCE.with_name(ops_native.library_name())
    if not out.is_file():
        with contextlib.suppress(_cbuild.BuildError):
            ops_native.build(out)


@pytest.fixture(autouse=True)
def _nothing_left_behind() -> object:
    """Every test that starts a recorder stops it, and nothing stays patched (STYLE.md 8)."""
    yield
    left = recorder.active
    if left is not None:
        recorder.stop()
        pytest.fail(f"a recorder was left active for {left.run_dir}")
    from gpu_trace.collectors.nvtx import patch as nvtx_patch

    if nvtx_patch.is_patched():
        nvtx_patch.unpatch()
        pytest.fail("the nvtx package was left patched")
    patches = sys.modules.get("gpu_trace.framework_patches.hooks")
    if patches is not None and patches.is_patched():
        patches.uninstall()
        pytest.fail("a framework (PyTorch or TensorFlow) was left patched")
    otel = sys.modules.get("gpu_trace.tracer.otel")
    if otel is not None and otel.installed():
        otel.uninstall()
        pytest.fail("the OpenTelemetry SDK was left patched")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def python() -> str:
    return sys.executable


def recorded(run_dir: Path, kind: str = "spans") -> list[dict]:
    """The rows of one kind (``spans``, ``counters``) the run spooled, as dicts, in file order."""
    rows: list[dict] = []
    for path in list_spool(run_dir):
        f = read_spool_file(path)
        if f.kind == kind and f.table is not None:
            rows.extend(f.table.to_pylist())
    return rows


class Sink:
    """What a sampler writes into in place of a Recorder: per-thread buffers, like a Recorder's."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.buffers: list[ThreadBuffer] = []

    def buffer(self) -> ThreadBuffer:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = ThreadBuffer(1 << 20)
            self.buffers.append(buf)
        return buf

    @property
    def buf(self) -> ThreadBuffer:
        """This thread's buffer: everything, where the test samples on its own thread."""
        return self.buffer()

    def counters(self, metric: str, device: str = "gpu0") -> list[tuple]:
        """Counter tuples of ``metric`` on ``device``, from every thread."""
        return [c for b in self.buffers for c in b.counters if c[2] == metric and c[1] == device]
