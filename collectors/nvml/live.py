"""The real NVML source: pynvml (``pip install 'gpu-trace[nvml]'``), imported only when opened.

Each metric is one NVML call (docs/collectors.md lists them); a failing call is reported by the
name of its NVML error and the sampler stops asking. With ``buffers`` (family ``buffers``, off by
default: 1.37 ms a call on an H100, three a tick) utilization and power come from NVML's own
sample buffers (``nvmlDeviceGetSamples``) where the device keeps them: the driver samples them
faster than we poll, and each sample carries its time; a device without them falls back to
polling. XID events are registered on the first poll that asks for them (on the sampler's slow
thread), not at open. Buffer timestamps are CPU wall-clock microseconds; they are moved onto the recorder's
clock (CLOCK_MONOTONIC ns) with a wall/monotonic anchor taken at open.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from gpu_trace.collectors.nvml import (
    EVENTS,
    PROCESSES,
    DeviceInfo,
    NvmlUnavailable,
    Reading,
)
from gpu_trace.tracer.clock import now_ns

log = logging.getLogger(__name__)

#: Metrics read from NVML's sample buffers where available: metric -> (sampling type, scale).
_BUFFERED = {"gpu_util_pct": (1, 1.0), "mem_util_pct": (2, 1.0), "power_w": (0, 1e-3)}
#: c_nvmlValue_t field by nvmlValueType_t.
_VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def error_name(exc: BaseException) -> str:
    """``NotSupported`` for ``pynvml.NVMLError_NotSupported``; the class name otherwise."""
    return type(exc).__name__.removeprefix("NVMLError_")


class PynvmlSource:
    """Reads every GPU of this machine through pynvml."""

    description = "nvml"

    def __init__(self, *, buffers: bool = False) -> None:
        self.buffers = buffers
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._wall_minus_mono_ns = 0
        self._last_seen: dict[tuple[int, int], int] = {}
        self._buffered: dict[tuple[int, str], bool] = {}
        self._event_set: Any = None
        self._events_ok: set[int] = set()
        self._events_opened = False
        self._pending: dict[int, list[tuple[str, str]]] = {}

    def open(self) -> Sequence[DeviceInfo]:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable(
                "pynvml is not installed (pip install 'gpu-trace[nvml]')"
            ) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML could not start ({exc})") from None
        self._nvml = nv = pynvml
        infos = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                self._handles.append(h)
                infos.append(
                    DeviceInfo(i, _text(nv.nvmlDeviceGetName(h)), _text(nv.nvmlDeviceGetUUID(h)))
                )
        except nv.NVMLError as exc:
            self.close()
            raise NvmlUnavailable(f"NVML could not list the GPUs ({exc})") from None
        self._wall_minus_mono_ns = time.time_ns() - now_ns()
        start_us = time.time_ns() // 1000
        for i in range(len(self._handles)):
            for kind, _ in _BUFFERED.values():
                self._last_seen[(i, kind)] = start_us
        return infos

    def _open_events(self) -> None:
        nv = self._nvml
        self._events_opened = True
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return
        for i, h in enumerate(self._handles):
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._event_set)
                self._events_ok.add(i)
            except nv.NVMLError:
                log.debug("gpu-trace: XID events unavailable on gpu%d", i, exc_info=True)

    def close(self) -> None:
        nv, self._nvml = self._nvml, None
        if nv is None:
            return
        if self._event_set is not None:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(self._event_set)
            self._event_set = None
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()

    # ---- reading ------------------------------------------------------------------------------

    def poll(self, index: int, metrics: Collection[str], now: int) -> Reading:
        nv = self._nvml
        h = self._handles[index]
        out = Reading()
        rates = None
        for metric in metrics:
            if metric in (PROCESSES, EVENTS):
                continue
            try:
                if (
                    self.buffers
                    and metric in _BUFFERED
                    and self._buffered.get((index, metric), True)
                ):
                    samples = self._samples(index, h, metric)
                    if samples is not None:
                        if samples:
                            out.samples[metric] = samples
                        continue
                if metric in ("gpu_util_pct", "mem_util_pct"):
                    rates = rates or nv.nvmlDeviceGetUtilizationRates(h)
                    out.values[metric] = rates.gpu if metric == "gpu_util_pct" else rates.memory
                else:
                    out.values[metric] = self._read(h, metric)
            except nv.NVMLError as exc:
                out.errors[metric] = error_name(exc)
        if PROCESSES in metrics:
            try:
                out.processes = self._processes(h)
            except nv.NVMLError as exc:
                out.errors[PROCESSES] = error_name(exc)
        if EVENTS in metrics:
            if not self._events_opened:
                self._open_events()
            if index in self._events_ok:
                self._drain_events()
                out.events = self._pending.pop(index, [])
            else:
                out.errors[EVENTS] = "NotSupported"
        return out

    def _read(self, h: Any, metric: str) -> float:
        nv = self._nvml
        if metric == "mem_used_bytes":
            return nv.nvmlDeviceGetMemoryInfo(h).used
        if metric == "mem_total_bytes":
            return nv.nvmlDeviceGetMemoryInfo(h).total
        if metric == "sm_clock_mhz":
            return nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
        if metric == "mem_clock_mhz":
            return nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)
        if metric == "power_w":
            return nv.nvmlDeviceGetPowerUsage(h) / 1000.0
        if metric == "temperature_c":
            return nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        if metric == "pcie_tx_bytes_per_s":  # KB/s; blocks ~20 ms in the driver
            return nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
        if metric == "pcie_rx_bytes_per_s":
            return nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
        if metric == "throttle_reasons":
            fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            )
            return fn(h)
        if metric in ("ecc_corrected_errors", "ecc_uncorrected_errors"):
            kind = (
                nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
                if metric == "ecc_corrected_errors"
                else nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            )
            return nv.nvmlDeviceGetTotalEccErrors(h, kind, nv.NVML_VOLATILE_ECC)
        raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)

    def _samples(self, index: int, h: Any, metric: str) -> list[tuple[int, float]] | None:
        """New buffered samples (possibly none), or None where the device keeps no buffer."""
        nv = self._nvml
        kind, scale = _BUFFERED[metric]
        try:
            vtype, samples = nv.nvmlDeviceGetSamples(h, kind, self._last_seen[(index, kind)])
        except nv.NVMLError_NotFound:  # no sample since the last one
            return []
        except nv.NVMLError:
            self._buffered[(index, metric)] = False  # fall back to polling from now on
            return None
        self._buffered[(index, metric)] = True
        field = _VALUE_FIELDS[vtype] if 0 <= vtype < len(_VALUE_FIELDS) else "uiVal"
        out = []
        last = self._last_seen[(index, kind)]
        for s in samples:
            if s.timeStamp <= last:
                continue
            last = s.timeStamp
            out.append(
                (
                    s.timeStamp * 1000 - self._wall_minus_mono_ns,
                    getattr(s.sampleValue, field) * scale,
                )
            )
        self._last_seen[(index, kind)] = last
        return out

    def _processes(self, h: Any) -> list[tuple[int, int]]:
        nv = self._nvml
        used: dict[int, int] = {}
        for fn in (
            nv.nvmlDeviceGetComputeRunningProcesses,
            nv.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            for p in fn(h):
                if p.usedGpuMemory is not None:  # None: the driver won't say (no permission)
                    used[p.pid] = max(used.get(p.pid, 0), int(p.usedGpuMemory))
        return sorted(used.items())

    def _drain_events(self) -> None:
        nv = self._nvml
        for _ in range(64):  # bounded: a storm of events must not stall sampling
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, 0)
            except nv.NVMLError:  # Timeout: nothing pending
                return
            index = self._index_of(data.device)
            if index is not None and data.eventType & nv.nvmlEventTypeXidCriticalError:
                self._pending.setdefault(index, []).append(("xid", str(data.eventData)))

    def _index_of(self, handle: Any) -> int | None:
        want = _address(handle)
        for i, h in enumerate(self._handles):
            if _address(h) == want:
                return i
        return None


def _address(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
