"""The server's GPU activity under its forwarded ops, without a GPU: a real server on loopback (CPU
device), a real client forwarding a small model, the real chDB store; activity records are laid
into the server's activity directory the way the injection library writes them, with the thread
and times of the ops the server executed (the replay seam: records in, spans out, by the same
code a CUDA server runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import gpu_trace
from gpu_trace import runtime
from gpu_trace.collectors.gpu_activity import activity as act
from gpu_trace.collectors.gpu_activity import activity_file
from gpu_trace.collectors.gpu_activity.activity_file import ActivityData
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.admin_requests import format_listing
from gpu_trace.runtime.server import admin, metrics
from gpu_trace.runtime.server.activity_tail import FileSource
from gpu_trace.runtime.server.device_activity import DeviceActivity
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.server.sink import SpoolSink
from gpu_trace.store.client import Store
from gpu_trace.store.clock_mapping import CLOCK_WINDOW_NS
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.clocksync import ClockModel
from gpu_trace.tracer.run import RunInfo
from tests import cuda_headers

TOKEN = "gpu-activity-token-0123"
#: CUPTI's clock in these records is the server's CLOCK_MONOTONIC plus this (an anchor says so).
CUPTI_OFFSET = 7_000_000_000_000
KERNEL_NS = 3_000  # long enough that some kernels overlap the next op's


class LaidRecords:
    """A source that, before each read, writes an activity file for the batches executed since
    the last one (an API call inside each op on the op's thread, its kernel just after), then
    reads the directory as the server always does."""

    def __init__(self, directory: Path) -> None:
        self.files = FileSource(directory)
        self.problems = self.files.problems
        self.activity: DeviceActivity | None = None
        self.seen = 0
        self.kernels: list[tuple[int, int, int]] = []  # (op span id, start, end), monotonic
        self.correlation = 0

    def read_new(self, flush: bool = False) -> list[ActivityData]:
        assert self.activity is not None
        batches = self.activity.batches()
        new = [b for b in batches if b.execute_id > self.seen]
        if new:
            self.seen = max(b.execute_id for b in new)
            self._write(new)
        return self.files.read_new(flush)

    def close(self) -> None:
        self.files.close()

    def _write(self, batches: list) -> None:
        """Per op two launches, inside it, whose kernels on two streams overlap by half."""
        assert self.activity is not None
        pid = self.activity.pid  # the library names its process on every record
        # An untraced session's batch has no op spans: its window stands for them (a traced
        # batch with no ops, only frees, launches nothing).
        ops = []
        for b in batches:
            spans = b.ops if b.session.trace else [(b.execute_id, b.start, b.end)]
            ops += [(b.tid, *op) for op in spans]
        records = act.empty(4 * len(ops))
        for i, (tid, op_id, t0, t1) in enumerate(ops):
            quarter = (t1 - t0) // 4
            for j in range(2):
                self.correlation += 1
                api, kernel = records[4 * i + 2 * j], records[4 * i + 2 * j + 1]
                a0, a1 = t0 + (j + 1) * quarter, t0 + (j + 2) * quarter
                api["kind"], api["pid"], api["tid"] = act.RUNTIME, pid, tid
                api["start"], api["end"] = a0 + CUPTI_OFFSET, a1 + CUPTI_OFFSET
                api["correlation"], api["code"] = self.correlation, 211  # cudaLaunchKernel
                k0 = t0 + 3 * quarter + 500 + j * KERNEL_NS // 2
                kernel["kind"], kernel["pid"], kernel["device"] = act.CONCURRENT_KERNEL, pid, 0
                kernel["stream"], kernel["correlation"] = 7 + j, self.correlation
                kernel["start"], kernel["end"] = k0 + CUPTI_OFFSET, k0 + KERNEL_NS + CUPTI_OFFSET
                kernel["grid"], kernel["block"] = (4, 1, 1), (128, 1, 1)
                self.kernels.append((op_id, k0, k0 + KERNEL_NS))
        blob = activity_file.encode(records, {0: "_Z10gemm_smallPfS_"}, anchors=[(CUPTI_OFFSET, 0)])
        name = f"{activity_file.PREFIX}{self.activity.pid}-laid{self.correlation}{activity_file.SUFFIX}"
        activity_file.write(self.files.spool / name, blob)


def union(intervals: list[tuple[int, int]]) -> int:
    total, covered = 0, 0
    for start, end in sorted(intervals):
        total += max(0, end - max(start, covered))
        covered = max(covered, end)
    return total


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"chdb://{tmp_path / 'store'}") as s:
        yield s


def _capture(tmp_path: Path) -> tuple[DeviceActivity, LaidRecords]:
    source = LaidRecords(tmp_path / "activity")
    activity = DeviceActivity(source, interval_s=0.05)
    source.activity = activity
    return activity, source


def _forward(server: Server, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model's training steps, forwarded, in a recorded run."""
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    gpu_trace.start(run_dir)
    try:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
            )
            model = model.to(dev)
            x, y = torch.randn(16, 8).to(dev), torch.zeros(16, 1).to(dev)
            for _ in range(3):
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
            rt.conn.trace.clock_exchange(4)
        finally:
            runtime.disconnect()
    finally:
        gpu_trace.stop()


