"""`gpu-trace export RUN --otlp URL` end to end: a real recorded run (and a forwarded one with a
real server on loopback), a real OTLP/HTTP endpoint decoding with OpenTelemetry's proto package,
and the tree it receives."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_trace.cli import main
from tests.integration.test_remote_record import PROGRAM, TOKEN, server  # noqa: F401 (fixture)
from tests.otlp_receiver import Received, otlp_receiver

USER_PROGRAM = """
import gpu_trace, nvtx
for step in range(2):
    gpu_trace.step(step)
    with gpu_trace.range("forward", batch=step):
        with gpu_trace.range("inner"):
            pass
    with nvtx.annotate("backward", domain="model"):
        pass
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN},
        timeout=240,
    )


def record(tmp_path: Path, body: str, *extra: str) -> tuple[str, subprocess.CompletedProcess]:
    """Record ``body``; its run id and what `record` printed."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(body))
    out = cli("record", "--no-nvml", "--host-hz", "0", *extra, "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    return re.search(r"run (\S+): ", out.stderr).group(1), out  # type: ignore[union-attr]


def run_json(tmp_path: Path, run_id: str) -> dict:
    """run.json of a recorded run (the run directory lives under GPU_TRACE_HOME/runs)."""
    home = Path(os.environ["GPU_TRACE_HOME"])
    return json.loads((home / "runs" / run_id / "run.json").read_text())


def tree(spans: list[Received]) -> dict[str, Received]:
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans), "span ids are unique"
    return by_id


def test_export_sends_the_run_as_one_trace_under_its_root_or_says_why_not(tmp_path: Path) -> None:
    run_id, _ = record(tmp_path, USER_PROGRAM)
    run = run_json(tmp_path, run_id)
    with otlp_receiver() as receiver:
        out = cli("export", run["run_id"], "--otlp", receiver.url)
        assert out.returncode == 0, out.stderr
        assert f"sent 9 spans of run {run['run_id']} (trace {run['trace_id']})" in out.stderr
        spans = receiver.spans()
    assert receiver.paths == ["/v1/traces"]
    by_id = tree(spans)
    assert {s.trace_id for s in spans} == {run["trace_id"]}
    root = by_id[run["attrs"]["root_span_id"]]
    assert root.parent_span_id == "" and root.resource["service.name"] == "gpu-trace"
    names = sorted(s.name for s in spans if s.parent_span_id == root.span_id)
    assert names == ["ProfilerStep#0", "ProfilerStep#1"]
    steps = {s.span_id: s.name for s in spans if s.name.startswith("ProfilerStep#")}
    # Each step holds its ranges, NVTX domains' included (they name no parent: nesting by time).
    for top in ("forward", "backward"):
        held = sorted(steps[s.parent_span_id] for s in spans if s.name == top)
        assert held == ["ProfilerStep#0", "ProfilerStep#1"], top
    inner = [s for s in spans if s.name == "inner"]
    assert len(inner) == 2 and all(by_id[s.parent_span_id].name == "forward" for s in inner)
    forward = [s for s in spans if s.name == "forward"]
    assert {s.attrs["batch"] for s in forward} == {"0", "1"}
    program = forward[0].resource
    assert program["process.command_line"].endswith("prog.py")
    assert program["host.name"] == socket.gethostname() and program["process.pid"] > 0
    assert all(root.start <= s.start <= s.end <= root.end for s in spans)

    # Depth: only steps (and the root) are sent.
    with otlp_receiver() as receiver:
        out = cli("export", "last", "--otlp", receiver.url, "--otlp-spans", "steps")
        assert out.returncode == 0, out.stderr
        assert sorted(s.name for s in receiver.spans()) == [
            "ProfilerStep#0",
            "ProfilerStep#1",
            root.name,
        ]

    # A dead collector and a refusing one: one line each, exit 1, saying how far it got.
    dead = cli("export", "last", "--otlp", f"http://127.0.0.1:{_closed_port()}")
    assert dead.returncode == 1
    assert dead.stderr.count("\n") == 1 and "connection refused" in dead.stderr
    assert f"OTLP export of {run_id}" in dead.stderr and "after 0 spans" in dead.stderr
    with otlp_receiver(status=[400]) as receiver:
        refused = cli("export", "last", "--otlp", receiver.url)
    assert refused.returncode == 1 and "HTTP 400" in refused.stderr, refused.stderr


#: Steps holding a range, modules and their ops (op level), in a ``profile()`` block with a name of
#: two words; ops before the first step belong to no step.
NAMED_PROGRAM = """
import gpu_trace, torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
x = torch.randn(2, 4)
with gpu_trace.profile(name="tiny-net training", torch="op", nvml=False, host=False) as run:
    torch.zeros(3).sum()
    for step in range(2):
        gpu_trace.step(step)
        with gpu_trace.range("forward", step=step):
            net(x).sum().backward()
