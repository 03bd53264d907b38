"""One run per job: merging each part's ``runs`` row, and another host's times onto the run's clock.

Every record of a job (``gpu-trace record --job ID``: each rank under its own record, on any host)
writes a run directory of its own under the run id ``job-<ID>`` (:func:`gpu_trace.tracer.ranks.
job_run_id`). Ingest stores each part as it comes, in any order, into the same run:

- **the run's row** (:func:`merge`): the first part stored sets the run's clock (its host,
  ``clock_host``, and its wall-clock anchor); later parts add their hosts, widen the run's start
  and end (on the run's clock), and make the status the worst of the parts' (failed over killed
  over running over finished); the command is the first part's, with the number of parts;
- **times of another host** (:func:`part_clock`): each host's CLOCK_MONOTONIC counts from its own
  boot, so a part recorded on another host than ``clock_host`` is mapped onto the run's clock by a
  constant offset ``d`` (run = part + d). The two records' wall-clock anchors give a first value
  (``wall``: as good as the hosts' clock synchronisation, NTP or PTP, which nothing here can
  measure). The job's own collectives then bound ``d`` for certain: a collective that needs every
  rank (all-reduce, all-gather, reduce-scatter, all-to-all, barrier) cannot end on any rank before
  the last rank entered, so for each one linked across the two sides (process group and sequence
  number), ``enter_run - end_part <= d <= end_run - enter_part``. The offset taken is the wall
  value moved into that interval, and its uncertainty the farther end of the interval from it: a
  hard bound, like a clock-sync sample's half round trip (docs/clock-sync.md). With no linked
  collective the uncertainty is unknown and the run's ``clock.<host>`` attribute says so.

The offset reaches ingest as clock-sync rows (``host`` the run's clock host, ``peer`` the part's
host), so the part's spans and counters are mapped by the same model as a forwarding server's
(``clock_offset_ns``/``clock_uncertainty_ns`` on each span), and ``show`` prints them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.tracer.ranks import COLLECTIVE_LANE, JOB_ATTR
from gpu_trace.tracer.run import RunInfo

if TYPE_CHECKING:
    from gpu_trace.store.client import Store

#: ``runs`` attrs: the host whose clock the run's times are on.
CLOCK_HOST = "clock_host"
#: ``runs`` attrs: how many parts of the job are stored.
PARTS = "job_parts"
#: Collectives every rank of the group must enter before any rank's work ends.
SYMMETRIC = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")
#: ``runs`` attrs prefix: one entry per part (``part.<host>.<recorder pid>``).
_PART = "part."
#: What each part counts, summed into the run's attrs of the same names.
_COUNTED = ("events", "dropped", "processes")
#: Worst first: the status a job takes from its parts'.
_STATUS_ORDER = ("died", "failed", "killed", "running", "finished")

_STORED_COLLECTIVES = """
SELECT attrs['pg'] AS pg, attrs['seq'] AS seq, name, start_ns, end_ns FROM __db__.spans
WHERE run_id = {run_id:String} AND category = 'collective' AND lane = {lane:String}
  AND name IN {names:Array(String)} AND attrs['seq'] != ''
"""


@dataclass(frozen=True)
class PartClock:
    """How one part's times go onto the run's clock: ``run = part + offset_ns``."""

    host: str  # the part's host: its spans' clock
    clock_host: str  # the run's clock
    offset_ns: int
    #: A hard bound on the offset's error; None when no collective bounded it (wall clocks only).
    uncertainty_ns: int | None
    wall_offset_ns: int  # what the wall-clock anchors alone gave
    collectives: int  # how many linked collectives bounded it

    def describe(self) -> str:
        """One line for the run's ``clock.<host>`` attribute (``show`` prints it)."""
        if self.uncertainty_ns is None:
            return (
                f"{self.offset_ns:+,} ns onto {self.clock_host}'s clock by the wall clocks; "
                "uncertainty unknown (no collective linked the hosts)"
            )
        moved = self.offset_ns - self.wall_offset_ns
        wall = (
            "the wall clocks' offset lies inside that bound"
            if moved == 0
            else f"the wall clocks' offset was {moved:+,} ns outside it"
        )
        return (
            f"{self.offset_ns:+,} ns onto {self.clock_host}'s clock, +/- {self.uncertainty_ns:,} "
            f"ns as {self.collectives} collectives bound it ({wall})"
        )

    def samples(self, start_ns: int, end_ns: int) -> set[tuple[int, int, int]]:
        """Clock-sync rows ``(ts_ns, offset_ns, rtt_ns)`` for the run's clock model of
        :attr:`host`: the sample offset is the peer's clock minus the run's (``-offset_ns``) and
        the round trip twice the uncertainty (0 where it is unknown: the model's least)."""
        rtt = 2 * (self.uncertainty_ns or 0)
        theta = -self.offset_ns
        return {(start_ns + self.offset_ns, theta, rtt), (end_ns + self.offset_ns, theta, rtt)}


def is_part(info: RunInfo) -> bool:
    """Whether ``info`` is one part of a job (``record --job``)."""
    return bool(info.attrs.get(JOB_ATTR))


def _wall_minus_mono(info: RunInfo) -> int | None:
    with contextlib.suppress(KeyError, ValueError):
        return int(info.attrs["anchor_wall_ns"]) - int(info.attrs["anchor_mono_ns"])
    return None


def clock_host(info: RunInfo) -> str:
    """The host whose clock a stored job run's times are on."""
    return info.attrs.get(CLOCK_HOST) or (info.hosts[0] if info.hosts else "")


#: One collective on the run's clock: ``(pg, seq, name) -> (latest enter, earliest end)`` over
#: the ranks stored.
Linked = dict[tuple[str, str, str], tuple[int, int]]


