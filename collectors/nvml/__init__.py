"""The NVML sampler: GPU counters of every device, read from a source, recorded on the run's clock.

The sampler reads through a seam, :class:`NvmlSource`: the real one calls NVML through pynvml
(``live.py``), the replay one reads a recorded sample file (``replay.py``). What to do
with a reading lives here, once, whatever the source:

- every value becomes a counter (source ``nvml``, device ``gpu<index>``), stamped with the
  sampler's clock; values from NVML's own sample buffers keep their own timestamps;
- a metric that fails is not asked for again on that device, and an error mark is recorded on the
  device's lane (``nvml/gpu<index>``); a lost device (or a source that raises) stops that device
  only; the other metrics and devices go on;
- per-process GPU memory is kept only for the run's processes (``attribute(pid)`` gives their
  labels: pid now, tenant later) and totalled per device;
- throttle-reason changes, new ECC errors and XID events become marks.

Run ``python -m gpu_trace.collectors.nvml record FILE`` on a machine with a GPU to record a sample
file that the replay source plays back (see docs/collectors.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpu_trace.collectors.periodic import Sampler, Sink
from gpu_trace.tracer.clock import now_ns

log = logging.getLogger(__name__)

#: Counter metrics, in the order they are read. Units are in the names; docs/collectors.md has
#: the NVML call behind each.
METRICS: tuple[str, ...] = (
    "gpu_util_pct",
    "mem_util_pct",
    "mem_used_bytes",
    "mem_total_bytes",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "power_w",
    "temperature_c",
    "pcie_tx_bytes_per_s",
    "pcie_rx_bytes_per_s",
    "throttle_reasons",
    "ecc_corrected_errors",
    "ecc_uncorrected_errors",
)
#: Not counters, but asked for and disabled the same way.
PROCESSES = "processes"
EVENTS = "events"
#: Read at most once a second whatever the rate: PCIe throughput blocks ~20 ms per call in the
#: driver, and these change slowly.
SLOW_METRICS = frozenset(
    {"pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "mem_total_bytes", "ecc_corrected_errors"}
    | {"ecc_uncorrected_errors"}
)
SLOW_PERIOD_NS = 1_000_000_000

#: Bits of nvmlDeviceGetCurrentClocksEventReasons, named as in the marks.
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
#: Errors after which a device answers nothing more.
DEVICE_LOST_ERRORS = frozenset(
    {"GpuIsLost", "GpuNotFound", "Uninitialized", "LibRmVersionMismatch"}
)


class NvmlUnavailable(Exception):
    """No NVML here (library, driver or GPU missing); the message is one line for the user."""


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str


@dataclass
class Reading:
    """What a source read from one device in one tick.

    ``values`` are read now; ``samples`` come from NVML's buffers with their own timestamps
    (recorder clock, ns); ``errors`` maps a metric (or ``processes``/``events``) to the NVML
    error's name (``NotSupported``, ``GpuIsLost``, ...); ``processes`` is ``(pid, used_bytes)``
    of every process on the device (None when not asked); ``events`` are ``(kind, detail)``
    pairs such as ``("xid", "79")``.
    """

    values: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    processes: list[tuple[int, int]] | None = None
    events: list[tuple[str, str]] = field(default_factory=list)


class NvmlSource(Protocol):
    """The seam between the sampler and NVML."""

    #: How the source reads: ``nvml`` or ``replay:<file name>`` (recorded in run.json).
    description: str

    def open(self) -> Sequence[DeviceInfo]:
        """Initialize and list the devices; raises :class:`NvmlUnavailable`."""

    def poll(self, index: int, metrics: Collection[str], now: int) -> Reading:
        """Read ``metrics`` (names from METRICS, PROCESSES, EVENTS) of device ``index``."""

    def close(self) -> None: ...


class _Device:
    __slots__ = ("info", "key", "lane", "enabled", "alive", "last_slow", "throttle", "ecc")

    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self.key = f"gpu{info.index}"
        self.lane = f"nvml/{self.key}"
        self.enabled = {*METRICS, PROCESSES, EVENTS}
        self.alive = True
        self.last_slow = -(1 << 62)
        self.throttle: int | None = None
        self.ecc: dict[str, float] = {}


class NvmlSampler(Sampler):
    """Samples every device of ``source`` at ``hz``; see the module docstring for the policy."""

    source = "nvml"

    def __init__(
        self,
        sink: Sink,
        source: NvmlSource,
        hz: float = 10.0,
        *,
        attribute: Callable[[int], dict[str, str] | None] | None = None,
        clock: Callable[[], int] = now_ns,
    ) -> None:
        super().__init__(sink, hz, clock=clock, name="gpu-trace-nvml")
        self.nvml = source
        self.attribute = attribute or (lambda pid: None)
        self.devices = [_Device(d) for d in source.open()]  # raises NvmlUnavailable

    def close(self) -> None:
        try:
            self.nvml.close()
        except Exception:
            log.debug("gpu-trace: closing the NVML source failed", exc_info=True)

    def sample(self, now: int) -> None:
        for dev in self.devices:
            if dev.alive:
                self._sample_device(dev, now)

    def _sample_device(self, dev: _Device, now: int) -> None:
        wanted = dev.enabled
        if now - dev.last_slow < SLOW_PERIOD_NS:
            wanted = wanted - SLOW_METRICS
        else:
            dev.last_slow = now
        try:
            reading = self.nvml.poll(dev.info.index, wanted, now)
        except Exception as exc:  # the source itself broke: this device stops, the rest go on
            self._lose(dev, now, type(exc).__name__, str(exc))
            return
        key = dev.key
        for metric, value in reading.values.items():
            self.counter(key, metric, now, value)
        for metric, samples in reading.samples.items():
            for ts, value in samples:
                self.counter(key, metric, ts, value)
        if "throttle_reasons" in reading.values:
            self._throttle(dev, now, int(reading.values["throttle_reasons"]))
        for metric in ("ecc_corrected_errors", "ecc_uncorrected_errors"):
            if metric in reading.values:
                self._ecc(dev, now, metric, reading.values[metric])
        if reading.processes is not None:
            self._processes(dev, now, reading.processes)
        for kind, detail in reading.events:
            self.mark(dev.lane, f"{kind} {detail}", now, {"kind": kind, "detail": detail})
        for metric, error in reading.errors.items():
            if error in DEVICE_LOST_ERRORS:
                self._lose(dev, now, error, f"while reading {metric}")
                return
            dev.enabled.discard(metric)
            self.mark(
                dev.lane,
                f"nvml error: {metric} {error}",
                now,
                {"metric": metric, "error": error, "device": key},
            )
            log.info("gpu-trace: %s on %s stops: NVML %s", metric, key, error)

    def _lose(self, dev: _Device, now: int, error: str, detail: str) -> None:
        dev.alive = False
        self.mark(
            dev.lane,
            f"nvml error: {dev.key} lost ({error})",
            now,
            {"error": error, "detail": detail[:200], "device": dev.key},
        )
        log.warning("gpu-trace: NVML sampling of %s stops: %s %s", dev.key, error, detail)

    def _throttle(self, dev: _Device, now: int, bits: int) -> None:
        previous, dev.throttle = dev.throttle, bits
        if previous is None or previous == bits:
            return
        added = bits & ~previous & ~0x1  # idle is not worth a mark
        if added:
            names = ",".join(n for b, n in THROTTLE_BITS.items() if added & b) or hex(added)
            self.mark(dev.lane, f"throttle: {names}", now, {"reasons": hex(bits)})

    def _ecc(self, dev: _Device, now: int, metric: str, value: float) -> None:
        previous = dev.ecc.get(metric)
        dev.ecc[metric] = value
        if previous is not None and value > previous:
            kind = metric.split("_")[1]
            self.mark(dev.lane, f"ecc: {int(value - previous)} new {kind} errors", now)

    def _processes(self, dev: _Device, now: int, processes: list[tuple[int, int]]) -> None:
        total = 0
        for pid, used in processes:
            labels = self.attribute(pid)
            if labels is None:
                continue
            total += used
            self.counter(
                f"{dev.key}/pid{pid}",
                "process_mem_used_bytes",
                now,
                used,
                {**labels, "gpu": dev.key},
            )
        self.counter(dev.key, "run_mem_used_bytes", now, total)


def open_sampler(
    sink: Sink,
    source: NvmlSource,
    hz: float,
    attribute: Callable[[int], dict[str, str] | None] | None = None,
) -> tuple[NvmlSampler | None, str]:
    """An NVML sampler, or None and the one-line reason it is off (no NVML, no GPU)."""
    try:
        sampler = NvmlSampler(sink, source, hz, attribute=attribute)
    except NvmlUnavailable as exc:
        return None, f"NVML sampling is off: {exc}"
    except Exception as exc:  # a broken driver or binding must not stop the recording
        log.debug("gpu-trace: opening NVML failed", exc_info=True)
        return None, f"NVML sampling is off: {type(exc).__name__}: {exc}"
    if not sampler.devices:
        sampler.close()
        return None, "NVML sampling is off: no GPU found"
    return sampler, ""