KERNELS = """
SELECT k.name, k.lane, k.pid, k.start_ns, toInt64(k.attrs['raw_start_ns']),
       toInt64(k.attrs['clock_offset_ns']), a.category, a.name, o.span_id, o.lane,
       toInt64(o.attrs['clock_offset_ns']), e.lane, o.start_ns, toInt64(o.attrs['raw_start_ns'])
FROM spans AS k
  LEFT JOIN (SELECT span_id, parent_span_id, category, name FROM spans
             WHERE run_id = {run:String}) AS a ON k.parent_span_id = a.span_id
  LEFT JOIN (SELECT span_id, parent_span_id, lane, start_ns, attrs FROM spans
             WHERE run_id = {run:String}) AS o ON a.parent_span_id = o.span_id
  LEFT JOIN (SELECT span_id, lane FROM spans WHERE run_id = {run:String}) AS e
    ON o.parent_span_id = e.span_id
WHERE k.run_id = {run:String} AND k.category = 'kernel'
"""


def _check_kernels(store: Store, run_id: str, source: LaidRecords, server_pid: int) -> None:
    rows = store.sql(KERNELS, {"run": run_id})[1]
    samples = store.sql(
        "SELECT ts_ns, offset_ns, rtt_ns FROM clock_sync WHERE run_id = {run:String}",
        {"run": run_id},
    )[1]
    model = ClockModel.from_measurements(sorted(samples), window_ns=CLOCK_WINDOW_NS)
    assert len(rows) == len(source.kernels) > 0
    laid = {(op, t0) for op, t0, _ in source.kernels}
    for (
        name,
        lane,
        pid,
        start,
        raw,
        offset,
        a_cat,
        a_name,
        op,
        o_lane,
        o_off,
        e_lane,
        o0,
        o_raw,
    ) in rows:
        assert (
            name == "gemm_small(float*, float*)"
            and lane in ("gpu0/stream7", "gpu0/stream8")
            and pid == server_pid
        )
        assert (a_cat, a_name) == ("cuda_api", "cudaLaunchKernel")
        assert o_lane == "server/op" and e_lane == "server/execute"
        # On the server's clock as laid, put on the client's by the op's measured offset.
        assert (op, raw) in laid
        # and mapped by the run's clock model, as its op was (the same offset at the same time).
        assert start == raw - offset == model.map_to_client(np.array([raw]))[0][0]
        assert o0 == o_raw - o_off == model.map_to_client(np.array([o_raw]))[0][0]