def stored_collectives(store: Store, run_id: str) -> Linked:
    """The run's stored collectives that every rank must enter before any ends, each with the
    latest enter and the earliest end of its ranks (the run's clock)."""
    rows = store.query(
        _STORED_COLLECTIVES,
        {"run_id": run_id, "lane": COLLECTIVE_LANE, "names": list(SYMMETRIC)},
    ).result_rows
    out: Linked = {}
    for pg, seq, name, start, end in rows:
        key = (str(pg), str(seq), str(name))
        got = out.get(key)
        out[key] = (
            (int(start), int(end))
            if got is None
            else (max(got[0], int(start)), min(got[1], int(end)))
        )
    return out


def part_clock(
    run: Linked, stored: RunInfo | None, part: RunInfo, spans: list[pa.Table]
) -> PartClock | None:
    """The offset of ``part``'s times onto the stored run's clock; None when none is needed (not
    a job part, the first part stored, or one recorded on the run's clock host) or none can be
    had (an anchor missing: the part is stored as recorded, and ingest says so).

    ``run``: the run's stored collectives (:func:`stored_collectives`); ``spans``: the part's span
    tables (from its spool), for its own."""
    if not is_part(part) or stored is None:
        return None
    host = part.hosts[0] if part.hosts else ""
    ref_host = clock_host(stored)
    if not host or host == ref_host:
        return None
    mine, theirs = _wall_minus_mono(part), _wall_minus_mono(stored)
    if mine is None or theirs is None:
        return None
    wall = mine - theirs
    lo, hi, n = _bounds(run, spans)
    if n == 0 or lo > hi:
        # No collective linked the hosts, or they contradict each other (a clock stepped during
        # the job): the wall clocks alone.
        return PartClock(host, ref_host, wall, None, wall, 0)
    offset = min(max(wall, lo), hi)
    return PartClock(host, ref_host, offset, max(offset - lo, hi - offset), wall, n)


def _bounds(run: Linked, spans: list[pa.Table]) -> tuple[int, int, int]:
    """``(lo, hi, n)``: the interval the offset must lie in from ``n`` collectives linked between
    the part's spans and the run's (``n`` 0: nothing linked). For each, the run's latest enter
    is at most the part's end and the part's enter at most the run's earliest end."""
    lo, hi, n = -(1 << 62), 1 << 62, 0
    for table in spans:
        for pg, seq, name, start, end in _collectives(table):
            got = run.get((pg, seq, name))
            if got is None:
                continue
            enter_run, end_run = got
            lo = max(lo, enter_run - end)
            hi = min(hi, end_run - start)
            n += 1
    return lo, hi, n


def _collectives(table: pa.Table) -> list[tuple[str, str, str, int, int]]:
    """``(pg, seq, name, start, end)`` of the symmetric collective spans in a spool table."""
    if table.num_rows == 0 or "category" not in table.column_names:
        return []
    keep = pc.and_(
        pc.and_(
            pc.equal(table.column("category").cast(pa.string()), "collective"),
            pc.equal(table.column("lane").cast(pa.string()), COLLECTIVE_LANE),
        ),
        pc.is_in(table.column("name").cast(pa.string()), pa.array(SYMMETRIC)),
    )
    picked = table.filter(keep)
    out = []
    names = picked.column("name").cast(pa.string()).to_pylist()
    starts = np.asarray(picked.column("start_ns").to_numpy(), dtype=np.int64)
    ends = np.asarray(picked.column("end_ns").to_numpy(), dtype=np.int64)
    for i, attrs in enumerate(picked.column("attrs").to_pylist()):
        values = dict(attrs or [])
        seq = str(values.get("seq", ""))
        if seq:
            out.append((str(values.get("pg", "")), seq, names[i], int(starts[i]), int(ends[i])))
    return out


def merge(stored: RunInfo | None, part: RunInfo, clock: PartClock | None) -> RunInfo:
    """The job run's row with ``part`` added (see the module's docstring).

    Each part is kept in the attrs as ``part.<host>.<recorder pid>`` (its status, events,
    dropped, processes), so ingesting a part again replaces it rather than counting it twice; the
    run's ``events``, ``dropped``, ``processes``, ``job_parts`` and status come from those."""
    shift = clock.offset_ns if clock is not None else 0
    base = stored if stored is not None else part
    attrs = dict(base.attrs)
    attrs.setdefault(CLOCK_HOST, clock_host(base))
    host = part.hosts[0] if part.hosts else ""
    key = f"{_PART}{host}.{part.attrs.get('recorder_pid', '')}"
    attrs[key] = " ".join([part.status, *(part.attrs.get(k, "0") or "0" for k in _COUNTED)])
    if clock is not None:
        attrs[f"clock.{clock.host}"] = clock.describe()
    parts = [v.split() for k, v in attrs.items() if k.startswith(_PART)]
    for i, name in enumerate(_COUNTED, start=1):
        attrs[name] = str(sum(int(p[i]) for p in parts if len(p) > i and p[i].isdigit()))
    attrs[PARTS] = str(len(parts))
    status = min(
        (p[0] for p in parts if p),
        key=lambda s: _STATUS_ORDER.index(s) if s in _STATUS_ORDER else len(_STATUS_ORDER),
    )
    if stored is None:
        started, ended = part.started_ns, part.ended_ns
    else:
        started = min(stored.started_ns, part.started_ns + shift)
        ended = max(stored.ended_ns, part.ended_ns + shift)
    return RunInfo(
        run_id=base.run_id,
        trace_id=base.trace_id,
        started_ns=started,
        ended_ns=0 if status == "running" else ended,
        command=base.command,
        hosts=list(dict.fromkeys([*(stored.hosts if stored else []), *part.hosts])),
        status=status,
        attrs=attrs,
    )
