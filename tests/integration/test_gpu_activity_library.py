"""The CUPTI injection library, built and run here without a GPU: it exports the driver's entry
point, writes chunks the Python reader checks (CRC, framing), and a machine without CUPTI or
without a GPU gets one line while the program runs on unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from gpu_trace import _cbuild
from gpu_trace.collectors import gpu_activity
from gpu_trace.collectors.gpu_activity import activity_file, library
from gpu_trace.collectors.gpu_activity.converter import convert_run
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import list_spool, read_spool_file
from tests import cuda_headers

PROGRAM = textwrap.dedent(
    """
    import ctypes, sys
    lib = ctypes.CDLL(sys.argv[1])
    # what the CUDA driver does at cuInit when CUDA_INJECTION64_PATH names the library
    print("init", lib.InitializeInjection(), flush=True)
    print("the program goes on")
    """
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    inc = cuda_headers.include_dirs()
    if inc is None:
        pytest.skip(
            "CUPTI headers not installed here (CUDA toolkit or nvidia-cuda-cupti) and not"
            " fetched (scripts/cuda_headers.sh): not built"
        )
    try:
        return library.build(tmp_path_factory.mktemp("lib") / library.library_name(), include=inc)
    except _cbuild.BuildError as exc:
        pytest.skip(f"no C compiler: {exc}")


def _run_program(lib: Path, run_dir: Path, cupti: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_TRACE_RUN_DIR": str(run_dir)}
    env.pop("GPU_TRACE_CUPTI_LIBRARY", None)
    if cupti is not None:
        env["GPU_TRACE_CUPTI_LIBRARY"] = cupti
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, str(lib)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip


def test_the_library_exports_the_drivers_entry_point(built: Path) -> None:
    out = subprocess.run(["nm", "-D", "--defined-only", str(built)], capture_output=True, text=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    assert "InitializeInjection" in exported


def test_without_cupti_one_note_reaches_the_run_and_the_program_goes_on(
    built: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    RunInfo(run_id="r", trace_id="ab" * 16, started_ns=0).save(run_dir)
    out = _run_program(built, run_dir, "/nonexistent/libcupti.so")
    assert out.returncode == 0 and out.stdout == "init 1\nthe program goes on\n", out.stderr
    problems = convert_run(run_dir)  # the chunk the C library wrote passes Python's checksum
    assert len(problems) == 1
    assert problems[0].startswith("GPU activity is off: CUPTI not found (/nonexistent/libcupti.so")
    assert RunInfo.load(run_dir).attrs["gpu_activity_note"] == problems[0]
    assert not activity_file.activity_files(run_dir / "spool")


def test_with_cupti_but_no_gpu_one_note(built: Path, tmp_path: Path) -> None:
    cupti = library.cupti_library()
    if cupti is None:
        pytest.skip("libcupti is not installed here")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = _run_program(built, run_dir, str(cupti))
    assert out.returncode == 0 and out.stdout == "init 1\nthe program goes on\n", out.stderr
    data = activity_file.read(activity_file.activity_files(run_dir / "spool"))
    assert not data.problems and len(data.records) == 0
    assert len(data.notes) == 1 and data.notes[0].startswith("GPU activity is off: CUPTI ")


def test_record_steps_aside_for_another_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nsight Systems names its own injection library; one process loads one."""
    monkeypatch.setenv(library.ENV, "/opt/nsight/libToolsInjection64.so")
    env, why = library.injection_env(Path("/nonexistent"))
    assert env == {} and why is not None and "/opt/nsight/libToolsInjection64.so" in why


def test_asked_for_without_a_driver_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_activity, "driver_present", lambda: False)
    assert gpu_activity.prepare("on") == (
        {},
        "off",
        "GPU activity is off: no NVIDIA driver (libcuda) on this machine",
    )
    assert gpu_activity.prepare("auto") == ({}, "off", None)  # a CPU machine: nothing to say
    assert gpu_activity.prepare("off") == ({}, "off", None)


FAKE_PROGRAM = textwrap.dedent(
    """
    import ctypes, json, sys, threading, time
    lib = ctypes.CDLL(sys.argv[1])
    fake = ctypes.CDLL(sys.argv[2])  # the libcupti the injection library opened: the same one
    fake.fake_cupti_emit.restype = ctypes.c_uint64
    print("init", lib.InitializeInjection(), flush=True)
    t0 = time.perf_counter_ns()
    tid = fake.fake_cupti_emit(1)
    t1 = time.perf_counter_ns()
    fake.fake_cupti_emit(2)
    print(json.dumps({"t0": t0, "t1": t1, "tid": tid, "native": threading.get_native_id()}))
    """  # the library's exit handler flushes CUPTI; the records reach the file then
)


