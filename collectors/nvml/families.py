"""NVML metric families: what the sampler asks for together, on which lane, how often, by default.

A family is the NVML calls behind a group of metrics (``clocks`` is two ``nvmlDeviceGetClockInfo``
calls). Families are polled one call each, so the sampler can time each family and keep a slow one
from delaying the others. Per-call latencies measured on an NVIDIA H100 (driver 580, issue 17):
utilization rates 1-2 µs, memory info 6-8 µs, running processes 9-10 µs, power, temperature,
ECC and throttle reasons 1-4 µs, clocks 4-6 µs; ``nvmlDeviceGetSamples`` 1.37 ms; PCIe throughput
41 ms (it blocks for its sampling window). Hence two lanes, each its own thread:

- ``tick``: the cheap families, every tick at the sampler's rate (10 Hz by default);
- ``slow``: families that change slowly or may block, each on its own period, on a thread of
  their own, so a blocking call there never delays a tick.

PCIe throughput (41 ms a call, two calls), NVML's sample buffers (1.37 ms a call, three calls a
tick) and XID events (a registration with the driver) are off by default;
``GPU_TRACE_NVML_FAMILIES`` turns them on (docs/collectors.md).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

#: Not counters, but asked for and disabled the same way as metrics.
PROCESSES = "processes"
EVENTS = "events"

TICK = "tick"
SLOW = "slow"


@dataclass(frozen=True)
class Family:
    """``metrics`` polled together; ``period_ns`` 0 means every tick (lane ``tick``)."""

    name: str
    metrics: tuple[str, ...]
    period_ns: int = 0
    default: bool = True
    #: Per-call latency on the H100 (µs), for the docs and the bench's expectations.
    h100_us: str = ""

    @property
    def lane(self) -> str:
        return SLOW if self.period_ns else TICK


_S = 1_000_000_000

FAMILIES: tuple[Family, ...] = (
    Family("utilization", ("gpu_util_pct", "mem_util_pct"), h100_us="1-2"),
    Family("memory", ("mem_used_bytes",), h100_us="6-8"),
    Family("clocks", ("sm_clock_mhz", "mem_clock_mhz"), h100_us="4-6"),
    Family("power", ("power_w",), h100_us="1-4"),
    Family("temperature", ("temperature_c",), h100_us="1-4"),
    Family("throttle", ("throttle_reasons",), h100_us="1-4"),
    Family(PROCESSES, (PROCESSES,), h100_us="9-10"),
    Family("memory_total", ("mem_total_bytes",), period_ns=10 * _S, h100_us="6-8"),
    Family("ecc", ("ecc_corrected_errors", "ecc_uncorrected_errors"), period_ns=_S, h100_us="1-4"),
    # Off by default: registering for XID events is the one thing the sampler did that polling
    # each family from a separate process (which cost the H100 step nothing) did not; until a
    # GPU run of bench/gpu_overhead.py (configuration off-events) clears it, it is opt-in.
    Family(EVENTS, (EVENTS,), period_ns=_S, default=False),
    Family(
        "pcie",
        ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"),
        period_ns=5 * _S,
        default=False,
        h100_us="41000",
    ),
)
#: Not a family of metrics but a way of reading two: utilization and power from NVML's sample
#: buffers (``nvmlDeviceGetSamples``, every sample the driver took, 1.37 ms a call) instead of
#: one value a tick. Off by default.
BUFFERS = "buffers"

BY_NAME = {f.name: f for f in FAMILIES}
FAMILY_OF = {m: f for f in FAMILIES for m in f.metrics}
DEFAULT = frozenset(f.name for f in FAMILIES if f.default)
ALL = frozenset([*BY_NAME, BUFFERS])


def parse(text: str | None) -> frozenset[str]:
    """Families from ``GPU_TRACE_NVML_FAMILIES``: ``default``, ``all``, names, ``+name``/``-name``.

    ``default,+pcie`` adds PCIe to the default set; ``-processes`` drops one; ``all`` is every
    family and the buffers. Raises ValueError naming an unknown family.
    """
    chosen = set(DEFAULT)
    words = [w.strip() for w in (text or "").split(",") if w.strip()]
    if words and not words[0].startswith(("+", "-")) and words[0] not in ("default", "all"):
        chosen = set()  # a plain list: exactly those
    for word in words:
        if word == "default":
            chosen |= DEFAULT
            continue
        if word == "all":
            chosen |= ALL
            continue
        sign, name = (word[0], word[1:]) if word[0] in "+-" else ("+", word)
        if name not in ALL:
            known = ", ".join(sorted(ALL))
            raise ValueError(f"unknown NVML family {name!r} (known: {known}, default, all)")
        if sign == "-":
            chosen.discard(name)
        else:
            chosen.add(name)
    return frozenset(chosen)


def lane_of(metrics: Collection[str]) -> str:
    """The lane of a request (every metric of one request is of one family)."""
    for m in metrics:
        family = FAMILY_OF.get(m)
        if family is not None:
            return family.lane
    return TICK
