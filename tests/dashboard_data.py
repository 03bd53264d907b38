"""Runs with known spans for the dashboard tests, written straight into a store as Arrow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from gpu_trace.store.client import Store
from gpu_trace.tracer.run import RunInfo

XSS = "<script>alert(1)</script>"
DATA = Path(__file__).resolve().parent / "data"


def add_run(store: Store, run_id: str, spans: list[dict[str, Any]], start: int, end: int) -> None:
    """Insert ``spans`` (dicts with at least name, lane, start_ns, end_ns) as run ``run_id``."""
    rows = []
    for i, s in enumerate(spans):
        rows.append(
            {
                "run_id": run_id,
                "trace_id": "0" * 32,
                "span_id": s.get("span_id", 1000 + i),
                "parent_span_id": s.get("parent_span_id", 0),
                "host": s.get("host", "client"),
                "pid": s.get("pid", 10),
                "tid": s.get("tid", 10),
                "lane": s["lane"],
                "category": s.get("category", "nvtx"),
                "name": s["name"],
                "start_ns": s["start_ns"],
                "end_ns": s["end_ns"],
                "depth": s.get("depth", 0),
                "attrs": list((s.get("attrs") or {}).items()),
            }
        )
    schema = pa.schema(
        [
            ("run_id", pa.string()),
            ("trace_id", pa.string()),
            ("span_id", pa.uint64()),
            ("parent_span_id", pa.uint64()),
            ("host", pa.string()),
            ("pid", pa.uint32()),
            ("tid", pa.uint64()),
            ("lane", pa.string()),
            ("category", pa.string()),
            ("name", pa.string()),
            ("start_ns", pa.int64()),
            ("end_ns", pa.int64()),
            ("depth", pa.uint16()),
            ("attrs", pa.map_(pa.string(), pa.string())),
        ]
    )
    store.insert_arrow("spans", pa.Table.from_pylist(rows, schema=schema))
    store.upsert_run(
        RunInfo(
            run_id=run_id,
            trace_id="0" * 32,
            started_ns=start,
            ended_ns=end,
            command=f"test {run_id}",
            hosts=["client"],
            status="finished",
            attrs={"anchor_mono_ns": "0", "anchor_wall_ns": str(1_700_000_000 * 10**9 + start)},
        )
    )


def lod_run(store: Store, run_id: str = "lod") -> None:
    """1000 spans of 1 µs every 10 µs and 5 spans of 1 ms on one lane, over 10 ms."""
    spans = [
        {"name": "tiny", "lane": "nvtx/a", "start_ns": 10_000 * i, "end_ns": 10_000 * i + 1_000,
         "depth": 1}
        for i in range(1000)
    ]  # fmt: skip
    spans += [
        {"name": f"long{i}", "lane": "nvtx/a", "start_ns": 2_000_000 * i,
         "end_ns": 2_000_000 * i + 1_000_000, "depth": 0, "span_id": 90 + i}
        for i in range(5)
    ]  # fmt: skip
    add_run(store, run_id, spans, 0, 10_000_000)


def forwarded_run(store: Store, run_id: str = "fwd") -> None:
    """Three steps, each with two ``fwd`` batches forwarded to a server span on another host, and
    a span named like a script tag."""
    spans: list[dict[str, Any]] = []
    sid = 1
    for step in range(3):
        t = step * 1_000_000
        spans.append({"name": f"ProfilerStep#{step}", "lane": "steps", "category": "step",
                      "start_ns": t, "end_ns": t + 900_000, "span_id": sid})  # fmt: skip
        sid += 1
        for k in range(2):
            b0 = t + 100_000 + k * 400_000
            batch = sid
            spans.append({"name": "batch", "lane": "forward/batch", "category": "forward",
                          "start_ns": b0, "end_ns": b0 + 100_000, "span_id": batch,
                          "attrs": {"k": str(k)}})  # fmt: skip
            spans.append({"name": "execute", "lane": "server/execute", "category": "server",
                          "start_ns": b0 + 150_000, "end_ns": b0 + 250_000, "span_id": sid + 1,
                          "parent_span_id": batch, "host": "gpu-box", "pid": 99, "tid": 2,
                          "depth": 1, "attrs": {"clock_uncertainty_ns": "5000",
                                                "clock_offset_ns": "123"}})  # fmt: skip
            sid += 2
    spans.append({"name": XSS, "lane": "nvtx/<b>lane</b>", "start_ns": 2_950_000,
                  "end_ns": 3_000_000, "span_id": 500, "attrs": {"note": XSS}})  # fmt: skip
    add_run(store, run_id, spans, 0, 3_000_000)


def add_counters(store: Store, run_id: str, rows: list[dict[str, Any]]) -> None:
    """Insert runtime counters (dicts with metric, ts_ns, value, labels) into run ``run_id``."""
    schema = pa.schema(
        [
            ("run_id", pa.string()),
            ("host", pa.string()),
            ("source", pa.string()),
            ("device", pa.string()),
            ("metric", pa.string()),
            ("ts_ns", pa.int64()),
            ("value", pa.float64()),
            ("labels", pa.map_(pa.string(), pa.string())),
        ]
    )
    table = [
        {"run_id": run_id, "host": "gpu-box", "source": "runtime", "device": "", **r,
         "labels": list(r["labels"].items())}
        for r in rows
    ]  # fmt: skip
    store.insert_arrow("counters", pa.Table.from_pylist(table, schema=schema))


def tenants_run(
    store: Store, run_id: str, tenants: tuple[str, str] | None, stamped: bool = True
) -> None:
    """Two forwarding sessions (1 and 2, from client pids 21 and 22) of four batches each, as the
    sharing runtime records them: each server span stamped with its session and tenant (attrs
    ``session``, ``tenant``), its counters stamped with its batches' reply ends, session 2 paged
    out and restored between its 2nd and 3rd batch.

    ``tenants``: the sessions' tenant names (the first has a 64 MiB quota, the second none), or
    None for a run from before tenants (a ``session`` label only, no quotas, page-outs or busy
    counters). Session 1's batches wait 10 µs in the queue and execute 200 µs; session 2's, 30 and
    300 µs. Session k holds k MiB after its k-th batch.

    Both sessions' span ids come from one sequence, with one high half: a reader that took a
    span's session from its id bits would put every span in one session. ``stamped=False``: a run
    stored before server spans carried their session and tenant (no such attrs; each session's
    ids from a prefix of its own, as that server numbered them).
    """
    spans: list[dict[str, Any]] = []
    counters: list[dict[str, Any]] = []
    shared = iter(range((0x1000 << 32) + 1, (0x1000 << 32) + 2000))
    owner: dict[str, str] = {}

    def server(lane: str, ids: Any, s0: int, s1: int, parent: int = 0, **attrs: str) -> None:
        spans.append({"name": lane.split("/")[1], "lane": lane, "category": "server",
                      "start_ns": s0, "end_ns": s1, "span_id": next(ids), "parent_span_id": parent,
                      "host": "gpu-box", "pid": 99, "attrs": attrs | owner})  # fmt: skip

    def count(metric: str, ts: int, value: float, labels: dict[str, str]) -> None:
        counters.append({"metric": metric, "ts_ns": ts, "value": value, "labels": labels})

    for n, (wait, run) in enumerate(((10_000, 200_000), (30_000, 300_000))):
        session = n + 1
        ids = iter(range(((0x1000 + session) << 32) + 1, ((0x1000 + session) << 32) + 1000))
        labels = {"session": str(session)}
        tenant = {"tenant": tenants[n]} if tenants is not None else {}
        labels |= tenant
        if stamped:  # the server's: its session, and its tenant ("default" before tenants)
            ids, owner = (
                shared,
                {"session": str(session), "tenant": tenant.get("tenant", "default")},
            )
        busy = queued = 0
        for k in range(4):
            t = 1_000_000 + 2_000_000 * k + 500_000 * n + (3_000_000 if n and k >= 2 else 0)
            batch = 10_000 * session + k
            spans.append({"name": "batch", "lane": "forward/batch", "category": "forward",
                          "start_ns": t, "end_ns": t + 600_000, "span_id": batch,
                          "pid": 20 + session})  # fmt: skip
            q0 = t + 20_000
            e0, e1 = q0 + wait, q0 + wait + run
            server("server/receive", ids, t + 10_000, q0, batch)
            server("server/queue", ids, q0, e0, batch)
            server("server/execute", ids, e0, e1, batch, ops="3")
            server("server/reply", ids, e1, e1 + 5_000, batch)
            busy, queued, held, ts = busy + run, queued + wait, (k + 1) << 20, e1 + 5_000
            count("session_memory_bytes", ts, held, labels)
            count("session_handles", ts, k + 1, labels)
            count("queue_depth", ts, 0, labels)
            if not tenant:
                continue
            for metric, value in (("busy_ns", busy), ("queue_wait_ns", queued),
                                  ("bytes_in", 1000 * (k + 1)), ("bytes_out", 10 * (k + 1)),
                                  ("quota_waits", 0), ("quota_errors", 0)):  # fmt: skip
                count(metric, ts, value, labels)
            count("tenant_memory_bytes", ts, held, tenant)
            count("tenant_resident_bytes", ts, held, tenant)
            if session == 1:
                count("quota_bytes", ts, 64 << 20, tenant)
            if session == 2 and k == 1:
                p0 = ts + 1_000_000
                server("server/evict", ids, p0, p0 + 100_000, reason="idle", bytes=str(held),
                       storages="2")  # fmt: skip
                count("evictions", p0 + 100_000, 1, labels)
                server("server/restore", ids, p0 + 2_000_000, p0 + 2_050_000, bytes=str(held),
                       storages="2", first_op_ns="20000")  # fmt: skip
                count("restores", p0 + 2_060_000, 1, labels)
    add_run(store, run_id, spans, 0, 14_000_000)
    add_counters(store, run_id, counters)


def minute_run(store: Store, run_id: str = "minute") -> None:
    """A run shaped like a one-minute training run: 60 steps of 1 s, each with a module tree
    (``Net`` 300 ms, ``Net.encoder`` 120 ms, ``Net.decoder`` 150 ms, ``Net.backward`` 400 ms)
    and 100 ops of 2 ms (6,000), two forwarded batches of 5 ms per step, and a GPU utilisation
    counter sampled every 500 ms (the value is the sample's index)."""
    s = 10**9
    ms = 10**6
    spans: list[dict[str, Any]] = []
    sid = 1

    def add(name: str, lane: str, category: str, t0: int, t1: int, depth: int = 0) -> None:
        nonlocal sid
        spans.append({"name": name, "lane": lane, "category": category, "start_ns": t0,
                      "end_ns": t1, "depth": depth, "span_id": sid})  # fmt: skip
        sid += 1

    for k in range(60):
        t = k * s
        add(f"ProfilerStep#{k}", "steps", "step", t, t + 990 * ms)
        add("Net", "torch/modules", "module", t + 10 * ms, t + 310 * ms)
        add("Net.encoder", "torch/modules", "module", t + 20 * ms, t + 140 * ms, 1)
        add("Net.decoder", "torch/modules", "module", t + 150 * ms, t + 300 * ms, 1)
        add("Net.backward", "torch/modules", "module", t + 400 * ms, t + 800 * ms)
        for i in range(100):
            o = t + 10 * ms + i * 9 * ms
            add("aten::addmm" if i % 2 else "aten::relu", "torch/ops", "op", o, o + 2 * ms)
        for i in range(2):
            b = t + 850 * ms + i * 60 * ms
            add("batch", "forward/batch", "forward", b, b + 5 * ms)
    add_run(store, run_id, spans, 0, 60 * s)
    schema = pa.schema(
        [("run_id", pa.string()), ("host", pa.string()), ("source", pa.string()),
         ("device", pa.string()), ("metric", pa.string()), ("ts_ns", pa.int64()),
         ("value", pa.float64()), ("labels", pa.map_(pa.string(), pa.string()))]
    )  # fmt: skip
    samples = [
        {"run_id": run_id, "host": "client", "source": "nvml", "device": "gpu0",
         "metric": "gpu_util_pct", "ts_ns": i * 500 * ms, "value": float(i), "labels": []}
        for i in range(120)
    ]  # fmt: skip
    store.insert_arrow("counters", pa.Table.from_pylist(samples, schema=schema))


#: A demangled kernel name as CUPTI and PyTorch's profiler give it, and its short form.
FILL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, "
    "at::detail::Array<char*, 1>)"
)
FILL_SHORT = "vectorized_elementwise_kernel<4, FillFunctor, Array>"


