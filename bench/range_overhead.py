"""Per-range recording cost: gpu-trace vs NVTX tools and peers, side by side in one run.

    python bench/range_overhead.py [--n 100000] [--repeat 5] [--rounds 3]
    python bench/range_overhead.py --flood 10 [--rounds 3]


Each variant runs in its own process (the NVTX injection differs between them) and reports the best
of ``--repeat`` timings of ``--n`` ranges, in ns per range with the empty loop's cost subtracted.
The whole list runs ``--rounds`` times, interleaved, and each variant keeps its best round, so a
burst of load from elsewhere on the machine skews no single variant. ``gpu_trace.range`` is shown
twice: the C type it normally is (``tracer/_fastpath.c``) and its pure-Python twin.
The table's ratios are against "NVTX no-op tool": the NVTX calls themselves with a tool attached
that does nothing, the floor for any NVTX-based capture. It runs in a process that records like the
captured variant does (recorder, flusher thread, numpy and Arrow loaded; NVTX capture off), so the
ratio is the capture's own cost; the same calls in a bare process are shown too. This machine is
shared and noisy: read ratios, not absolute numbers.

``--flood SECONDS``: one thread emits ranges as fast as ``gpu_trace.range`` allows, for that long,
at the default settings (buffer capacity, flush interval), with the C type and with the Python
twin, each in its own process, ``--rounds`` times; it reports the ranges emitted, stored (rows in
the spool) and dropped, and ranges per second. Nothing may be lost: emitted = stored + dropped,
and dropped should be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOOP_TOOL = r"""
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>
static int NVTX_API push(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) { (void)d; (void)a; return 0; }
static int NVTX_API pop(nvtxDomainHandle_t d) { (void)d; return 0; }
static nvtxDomainHandle_t NVTX_API create(const char* n) { (void)n; return (nvtxDomainHandle_t)1; }
static nvtxStringHandle_t NVTX_API reg(nvtxDomainHandle_t d, const char* s) { (void)d; (void)s; return (nvtxStringHandle_t)1; }
__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
    const NvtxExportTableCallbacks* cb = (const NvtxExportTableCallbacks*)get(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable t = 0; unsigned int n = 0;
    if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &t, &n)) return 0;
    *t[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)push;
    *t[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)pop;
    *t[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)create;
    *t[NVTX_CBID_CORE2_DomainRegisterStringA] = (NvtxFunctionPointer)reg;
    return 1;
}
"""

VARIANTS = [
    # name, label, scale (fewer iterations for the slow peers)
    ("api_cm", "gpu_trace.range (with), C", 1),
    ("api_deco", "gpu_trace.range (decorator), C", 1),
    ("api_cm_py", "gpu_trace.range (with), Python twin", 1),
    ("api_deco_py", "gpu_trace.range (decorator), Python twin", 1),
    ("nvtx_captured", "NVTX domain push/pop, captured by gpu-trace", 1),
    ("nvtx_noop", "NVTX no-op tool", 1),
    ("nvtx_noop_bare", "NVTX no-op tool, bare process", 1),
    ("nvtx_python_path", "NVTX domain push/pop, gpu-trace Python path", 5),
    ("annotate_no_tool", "nvtx.annotate, no tool", 1),
    ("torch_record_function", "torch.profiler.record_function (CPU profile)", 5),
    ("otel_span", "OpenTelemetry SDK span (no exporter)", 5),
    ("viztracer_call", "VizTracer, per traced call", 5),
]
BASELINE = "nvtx_noop"


def _best(fn, n: int, repeat: int, between=None) -> float:
    """Best ns per iteration of ``fn(n)`` over ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(n)
        best = min(best, (time.perf_counter_ns() - t0) / n)
        if between is not None:
            between()
    return best


def _empty(n: int) -> None:
    for _ in range(n):
        pass


def _noop() -> None:
    pass


def _calls(n: int) -> None:
    f = _noop
    for _ in range(n):
        f()


