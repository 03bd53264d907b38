"""The program's OpenTelemetry SDK spans recorded into the run, in-process and under sitecustomize."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Status, StatusCode

import gpu_trace
from gpu_trace import _imports
from gpu_trace.tracer import otel, recorder
from gpu_trace.tracer.otel import GpuTraceSpanProcessor
from gpu_trace.tracer.records import OTEL
from tests.conftest import recorded

REPO = Path(__file__).resolve().parents[2]
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
ORIGINAL_INIT = TracerProvider.__init__


@pytest.fixture(autouse=True)
def _no_patch_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    # Any earlier test that started a run with the SDK imported left the (inert) patch installed.
    otel.uninstall()
    _imports.remove_hooks()
    yield
    otel.uninstall()
    _imports.remove_hooks()
    assert TracerProvider.__init__ is ORIGINAL_INIT


def spans_of(run_dir: Path) -> list[dict]:
    rows = recorded(run_dir)
    for row in rows:
        row["attrs"] = dict(row["attrs"])
    return rows


def processors(provider: TracerProvider) -> list[object]:
    return [
        p
        for p in provider._active_span_processor._span_processors
        if isinstance(p, GpuTraceSpanProcessor)
    ]


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def test_program_spans_are_recorded_nested_on_the_monotonic_clock(tmp_path: Path) -> None:
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        assert otel.installed()  # the SDK is imported here already: the hook ran at start
        provider = TracerProvider(shutdown_on_exit=False)
        tracer = provider.get_tracer("my.library")
        with gpu_trace.range("before"):
            pass
        with (
            gpu_trace.range("outer"),
            tracer.start_as_current_span(
                "parent", attributes={"batch": 3, "tags": ["a", "b"]}
            ) as parent,
        ):
            with tracer.start_as_current_span("child", kind=trace_api.SpanKind.CLIENT) as child:
                child.set_status(Status(StatusCode.ERROR, "it broke"))
            with tracer.start_as_current_span("sibling"):
                pass
        with gpu_trace.range("after"):
            pass
        default = TracerProvider(shutdown_on_exit=False).get_tracer("")
        with default.start_as_current_span("unscoped"):
            pass
    finally:
        gpu_trace.stop()
    rows = by_name(spans_of(run_dir))
    p, c, s, outer = rows["parent"], rows["child"], rows["sibling"], rows["outer"]
    for row in (p, c, s):
        assert row["lane"] == "otel/my.library"
        assert row["category"] == OTEL
        assert row["tid"] == threading.get_native_id()
        assert row["attrs"]["otel.trace_id"] == f"{parent.get_span_context().trace_id:032x}"
    assert rows["unscoped"]["lane"] == "otel/default"
    # OpenTelemetry's ids are ours; nesting follows its parent links.
    assert p["span_id"] == parent.get_span_context().span_id
    assert c["span_id"] == child.get_span_context().span_id
    assert (p["parent_span_id"], c["parent_span_id"], s["parent_span_id"]) == (
        0,
        p["span_id"],
        p["span_id"],
    )
    assert (p["depth"], c["depth"], s["depth"]) == (0, 1, 1)
    # Attributes and status as strings.
    assert p["attrs"]["batch"] == "3"
    assert p["attrs"]["tags"] == '["a", "b"]'
    assert p["attrs"]["otel.status"] == "UNSET"
    assert c["attrs"]["otel.status"] == "ERROR"
    assert c["attrs"]["otel.status_description"] == "it broke"
    assert c["attrs"]["otel.kind"] == "CLIENT"
    # Wall-clock OTel times mapped onto the recorder's clock: inside the range around them, in order.
    assert rows["before"]["end_ns"] <= outer["start_ns"] <= p["start_ns"] <= c["start_ns"]
    assert (
        c["start_ns"]
        <= c["end_ns"]
        <= s["start_ns"]
        <= s["end_ns"]
        <= p["end_ns"]
        <= outer["end_ns"]
    )
    assert outer["end_ns"] <= rows["after"]["start_ns"]


def test_spans_ended_on_another_thread_land_in_that_threads_buffer(tmp_path: Path) -> None:
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        tracer = TracerProvider(shutdown_on_exit=False).get_tracer("worker")
        tids: list[int] = []

        def work() -> None:
            tids.append(threading.get_native_id())
            with tracer.start_as_current_span("in-thread"):
                pass

        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        gpu_trace.stop()
    (row,) = [r for r in spans_of(run_dir) if r["name"] == "in-thread"]
    assert row["tid"] == tids[0]


def test_exceptions_are_recorded_as_attributes(tmp_path: Path) -> None:
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        tracer = TracerProvider(shutdown_on_exit=False).get_tracer("t")
        with pytest.raises(KeyError), tracer.start_as_current_span("failing"):
            raise KeyError("missing")
    finally:
        gpu_trace.stop()
    (row,) = spans_of(run_dir)
    assert row["attrs"]["otel.status"] == "ERROR"
    assert row["attrs"]["exception.type"] == "KeyError"
    assert "missing" in row["attrs"]["exception.message"]


def test_root_spans_join_the_run_trace_from_traceparent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEPARENT", TRACEPARENT)
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        tracer = TracerProvider(shutdown_on_exit=False).get_tracer("t")
        with tracer.start_as_current_span("root") as root:
            pass
        own = TracerProvider(shutdown_on_exit=False, id_generator=RandomIdGenerator()).get_tracer(
            "t"
        )
        with own.start_as_current_span("own") as own_root:
            pass
    finally:
        gpu_trace.stop()
    assert f"{root.get_span_context().trace_id:032x}" == TRACE
    assert f"{own_root.get_span_context().trace_id:032x}" != TRACE  # an explicit generator is kept
    rows = by_name(spans_of(run_dir))
    assert rows["root"]["attrs"]["otel.trace_id"] == TRACE


def test_remote_parents_are_kept_and_marked(tmp_path: Path) -> None:
    from gpu_trace.tracer.context import _get_propagator

    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        tracer = TracerProvider(shutdown_on_exit=False).get_tracer("server")
        ctx = _get_propagator().extract({"traceparent": TRACEPARENT})
        with tracer.start_as_current_span("handle", context=ctx):
            pass
    finally:
        gpu_trace.stop()
    (row,) = spans_of(run_dir)
    assert row["parent_span_id"] == 0x00F067AA0BA902B7
    assert row["depth"] == 0
    assert row["attrs"]["otel.parent_remote"] == "true"
    assert row["attrs"]["otel.trace_id"] == TRACE


def test_no_recorder_means_no_op() -> None:
    otel.install()
    provider = TracerProvider(shutdown_on_exit=False)
    assert len(processors(provider)) == 1
    with provider.get_tracer("t").start_as_current_span("nothing-records-this"):
        pass
    assert recorder.active is None


def test_a_failing_recorder_never_reaches_the_program(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def buffer(self) -> object:
            raise RuntimeError("buffer exploded")

    otel.install()
    provider = TracerProvider(shutdown_on_exit=False)
    monkeypatch.setattr(recorder, "active", Broken())
    tracer = provider.get_tracer("t")
    for _ in range(3):
        with tracer.start_as_current_span("s"):
            pass
    monkeypatch.setattr(recorder, "active", None)
    assert sum("OpenTelemetry span failed" in r.getMessage() for r in caplog.records) == 1


def test_install_is_idempotent_and_uninstall_restores_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    otel.install()
    otel.install()
    assert otel.installed()
    assert TracerProvider.__init__ is not ORIGINAL_INIT
    provider = TracerProvider(shutdown_on_exit=False)
    assert len(processors(provider)) == 1
    otel.uninstall()
    otel.uninstall()
    assert not otel.installed()
    assert TracerProvider.__init__ is ORIGINAL_INIT
    assert processors(provider) == []
    assert processors(TracerProvider(shutdown_on_exit=False)) == []


def test_a_global_provider_set_before_install_gets_the_processor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    early = TracerProvider(shutdown_on_exit=False)
    monkeypatch.setattr(trace_api, "_TRACER_PROVIDER", early)
    otel.install()
    assert len(processors(early)) == 1
    otel.install()
    assert len(processors(early)) == 1
    otel.uninstall()
    assert processors(early) == []


def test_a_patch_over_ours_is_left_alone_and_ours_passes_through() -> None:
    otel.install()
    ours = TracerProvider.__init__

    def theirs(self: TracerProvider, *args: object, **kwargs: object) -> None:
        ours(self, *args, **kwargs)

    TracerProvider.__init__ = theirs  # type: ignore[method-assign]
    try:
        otel.uninstall()
        assert TracerProvider.__init__ is theirs
        assert processors(TracerProvider(shutdown_on_exit=False)) == []
    finally:
        TracerProvider.__init__ = ORIGINAL_INIT  # type: ignore[method-assign]


def test_starting_a_run_registers_the_sdk_hook(tmp_path: Path) -> None:
    gpu_trace.start(tmp_path / "run")
    try:
        assert "opentelemetry.sdk.trace" in _imports.hooked()
    finally:
        gpu_trace.stop()


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_the_sdk_is_not_imported_by_recording(tmp_path: Path) -> None:
    code = f"""
        import sys
        import gpu_trace
        gpu_trace.start({str(tmp_path / "run")!r})
        assert "opentelemetry.sdk.trace" not in sys.modules, "recording imported the OTel SDK"
        assert "gpu_trace.tracer.otel" not in sys.modules
        import opentelemetry.sdk.trace
        assert sys.modules["gpu_trace.tracer.otel"].installed()
        gpu_trace.stop()
    """
    result = _run(code, {"GPU_TRACE_NVTX": "off"})
    assert result.returncode == 0, result.stderr


def test_a_program_under_record_gets_its_otel_spans_recorded(tmp_path: Path) -> None:
    # What `gpu-trace record` does: sitecustomize on PYTHONPATH, the run directory and the trace.
    run_dir = tmp_path / "run"
    code = """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
        tracer = trace.get_tracer("app")
        with tracer.start_as_current_span("request"):
            with tracer.start_as_current_span("db"):
                pass
    """
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "gpu_trace" / "_boot"), os.environ.get("PYTHONPATH", "")]
        ),
        "GPU_TRACE_RUN_DIR": str(run_dir),
        "GPU_TRACE_RUN_ID": "run",
        "GPU_TRACE_NVTX": "off",
        "TRACEPARENT": TRACEPARENT,
    }
    result = _run(code, env)
    assert result.returncode == 0, result.stderr
    rows = by_name(spans_of(run_dir))
    assert rows["db"]["parent_span_id"] == rows["request"]["span_id"]
    assert (
        rows["request"]["start_ns"]
        <= rows["db"]["start_ns"]
        <= rows["db"]["end_ns"]
        <= rows["request"]["end_ns"]
    )
    assert {r["attrs"]["otel.trace_id"] for r in rows.values()} == {TRACE}
    assert {r["lane"] for r in rows.values()} == {"otel/app"}
