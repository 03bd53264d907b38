"""Counter series of a run: which it holds, and their samples in a window, a few per pixel.

Plain functions of a :class:`~gpu_trace.query.source.Source`; the timeline's counter panels are
drawn from what they return (:func:`gpu_trace.plots.figures.timeline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows


class CounterSeries(TypedDict):
    """One counter metric of a run and how many samples it has."""

    source: str
    metric: str
    samples: int


class CounterPoint(TypedDict):
    """One point of a counter panel: a series' mean over a bucket (``max``: its largest), or
    a sample just outside the window."""

    series: str
    ts_ns: int
    value: float
    max: float


def _point(series: Any, ts_ns: Any, value: Any, top: Any) -> CounterPoint:
    return CounterPoint(series=series, ts_ns=ts_ns, value=value, max=top)


def counter_series(source: Source, run_id: str) -> list[CounterSeries]:
    """Counter metrics of a run: source, metric, samples."""
    return [
        CounterSeries(source=str(r["source"]), metric=str(r["metric"]), samples=int(r["samples"]))
        for r in query_rows(
            source,
            """
            SELECT source, metric, count() AS samples FROM __db__.counters
            WHERE run_id = {run:String} GROUP BY source, metric ORDER BY source, metric
            """,
            {"run": run_id},
        )
    ]


#: A counter sample's series: its host, device, tenant and session (a tenant's sessions are lines
#: of their own: two sessions of one tenant were one line, their samples interleaved).
_SERIES = """concat(host, if(device = '', '', concat(' ', device)),
    if(labels['tenant'] != '', concat(' tenant ', labels['tenant']), ''),
    if(labels['session'] != '', concat(' session ', labels['session']), ''))"""


def counters(
    source: Source, run_id: str, metrics: list[str], t0: int, t1: int, width_px: int = 1600
) -> dict[str, list[CounterPoint]]:
    """Samples of ``metrics`` (``source/metric``) in the window, averaged per bucket of two
    pixels: ``{"source/metric": [{"series", "ts_ns", "value", "max"}...]}``, ordered by time,
    with each series' last sample before the window and first after it (a counter's value
    holds until its next sample: the figure draws them as steps)."""
    wanted = [m.split("/", 1) for m in metrics if "/" in m]
    if not wanted:
        return {}
    bucket = max(1, -(-(int(t1) - int(t0)) // max(1, int(width_px) // 2)))
    rows = query_rows(
        source,
        f"""
        SELECT source, metric, {_SERIES} AS series,
               intDiv(ts_ns - {{t0:Int64}}, {{bucket:Int64}}) AS b,
               min(ts_ns) AS first_ns, avg(value) AS mean, max(value) AS max
        FROM __db__.counters
        WHERE run_id = {{run:String}} AND ts_ns >= {{t0:Int64}} AND ts_ns < {{t1:Int64}}
          AND concat(source, '/', metric) IN {{wanted:Array(String)}}
        GROUP BY source, metric, series, b ORDER BY source, metric, series, b
        """,
        {
            "run": run_id,
            "t0": int(t0),
            "t1": int(t1),
            "bucket": bucket,
            "wanted": [f"{s}/{m}" for s, m in wanted],
        },
    )
    # The last sample before the window and the first after it, per series: a counter holds
    # its value between samples, so a window narrower than the sampling interval still has one.
    edges = query_rows(
        source,
        f"""
        SELECT source, metric, {_SERIES} AS series, ts_ns >= {{t1:Int64}} AS after,
               if(after, min(ts_ns), max(ts_ns)) AS ts,
               if(after, argMin(value, ts_ns), argMax(value, ts_ns)) AS value
        FROM __db__.counters
        WHERE run_id = {{run:String}} AND (ts_ns < {{t0:Int64}} OR ts_ns >= {{t1:Int64}})
          AND concat(source, '/', metric) IN {{wanted:Array(String)}}
        GROUP BY source, metric, series, after
        """,
        {"run": run_id, "t0": int(t0), "t1": int(t1), "wanted": [f"{s}/{m}" for s, m in wanted]},
    )
    out: dict[str, list[CounterPoint]] = {f"{s}/{m}": [] for s, m in wanted}
    for r in sorted(edges, key=lambda r: r["after"]):
        if not r["after"]:
            out[f"{r['source']}/{r['metric']}"].append(
                _point(r["series"], r["ts"], r["value"], r["value"])
            )
    for r in rows:
        out[f"{r['source']}/{r['metric']}"].append(
            _point(r["series"], r["first_ns"], r["mean"], r["max"])
        )
    for r in edges:
        if r["after"]:
            out[f"{r['source']}/{r['metric']}"].append(
                _point(r["series"], r["ts"], r["value"], r["value"])
            )
    return out


#: Counters drawn under a timeline when none are named: these first, then any, up to four.
TIMELINE_COUNTERS = (
    "nvml/gpu_util_pct",
    "nvml/mem_used_bytes",
    "host/cpu_util_pct",
    "user/loss",
)


def counters_to_draw(found: list[str], asked: list[str] | None) -> list[str]:
    """The counters to read of those the run has (``found``): those asked, or every one, the
    usual four first (a timeline keeps the first four with something to draw: :func:`drawable`).
    ValueError naming what the run has when an asked one is not there."""
    if asked is None:
        first = [c for c in TIMELINE_COUNTERS if c in found]
        return first + [c for c in found if c not in first]
    missing = [c for c in asked if c not in found]
    if missing:
        raise ValueError(
            f"no counter {', '.join(missing)} in this run; it has: {', '.join(found) or 'none'}"
        )
    return list(asked)


def drawable(points: Sequence[Mapping[str, object]], t0: int) -> bool:
    """Whether a counter panel of ``points`` (:func:`counters`) draws a line in a window starting
    at ``t0``: some series has two samples, the last in or after the window. A short block has
    one host sample at most (2 a second), from before it: that is no line, and its panel would
    be empty axes."""
    by_series: dict[object, list[int]] = {}
    for r in points:
        by_series.setdefault(r["series"], []).append(int(str(r["ts_ns"])))
    return any(len(ts) > 1 and max(ts) >= t0 for ts in by_series.values())