def gpu_run(store: Store, run_id: str = "gpu") -> None:
    """Two steps of 1 ms on one thread (pid 10, tid 10) with GPU activity as the collector
    records it (collectors/gpu_activity/conversion.py): each step has a module ``Net``, an op
    ``aten::mm`` in it and a ``cudaLaunchKernel`` under the op; device work on lanes
    ``gpu<d>/stream<s>`` (tid 0), each the child of its API call.

    Exact GPU times: step 0 ``[0, 1 ms)``: GPU 0 runs ``FILL`` on stream 7 ``[200, 400) µs``, a
    memcpy on stream 13 ``[300, 500) µs`` (overlapping: busy counts it once) and ``sgemm`` on
    stream 7 ``[900, 1100) µs`` (half in each step): busy 400 µs. Step 1 ``[1, 2 ms)``: GPU 0
    runs the rest of ``sgemm`` (100 µs) and ``FILL`` ``[1500, 1600) µs``: busy 200 µs; GPU 1 a
    memset ``[1200, 1300) µs``: 100 µs."""
    us = 1000
    spans: list[dict[str, Any]] = []

    def add(sid: int, name: str, lane: str, cat: str, t0: int, t1: int, parent: int = 0,
            depth: int = 0, tid: int = 10, **attrs: str) -> None:  # fmt: skip
        spans.append({"span_id": sid, "parent_span_id": parent, "name": name, "lane": lane,
                      "category": cat, "start_ns": t0 * us, "end_ns": t1 * us, "depth": depth,
                      "tid": tid, "attrs": attrs})  # fmt: skip

    for k in range(2):
        t, sid = 1000 * k, 100 * (k + 1)
        add(sid, f"ProfilerStep#{k}", "steps", "step", t, t + 1000)
        add(sid + 1, "Net", "torch/modules", "module", t + 50, t + 950, sid, 1)
        add(sid + 2, "aten::mm", "torch/ops", "op", t + 100, t + 300, sid + 1, 2)
        add(sid + 3, "cudaLaunchKernel", "cuda_api", "cuda_api", t + 150, t + 160, sid + 2, 3,
            correlation=str(sid + 3), api="runtime")  # fmt: skip
        add(sid + 4, "cudaMemcpyAsync", "cuda_api", "cuda_api", t + 170, t + 180, sid + 2, 3)
        add(sid + 5, "cudaLaunchKernel", "cuda_api", "cuda_api", t + 800, t + 810, sid + 1, 2)
    kernel = {"device": "0", "stream": "7", "grid": "[128, 1, 1]", "block": "[256, 1, 1]",
              "registers per thread": "32", "shared memory": "0"}  # fmt: skip
    add(1, FILL, "gpu0/stream7", "kernel", 200, 400, 103, 4, 0, correlation="103", **kernel)
    add(2, "Memcpy HtoD (Pinned -> Device)", "gpu0/stream13", "memcpy", 300, 500, 104, 4, 0,
        bytes="4096")  # fmt: skip
    add(3, "ampere_sgemm_128x64_nn", "gpu0/stream7", "kernel", 900, 1100, 105, 3, 0, **kernel)
    add(4, "Memset (Device)", "gpu1/stream7", "memset", 1200, 1300, 204, 4, 0)
    add(5, FILL, "gpu0/stream7", "kernel", 1500, 1600, 203, 4, 0, **kernel)
    add_run(store, run_id, spans, 0, 2000 * us)


