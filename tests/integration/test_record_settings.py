"""Every setting is checked before the program runs: `gpu-trace record` refuses a bad one with one
line and exit 2, without running the program; ``gpu_trace.start()`` raises ValueError.

The bad values come from a table that must name every variable of ``config.CHECKS``, so a new
setting fails here until it has a refused value (or a reason why none is refused)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace import config

#: A refused value of each variable; None where every value is accepted, with the reason.
BAD: dict[str, str | None] = {
    "GPU_TRACE_HOME": "{file}",
    "GPU_TRACE_STORE": "ftp://store.example:21",
    "GPU_TRACE_CLUSTER": "two words",
    "GPU_TRACE_REMOTE": "localhost",
    "GPU_TRACE_REMOTE_SYNC": "maybe",
    "GPU_TRACE_REMOTE_TOKEN": "short",
    "GPU_TRACE_REMOTE_TIMEOUT": "nan",
    "GPU_TRACE_SPIN_US": "-1",
    "GPU_TRACE_HANDSHAKE_TIMEOUT": "inf",
    "GPU_TRACE_MAX_HANDSHAKES": "2.5",
    "GPU_TRACE_RECORD_OPS": "{missing}/ops.txt",
    "GPU_TRACE_RUN_DIR": "{file}",
    "GPU_TRACE_RUN_ID": "../elsewhere",
    "GPU_TRACE_JOB": " ",
    "GPU_TRACE_SIGNAL_ECHO": "3:pipe",
    "GPU_TRACE_FLUSH_INTERVAL": "abc",
    "GPU_TRACE_BUFFER_EVENTS": "0",
    "GPU_TRACE_NVTX": "always",
    "GPU_TRACE_NVTX_CLOCK": "tsc",
    "GPU_TRACE_CC": 'cc "unterminated',
    "GPU_TRACE_GPU_ACTIVITY": "sometimes",
    "GPU_TRACE_CUPTI_LIBRARY": "/nonexistent/libcupti.so",
    "GPU_TRACE_TORCH": "layer",
    "GPU_TRACE_TORCH_SHAPES": "sometimes",
    "GPU_TRACE_TORCH_OPS": "fast",
    "GPU_TRACE_TF": "module",
    "GPU_TRACE_NVML_HZ": "1e9",
    "GPU_TRACE_HOST_HZ": "abc",
    "GPU_TRACE_NVML_REPLAY": "{missing}",
    "GPU_TRACE_NVML_FAMILIES": "pcie,sideband",
    "GPU_TRACE_KEEP_SPOOL": "maybe",
    # W3C Trace Context: a malformed traceparent is ignored, the run starts its own trace.
    "TRACEPARENT": None,
    # OpenTelemetry's own variables, read by the program's SDK too: `--otlp` checks them when it
    # sends (tests/integration/test_otlp_export.py), `record` never refuses them up front.
    "OTEL_EXPORTER_OTLP_ENDPOINT": None,
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": None,
    "OTEL_EXPORTER_OTLP_HEADERS": None,
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": None,
}

#: The values the issue found turning recording off (or spinning the flusher) instead of refused.
FROM_THE_ISSUE = [
    ("GPU_TRACE_FLUSH_INTERVAL", v) for v in ("abc", "-1", "0", "1e9", "nan", "inf", "-inf")
] + [("GPU_TRACE_BUFFER_EVENTS", v) for v in ("abc", "0", "-5", "nan", "1e30")]


def test_every_setting_has_a_check_and_a_refused_value() -> None:
    assert set(config.CHECKS) == set(config.ENVIRONMENT)
    assert set(BAD) == set(config.CHECKS), "add the new setting's refused value to BAD"


def _value(template: str, tmp_path: Path) -> str:
    file = tmp_path / "a-file"
    file.write_text("")
    return template.format(file=file, missing=tmp_path / "missing.jsonl")


def _record(tmp_path: Path, name: str, value: str) -> subprocess.CompletedProcess:
    marker = tmp_path / "ran"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gpu_trace",
            "record",
            "--run-dir",
            str(tmp_path / "run"),
            "--store",
            f"chdb://{tmp_path / 'store'}",
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w').close()",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, name: value},
        timeout=120,
    )


def _assert_refused(out: subprocess.CompletedProcess, tmp_path: Path, name: str, value: str):
    lines = out.stderr.splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"gpu-trace: {name} must be ")
    if name in config.SECRETS:  # a token is never shown, not even a refused one
        assert value not in lines[0] and f"got {len(value)} characters (not shown)" in lines[0]
    else:
        assert f"got {value!r}" in lines[0]
    assert not (tmp_path / "ran").exists(), "the program ran"
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()


@pytest.mark.parametrize("name", [n for n, v in BAD.items() if v is not None])
def test_record_refuses_a_bad_setting_before_the_program_runs(tmp_path: Path, name: str) -> None:
    value = _value(BAD[name] or "", tmp_path)
    _assert_refused(_record(tmp_path, name, value), tmp_path, name, value)


@pytest.mark.parametrize("name, value", FROM_THE_ISSUE)
def test_the_issue_s_values_are_refused_with_their_range(
    tmp_path: Path, name: str, value: str
) -> None:
    with pytest.raises(ValueError) as caught:
        config.check_environment({name: value})
    message = str(caught.value)
    assert message.startswith(f"{name} must be a ") and message.endswith(f"got {value!r}")
    assert "(0, 60]" in message or "[16, 1073741824]" in message


def test_record_names_every_bad_setting_in_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", "--run-dir", str(tmp_path / "run")]
        + ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_FLUSH_INTERVAL": "nan", "GPU_TRACE_BUFFER_EVENTS": "-5"},
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert "GPU_TRACE_FLUSH_INTERVAL must be" in out.stderr
    assert "GPU_TRACE_BUFFER_EVENTS must be" in out.stderr
    assert not marker.exists()


def test_a_malformed_traceparent_is_ignored(tmp_path: Path) -> None:
    config.check_environment({"TRACEPARENT": "00-not-a-trace-context"})


@pytest.mark.parametrize("name, value", FROM_THE_ISSUE[:3] + [("GPU_TRACE_TORCH", "all")])
def test_start_refuses_a_bad_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be"):
        gpu_trace.start(tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        {"flush_interval_s": math.nan},
        {"flush_interval_s": math.inf},
        {"flush_interval_s": -1.0},
        {"buffer_events": 0},
        {"buffer_events": 1.5},
        {"buffer_events": True},
    ],
)
def test_start_refuses_bad_arguments(tmp_path: Path, overrides: dict) -> None:
    with pytest.raises(ValueError, match="flush interval|buffer capacity"):
        gpu_trace.start(tmp_path / "run", **overrides)


def test_demo_refuses_a_bad_setting_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "demo", "--no-ui"]
        + ["--store", f"chdb://{tmp_path / 'store'}"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_BUFFER_EVENTS": "-5"},
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "gpu-trace: GPU_TRACE_BUFFER_EVENTS must be a whole number of events in [16, 1073741824],"
        " got '-5'"
    ]


def test_serve_refuses_a_bad_setting_before_it_listens(tmp_path: Path) -> None:
    # Checked like record's: every setting, also one the server reads only later (the buffer of
    # its spool's recorder), before it binds a port (without the check it served on; the
    # subprocess timeout then fails the test).
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0", "--device", "cpu"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_BUFFER_EVENTS": "-5", "GPU_TRACE_HOME": str(tmp_path)},
        timeout=30,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("gpu-trace: GPU_TRACE_BUFFER_EVENTS must be "), lines
