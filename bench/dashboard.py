"""Dashboard speed on big runs: window query + figure build per zoom level, first page load and
browser memory in headless Chromium.

    python bench/dashboard.py [--spans 10000000] [--lanes 100] [--no-browser] [--loads N]

Writes two synthetic runs straight into a fresh embedded store as Arrow (no spool, no recorder):
``bench-small`` with a tenth of ``--spans`` and ``bench`` with all of them, both over ``--lanes``
tracks (4 hosts x 5 processes x ``lanes/20`` threads) and the same time span, so the big run is
10x denser. Each track holds back-to-back spans of 1-100 µs at depths 0-2 and one "step" span of
about a second every second.

Prints, for the big run: the first (uncached) track query, then for zoom levels from the whole run
down to 1/100000 of it the window query (bars + density), the flow and counter queries and the
figure build (with its JSON, what the server sends), and how many spans were bars and density
cells. With Chromium (``/usr/bin/chromium`` and playwright), the first page load (navigation until
the timeline's bars are drawn; when the page's scripts, plotly.js included, had run and when the
layout with the first figure had arrived) on each run, and the page's JS heap after loading and
after zooming, for both runs: the page holds what is on screen, so 10x more spans should not mean
more memory; with ``--loads N``, N-1 more first loads per run after that (a fresh browser context
each), their median and range. No thresholds: figures only, like every bench here (the machine is shared and
noisy).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plotly.io.json import to_json_plotly as to_json  # noqa: E402

from gpu_trace.dashboard import timeline  # noqa: E402
from gpu_trace.dashboard.readonly_store import ReadOnlyStore  # noqa: E402
from gpu_trace.plots import figures  # noqa: E402
from gpu_trace.query import reads
from gpu_trace.store.client import Store  # noqa: E402
from gpu_trace.tracer.run import RunInfo  # noqa: E402

RUN_NS = 10_000_000_000  # 10 s
CHUNK = 1_000_000
NAMES = [f"aten::op_{i}" for i in range(300)]


def _dict(values: list[str], codes: np.ndarray) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(values))


def make_run(store: Store, run_id: str, spans: int, lanes: int, seed: int = 0) -> float:
    """Insert ``spans`` synthetic spans over ``lanes`` tracks; returns seconds taken."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    threads = max(1, lanes // 20)
    tracks = [(h, p, t, lane) for h in range(4) for p in range(5) for t in range(threads)
              for lane in ("nvtx/model",)][:lanes]  # fmt: skip
    per = spans // len(tracks)
    steps_per_track = RUN_NS // 1_000_000_000
    sid = 1
    batch: list[pa.Table] = []
    rows = 0

    def flush() -> None:
        nonlocal batch, rows
        if batch:
            store.insert_arrow("spans", pa.concat_tables(batch))
        batch, rows = [], 0

    for host, pid, tid, lane in tracks:
        n = per
        gap = RUN_NS // max(1, n)
        start = np.arange(n, dtype=np.int64) * gap + rng.integers(0, max(1, gap // 4), n)
        dur = rng.integers(1_000, min(100_000, gap) + 1, n, dtype=np.int64)
        step_start = np.arange(steps_per_track, dtype=np.int64) * 1_000_000_000
        start = np.concatenate([start, step_start])
        dur = np.concatenate([dur, np.full(steps_per_track, 950_000_000, dtype=np.int64)])
        m = len(start)
        cat = np.concatenate([np.zeros(n, np.int32), np.ones(steps_per_track, np.int32)])
        names = np.concatenate(
            [rng.integers(0, len(NAMES), n), np.full(steps_per_track, len(NAMES))]
        )
        depth = np.concatenate([rng.integers(1, 3, n), np.zeros(steps_per_track, np.int64)])
        table = pa.table(
            {
                "run_id": _dict([run_id], np.zeros(m, np.int32)),
                "trace_id": _dict(["0" * 32], np.zeros(m, np.int32)),
                "span_id": pa.array(np.arange(sid, sid + m, dtype=np.uint64)),
                "parent_span_id": pa.array(np.zeros(m, np.uint64)),
                "host": _dict([f"host{host}"], np.zeros(m, np.int32)),
                "pid": pa.array(np.full(m, 1000 + pid, np.uint32)),
                "tid": pa.array(np.full(m, 1000 + pid * 100 + tid, np.uint64)),
                "lane": _dict([lane], np.zeros(m, np.int32)),
                "category": _dict(["op", "step"], cat),
                "name": _dict(NAMES + ["ProfilerStep"], names),
                "start_ns": pa.array(start),
                "end_ns": pa.array(start + dur),
                "depth": pa.array(depth.astype(np.uint16)),
                "attrs": pa.array([[]] * m, pa.map_(pa.string(), pa.string())),
            }
        )
        sid += m
        batch.append(table)
        rows += m
        if rows >= CHUNK:
            flush()
    flush()
    ts = np.arange(0, RUN_NS, 100_000_000, dtype=np.int64)
    k = len(ts)
    store.insert_arrow(
        "counters",
        pa.table(
            {
                "run_id": pa.array([run_id] * k),
                "host": pa.array(["host0"] * k),
                "source": pa.array(["nvml"] * k),
                "device": pa.array(["gpu0"] * k),
                "metric": pa.array(["gpu_util_pct"] * k),
                "ts_ns": pa.array(ts),
                "value": pa.array(rng.random(k) * 100),
                "labels": pa.array([[]] * k, pa.map_(pa.string(), pa.string())),
            }
        ),
    )
    store.upsert_run(
        RunInfo(run_id=run_id, trace_id="0" * 32, started_ns=0, ended_ns=RUN_NS,
                command=f"bench {spans:,} spans", hosts=[f"host{h}" for h in range(4)],
                status="finished", attrs={"anchor_mono_ns": "0", "anchor_wall_ns": str(time.time_ns())})
    )  # fmt: skip
    return time.perf_counter() - t0


def bench_queries(source: ReadOnlyStore, run_id: str, width: int = 1270) -> None:
    t = time.perf_counter()
    tr = timeline.prepare(source, run_id)
    print(f"  first open (one scan: overview grid, long spans, tracks, grid rows; kept in memory): "
          f"{1e3 * (time.perf_counter() - t):.0f} ms, {len(tr['tracks'])} tracks, "
          f"{tr['rows']} rows")  # fmt: skip
    run = reads.run(source, run_id)
    print(f"  {'window':>12} {'query':>8} {'flows+ctr':>9} {'figure':>8} {'total':>8}"
          f" {'bars':>6} {'density spans':>14} {'cells':>7}")  # fmt: skip
    for frac in (1, 10, 100, 1_000, 10_000, 100_000):
        span = RUN_NS // frac
        t0 = RUN_NS // 3
        t1 = t0 + span
        a = time.perf_counter()
        w = timeline.window(source, run_id, t0, t1, width)
        b = time.perf_counter()
        fl = timeline.flows(source, run_id, t0, t1)
        cs = timeline.counters(source, run_id, ["nvml/gpu_util_pct"], t0, t1, width)
        c = time.perf_counter()
        fig = figures.timeline(run, tr, w, fl, cs, [], width)
        to_json(fig)
        d = time.perf_counter()
        print(f"  {figures.fmt.duration(span):>12} {1e3 * (b - a):6.0f}ms {1e3 * (c - b):7.0f}ms"
              f" {1e3 * (d - c):6.0f}ms {1e3 * (d - a):6.0f}ms {len(w.bars):6,}"
              f" {w.density_spans:14,} {w.density_cells:7,}")  # fmt: skip


def bench_browser(source: ReadOnlyStore, runs: list[str], loads: int = 1) -> None:
    from gpu_trace.dashboard.app import Server

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("browser: playwright is not installed; skipped")
        return
    if not Path("/usr/bin/chromium").exists():
        print("browser: no /usr/bin/chromium; skipped")
        return
    server = Server(source, "127.0.0.1", 0).start()
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=flags)
            for run_id in runs:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                cdp = page.context.new_cdp_session(page)
                cdp.send("Performance.enable")
                t = time.perf_counter()
                page.goto(f"{server.url}/?run={run_id}")
                try:
                    page.locator("#timeline g.barlayer g.point path").first.wait_for(
                        state="attached", timeout=120_000
                    )
                except Exception as exc:
                    said = " | ".join(
                        page.inner_text(s) for s in ("#message", "#timeline-message", "#lod")
                    )
                    print(f"  {run_id:>12}: no bars after 120 s ({type(exc).__name__}); "
                          f"the page says: {said!r}")  # fmt: skip
                    page.close()
                    continue
                load = time.perf_counter() - t
                nav = page.evaluate(
                    "() => { const n = performance.getEntriesByType('navigation')[0];"
                    " const l = performance.getEntriesByType('resource')"
                    ".filter(e => e.name.includes('_dash-layout'))[0];"
                    " return [n.domContentLoadedEventEnd, n.loadEventEnd, l ? l.responseEnd : 0]; }"
                )

                def heap(cdp=cdp) -> float:
                    cdp.send("HeapProfiler.collectGarbage")
                    metrics = {m["name"]: m["value"] for m in
                               cdp.send("Performance.getMetrics")["metrics"]}  # fmt: skip
                    return metrics["JSHeapUsedSize"] / 2**20

                page.wait_for_function("document.querySelector('#lod').innerText.length > 0")
                page.wait_for_timeout(1000)  # let Dash settle before zooming
                loaded = heap()
                before = page.inner_text("#window-text")
                page.evaluate(
                    """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
                       const [a, b] = gd.layout.xaxis.range;
                       Plotly.relayout(gd, {'xaxis.range[0]': a + (b - a) * 0.3,
                                            'xaxis.range[1]': a + (b - a) * 0.31}); }"""
                )
                page.wait_for_function(
                    "t => document.querySelector('#window-text').innerText !== t",
                    arg=before,
                    timeout=120_000,
                )
                page.wait_for_timeout(500)
                zoomed = heap()
                spans = reads.run(source, run_id)["spans"]
                print(f"  {run_id:>12}: {spans:>11,} spans: first page load {load:5.2f} s (scripts"
                      f" run by {nav[1] / 1e3:.2f} s, layout in by {nav[2] / 1e3:.2f} s);"
                      f" JS heap {loaded:6.1f} MiB loaded, {zoomed:6.1f} MiB after a zoom")  # fmt: skip
                page.close()
                # More first loads, now that the server has read the run (as the bench run was).
                times = [_load_once(browser, server.url, run_id) for _ in range(loads - 1)]
                if times:
                    times.sort()
                    print(f"  {'':>12}  then {len(times)} more (a fresh browser context each): median"
                          f" {statistics.median(times):.2f} s, {times[0]:.2f}-{times[-1]:.2f} s")  # fmt: skip
            browser.close()
    finally:
        server.close()


def _load_once(browser: Any, url: str, run_id: str) -> float:
    """Seconds from navigation until the timeline's bars are in a fresh page (nan if never)."""
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    try:
        t = time.perf_counter()
        page.goto(f"{url}/?run={run_id}")
        page.locator("#timeline g.barlayer g.point path").first.wait_for(
            state="attached", timeout=120_000
        )
        return time.perf_counter() - t
    except Exception:
        return float("nan")
    finally:
        page.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=int, default=10_000_000)
    p.add_argument("--lanes", type=int, default=100)
    p.add_argument("--no-browser", action="store_true")
    p.add_argument("--loads", type=int, default=1,
                   help="page loads per run: the first, then N-1 more (median and range)")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the temporary store")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-trace-bench-dashboard-"))
    try:
        store = Store(f"chdb://{tmp / 'store'}")
        small = make_run(store, "bench-small", args.spans // 10, args.lanes, seed=1)
        big = make_run(store, "bench", args.spans, args.lanes)
        print(f"generated {args.spans // 10:,} + {args.spans:,} spans over {args.lanes} tracks "
              f"in {small:.1f} + {big:.1f} s (Arrow straight into chDB)")  # fmt: skip
        source = ReadOnlyStore(store=store)
        print(f"run 'bench' ({args.spans:,} spans), plot width 1270 px:")
        bench_queries(source, "bench")
        if not args.no_browser:
            print("headless Chromium (first page load includes Dash's and plotly's scripts):")
            bench_browser(source, ["bench-small", "bench"], max(1, args.loads))
        source.close()
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