def forwarded_gpu_run(store: Store, run_id: str = "fwd-gpu") -> None:
    """Two forwarded batches, each of ops ``aten::mm`` and ``aten::relu``, executed on a server
    with GPU activity under its spans: execute -> op -> ``cudaLaunchKernel`` -> kernel.

    Per batch: ``aten::mm`` launches a 50 µs kernel and ``aten::relu`` a 10 µs kernel named
    ``aten::mm`` (so a sum by name would be wrong: it is relu's, by its parents); a 7 µs copy is
    launched by the execute span itself, outside any op. GPU time per op: mm 100 µs, relu 20 µs.
    """
    us = 1000
    spans: list[dict[str, Any]] = []

    def add(sid: int, name: str, lane: str, cat: str, t0: int, t1: int, parent: int = 0,
            server: bool = True) -> None:  # fmt: skip
        where = {"host": "gpu-box", "pid": 99, "tid": 0 if lane.startswith("gpu") else 2}
        spans.append({"span_id": sid, "parent_span_id": parent, "name": name, "lane": lane,
                      "category": cat, "start_ns": t0 * us, "end_ns": t1 * us,
                      **(where if server else {})})  # fmt: skip

    for k in range(2):
        t, sid = 1000 * k, 1000 * (k + 1)
        add(sid, "batch", "forward/batch", "forward", t, t + 600, server=False)
        add(sid + 1, "execute", "server/execute", "server", t + 100, t + 500, sid)
        for j, (op, ns) in enumerate((("aten::mm", 50), ("aten::relu", 10))):
            o = t + 120 + 150 * j
            add(sid + 10 + j, op, "forward/op", "forward", t + 10 + 20 * j, t + 20 + 20 * j, sid,
                server=False)  # fmt: skip
            add(sid + 20 + j, op, "server/op", "server", o, o + 100, sid + 1)
            add(sid + 30 + j, "cudaLaunchKernel", "cuda_api", "cuda_api", o + 5, o + 10,
                sid + 20 + j)  # fmt: skip
            add(sid + 40 + j, "aten::mm", "gpu0/stream7", "kernel", o + 20, o + 20 + ns,
                sid + 30 + j)  # fmt: skip
        add(sid + 50, "cudaMemcpyAsync", "cuda_api", "cuda_api", t + 450, t + 455, sid + 1)
        add(sid + 51, "Memcpy DtoH", "gpu0/stream7", "memcpy", t + 460, t + 467, sid + 50)
    add_run(store, run_id, spans, 0, 2000 * us)