def test_forwarded_kernels_land_under_their_ops_in_the_clients_run(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    activity, source = _capture(tmp_path)
    with Server("127.0.0.1:0", token=TOKEN, gpu_activity=activity) as server:
        _forward(server, tmp_path / "run", monkeypatch)
        listing = admin.snapshot(server)
        text = metrics.render(server)
    info = RunInfo.load(tmp_path / "run")
    ingest(store, tmp_path / "run")
    _check_kernels(store, info.run_id, source, activity.pid)
    assert activity.counts.late == activity.counts.unattributed == 0

    # Tenant GPU busy time: the union of its kernels' intervals, beside its device time.
    busy = union([(t0, t1) for _, t0, t1 in source.kernels])
    assert busy < KERNEL_NS * len(source.kernels)  # some overlap: a sum would be wrong
    (tenant,) = listing["tenants"]
    assert tenant["gpu_busy_ns"] == busy and tenant["busy_ns"] > 0
    assert f'gpu_trace_tenant_gpu_busy_seconds_total{{tenant="default"}} {busy / 1e9:g}' in text
    counters = store.sql(
        "SELECT max(value) FROM counters WHERE run_id = {run:String} AND metric = 'gpu_busy_ns'",
        {"run": info.run_id},
    )[1]
    assert counters == [(float(busy),)]
    assert "GPU BUSY" in format_listing(listing)


def test_forwarded_kernels_go_to_the_shared_store_with_the_server_spans(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    activity, source = _capture(tmp_path)
    spool = tmp_path / "server-spool"
    with Server("127.0.0.1:0", token=TOKEN, sink=SpoolSink(spool), gpu_activity=activity) as server:
        _forward(server, tmp_path / "run", monkeypatch)
    info = RunInfo.load(tmp_path / "run")
    ingest(store, tmp_path / "run")
    ingest(store, spool / info.run_id)
    _check_kernels(store, info.run_id, source, activity.pid)


def test_an_untraced_sessions_kernels_count_toward_its_gpu_busy_time_only(
    tmp_path: Path,
) -> None:
    activity, source = _capture(tmp_path)
    with Server("127.0.0.1:0", token=TOKEN, gpu_activity=activity) as server:
        dev = runtime.connect(server.address, token=TOKEN)  # no run recorded: not traced
        try:
            x = torch.ones(8, device=dev)
            for _ in range(5):
                x = x * 2
            assert x.sum().item() == 256.0
            (session,) = server.sessions.values()
        finally:
            runtime.disconnect()
    # The server has stopped: every batch's records were laid and converted by then.
    assert source.kernels
    busy = union([(a, b) for _, a, b in source.kernels])
    assert session.usage.gpu_busy_ns == busy
    # Its tenant's total too, though its last kernels came after it ended (and was retired).
    assert admin.snapshot(server)["tenants"][0]["gpu_busy_ns"] == busy
    assert activity.counts.spans == 0 and activity.counts.unattributed == 0


def test_without_capture_gpu_busy_is_not_measured_not_zero(tmp_path: Path) -> None:
    with Server("127.0.0.1:0", token=TOKEN) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            (torch.ones(4, device=dev) * 2).sum().item()
            listing = admin.snapshot(server)
            text = metrics.render(server)
        finally:
            runtime.disconnect()
    (tenant,), (session,) = listing["tenants"], listing["sessions"]
    assert tenant["gpu_busy_ns"] is None and session["gpu_busy_ns"] is None
    assert tenant["busy_ns"] > 0
    assert "gpu_busy_seconds_total{" not in text
    text = format_listing(listing)
    lines = format_listing(listing).splitlines()
    for head in ("TENANT ", "SESSION "):  # the GPU BUSY column of both tables says "-"
        i = next(k for k, line in enumerate(lines) if line.startswith(head))
        end = lines[i].index("GPU BUSY") + len("GPU BUSY")
        assert lines[i + 2][:end].split()[-1] == "-"


def test_records_no_op_launched_are_counted_not_lost(tmp_path: Path) -> None:
    source = FileSource(tmp_path / "activity")
    activity = DeviceActivity(source)
    records = act.empty(2)
    records["kind"] = (act.RUNTIME, act.CONCURRENT_KERNEL)
    records["pid"], records["tid"], records["correlation"] = activity.pid, 1, 5
    records["start"], records["end"] = (10, 100), (20, 200)
    blob = activity_file.encode(records, {0: "k"}, dropped=3)
    activity_file.write(source.spool / f"{activity_file.PREFIX}1-x{activity_file.SUFFIX}", blob)
    assert activity.poll() == 0
    assert activity.counts.unattributed == 2 and activity.counts.dropped == 3
    assert activity.counts.records == 2
    assert np.isclose(activity.counts.spans, 0)


def test_serve_asked_for_gpu_activity_without_a_driver_says_so_and_serves(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0"]
        + ["--gpu-activity", "on", "--metrics", "off"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN},
    )
    assert proc.stderr is not None
    try:
        serving, note = proc.stderr.readline(), proc.stderr.readline()
        assert "serving cpu on" in serving and "GPU activity off" in serving
        assert note.strip().endswith(
            "GPU activity is off: no NVIDIA driver (libcuda) on this machine"
        )
        address = serving.split(" on ")[1].split()[0]
        dev = runtime.connect(address, token=TOKEN)
        try:
            assert (torch.ones(3, device=dev) * 2).sum().item() == 6.0
        finally:
            runtime.disconnect()
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0 and "served" in rest and "GPU activity spans" not in rest


LIVE_PROGRAM = textwrap.dedent(
    """
    import ctypes, json, sys, time
    from gpu_trace.runtime.server.activity_tail import FileSource
    from gpu_trace.runtime.server.device_activity import DeviceActivity
    from gpu_trace.runtime.sharing.sessions import Session

    lib = ctypes.CDLL(sys.argv[1])
    fake = ctypes.CDLL(sys.argv[2])  # the libcupti the library opened: the same one
    lib.InitializeInjection()  # what the driver does at cuInit
    session = Session({"host": "test", "trace": "1"}, lambda *a: None)
    activity = DeviceActivity(FileSource(sys.argv[3], flush=lib.gpu_trace_activity_flush))
    tables = []
    for i in range(3):  # an op launches a kernel; the server converts after each batch
        t0 = time.perf_counter_ns()
        fake.fake_cupti_emit(i + 1)
        t1 = time.perf_counter_ns() + 20_000
        activity.batch(session, 100 + 10 * i, t0 - 1000, t1 + 1000, [("aten::mm", t0, t1)], [101 + 10 * i])
        activity.session_done(session)  # flushes CUPTI through the library, reads, converts
        tables += session.log.take().get("gpu", [])
    rows = [r for t in tables for r in t.to_pylist()]
    print(json.dumps({
        "spans": [[r["category"], r["span_id"], r["parent_span_id"], r["lane"]] for r in rows],
        "busy": session.usage.gpu_busy_ns,
        "unattributed": activity.counts.unattributed,
    }))
    """
)


def test_the_live_librarys_growing_file_reaches_the_ops(tmp_path: Path) -> None:
    """The real injection library (over a stand-in libcupti, CUPTI's own structs) appending to
    one file while the server reads it after each batch: each kernel under its launch under its
    op, through the library's own flush; busy time from the kernels."""
    from gpu_trace import _cbuild
    from gpu_trace.collectors.gpu_activity import library

    inc = cuda_headers.include_dirs()
    if inc is None:
        pytest.skip("CUPTI headers not installed here: the library is not built")
    try:
        lib = library.build(tmp_path / library.library_name(), include=inc)
        fake = tmp_path / "libcupti_fake.so"
        source = Path(__file__).with_name("fake_cupti.c")
        _cbuild.build(source, fake, include_dirs=inc, libs=["-lpthread"])
    except _cbuild.BuildError as exc:
        pytest.skip(f"no C compiler: {exc}")
    directory = tmp_path / "activity"
    (directory / "spool").mkdir(parents=True)  # as serve makes it (the library makes no parents)
    env = {
        **os.environ,
        "GPU_TRACE_RUN_DIR": str(directory),
        "GPU_TRACE_CUPTI_LIBRARY": str(fake),
        "GPU_TRACE_FLUSH_INTERVAL": "60",  # only the server's flushes
    }
    out = subprocess.run(
        [sys.executable, "-c", LIVE_PROGRAM, str(lib), str(fake), str(directory)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    by_id = {span_id: (cat, parent) for cat, span_id, parent, _ in got["spans"]}
    kernels = [(parent, lane) for cat, _, parent, lane in got["spans"] if cat == "kernel"]
    assert len(kernels) == 3 and {lane for _, lane in kernels} == {"gpu1/stream7"}
    assert sorted(by_id[launch][1] for launch, _ in kernels) == [101, 111, 121]
    assert {cat for cat, _ in by_id.values()} >= {"memcpy", "memset", "cuda_sync", "cuda_api"}
    assert got["busy"] == 3 * 3000  # each fake kernel lasts 3 us
