"""A run says how it was recorded: `gpu-trace record` and ``gpu_trace.start()`` write the same
settings keys into run.json's attrs (one function, ``recording_attrs``), the store keeps them, `ls`
shows them in a column and `show` in a line; a run from before they were kept shows ``-``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_trace import cli
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer import session
from gpu_trace.tracer.run import RECORDING_ATTRS, RunInfo, describe_recording, recording_attrs


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_record_writes_its_settings_and_ls_and_show_tell_two_levels_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: one command recorded at module and at op level looked alike."""
    home = Path(os.environ["GPU_TRACE_HOME"])
    env = {**os.environ, "GPU_TRACE_TORCH_SHAPES": "1"}
    for level in ("module", "op"):
        subprocess.run(
            [sys.executable, "-m", "gpu_trace", "record", "--torch", level, "--tf", "off"]
            + ["--no-nvml", "--host-hz", "0", "--", sys.executable, "-c", "pass"],
            env=env,
            check=True,
            capture_output=True,
            timeout=240,
        )
    code, out, _ = run_cli(capsys, "ls", "--json")
    assert code == 0
    runs = json.loads(out)
    by_level = {r["attrs"]["torch"]: r for r in runs}
    assert set(by_level) == {"module", "op"}
    for r in runs:
        attrs = r["attrs"]
        assert set(RECORDING_ATTRS) - {"remote"} <= set(attrs), attrs
        assert attrs["started_by"] == "record" and attrs["tf"] == "off"
        assert attrs["torch_shapes"] == "on" and attrs["nvml"] == "off"
        assert attrs["host_hz"] == "0" and attrs["nvml_hz"] == "0"
    code, out, _ = run_cli(capsys, "ls")
    header, _, *rows = out.splitlines()
    assert "RECORDING" in header.split()
    assert sum("torch=op tf=off nvml=off host=off" in row for row in rows) == 1
    assert sum("torch=module tf=off nvml=off host=off" in row for row in rows) == 1
    code, out, _ = run_cli(capsys, "show", by_level["op"]["run_id"])
    assert (
        "recording: started by record; torch=op (shapes on), tf=off, nvtx=native, nvml=off,"
        " host=off, remote=off"
    ) in out.replace("nvtx=python", "nvtx=native")  # python where no C compiler is found
    assert (home / "store").is_dir()


def test_start_writes_the_same_keys_as_record(tmp_path: Path) -> None:
    run_dir = session.start_run(tmp_path / "inproc")
    session.stop_run()
    attrs = RunInfo.load(run_dir).attrs
    assert {k: attrs[k] for k in RECORDING_ATTRS if k != "remote"} == {
        "started_by": "start",
        "torch": "module",
        "torch_shapes": "off",
        "tf": "layer",
        "nvtx": "native",
        "nvml": "off",
        "nvml_hz": "0",
        "host_hz": "0",
    }
    # The process that started it closes it: a run it left open is told apart once it is gone.
    assert attrs["recorder_pid"] == str(os.getpid())


def test_settings_come_from_the_given_environment_and_samplers() -> None:
    attrs = recording_attrs(
        "record",
        environ={
            "GPU_TRACE_TORCH": "op",
            "GPU_TRACE_TF": "OFF",
            "GPU_TRACE_TORCH_SHAPES": "yes",
            "GPU_TRACE_NVTX": "python",
            "GPU_TRACE_REMOTE": "gpu-box:7070",
        },
        samplers={"nvml": "replay:x.jsonl", "nvml_hz": "10", "host_hz": "2", "gpus": "0=H100"},
    )
    assert attrs == {
        "started_by": "record",
        "torch": "op",
        "torch_shapes": "on",
        "tf": "off",
        "nvtx": "python",
        "nvml": "replay:x.jsonl",
        "nvml_hz": "10",
        "host_hz": "2",
        "gpus": "0=H100",
        "remote": "gpu-box:7070",
    }
    assert describe_recording(attrs, compact=True) == (
        "torch=op tf=off nvml=10Hz host=2Hz remote=gpu-box:7070"
    )
    assert describe_recording(attrs) == (
        "started by record; torch=op (shapes on), tf=off, nvtx=python,"
        " nvml=replay:x.jsonl at 10Hz, host=2Hz, remote=gpu-box:7070"
    )
    # Explicit values win over the environment (gpu_trace.profile(torch="op") and the like).
    assert recording_attrs("profile", environ={"GPU_TRACE_TORCH": "op"}, torch="off")["torch"] == (
        "off"
    )


def test_a_run_from_before_shows_a_dash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "old"
    RunInfo(
        run_id="old-run",
        trace_id="ab" * 16,
        started_ns=1,
        ended_ns=2,
        status="finished",
        attrs={"nvtx": "native", "host_hz": "2", "anchor_mono_ns": "1", "anchor_wall_ns": "5"},
    ).save(run_dir)
    with Store() as store:
        ingest(store, run_dir)
    code, out, _ = run_cli(capsys, "ls")
    header, *lines = out.splitlines()
    row = next(line for line in lines if line.startswith("old-run"))
    column = header.index("RECORDING")
    assert row[column:].strip() == "-"  # the command is empty
    assert describe_recording(RunInfo.load(run_dir).attrs) == "-"
    code, out, _ = run_cli(capsys, "show", "old-run")
    assert "recording: -" in out.splitlines()