def cupti_run(store: Store, run_id: str = "cupti") -> int:
    """The real CUPTI records of three H100 training steps (``tests/data/cupti-h100-lm.jsonl.gz``)
    through the collector's own conversion (``collectors/gpu_activity``: the replay seam), as a
    run. Returns how many spans it holds."""
    import pyarrow.compute as pc

    from gpu_trace.collectors.gpu_activity.conversion import convert
    from gpu_trace.collectors.gpu_activity.replay_file import read_replay

    records, names, _ = read_replay(DATA / "cupti-h100-lm.jsonl.gz")
    table = convert(records, names).table
    n = table.num_rows
    for i, (name, value) in enumerate((("run_id", run_id), ("trace_id", "0" * 32),
                                       ("host", "h100"))):  # fmt: skip
        table = table.add_column(i, name, pa.array([value] * n, pa.string()))
    store.insert_arrow("spans", table)
    store.upsert_run(
        RunInfo(run_id=run_id, trace_id="0" * 32, started_ns=int(pc.min(table["start_ns"]).as_py()),
                ended_ns=int(pc.max(table["end_ns"]).as_py()), command=f"test {run_id}",
                hosts=["h100"], status="finished", attrs={})
    )  # fmt: skip
    return n


def ranked_run(store: Store, run_id: str = "ranked") -> None:
    """Two ranks (pids 100 and 200: rank 0 and 1, gloo, and NCCL kernels on rank 0), three steps
    of 1 ms each. In step ``i`` (``t = 1000 * i`` µs) each rank runs an op, then an all_reduce
    (sequence number ``i + 1``): rank 0 enters at ``t + 300``, rank 1 at ``t + 500`` (it made rank
    0 wait 200 µs: the straggler in every step), both end at ``t + 600``. Rank 0's GPU runs a
    compute kernel ``[t + 100, t + 400)`` and an NCCL kernel ``[t + 350, t + 600)``: 50 of its
    250 µs beside computation (NCCL overlap 20%)."""
    us = 1000
    spans: list[dict[str, Any]] = []

    def add(pid: int, name: str, lane: str, cat: str, t0: int, t1: int, tid: int = 1,
            **attrs: str) -> None:  # fmt: skip
        spans.append({"pid": pid, "tid": tid, "name": name, "lane": lane, "category": cat,
                      "start_ns": t0 * us, "end_ns": t1 * us, "attrs": attrs})  # fmt: skip

    for i in range(3):
        t = 1000 * i
        for pid, enter, busy in ((100, 300, 250), (200, 500, 450)):
            add(pid, f"ProfilerStep#{i}", "steps", "step", t, t + 1000)
            add(pid, "aten::mm", "torch/ops", "op", t + 20, t + 20 + busy)
            add(pid, "all_reduce", "torch/collectives", "collective", t + enter, t + 600,
                seq=str(i + 1), pg="0", backend="gloo")  # fmt: skip
        add(100, "ampere_sgemm_128x64_nn", "gpu0/stream7", "kernel", t + 100, t + 400, tid=0,
            device="0", stream="7")  # fmt: skip
        add(100, "ncclDevKernel_AllReduce_Sum_f32", "gpu0/stream13", "kernel", t + 350, t + 600,
            tid=0, device="0", stream="13")  # fmt: skip
    add_run(store, run_id, spans, 0, 3000 * us)
    facts = {100: {"rank": "0", "world_size": "2", "backend": "gloo"},
             200: {"rank": "1", "world_size": "2", "backend": "gloo"}}  # fmt: skip
    store.insert_rows(
        "threads",
        ["run_id", "host", "pid", "tid", "process_name", "thread_name", "updated_ns",
         "process_attrs"],
        [[run_id, "client", pid, 1, "python", "main", 1, f] for pid, f in facts.items()],
    )  # fmt: skip
