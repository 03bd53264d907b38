"""Make this CPU build of torch behave as a CUDA build of torch on a machine without a GPU.

pip's default torch on Linux is a CUDA build; on a machine with no GPU (or with
``CUDA_VISIBLE_DEVICES=""``) its Python code in ``torch/cuda/`` is the same as a CPU build's, but
``torch._C`` has the ``_cuda_*`` bindings, and they fail in two ways. CI has only a CPU build, so
this harness adds stand-ins for the bindings that the Python side reaches without a device, each
failing as the CUDA build's C++ does; the Python code of ``torch.cuda`` then runs unchanged on top
of them. What each stand-in mimics, from PyTorch's sources (torch 2.11-2.13):

- ``torch.version.cuda`` is a version string, ``torch._C._has_cuda`` / ``_has_cudnn`` are true
  (``torch.backends.cuda.is_built()``, ``torch.backends.cudnn.is_available()``).
- ``_cuda_getDeviceCount`` returns 0: ``c10::cuda::device_count()`` maps "no device" and "no
  driver" to 0 without raising, so ``is_available()`` is False and ``device_count()`` 0.
- ``_cuda_init`` raises ``RuntimeError``: ``CUDAHooks::init`` calls
  ``device_count_ensure_non_zero()``, which raises ``No CUDA GPUs are available`` (a driver, no
  visible device: the GPU-less client of issue 16) or ``Found no NVIDIA driver on your system...``
  (``driver=False``). Everything that lazily initializes (``current_device``, ``synchronize``,
  ``current_stream``, ``default_stream``, ``get_device_properties`` and so ``get_device_name`` /
  ``get_device_capability``, ``mem_get_info``, ``get_rng_state``, ``Event.record``/``wait``,
  ``set_device``, ``torch.cuda.device(0)``, ``torch.empty(..., device="cuda")``) raises it, through
  torch.cuda's own ``_lazy_init`` (the ``_cudart`` module must look present for it to get there).
- ``_cuda_isCurrentStreamCapturing``, and the stream and CUDA-graph constructors
  (``torch.cuda.Stream()``, ``CUDAGraph()``, so ``torch.cuda.graph(g)``) call
  ``c10::cuda::current_device()`` without initializing, whose ``cudaGetDevice`` fails:
  ``torch.AcceleratorError: CUDA error: no CUDA-capable device is detected`` (with a driver; the
  error of issue 16's ``AdamW.step()``) or ``CUDA driver version is insufficient for CUDA runtime
  version`` (without).
- ``torch.cuda.Event()`` succeeds (a CUDA event is created lazily, at its first record); an
  unrecorded event's ``query()`` is True, ``synchronize()`` does nothing, ``elapsed_time`` raises
  ``ValueError: Both events must be recorded...`` (c10/cuda/CUDAEvent.h).
- Memory queries that check ``is_initialized()`` first return 0 / ``{}`` and ``empty_cache()``
  does nothing, as they do there, with no stand-in needed; ``reset_peak_memory_stats()`` reaches
  the caching allocator's ``assertValidDevice``: ``RuntimeError: Invalid device argument ...: did
  you call init?``.
- ``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32`` / ``benchmark``
  / ``deterministic`` and ``torch.set_float32_matmul_precision`` set the same global flags in both
  builds: nothing to mimic.

Not mimicked: what C++ reaches on its own (``torch.accelerator`` and ``torch.Stream("cuda")``,
the dispatcher's CUDA kernels), ``torch.backends.cudnn.version()`` (None here, a number there).

Use: ``with CudaBuild():`` (or ``apply()`` / ``remove()``); the pytest fixture ``cuda_build``
(import it into a test module, then ``@pytest.mark.usefixtures("cuda_build")``); or, in a
program run as a subprocess, its first lines: ``from tests.cuda_build import apply; apply()``. It
is reversible: ``remove()`` restores every attribute it set and the classes' bases.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

CUDA_VERSION = "13.0"
NO_GPUS = "No CUDA GPUs are available"
NO_DRIVER = (
    "Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed"
    " a driver from http://www.nvidia.com/Download/index.aspx"
)
_CHECK_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the"
    " stacktrace below might be incorrect.\nFor debugging consider passing"
    " CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
NO_DEVICE = "CUDA error: no CUDA-capable device is detected"
OLD_DRIVER = "CUDA error: CUDA driver version is insufficient for CUDA runtime version"

_ABSENT = object()


class CudaBuild:
    """The CUDA-build-without-a-GPU state; ``driver`` says whether an NVIDIA driver is installed."""

    def __init__(self, *, driver: bool = True) -> None:
        self.driver = driver
        self._saved: list[tuple[Any, str, Any]] = []
        self._bases: list[tuple[type, tuple[type, ...]]] = []

    # -- what the CUDA build's bindings do without a device ---------------------------------

    def init_error(self) -> RuntimeError:
        return RuntimeError(NO_GPUS if self.driver else NO_DRIVER)

    def device_error(self) -> Exception:
        import torch

        return torch.AcceleratorError((NO_DEVICE if self.driver else OLD_DRIVER) + _CHECK_TAIL)

    def _bindings(self) -> dict[str, Any]:
        import torch

        def get_device_count() -> int:
            return 0

        def init() -> None:
            raise self.init_error()

        def current_device_error(*args: Any) -> Any:
            raise self.device_error()

        def lazy(*args: Any) -> Any:  # device_lazy_init(kCUDA) first: torch.cuda._lazy_init
            torch.cuda._lazy_init()
            raise AssertionError("unreachable: CUDA cannot initialize here")

        def exchange(device: int) -> int:
            if device < 0:
                return -1
            return lazy(device)

        def reset_stats(device: int | None) -> None:
            device = -1 if device is None else device  # THPUtils_unpackDeviceIndex(None)
            raise RuntimeError(f"Invalid device argument {device}: did you call init?")

        return {
            "_has_cuda": True,
            "_has_cudnn": True,
            "_cuda_getDeviceCount": get_device_count,
            "_cuda_init": init,
            "_cuda_isCurrentStreamCapturing": current_device_error,
            "_cuda_getCurrentRawStream": current_device_error,
            # Reached only after ``_lazy_init`` succeeded, which cannot happen here unless a
            # patch skips it (transparent mode does): the device error, as the first CUDA call.
            "_cuda_getCurrentStream": current_device_error,
            "_cuda_getDefaultStream": current_device_error,
            "_cuda_setStream": current_device_error,
            "_cuda_synchronize": current_device_error,
            "_cuda_emptyCache": current_device_error,
            "_cuda_memoryStats": current_device_error,
            "_cuda_setDevice": lazy,
            "_cuda_getDevice": lazy,
            "_cuda_exchangeDevice": exchange,
            "_cuda_maybeExchangeDevice": exchange,
            "_cuda_resetPeakMemoryStats": reset_stats,
            "_cuda_resetAccumulatedMemoryStats": reset_stats,
        }

    def _base_classes(self) -> tuple[type, type, type]:
        harness = self

        class StreamBase:
            """``_CudaStreamBase``: THCPStream_pynew asks ``c10::cuda::current_device()``."""

            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                raise harness.device_error()

        class EventBase:
            """``_CudaEventBase``: the CUDA event is made at its first record, never here."""

            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                return object.__new__(cls)

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

            def record(self, stream: Any = None) -> None:
                raise harness.device_error()  # not reached: current_stream() fails first

            def wait(self, stream: Any = None) -> None:
                raise harness.device_error()

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                return None

            def elapsed_time(self, other: Any) -> float:
                raise ValueError("Both events must be recorded before calculating elapsed time.")

            def ipc_handle(self) -> Any:
                raise harness.device_error()

        class GraphBase:
            """``_CUDAGraph``: its constructor takes the current stream, asking the device."""

            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                raise harness.device_error()

        return StreamBase, EventBase, GraphBase

    # -- applying and removing ---------------------------------------------------------------

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, value)

    def apply(self) -> CudaBuild:
        import torch
        import torch.cuda.graphs
        import torch.cuda.streams

        self.remove()
        bindings = self._bindings()
        self._set(torch.version, "cuda", CUDA_VERSION)
        for name, value in bindings.items():
            self._set(torch._C, name, value)
        self._set(torch.cuda, "_cudart", _CudartStandIn())
        for name, binding in (
            ("_exchange_device", "_cuda_exchangeDevice"),
            ("_maybe_exchange_device", "_cuda_maybeExchangeDevice"),
        ):  # bound at import in a CUDA build: replace the CPU build's fallback, not a patch's
            if getattr(torch.cuda, name).__module__ == "torch.cuda":
                self._set(torch.cuda, name, bindings[binding])
        self._set(
            torch.cuda.graphs,
            "_cuda_isCurrentStreamCapturing",
            bindings["_cuda_isCurrentStreamCapturing"],
        )
        stream_base, event_base, graph_base = self._base_classes()
        for cls, base in (
            (torch.cuda.streams.Stream, stream_base),
            (torch.cuda.streams.Event, event_base),
            (torch.cuda.graphs.CUDAGraph, graph_base),
        ):
            self._bases.append((cls, cls.__bases__))
            cls.__bases__ = (base,)
        return self

    def remove(self) -> None:
        for owner, name, value in reversed(self._saved):
            if value is _ABSENT:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
        for cls, bases in reversed(self._bases):
            cls.__bases__ = bases
        self._bases.clear()

    def __enter__(self) -> CudaBuild:
        return self.apply()

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _CudartStandIn:
    """``torch.cuda._cudart``: present in a CUDA build (``_lazy_init`` checks it before
    ``_cuda_init``); reached only after a successful initialization, which cannot happen here."""


_active: CudaBuild | None = None


def apply(*, driver: bool = True) -> CudaBuild:
    """Apply the harness for the rest of the process (a test program's first lines)."""
    global _active
    remove()
    _active = CudaBuild(driver=driver).apply()
    return _active


def remove() -> None:
    global _active
    if _active is not None:
        _active.remove()
        _active = None


@pytest.fixture
def cuda_build() -> Iterator[CudaBuild]:
    """The harness for one test, removed after it."""
    with CudaBuild() as harness:
        yield harness
