"""OTLP out: the span mapping (kinds, nearest sent ancestor, ids, times, the run's root span), the
flags' parsing, and the transport against real endpoints (an HTTP server decoding with
OpenTelemetry's proto package, a grpcio server with the proto's TraceService)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pyarrow as pa
import pytest

from gpu_trace.export import endpoint as ep
from gpu_trace.export.exporter import SPAN_BATCH_SCHEMA, export_run
from gpu_trace.export.otlp import OtlpExporter
from gpu_trace.export.span_mapping import (
    DEFAULT_KINDS,
    KINDS,
    Row,
    RunFacts,
    SpanMapper,
    parse_kinds,
)
from gpu_trace.export.streaming import RunStream
from gpu_trace.tracer.columns import spans_to_table
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolWriter
from tests.otlp_receiver import otlp_receiver

TRACE = "0af7651916cd43dd8448eb211c80319c"
ROOT = 0x1111
INCOMING = 0xABCDEF
RUN = {
    "run_id": "20261124-000000-abcdef",
    "trace_id": TRACE,
    "command": "python train.py --epochs 1",
    "started_ns": 1_000,
    "ended_ns": 90_000,
    "status": "finished",
    "attrs": {
        "anchor_mono_ns": "0",
        "anchor_wall_ns": "1700000000000000000",
        "root_span_id": f"{ROOT:016x}",
        "parent_span_id": f"{INCOMING:016x}",
        "recorder_host": "box",
        "gpus": "gpu0=NVIDIA H100",
    },
}


def row(
    sid: int,
    parent: int,
    lane: str,
    category: str,
    name: str,
    start: int = 2_000,
    end: int = 3_000,
    host: str = "box",
    pid: int = 10,
    attrs: tuple[tuple[str, str], ...] = (),
) -> Row:
    return Row(sid, parent, host, pid, 1, lane, category, name, start, end, attrs)


#: A step holding a module holding a submodule holding an op; a user range; a forwarded batch with
#: its op and the server's spans (another host), the server op recorded without a span id.
TREE = [
    row(1, 0, "steps", "step", "ProfilerStep#0", 2_000, 9_000),
    row(2, 1, "nvtx/torch", "module", "Net", 2_100, 8_000),
    row(3, 2, "nvtx/torch", "module", "Linear", 2_200, 7_000),
    row(4, 3, "torch/ops", "op", "aten::addmm", 2_300, 6_000),
    row(5, 4, "nvtx/gpu_trace", "nvtx", "inside-op", 2_400, 5_000),
    row(6, 0, "forward/batch", "forward", "batch", 10_000, 20_000, attrs=(("error", "1"),)),
    row(7, 6, "forward/op", "forward", "aten::mm", 10_000, 10_100),
    row(8, 6, "server/execute", "server", "execute", 12_000, 15_000, host="gpu", pid=99),
    row(0, 8, "server/op", "server", "aten::mm", 12_100, 14_000, host="gpu", pid=99),
]


def parents(mapped: list, kinds: frozenset[str] = DEFAULT_KINDS) -> dict[str, str]:
    return {span.name: span.parent_span_id.hex() for _, span in mapped}


def hx(value: int) -> str:
    return f"{value:016x}"


def test_default_kinds_send_steps_ranges_top_modules_and_batches_with_nearest_sent_parents() -> (
    None
):
    mapper = SpanMapper(RunFacts.of(RUN))
    got = parents(mapper.add(TREE) + mapper.finish())
    assert got == {
        "ProfilerStep#0": hx(ROOT),
        "Net": hx(1),  # a top-level module
        "inside-op": hx(2),  # its parents Linear (a submodule) and the op are not sent
        "batch": hx(ROOT),
        "execute": hx(6),  # the server's span under the client's batch, across hosts
    }


def test_all_sends_every_span_and_a_span_without_an_id_gets_a_stable_one() -> None:
    first = SpanMapper(RunFacts.of(RUN), parse_kinds("all")).add(TREE)
    again = SpanMapper(RunFacts.of(RUN), parse_kinds("all")).add(TREE)
    assert len(first) == len(TREE)
    server_op = [s for r, s in first if r.lane == "server/op"][0]
    assert server_op.span_id != bytes(8) and server_op.parent_span_id.hex() == hx(8)
    assert server_op.span_id == [s for r, s in again if r.lane == "server/op"][0].span_id
    assert parents(first)["Linear"] == hx(2) and parents(first)["aten::addmm"] == hx(3)


def test_children_that_come_before_their_parents_wait_for_them() -> None:
    """The spool holds a span when it ends: children first. A child is sent once its parent is
    known, and a submodule is not taken for a top-level module meanwhile."""
    mapper = SpanMapper(RunFacts.of(RUN))
    early = mapper.add(reversed(TREE[:5]))
    assert parents(early) == {"ProfilerStep#0": hx(ROOT), "Net": hx(1), "inside-op": hx(2)}
    assert mapper.finish() == []


def test_a_parent_that_never_comes_is_named_at_the_end() -> None:
    mapper = SpanMapper(RunFacts.of(RUN))
    assert mapper.add([row(5, 77, "nvtx/gpu_trace", "nvtx", "orphan")]) == []
    assert parents(mapper.finish()) == {"orphan": hx(77)}
    assert mapper.stats.held_out == 1


def test_ids_times_kinds_status_and_the_run_root() -> None:
    mapper = SpanMapper(RunFacts.of(RUN))
    mapped = dict((s.name, s) for _, s in mapper.add(TREE))
    batch = mapped["batch"]
    assert batch.trace_id.hex() == TRACE and batch.span_id.hex() == hx(6)
    assert batch.start_time_unix_nano == 1700000000000000000 + 10_000
    assert batch.end_time_unix_nano == 1700000000000000000 + 20_000
    assert batch.kind == 3 and mapped["execute"].kind == 2  # CLIENT, SERVER
    assert batch.status.code == 2  # ERROR: the batch failed
    attrs = {kv.key: kv.value for kv in batch.attributes}
    assert attrs["gpu_trace.lane"].string_value == "forward/batch"
    assert attrs["error"].string_value == "1"
    _, root = mapper.root_span()
    assert root.span_id.hex() == hx(ROOT) and root.parent_span_id.hex() == hx(INCOMING)
    assert root.name == "python train.py"
    assert root.end_time_unix_nano - root.start_time_unix_nano == 89_000


#: As the store holds a step of a PyTorch program: only a range's, a submodule's and an inner op's
#: parents are named; the step, the top-level range, module and op name none (one thread).
FLAT = [
    row(1, 0, "steps", "step", "ProfilerStep#0", 2_000, 9_000),
    row(2, 0, "nvtx/gpu_trace", "nvtx", "forward", 2_100, 8_000),
    row(3, 0, "nvtx/torch", "module", "Net", 2_200, 7_000),
    row(4, 3, "nvtx/torch", "module", "Linear", 2_300, 6_000),
    row(5, 0, "torch/ops", "op", "aten::linear", 2_400, 5_000),
    row(6, 5, "torch/ops", "op", "aten::addmm", 2_500, 4_000),
    row(7, 0, "torch/ops", "op", "aten::zeros", 100, 200),  # before the step
    row(8, 0, "nvtx/gpu_trace", "nvtx", "other thread", 2_600, 3_000)._replace(tid=2),
]
NESTED = {
    "ProfilerStep#0": hx(ROOT),
    "forward": hx(1),
    "Net": hx(2),
    "Linear": hx(3),
    "aten::linear": hx(4),
    "aten::addmm": hx(5),
    "aten::zeros": hx(ROOT),
    "other thread": hx(ROOT),
}


def test_a_span_naming_no_parent_goes_under_the_innermost_span_enclosing_it() -> None:
    mapper = SpanMapper(RunFacts.of(RUN), parse_kinds("all"))
    assert parents(mapper.add(FLAT) + mapper.finish()) == NESTED
    # The default kinds: the nearest sent ancestor of what it encloses.
    mapper = SpanMapper(RunFacts.of(RUN))
    got = parents(mapper.add(FLAT) + mapper.finish())
    assert got == {
        "ProfilerStep#0": hx(ROOT),
        "forward": hx(1),
        "Net": hx(2),
        "other thread": hx(ROOT),
    }


def test_in_end_order_a_span_waits_for_the_span_enclosing_it() -> None:
    """The stream's order: a span comes when it ends, before what encloses it. What nothing
    enclosed goes top-level when given up on (release) or at the end."""
    mapper = SpanMapper(RunFacts.of(RUN), parse_kinds("all"), order="end")
    by_end = sorted(FLAT, key=lambda r: r.end_ns)
    assert mapper.add(by_end[:-1]) == []  # all wait, for the step at last
    assert parents(mapper.add(by_end[-1:])) == {}  # the step itself may be enclosed yet
    assert parents(mapper.release(ended_before_ns=5_000)) == {
        "aten::zeros": hx(ROOT),
        "other thread": hx(ROOT),
    }
    assert parents(mapper.release(ended_before_ns=10_000)) == {
        k: v for k, v in NESTED.items() if k not in ("aten::zeros", "other thread")
    }
    assert mapper.finish() == []
    # One call in any order, or the end of the run: the same tree.
    mapper = SpanMapper(RunFacts.of(RUN), parse_kinds("all"), order="end")
    assert parents(mapper.add(reversed(FLAT)) + mapper.finish()) == NESTED
    with pytest.raises(ValueError, match="order is 'start' or 'end'"):
        SpanMapper(RunFacts.of(RUN), order="spool")  # type: ignore[arg-type]


def test_waiting_to_be_enclosed_counts_against_the_held_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gpu_trace.export.span_mapping.MAX_HELD", 2)
    mapper = SpanMapper(RunFacts.of(RUN), parse_kinds("all"), order="end")
    marks = [row(10 + i, 0, "nvtx/gpu_trace", "mark", f"m{i}", i, i) for i in range(3)]
    assert parents(mapper.add(marks)) == {"m0": hx(ROOT)}  # the oldest, as top-level
    assert mapper.stats.held_out == 1
    assert parents(mapper.finish()) == {"m1": hx(ROOT), "m2": hx(ROOT)}


@pytest.mark.parametrize(
    "command, attrs, name",
    [
        ("tiny-net training", {"name": "tiny-net training"}, "tiny-net training"),  # profile()
        ("lm rank 3", {"source": "kineto"}, "lm rank 3"),  # import --name
        ("import rank-3.json", {"source": "kineto"}, "import rank-3.json"),
        ("/usr/bin/python3 /src/train.py --lr 3", {}, "python3 /src/train.py"),  # record
        ("./serve --port 1", {}, "serve"),
        ("", {}, "run"),
    ],
)
def test_the_root_span_is_named_after_the_whole_run_name(
    command: str, attrs: dict[str, str], name: str
) -> None:
    facts = RunFacts.of({**RUN, "command": command, "attrs": {**RUN["attrs"], **attrs}})
    _, root = SpanMapper(facts).root_span()
    assert root.name == name


def test_parse_kinds() -> None:
    assert parse_kinds("default") == DEFAULT_KINDS
    assert parse_kinds("all") == frozenset(KINDS)
    assert parse_kinds("steps, ops") == {"steps", "ops"}
    with pytest.raises(ValueError, match="unknown span kind 'layers'; accepted: steps"):
        parse_kinds("steps,layers")


@pytest.mark.parametrize(
    "url, message",
    [
        ("localhost:4318", "must start with http://"),
        ("ftp://collector:21", "must start with http://"),
        ("http://:4318", "has no host"),
        ("http://collector:99999", "bad port"),
        ("grpc://collector:4317/v1/traces", "without a path"),
        ("https://key:secret@collector:4318", "takes no user:password@"),
    ],
)
def test_bad_urls_are_one_clear_line(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ep.parse_url(url)


def test_urls_headers_and_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ep.parse_url("http://c:4318").url == "http://c:4318/v1/traces"
    assert ep.parse_url("https://c/otlp/traces").url == "https://c/otlp/traces"
    assert ep.parse_url("grpc://c").url == "c:4317"
    with pytest.raises(ValueError, match="needs a URL"):
        ep.from_settings(None)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://base:4318/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "api-key=a%20b,x=1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x=2")
    target, headers = ep.from_settings("", ["Authorization=Basic a,b=="])
    assert target.url == "http://base:4318/v1/traces"
    assert headers == {"api-key": "a b", "x": "2", "authorization": "Basic a,b=="}
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "novalue")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_HEADERS: a header is KEY=VALUE"):
        ep.from_settings("http://c:4318")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS")
    with pytest.raises(ValueError, match="--otlp-header takes KEY=VALUE"):
        ep.from_settings("http://c:4318", ["bad header=1"])


def spans_table(rows: list[Row]) -> pa.Table:
    data = {name: [] for name in SPAN_BATCH_SCHEMA.names}
    for r in rows:
        data["run_id"].append(RUN["run_id"])
        data["trace_id"].append(TRACE)
        data["depth"].append(0)
        for name in Row._fields:
            value = list(r.attrs) if name == "attrs" else getattr(r, name)
            data[name].append(value)
    return pa.table(data, schema=SPAN_BATCH_SCHEMA)


class NoWait:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def test_busy_answers_are_retried_with_backoff_then_delivered() -> None:
    with otlp_receiver(status=[503, 429, 200]) as receiver:
        sleep = NoWait()
        collector = ep.Collector(ep.parse_url(receiver.url), {"x-team": "ml"}, sleep=sleep)
        exporter = OtlpExporter(collector, RUN, batch_spans=2)
        assert export_run(exporter, [spans_table(TREE)])
        assert sleep.waits == [0.5, 1.0]
        assert receiver.paths[0] == "/v1/traces"
        assert set(receiver.content_types) == {"application/x-protobuf"}
        assert all(h["x-team"] == "ml" for h in receiver.headers)
        got = receiver.spans()
        assert len(got) == 6 and exporter.stats == {"sent": 6, "requests": 3}
        assert {s.trace_id for s in got} == {TRACE}
        by_name = {s.name: s for s in got}
        assert by_name["execute"].resource["service.name"] == "gpu-trace serve"
        assert by_name["execute"].resource["host.name"] == "gpu"
        assert by_name["Net"].resource["process.pid"] == 10
        assert by_name["Net"].resource["gpu_trace.gpus"] == "gpu0=NVIDIA H100"


@pytest.mark.parametrize("status, retried", [(400, False), (503, True)])
def test_a_refused_request_fails_the_export_with_one_line(status: int, retried: bool) -> None:
    with otlp_receiver(status=[status] * 10) as receiver:
        sleep = NoWait()
        collector = ep.Collector(ep.parse_url(receiver.url), deadline_s=2.0, sleep=sleep)
        exporter = OtlpExporter(collector, RUN)
        export_run(exporter, [spans_table(TREE)])  # the one request goes at shutdown
        assert exporter.error is not None and f"HTTP {status}" in exporter.error
        assert "\n" not in exporter.error
        assert bool(sleep.waits) == retried


def test_a_dead_endpoint_is_one_line_without_retries() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleep = NoWait()
    collector = ep.Collector(ep.parse_url(f"http://127.0.0.1:{port}"), sleep=sleep)
    exporter = OtlpExporter(collector, RUN)
    export_run(exporter, [spans_table(TREE)])
    assert exporter.error is not None and "connection refused" in exporter.error
    assert sleep.waits == []


@pytest.fixture
def grpc_collector() -> Iterator[tuple[str, list]]:
    grpc = pytest.importorskip("grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got: list = []
    lock = threading.Lock()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the proto's name)
            with lock:
                got.append((request, dict(context.invocation_metadata())))
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"grpc://127.0.0.1:{port}", got
    finally:
        server.stop(None).wait(5)


def test_grpc_export_reaches_a_real_grpc_collector(grpc_collector: tuple[str, list]) -> None:
    url, got = grpc_collector
    collector = ep.Collector(ep.parse_url(url), {"x-team": "ml"})
    exporter = OtlpExporter(collector, RUN)
    assert export_run(exporter, [spans_table(TREE)]), exporter.error
    names = {
        s.name
        for request, _ in got
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    }
    assert names == {"ProfilerStep#0", "Net", "inside-op", "batch", "execute", "python train.py"}
    assert got[0][1]["x-team"] == "ml"


# ---- streaming from a spool ------------------------------------------------------------------------


def spooled_run(tmp_path: Path) -> Path:
    """A run directory as `record` leaves it mid-run: run.json and two span files, the children
    in the first (a span is written when it ends) and their parents in the second."""
    run_dir = tmp_path / "run"
    info = RunInfo(
        run_id=RUN["run_id"],
        trace_id=TRACE,
        started_ns=1_000,
        command=RUN["command"],
        attrs=dict(RUN["attrs"]),
    )
    info.save(run_dir)
    writer = SpoolWriter(run_dir, {"run_id": info.run_id, "host": "box", "pid": "10"})
    records = [
        (
            r.span_id,
            r.parent_span_id,
            r.lane,
            r.category,
            r.name,
            r.start_ns,
            r.end_ns,
            0,
            dict(r.attrs) or None,
        )
        for r in TREE[:5]
    ]
    writer.write("spans", spans_to_table(records[:0:-1], 10, [1] * 4))  # children first
    writer.write("spans", spans_to_table(records[:1], 10, [1]))
    return run_dir


def test_a_stream_sends_a_spooled_run_with_parents_that_came_late(tmp_path: Path) -> None:
    run_dir = spooled_run(tmp_path)
    with otlp_receiver() as receiver:
        stream = RunStream(run_dir, ep.Collector(ep.parse_url(receiver.url)), poll_s=0.01)
        report = stream.start().close()
        got = {s.name: s.parent_span_id for s in receiver.spans()}
    assert report.error is None and (report.sent, report.dropped) == (4, 0)
    assert got == {
        "ProfilerStep#0": hx(ROOT),
        "Net": hx(1),
        "inside-op": hx(2),
        "python train.py": hx(INCOMING),
    }


def test_a_stream_nests_spans_that_reach_the_spool_after_what_encloses_them(
    tmp_path: Path,
) -> None:
    """Op spans reach the spool after the module around them (PyTorch hands them over in
    batches): spans are mapped once settled, in end order, so the op still finds its module;
    with a clock past every hold, the step and what it holds go while the stream runs."""
    run_dir = tmp_path / "run"
    RunInfo(RUN["run_id"], TRACE, 1_000, command=RUN["command"], attrs=dict(RUN["attrs"])).save(
        run_dir
    )
    writer = SpoolWriter(run_dir, {"run_id": RUN["run_id"], "host": "box", "pid": "10"})
    records = [(*r[:2], *r[5:10], 0, None) for r in FLAT[:6]]
    for part in (records[2:4], records[4:6], records[:2]):  # modules, ops, step and range
        writer.write("spans", spans_to_table(part, 10, [1] * len(part)))
    with otlp_receiver() as receiver:
        collector = ep.Collector(ep.parse_url(receiver.url))
        stream = RunStream(
            run_dir, collector, parse_kinds("all"), poll_s=0.01, clock=lambda: 1 << 62
        )
        stream.start()
        assert receiver.seen.wait(60)
        running = {s.name: s.parent_span_id for s in receiver.spans()}
        report = stream.close()
        got = {s.name: s.parent_span_id for s in receiver.spans()}
    assert report.error is None and report.sent == 7
    assert running == {k: v for k, v in NESTED.items() if k in running} and len(running) == 6
    assert got == {**running, "python train.py": hx(INCOMING)}


def test_a_queue_smaller_than_a_flush_makes_the_reader_wait_not_drop(tmp_path: Path) -> None:
    """The spool on disk is the buffer: a burst larger than the queue is sent whole."""
    run_dir = spooled_run(tmp_path)
    with otlp_receiver() as receiver:
        collector = ep.Collector(ep.parse_url(receiver.url))
        stream = RunStream(
            run_dir, collector, parse_kinds("all"), poll_s=0.01, queue_spans=2, batch_spans=1
        )
        report = stream.start().close()
        assert len(receiver.spans()) == 6
    assert (report.sent, report.dropped, report.error) == (6, 0, None)


class Blocked:
    """A collector that takes the first request and never answers it (until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.requests = 0

    def send(self, request: object) -> str | None:
        self.requests += 1
        self.release.wait(30)
        return None

    def close(self) -> None:
        self.release.set()


def test_a_stuck_collector_fills_the_queue_and_the_rest_is_counted_dropped(
    tmp_path: Path,
) -> None:
    """The record process never waits on the collector past close's deadline, and what could not
    go is counted, never lost silently."""
    run_dir = spooled_run(tmp_path)
    stuck = Blocked()
    stream = RunStream(
        run_dir, stuck, parse_kinds("all"), poll_s=0.01, queue_spans=2, batch_spans=1
    )
    report = stream.start().close(timeout_s=0.2)
    assert stuck.requests == 1 and report.sent == 0
    assert report.dropped == 6  # 5 spans and the root, the one stuck in flight included
    assert report.error is not None and "not all sent" in report.error


def test_without_the_grpc_packages_a_grpc_url_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "grpc", None)  # what an interpreter without grpcio sees
    with pytest.raises(ValueError, match=r"pip install 'gpu-trace\[otlp-grpc\]'"):
        ep.parse_url("grpc://collector:4317")
    assert ep.parse_url("http://collector:4318").protocol == "http"