print("RUN", run.id)
"""


def test_export_nests_ops_in_modules_in_steps_under_the_whole_run_name(tmp_path: Path) -> None:
    """The store names no parent for a step, a top-level range, module or op: each goes under the
    innermost span of its thread that encloses it, and only what nothing encloses under the run's
    root, which is named after the whole run name."""
    pytest.importorskip("torch")
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(NAMED_PROGRAM))
    ran = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr
    run_id = re.search(r"RUN (\S+)", ran.stdout).group(1)  # type: ignore[union-attr]
    with otlp_receiver() as receiver:
        out = cli("export", run_id, "--otlp", receiver.url, "--otlp-spans", "all")
        assert out.returncode == 0, out.stderr
        spans = receiver.spans()
    by_id = tree(spans)
    (root,) = [s for s in spans if s.parent_span_id == ""]
    assert root.name == "tiny-net training"

    def parent(s: Received) -> Received:
        return by_id[s.parent_span_id]

    def chain(s: Received) -> list[str]:
        names = []
        while s.parent_span_id:
            s = parent(s)
            names.append(s.name)
        return names

    steps = [s for s in spans if s.attrs.get("gpu_trace.category") == "step"]
    assert len(steps) == 2 and all(parent(s) is root for s in steps)
    for step in steps:
        inside = [s for s in spans if step.start <= s.start and s.end <= step.end and s is not step]
        assert inside and all(step.name in chain(s) for s in inside), step.name
    (first,) = [s for s in spans if s.name == "forward" and s.attrs["step"] == "0"]
    assert parent(first).name == "ProfilerStep#0"
    modules = [s for s in spans if s.attrs.get("gpu_trace.category") == "module"]
    top = [s for s in modules if s.name == "Sequential"]
    assert len(top) == 2 and {parent(s).name for s in top} == {"forward"}
    layers = [s for s in modules if s.name in ("Sequential.0", "Sequential.1", "Sequential.2")]
    assert len(layers) == 6 and {parent(s).name for s in layers} == {"Sequential"}
    ops = [s for s in spans if s.attrs.get("gpu_trace.category") == "op"]
    linear = [s for s in ops if s.name == "aten::linear"]
    assert len(linear) == 4
    assert sorted(chain(s) for s in linear) == [
        [layer, "Sequential", "forward", f"ProfilerStep#{n}", "tiny-net training"]
        for layer in ("Sequential.0", "Sequential.2")
        for n in (0, 1)
    ]
    # An op inside an op keeps the parent it names; one before the first step hangs under the root.
    assert {parent(s).name for s in ops if s.name == "aten::addmm"} == {"aten::linear"}
    before = [s for s in ops if s.name == "aten::zeros"]
    assert before and all(parent(s) is root for s in before)
    assert all(s is root or s.parent_span_id in by_id for s in spans)  # one whole tree

    # The default kinds: steps, ranges and top-level modules, the same nesting.
    with otlp_receiver() as receiver:
        out = cli("export", run_id, "--otlp", receiver.url)
        assert out.returncode == 0, out.stderr
        default = tree(receiver.spans())
    held = sorted(
        (s.name, default[s.parent_span_id].name) for s in default.values() if s.parent_span_id
    )
    assert held == [
        ("ProfilerStep#0", "tiny-net training"),
        ("ProfilerStep#1", "tiny-net training"),
        ("Sequential", "forward"),
        ("Sequential", "forward"),
        ("Tensor.backward", "forward"),
        ("Tensor.backward", "forward"),
        ("forward", "ProfilerStep#0"),
        ("forward", "ProfilerStep#1"),
    ]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--otlp", "collector:4318"], "must start with http://"),
        (["--otlp", "http://c:4318", "--otlp-spans", "layers"], "unknown span kind 'layers'"),
        (["--otlp", "http://c:4318", "-o", "t.json"], "not both"),
        (["--otlp-spans", "steps"], "need --otlp"),
        ([], "needs -o FILE"),
    ],
)
def test_bad_export_flags_are_refused_before_the_store_is_opened(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", "last", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_bad_otlp_settings_stop_record_before_the_program_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran"
    program = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    assert main(["record", "--otlp", "collector:4318", *program]) == 2
    assert "must start with http://" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "api-key")
    assert main(["record", "--otlp", "http://127.0.0.1:4318", *program]) == 2
    err = capsys.readouterr().err
    assert "OTEL_EXPORTER_OTLP_HEADERS: a header is KEY=VALUE, got 'api-key'" in err
    assert err.count("\n") == 1 and not marker.exists()


def test_forwarded_run_links_server_spans_under_client_batches(
    tmp_path: Path,
    server: str,  # noqa: F811 (the fixture)
) -> None:
    """Streamed during `record --remote --otlp` and exported afterwards, the same tree: each
    server span (another process, `gpu-trace serve`) is a child of the client's batch span."""
    with otlp_receiver() as streamed:
        run_id, out = record(
            tmp_path,
            PROGRAM.format(use_cuda=True),
            "--remote",
            server,
            "--otlp",
            streamed.url,
            "--otlp-spans",
            "default,ops",
        )
        assert "spans sent, 0 dropped" in out.stderr, out.stderr
        live = streamed.spans()
    with otlp_receiver() as exported:
        done = cli("export", "last", "--otlp", exported.url, "--otlp-spans", "default,ops")
        assert done.returncode == 0, done.stderr
        later = exported.spans()
    for spans in (live, later):
        by_id = tree(spans)
        assert {s.trace_id for s in spans} == {run_json(tmp_path, run_id)["trace_id"]}
        batches = {  # forward/batch, or forward/batch/N for a batch sent while others flew
            s.span_id
            for s in spans
            if str(s.attrs.get("gpu_trace.lane")).split("/")[:2] == ["forward", "batch"]
        }
        assert batches and all(by_id[b].kind == 3 for b in batches)  # CLIENT
        server_spans = [s for s in spans if s.resource["service.name"] == "gpu-trace serve"]
        stages = {s.name for s in server_spans}
        assert {"receive", "queue", "execute", "reply"} <= stages
        for s in server_spans:
            if s.attrs["gpu_trace.lane"] == "server/op":
                assert by_id[s.parent_span_id].name == "execute"
            else:
                assert s.parent_span_id in batches and s.kind == 2  # SERVER
                assert s.resource["process.pid"] != by_id[s.parent_span_id].resource["process.pid"]
        modules = [s for s in spans if s.attrs.get("gpu_trace.category") == "module"]
        assert {s.name for s in modules} >= {"Sequential"}
        assert all(
            by_id[s.parent_span_id].attrs.get("gpu_trace.category") != "module" for s in modules
        )
    assert len(live) == len(later)
    assert {(s.span_id, s.parent_span_id) for s in live} == {
        (s.span_id, s.parent_span_id) for s in later
    }


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_EXPORTER_OTLP"):
            monkeypatch.delenv(name)