def run_variant(name: str, n: int, repeat: int) -> float:
    """ns per range of one variant, measured in this process."""
    loop = _best(_empty, n, repeat)
    if name.startswith("api_") or name in ("nvtx_captured", "nvtx_python_path", "nvtx_noop"):
        import gpu_trace
        from gpu_trace import _api
        from gpu_trace.tracer import recorder

        if name.startswith("api_"):
            if name.endswith("_py"):
                rng = _api.PyRange
            elif gpu_trace.range is _api.PyRange:
                raise RuntimeError("the C range is unavailable here")
            else:
                rng = gpu_trace.range
            name = name.removesuffix("_py")
        mode = {"nvtx_captured": "native", "nvtx_python_path": "python"}.get(name, "off")
        gpu_trace.start(Path(tempfile.mkdtemp()) / "run", nvtx=mode)
        flush = recorder.active.flush
        try:
            if name == "api_cm":

                def body(k: int) -> None:
                    for _ in range(k):
                        with rng("step"):
                            pass

                return _best(body, n, repeat, flush) - loop
            if name == "api_deco":
                f = rng("step")(_noop)

                def body(k: int) -> None:
                    for _ in range(k):
                        f()

                return _best(body, n, repeat, flush) - _best(_calls, n, repeat)
            return _domain_push_pop(n, repeat, flush) - loop
        finally:
            gpu_trace.stop()
    if name == "nvtx_noop_bare":
        return _domain_push_pop(n, repeat) - loop
    if name == "annotate_no_tool":
        import nvtx

        def body(k: int) -> None:
            for _ in range(k):
                with nvtx.annotate("step"):
                    pass

        return _best(body, n, repeat) - loop
    if name == "torch_record_function":
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU]):

            def body(k: int) -> None:
                for _ in range(k):
                    with record_function("step"):
                        pass

            return _best(body, n, repeat) - loop
        del torch
    if name == "otel_span":
        from opentelemetry.sdk.trace import TracerProvider

        tracer = TracerProvider().get_tracer("bench")

        def body(k: int) -> None:
            for _ in range(k):
                with tracer.start_as_current_span("step"):
                    pass

        return _best(body, n, repeat) - loop
    if name == "viztracer_call":
        from viztracer import VizTracer

        plain = _best(_calls, n, repeat)
        tracer = VizTracer(tracer_entries=4 * n + 1000, verbose=0)
        tracer.start()
        try:
            traced = _best(_calls, n, repeat, tracer.clear)
        finally:
            tracer.stop()
        return traced - plain
    raise ValueError(f"unknown variant {name!r}")


def _domain_push_pop(n: int, repeat: int, between=None) -> float:
    import nvtx

    domain = nvtx.get_domain("bench")
    attrs = domain.get_event_attributes(message="step", color="blue")
    push, pop = domain.push_range, domain.pop_range

    def body(k: int) -> None:
        for _ in range(k):
            push(attrs)
            pop()

    return _best(body, n, repeat, between)


def run_flood(which: str, seconds: float) -> dict:
    """Ranges emitted, stored and dropped by one thread flooding ``gpu_trace.range`` (``c``: the C
    type, ``py``: the Python twin) for ``seconds`` at the default settings, in this process."""
    import gpu_trace
    from gpu_trace import _api
    from gpu_trace.tracer import recorder
    from gpu_trace.tracer.spool import list_spool, read_spool_file

    rng = _api.PyRange if which == "py" else gpu_trace.range
    if which == "c" and rng is _api.PyRange:
        raise RuntimeError("the C range is unavailable here")
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-trace-flood-")) / "run"
    gpu_trace.start(run_dir)
    rec = recorder.active
    emitted = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        for _ in range(10_000):
            with rng("step"):
                pass
        emitted += 10_000
    elapsed = time.perf_counter() - t0
    dropped = rec.dropped()
    gpu_trace.stop()
    stored = 0
    for path in list_spool(run_dir):
        f = read_spool_file(path)
        if f.kind == "spans" and f.table is not None:
            stored += f.table.num_rows
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return {"emitted": emitted, "stored": stored, "dropped": dropped, "seconds": elapsed}


