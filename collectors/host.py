"""The host sampler: CPU, memory, network and disk of the machine, CPU and RSS of the run's processes.

Read with psutil in the `gpu-trace record` parent (or a server), like the NVML sampler. Rates
(network, disk) are per-second differences between two ticks, so the first tick only sets the
baseline. Per-process counters cover the traced program's root process and its descendants
(:class:`~gpu_trace.collectors.processes.ProcessTree`); a process that exits just stops being
sampled. A metric psutil can't give here (no disk counters in a container, say) is recorded as an
error mark once and not asked again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psutil

from gpu_trace.collectors.periodic import Sampler, Sink
from gpu_trace.collectors.processes import ProcessTree
from gpu_trace.tracer.clock import now_ns

log = logging.getLogger(__name__)

LANE = "host"
#: Machine-wide metric groups, each disabled as a whole when it fails.
GROUPS = ("cpu", "memory", "network", "disk", "processes")


class HostSampler(Sampler):
    """Samples this machine and the run's processes ``hz`` times a second."""

    source = "host"

    def __init__(
        self,
        sink: Sink,
        hz: float = 2.0,
        *,
        tree: ProcessTree | None = None,
        clock: Callable[[], int] = now_ns,
    ) -> None:
        super().__init__(sink, hz, clock=clock, name="gpu-trace-host")
        self.tree = tree or ProcessTree()
        self.enabled = set(GROUPS)
        self._procs: dict[int, psutil.Process] = {}
        self._last: dict[str, tuple[int, tuple[float, ...]]] = {}
        psutil.cpu_percent(None)  # the first call only sets psutil's baseline

    def sample(self, now: int) -> None:
        for group in GROUPS:
            if group not in self.enabled:
                continue
            try:
                getattr(self, f"_{group}")(now)
            except Exception as exc:
                self.enabled.discard(group)
                error = type(exc).__name__
                self.mark(
                    LANE, f"host error: {group} {error}", now, {"metric": group, "error": error}
                )
                log.info("gpu-trace: host %s sampling stops: %s", group, exc)

    def _cpu(self, now: int) -> None:
        self.counter("", "cpu_util_pct", now, psutil.cpu_percent(None))

    def _memory(self, now: int) -> None:
        vm = psutil.virtual_memory()
        self.counter("", "host_mem_used_bytes", now, vm.total - vm.available)

    def _rates(self, now: int, key: str, values: tuple[float, ...], names: tuple[str, ...]) -> None:
        previous = self._last.get(key)
        self._last[key] = (now, values)
        if previous is None or now <= previous[0]:
            return
        dt = (now - previous[0]) / 1e9
        for name, v, p in zip(names, values, previous[1]):
            self.counter("", name, now, max(0.0, v - p) / dt)

    def _network(self, now: int) -> None:
        io = psutil.net_io_counters()
        if io is None:
            raise RuntimeError("no network counters")
        self._rates(
            now,
            "net",
            (io.bytes_sent, io.bytes_recv),
            ("net_sent_bytes_per_s", "net_recv_bytes_per_s"),
        )

    def _disk(self, now: int) -> None:
        io = psutil.disk_io_counters()
        if io is None:
            raise RuntimeError("no disk counters")
        self._rates(
            now,
            "disk",
            (io.read_bytes, io.write_bytes),
            ("disk_read_bytes_per_s", "disk_write_bytes_per_s"),
        )

    def _processes(self, now: int) -> None:
        pids = self.tree.pids()
        for gone in self._procs.keys() - pids:
            del self._procs[gone]
        if self.tree.root is None:
            return
        cpu_total = 0.0
        rss_total = 0
        for pid in sorted(pids):
            proc = self._procs.get(pid)
            try:
                if proc is None:  # cpu_percent's first call is a baseline: report from the next
                    proc = self._procs[pid] = psutil.Process(pid)
                    proc.cpu_percent(None)
                    cpu = None
                else:
                    cpu = proc.cpu_percent(None)
                rss = proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                self._procs.pop(pid, None)  # it exited between the walk and now
                continue
            labels = {"pid": str(pid)}
            if cpu is not None:
                cpu_total += cpu
                self.counter(f"pid{pid}", "process_cpu_pct", now, cpu, labels)
            rss_total += rss
            self.counter(f"pid{pid}", "process_rss_bytes", now, rss, labels)
        self.counter("", "run_cpu_pct", now, cpu_total)
        self.counter("", "run_rss_bytes", now, rss_total)
