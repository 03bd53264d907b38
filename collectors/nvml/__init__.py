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
- throttle-reason changes, new ECC errors and XID events become marks;
- metrics are asked for by family (``families.py``), one call each, timed: cheap families every
  tick on the sampler's thread, slow or blocking ones on a second thread with their own periods,
  so a blocking call never delays a tick; each family's call latency is a counter
  ``call_us.<family>`` (mean per second; :meth:`NvmlSampler.call_stats` has percentiles);
- a watchdog: a call that does not return within ``STALL_NS`` is reported once (mark and one
  warning line), the other lane goes on, and stop() is bounded whatever the source does.

Run ``python -m gpu_trace.collectors.nvml record FILE`` on a machine with a GPU to record a sample
file that the replay source plays back (see docs/collectors.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpu_trace.collectors.nvml.families import (
    BUFFERS,
    DEFAULT,
    EVENTS,
    FAMILIES,
    PROCESSES,
    SLOW,
    TICK,
    Family,
)
from gpu_trace.collectors.periodic import Sampler, Sink
from gpu_trace.tracer.clock import now_ns

log = logging.getLogger(__name__)

#: Counter metrics, in the order they are read. Units are in the names; docs/collectors.md has
#: the NVML call behind each, ``families.py`` which are read together, how often and by default.
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
#: A call that has not returned after this long is reported (a mark and one warning line); its
#: lane waits for it, the other lane goes on, and stop() abandons it.
STALL_NS = 2_000_000_000
#: How long stop() waits for each lane's thread, and opening or closing the source may take.
JOIN_S = 2.0
OPEN_TIMEOUT_S = 10.0
#: Per-family call latency counters (``call_us.<family>``) are written this often.
STATS_PERIOD_NS = 1_000_000_000

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
    __slots__ = ("info", "key", "lane", "enabled", "alive", "due", "throttle", "ecc")

    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self.key = f"gpu{info.index}"
        self.lane = f"nvml/{self.key}"
        self.enabled = {*METRICS, PROCESSES, EVENTS}
        self.alive = True
        self.due: dict[str, int] = {}  # slow family -> when it is next polled
        self.throttle: int | None = None
        self.ecc: dict[str, float] = {}


class CallStats:
    """Latencies of one family's calls on one device: all-time figures and the current window."""

    __slots__ = ("n", "total_ns", "max_ns", "recent", "window_n", "window_ns")

    def __init__(self) -> None:
        self.n = self.total_ns = self.max_ns = self.window_n = self.window_ns = 0
        self.recent: deque[int] = deque(maxlen=4096)

    def add(self, ns: int) -> None:
        self.n += 1
        self.total_ns += ns
        self.max_ns = max(self.max_ns, ns)
        self.recent.append(ns)
        self.window_n += 1
        self.window_ns += ns

    def summary(self) -> dict[str, float]:
        """``n``, ``mean_us``, ``p50_us``, ``p99_us`` (of the last 4,096 calls), ``max_us``."""
        ordered = sorted(self.recent)
        if not ordered:
            return {"n": 0}

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3

        return {
            "n": self.n,
            "mean_us": self.total_ns / self.n / 1e3,
            "p50_us": pct(0.5),
            "p99_us": pct(0.99),
            "max_us": self.max_ns / 1e3,
        }


class NvmlSampler(Sampler):
    """Samples every device of ``source`` at ``hz``; see the module docstring for the policy.

    ``families``: names from ``families.py`` (default: ``families.DEFAULT``). ``sample_once``
    polls the tick families and, where due, the slow ones, on the calling thread; ``start``
    runs each lane on its own thread.
    """

    source = "nvml"

    def __init__(
        self,
        sink: Sink,
        source: NvmlSource,
        hz: float = 10.0,
        *,
        attribute: Callable[[int], dict[str, str] | None] | None = None,
        clock: Callable[[], int] = now_ns,
        families: Collection[str] | None = None,
        stall_ns: int = STALL_NS,
    ) -> None:
        super().__init__(sink, hz, clock=clock, name="gpu-trace-nvml")
        self.nvml = source
        self.attribute = attribute or (lambda pid: None)
        self.families = frozenset(DEFAULT if families is None else families)
        self.tick_families = [f for f in FAMILIES if f.name in self.families and f.lane == TICK]
        self.slow_families = [f for f in FAMILIES if f.name in self.families and f.lane == SLOW]
        self.stall_ns = stall_ns
        self.stats: dict[tuple[str, str], CallStats] = {}
        self.stalled: dict[str, str] = {}  # lane -> what it was stuck in, once reported
        self._inflight: dict[str, tuple[str, str, int] | None] = {TICK: None, SLOW: None}
        self._window_at: dict[str, int] = {}
        self._slow_thread: threading.Thread | None = None
        self._slow_threaded = False  # the slow lane has a thread of its own (after start)
        self.devices = [_Device(d) for d in source.open()]  # raises NvmlUnavailable

    # ---- lifetime -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.slow_families:  # before the tick thread's first tick, which must not poll them
            self._slow_threaded = True
            period = min(f.period_ns for f in self.slow_families)
            self._slow_thread = threading.Thread(
                target=self.every,
                args=(period, self._slow_once),
                name=f"{self.name}-slow",
                daemon=True,
            )
        super().start()
        if self._slow_thread is not None:
            self._slow_thread.start()

    def stop(self, timeout: float = JOIN_S) -> None:
        """Stop both lanes, bounded: a lane stuck in a call is reported and abandoned (its
        thread is a daemon), and the source is then not closed (closing would wait for it)."""
        self._stop.set()
        threads = [self._thread, self._slow_thread]
        self._thread = self._slow_thread = None
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        self._watch(self.clock(), stopping=True)
        if any(self._inflight.values()):
            return
        closer = threading.Thread(target=self.close, name=f"{self.name}-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            log.warning(
                "gpu-trace: closing NVML did not finish within %.0f s; left behind", timeout
            )

    def close(self) -> None:
        try:
            self.nvml.close()
        except Exception:
            log.debug("gpu-trace: closing the NVML source failed", exc_info=True)

    # ---- one tick -----------------------------------------------------------------------------

    def sample(self, now: int) -> None:
        self._lane(TICK, self.tick_families, now)
        if (
            not self._slow_threaded
        ):  # sample_once on the caller's thread: the slow lane too, where due
            self._lane(SLOW, self.slow_families, now)

    def _slow_once(self) -> None:
        self._local.buf = self.sink.buffer()
        try:
            self._lane(SLOW, self.slow_families, self.clock())
        except Exception:
            self.failures += 1
            if self.failures == 1:
                log.exception("gpu-trace: %s failed; it keeps sampling", self.name)

    def _lane(self, lane: str, families: list[Family], now: int) -> None:
        self._watch(now)
        for dev in self.devices:
            for family in families:
                if not dev.alive:
                    break
                if family.period_ns:  # on its own grid, so the lane's jitter does not add up
                    due = dev.due.get(family.name)
                    if due is not None and now < due:
                        continue
                    due = now if due is None else due
                    due += family.period_ns
                    dev.due[family.name] = due if due > now else now + family.period_ns
                self._poll(dev, family, lane, now)
        if now - self._window_at.setdefault(lane, now) >= STATS_PERIOD_NS:
            self._window_at[lane] = now
            self._write_stats(families, now)

    def _poll(self, dev: _Device, family: Family, lane: str, now: int) -> None:
        wanted = [m for m in family.metrics if m in dev.enabled]
        if not wanted:
            return
        self._inflight[lane] = (dev.key, family.name, self.clock())
        t0 = time.perf_counter_ns()
        try:
            reading = self.nvml.poll(dev.info.index, wanted, now)
        except Exception as exc:  # the source itself broke: this device stops, the rest go on
            self._inflight[lane] = None
            self._lose(dev, now, type(exc).__name__, str(exc))
            return
        took = time.perf_counter_ns() - t0
        self._inflight[lane] = None
        self.stats.setdefault((dev.key, family.name), CallStats()).add(took)
        if lane in self.stalled:
            log.warning(
                "gpu-trace: NVML %s returned after %.1f s; sampling goes on",
                self.stalled.pop(lane),
                took / 1e9,
            )
        self._record(dev, reading, now)

    def _record(self, dev: _Device, reading: Reading, now: int) -> None:
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

    # ---- watchdog and call statistics ---------------------------------------------------------

    def _watch(self, now: int, *, stopping: bool = False) -> None:
        """Report (once per stall) a lane whose call has not returned within ``stall_ns``."""
        for lane, inflight in list(self._inflight.items()):
            if inflight is None or lane in self.stalled:
                continue
            key, family, since = inflight
            waited = self.clock() - since
            if waited < self.stall_ns and not stopping:
                continue
            what = f"{family} call on {key}"
            self.stalled[lane] = what
            if stopping:
                log.warning(
                    "gpu-trace: NVML sampling stopped with its %s blocked for %.1f s; "
                    "left behind (the run is complete without it)",
                    what,
                    waited / 1e9,
                )
            else:
                other = "tick" if lane == SLOW else "slow"
                log.warning(
                    "gpu-trace: NVML %s has not returned for %.1f s; the %s families wait for "
                    "it, the %s ones go on",
                    what,
                    waited / 1e9,
                    lane,
                    other,
                )
            if self._local.__dict__.get("buf") is not None:
                self.mark(
                    f"nvml/{key}",
                    f"nvml stalled: {family}",
                    now,
                    {"family": family, "device": key, "waited_ms": str(waited // 1_000_000)},
                )

    def _write_stats(self, families: list[Family], now: int) -> None:
        names = {f.name for f in families}
        for (key, family), st in self.stats.items():
            if family in names and st.window_n:
                self.counter(key, f"call_us.{family}", now, st.window_ns / st.window_n / 1e3)
                st.window_n = st.window_ns = 0

    def call_stats(self) -> dict[str, dict[str, float]]:
        """Per ``<device>/<family>``: calls, mean, p50, p99 and max latency in µs."""
        return {f"{key}/{family}": st.summary() for (key, family), st in self.stats.items()}

    # ---- policy -------------------------------------------------------------------------------

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
    *,
    families: Collection[str] | None = None,
    timeout_s: float = OPEN_TIMEOUT_S,
) -> tuple[NvmlSampler | None, str]:
    """An NVML sampler, or None and the one-line reason it is off (no NVML, no GPU, or NVML not
    answering within ``timeout_s``: opening runs on a thread of its own, so a hung driver cannot
    hold up the program's start)."""
    made: list[NvmlSampler | str] = []

    def opening() -> None:
        try:
            made.append(NvmlSampler(sink, source, hz, attribute=attribute, families=families))
        except NvmlUnavailable as exc:
            made.append(f"NVML sampling is off: {exc}")
        except Exception as exc:  # a broken driver or binding must not stop the recording
            log.debug("gpu-trace: opening NVML failed", exc_info=True)
            made.append(f"NVML sampling is off: {type(exc).__name__}: {exc}")

    opener = threading.Thread(target=opening, name="gpu-trace-nvml-open", daemon=True)
    opener.start()
    opener.join(timeout_s)
    if not made:
        return None, f"NVML sampling is off: NVML did not answer within {timeout_s:g} s"
    sampler = made[0]
    if isinstance(sampler, str):
        return None, sampler
    if not sampler.devices:
        sampler.close()
        return None, "NVML sampling is off: no GPU found"
    return sampler, ""


def wants_buffers(families: Collection[str] | None) -> bool:
    """Whether utilization and power are read from NVML's sample buffers (family ``buffers``)."""
    return families is not None and BUFFERS in families