def flood(args: argparse.Namespace) -> None:
    """``--flood``: each variant in its own process, ``--rounds`` times, interleaved."""
    rows = []
    for round_ in range(max(args.rounds, 1)):
        for which, label in (("c", "C"), ("py", "Python twin")):
            cmd = [sys.executable, __file__, "--flood", str(args.flood), "--flood-variant", which]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            try:
                r = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                print(f"{label}: failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
                continue
            rows.append((round_ + 1, label, r))
    print(
        f"{'round':>5} {'range':<12} {'emitted':>11} {'stored':>11} {'dropped':>9} {'ranges/s':>10}"
    )
    for round_, label, r in rows:
        rate = r["emitted"] / r["seconds"]
        lost = r["emitted"] - r["stored"] - r["dropped"]
        note = "" if lost == 0 else f"  {lost} unaccounted for"
        print(
            f"{round_:>5} {label:<12} {r['emitted']:>11,} {r['stored']:>11,} {r['dropped']:>9,} "
            f"{rate:>10,.0f}{note}"
        )


def _build_noop_tool(workdir: Path) -> Path | None:
    from gpu_trace.collectors.nvtx import build as nvtx_build

    cc = os.environ.get("GPU_TRACE_CC") or "cc"
    inc = nvtx_build.include_dir()
    if inc is None or shutil.which(cc) is None:
        return None
    src = workdir / "noop_tool.c"
    src.write_text(NOOP_TOOL)
    out = workdir / "libnoop_tool.so"
    subprocess.run(
        [cc, "-O2", "-fPIC", "-shared", "-I", str(inc), str(src), "-o", str(out)], check=True
    )
    return out


def _run_one(name, scale, args, base_env, noop, ours, collector) -> float | str:
    """One variant in its own process: ns per range, or why it did not run."""
    env = dict(base_env)
    if name in ("nvtx_noop", "nvtx_noop_bare"):
        if noop is None:
            return "no C compiler"
        env["NVTX_INJECTION64_PATH"] = str(noop)
    if name == "nvtx_captured":
        if ours is None:
            return f"library not built: {collector.build_error()}"
        env["NVTX_INJECTION64_PATH"] = str(ours)
    if name in ("nvtx_python_path", "annotate_no_tool"):
        env["NVTX_INJECTION64_PATH"] = "./."  # explicitly no tool
    cmd = [sys.executable, __file__, "--variant", name, "--n", str(max(args.n // scale, 1000))]
    cmd += ["--repeat", str(args.repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    try:
        return float(json.loads(proc.stdout.strip().splitlines()[-1])["ns"])
    except (IndexError, ValueError, KeyError):
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:60]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="ranges per timing")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of every variant")
    parser.add_argument("--only", help="comma-separated variant names (default: all)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument(
        "--flood", type=float, metavar="SECONDS", help="emit ranges as fast as possible this long"
    )
    parser.add_argument("--flood-variant", choices=("c", "py"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood is not None:
        if args.flood_variant:
            print(json.dumps(run_flood(args.flood_variant, args.flood)))
        else:
            flood(args)
        return
    if args.variant:
        print(json.dumps({"ns": run_variant(args.variant, args.n, args.repeat)}))
        return

    from gpu_trace.collectors import nvtx as collector

    workdir = Path(tempfile.mkdtemp(prefix="gpu-trace-bench-"))
    noop = _build_noop_tool(workdir)
    ours = collector.library_path()
    keep = ("GPU_TRACE_HOME", "GPU_TRACE_CC")  # the same library cache as ours above
    base_env = {
        k: v
        for k, v in os.environ.items()
        if k != "NVTX_INJECTION64_PATH" and (k in keep or not k.startswith("GPU_TRACE_"))
    }
    chosen = [v for v in VARIANTS if not args.only or v[0] in args.only.split(",")]
    results: dict[str, float | str] = {}
    for _ in range(max(args.rounds, 1)):
        for name, _label, scale in chosen:
            value = _run_one(name, scale, args, base_env, noop, ours, collector)
            old = results.get(name)
            if isinstance(value, float):
                results[name] = min(value, old) if isinstance(old, float) else value
            elif not isinstance(old, float):
                results[name] = value
    base = results.get(BASELINE)
    print(f"{'variant':<48} {'ns/range':>10} {'vs no-op tool':>14}")
    for name, label, _ in chosen:
        value = results[name]
        if isinstance(value, float):
            ratio = f"{value / base:.2f}x" if isinstance(base, float) and base > 0 else "-"
            print(f"{label:<48} {value:>10.0f} {ratio:>14}")
        else:
            print(f"{label:<48} {value}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