@pytest.mark.parametrize("timestamp_callback", [True, False], ids=["cupti-clock", "anchors"])
def test_the_librarys_records_become_the_expected_spans(
    built: Path, tmp_path: Path, timestamp_callback: bool
) -> None:
    """The whole C path against a stand-in libcupti (CUPTI's own structs): conversion of each
    record kind, kernel names, system thread ids, drops, and the clock: CUPTI's clock is
    CLOCK_MONOTONIC + 1000 s here, and the launch must land between the program's
    perf_counter_ns readings around it, through CUPTI's timestamp callback or through anchors."""
    fake = tmp_path / "libcupti_fake.so"
    inc = cuda_headers.include_dirs()
    assert inc is not None
    source = Path(__file__).with_name("fake_cupti.c")
    flags = [] if timestamp_callback else ["-DNO_TS_CALLBACK"]
    _cbuild.build(source, fake, include_dirs=inc, libs=["-lpthread", *flags])
    run_dir = tmp_path / "run"
    RunInfo(run_id="r", trace_id="ab" * 16, started_ns=0).save(run_dir)
    env = {**os.environ, "GPU_TRACE_RUN_DIR": str(run_dir), "GPU_TRACE_CUPTI_LIBRARY": str(fake)}
    out = subprocess.run(
        [sys.executable, "-c", FAKE_PROGRAM, str(built), str(fake)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    (problem,) = convert_run(run_dir)
    assert problem.endswith(": CUPTI dropped 3 GPU activity records (buffers full)")
    spans = [
        row
        for path in list_spool(run_dir)
        for row in (read_spool_file(path).table or pa.table({})).to_pylist()
    ]
    by_cat: dict[str, list[dict]] = {}
    for s in spans:
        by_cat.setdefault(s["category"], []).append(s)
    assert {c: len(v) for c, v in by_cat.items()} == {
        "cuda_api": 2, "kernel": 2, "memcpy": 2, "memset": 2, "cuda_sync": 2,
    }  # fmt: skip
    api = min(by_cat["cuda_api"], key=lambda s: s["start_ns"])
    assert api["name"] == "cudaLaunchKernel" and api["tid"] == seen["native"] == seen["tid"]
    assert seen["t0"] <= api["start_ns"] <= seen["t1"]  # on the program's clock
    kernel = next(k for k in by_cat["kernel"] if dict(k["attrs"])["correlation"] == "1")
    assert kernel["name"] == "kernel(float*)" and kernel["parent_span_id"] == api["span_id"]
    assert kernel["lane"] == "gpu1/stream7" and kernel["start_ns"] - api["start_ns"] == 2000
    attrs = dict(kernel["attrs"])
    assert attrs["grid"] == "[8, 2, 1]" and attrs["block"] == "[256, 1, 1]"
    assert attrs["registers per thread"] == "32" and attrs["shared memory"] == "3072"
    copy = by_cat["memcpy"][0]
    assert copy["name"] == "Memcpy DtoH (Device -> Pinned)"
    assert dict(copy["attrs"])["memory bandwidth (GB/s)"] == "4.096"
    assert by_cat["memset"][0]["name"] == "Memset (Device)"
    sync = by_cat["cuda_sync"][0]
    assert sync["name"] == "Stream Synchronize" and sync["lane"] == "gpu1/stream7"
    info = RunInfo.load(run_dir)
    assert info.attrs["gpu_activity_records"] == "10"
    assert info.attrs["gpu_activity_dropped"] == "3"
    assert info.attrs["gpu_activity_unmatched"] == "0"


TAKEOVER_PROGRAM = textwrap.dedent(
    """
    import ctypes, glob, sys, time
    fake = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)  # also the process's "driver"
    lib = ctypes.CDLL(sys.argv[1])
    lib.InitializeInjection()
    fake.fake_cupti_emit(1)
    time.sleep(0.6)  # probes come back: CUPTI's buffers are ours
    fake.fake_cupti_take_over()  # the program starts torch.profiler(CUDA): Kineto's callbacks
    fake.fake_cupti_emit(2)  # goes to the program's profiler
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the library has said so (no timing assumed)
        if any(b"another profiler" in open(p, "rb").read() for p in glob.glob(sys.argv[3])):
            break
        time.sleep(0.05)
    print("done")
    """
)


def test_a_profiler_taking_cuptis_buffers_is_said_once_and_left_working(
    built: Path, tmp_path: Path
) -> None:
    """CUPTI keeps one pair of activity-buffer callbacks per process; when the program's own
    profiler registers its pair, the library notices (its probe's record stops coming back),
    says so once, and leaves the profiler its buffers; what came before is kept."""
    fake = tmp_path / "libcupti_fake.so"
    inc = cuda_headers.include_dirs()
    assert inc is not None
    _cbuild.build(
        Path(__file__).with_name("fake_cupti.c"), fake, include_dirs=inc, libs=["-lpthread"]
    )
    run_dir = tmp_path / "run"
    RunInfo(run_id="r", trace_id="ab" * 16, started_ns=0).save(run_dir)
    env = {
        **os.environ,
        "GPU_TRACE_RUN_DIR": str(run_dir),
        "GPU_TRACE_CUPTI_LIBRARY": str(fake),
        "GPU_TRACE_FLUSH_INTERVAL": "0.05",
    }
    pattern = str(run_dir / "spool" / "gpu_activity-*.bin")
    out = subprocess.run(
        [sys.executable, "-c", TAKEOVER_PROGRAM, str(built), str(fake), pattern],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    data = activity_file.read(activity_file.activity_files(run_dir / "spool"))
    (note,) = data.notes
    assert note.startswith("GPU activity of process ") and "another profiler" in note
    assert sorted(set(data.records["correlation"].tolist())) == [1]  # 2 went to the profiler
    assert 2 not in data.records["code"][data.records["kind"] == 4]  # no probe in the data
