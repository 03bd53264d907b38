"""Native NVTX capture through the real recorder, each case in its own process.

The injection library is built with the system C compiler into the test's GPU_TRACE_HOME; these
tests skip only where no C compiler exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from gpu_trace.collectors.nvtx import build as nvtx_build
from tests.conftest import recorded

CC = os.environ.get("GPU_TRACE_CC") or "cc"


def _need_compiler() -> None:
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler ({CC}) on this machine")


def run_script(
    tmp_path: Path, body: str, *, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    script = tmp_path / f"script_{len(list(tmp_path.glob('script_*')))}.py"
    script.write_text(textwrap.dedent(body))
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


WORKLOAD = """
import sys, threading
import gpu_trace
run, mode = sys.argv[1] if len(sys.argv) > 1 else None, None
run, mode = {run!r}, {mode!r}
gpu_trace.start(run, nvtx=mode)
from gpu_trace.tracer import recorder
sources = [s.name for s in recorder.active._sources]
import nvtx

@nvtx.annotate(domain="A")
def step(i):
    nvtx.push_range("load", domain="A", payload=i)
    nvtx.mark("loaded", domain="A")
    nvtx.pop_range(domain="A")
    with nvtx.annotate("compute", domain="A", category="math"):
        with nvtx.annotate("kernel", domain="A", color="red"):
            pass

def worker(i, ids):
    for k in range(3):
        step(k)
    d = nvtx.get_domain("B")
    reg = d.get_event_attributes(message="registered", category="io")
    d.push_range(reg)
    d.mark(message="b-mark")
    d.push_range(reg)
    d.pop_range()
    d.pop_range()
    ids.append(d.start_range(message="cross-thread"))
    nvtx.push_range("default-domain")
    nvtx.pop_range()

ids = []
threads = [threading.Thread(target=worker, args=(i, ids)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
d = nvtx.get_domain("B")
for r in ids:
    d.end_range(r)  # ends on the main thread
gpu_trace.stop()
print(sources)
"""


def _shape(rows: list[dict]) -> tuple[Counter, Counter]:
    key = {r["span_id"]: (r["lane"], r["category"], r["name"], r["depth"]) for r in rows}
    events = Counter(key.values())
    parents = Counter((key[r["span_id"]], key.get(r["parent_span_id"])) for r in rows)
    return events, parents


def test_native_and_python_paths_record_the_same(tmp_path: Path) -> None:
    _need_compiler()
    results = {}
    for mode in ("native", "python"):
        run = tmp_path / f"run-{mode}"
        proc = run_script(tmp_path, WORKLOAD.format(run=str(run), mode=mode))
        assert ("'nvtx'" if mode == "native" else "'nvtx-python'") in proc.stdout, proc.stderr
        assert "native NVTX capture is off" not in proc.stderr
        results[mode] = recorded(run)
    native, python = results["native"], results["python"]
    # 4 threads: 3 steps of 5 events, 3 in domain B, a cross-thread and a default-domain range
    assert len(native) == len(python) == 4 * (3 * 5 + 3 + 1 + 1)
    n_events, n_parents = _shape(native)
    p_events, p_parents = _shape(python)
    assert n_events == p_events
    assert n_parents == p_parents
    assert n_events[("nvtx/A", "mark", "loaded", 2)] == 12
    assert n_events[("nvtx/B", "nvtx", "registered", 1)] == 4
    assert n_events[("nvtx/B", "nvtx", "cross-thread", 0)] == 4
    for rows in (native, python):
        attrs = {r["name"]: dict(r["attrs"]) for r in rows}
        assert attrs["compute"]["category"] == "math"
        assert attrs["registered"]["category"] == "io"
        assert attrs["kernel"]["color"] == "#00ff0000"
        assert attrs["load"]["payload"] in {"0", "1", "2"}
        # cross-thread ranges keep the starting thread's tid, not the main thread's
        assert len({r["tid"] for r in rows if r["name"] == "cross-thread"}) == 4
        for r in rows:
            assert r["end_ns"] >= r["start_ns"] > 0


C_LIB = r"""
#include <nvtx3/nvToolsExt.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <wchar.h>

static nvtxRangeId_t g_range;
static unsigned g_tid;

static void* body(void* arg) {
    (void)arg;
    g_tid = (unsigned)syscall(SYS_gettid);
    nvtxNameOsThreadA(g_tid, "c-worker");
    nvtxDomainHandle_t dom = nvtxDomainCreateA("native");
    nvtxDomainNameCategoryA(dom, 5, "c-category");
    nvtxStringHandle_t reg = nvtxDomainRegisterStringA(dom, "c-registered");
    nvtxEventAttributes_t a;
    memset(&a, 0, sizeof(a));
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    a.message.registered = reg;
    a.category = 5;
    a.colorType = NVTX_COLOR_ARGB;
    a.color = 0xff00ff00;
    a.payloadType = NVTX_PAYLOAD_TYPE_DOUBLE;
    a.payload.dValue = 2.5;
    nvtxDomainRangePushEx(dom, &a);
    nvtxRangePushA("c-outer");
    nvtxRangePushW(L"c-inner-\u00fc\u6f22");
    nvtxMarkA("c-mark");
    nvtxRangePop();
    nvtxRangePop();
    nvtxDomainRangePop(dom);
    g_range = nvtxRangeStartA("c-cross");
    return 0;
}

unsigned run_native(void) {
    pthread_t t;
    pthread_create(&t, 0, body, 0);
    pthread_join(t, 0);
    nvtxRangeEnd(g_range);
    return g_tid;
}

int run_malformed(void) {
    nvtxDomainHandle_t dom = nvtxDomainCreateA("bad");
    nvtxEventAttributes_t a;
    memset(&a, 0, sizeof(a));
    nvtxRangePushA(0);
    nvtxRangePop();
    nvtxRangePushW(0);
    nvtxRangePop();
    nvtxMarkA(0);
    nvtxMarkW(0);
    nvtxDomainMarkEx(dom, 0);
    nvtxDomainRangePushEx(dom, 0);
    nvtxDomainRangePop(dom);
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;  /* size 0: no field may be read */
    a.message.ascii = "never-read";
    nvtxDomainRangePushEx(dom, &a);
    nvtxDomainRangePop(dom);
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.message.ascii = 0;
    nvtxDomainRangePushEx(dom, &a);
    nvtxDomainRangePop(dom);
    a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    a.message.registered = (nvtxStringHandle_t)(uintptr_t)0xdeadbeefu;
    nvtxDomainMarkEx(dom, &a);
    a.messageType = 77;
    a.payloadType = 99;
    nvtxDomainMarkEx(dom, &a);
    nvtxRangePop();
    nvtxRangePop();
    nvtxDomainRangePop(0);
    nvtxRangeEnd(0);
    nvtxRangeEnd(123456789);
    nvtxDomainRangeEnd(dom, 42);
    nvtxNameCategoryA(1, 0);
    nvtxNameOsThreadW(0, 0);
    nvtxDomainRegisterStringA(dom, 0);
    nvtxDomainCreateA(0);
    nvtxRangePushA("survived");
    return nvtxRangePop();
}
"""


def _build_c_lib(tmp_path: Path) -> Path:
    _need_compiler()
    inc = nvtx_build.include_dir()
    assert inc is not None, "nvidia-nvtx headers are a dependency"
    src = tmp_path / "emitter.c"
    src.write_text(C_LIB)
    out = tmp_path / "libemitter.so"
    subprocess.run(
        [
            CC,
            "-O1",
            "-fPIC",
            "-shared",
            "-I",
            str(inc),
            str(src),
            "-o",
            str(out),
            "-lpthread",
            "-ldl",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def test_ranges_from_a_native_thread_are_captured(tmp_path: Path) -> None:
    lib = _build_c_lib(tmp_path)
    run = tmp_path / "run"
    proc = run_script(
        tmp_path,
        f"""
        import ctypes, gpu_trace
        gpu_trace.start({str(run)!r})
        lib = ctypes.CDLL({str(lib)!r})
        print(lib.run_native())
        gpu_trace.stop()
        """,
    )
    tid = int(proc.stdout.split()[-1])
    rows = recorded(run)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"c-registered", "c-outer", "c-inner-\u00fc\u6f22", "c-mark", "c-cross"}
    reg, outer, inner, mark = (
        by_name[n] for n in ("c-registered", "c-outer", "c-inner-\u00fc\u6f22", "c-mark")
    )
    assert reg["lane"] == "nvtx/native" and outer["lane"] == "nvtx/default"
    assert dict(reg["attrs"]) == {
        "category": "c-category",
        "color": "#ff00ff00",
        "payload": "2.5",
        "thread_name": "c-worker",
    }
    assert (outer["depth"], inner["depth"], mark["depth"]) == (0, 1, 2)
    assert (
        inner["parent_span_id"] == outer["span_id"] and mark["parent_span_id"] == inner["span_id"]
    )
    assert mark["category"] == "mark"
    assert all(r["tid"] == tid for r in rows)  # the cross-thread range keeps its starting thread
    assert by_name["c-cross"]["end_ns"] >= by_name["c-cross"]["start_ns"]


def test_malformed_native_input_never_crashes(tmp_path: Path) -> None:
    lib = _build_c_lib(tmp_path)
    run = tmp_path / "run"
    run_script(
        tmp_path,
        f"""
        import ctypes, gpu_trace
        gpu_trace.start({str(run)!r})
        lib = ctypes.CDLL({str(lib)!r})
        assert lib.run_malformed() == 0
        gpu_trace.stop()
        """,
    )
    names = Counter(r["name"] for r in recorded(run))
    assert names["survived"] == 1
    assert names[""] >= 6  # null and unreadable messages become empty names


@pytest.mark.parametrize("mode", ["native", "python"])
def test_fork_child_records_its_own_events(tmp_path: Path, mode: str) -> None:
    if mode == "native":
        _need_compiler()
    run = tmp_path / "run"
    run_script(
        tmp_path,
        f"""
        import os, gpu_trace
        gpu_trace.start({str(run)!r}, nvtx={mode!r})
        import nvtx
        nvtx.push_range("before-fork")
        nvtx.mark("parent-early")
        pid = os.fork()
        if pid == 0:
            nvtx.push_range("child-only")
            nvtx.pop_range()
            nvtx.pop_range()  # closes nothing of the parent's in the child
            gpu_trace.stop()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        nvtx.push_range("parent-after")
        nvtx.pop_range()
        nvtx.pop_range()
        gpu_trace.stop()
        print(pid)
        """,
    )
    rows = recorded(run)
    by_pid: dict[int, set[str]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], set()).add(r["name"])
    assert len(by_pid) == 2, by_pid
    child = next(names for names in by_pid.values() if "child-only" in names)
    parent = next(names for names in by_pid.values() if "child-only" not in names)
    assert child == {"child-only"}
    assert parent == {"before-fork", "parent-early", "parent-after"}
    assert len({r["span_id"] for r in rows}) == len(rows)


@pytest.mark.parametrize("mode", ["native", "python"])
def test_full_buffer_drops_and_counts(tmp_path: Path, mode: str) -> None:
    if mode == "native":
        _need_compiler()
    run = tmp_path / "run"
    run_script(
        tmp_path,
        f"""
        import gpu_trace
        gpu_trace.start({str(run)!r}, nvtx={mode!r}, buffer_events=16, flush_interval_s=60)
        import nvtx
        for i in range(100):
            nvtx.push_range("r")
            nvtx.pop_range()
        gpu_trace.stop()
        """,
    )
    assert len(recorded(run)) == 16
    stats = [json.loads(p.read_text()) for p in (run / "stats").glob("*.json")]
    assert sum(s["dropped"] for s in stats) == 84


def test_missing_compiler_falls_back_to_python_with_one_warning(tmp_path: Path) -> None:
    prebuilt = nvtx_build.SOURCE.with_name(nvtx_build.library_name()).is_file()
    run = tmp_path / "run"
    proc = run_script(
        tmp_path,
        f"""
        import gpu_trace
        from gpu_trace.collectors import nvtx as collector
        modes = []
        for i in range(2):
            gpu_trace.start({str(run)!r} + str(i))
            from gpu_trace.tracer import recorder
            modes.append([s.name for s in recorder.active._sources])
            import nvtx
            with nvtx.annotate("still-recorded"):
                pass
            gpu_trace.stop()
        print(modes, collector.build_error())
        """,
        env={"GPU_TRACE_CC": "/nonexistent/cc", "GPU_TRACE_HOME": str(tmp_path / "fresh-home")},
    )
    if prebuilt:  # a wheel's prebuilt library needs no compiler
        assert "native NVTX capture is off" not in proc.stderr
        return
    assert proc.stderr.count("native NVTX capture is off") == 1, proc.stderr
    assert "/nonexistent/cc" in proc.stderr
    assert "[['nvtx-python'], ['nvtx-python']]" in proc.stdout
    assert [r["name"] for r in recorded(tmp_path / "run0")] == ["still-recorded"]


def test_another_nvtx_tool_keeps_its_place(tmp_path: Path) -> None:
    _need_compiler()
    other = tmp_path / "other-tool.so"
    other.write_bytes(b"")  # an injection named by another tool (say, Nsight Systems)
    run = tmp_path / "run"
    proc = run_script(
        tmp_path,
        f"""
        import os, gpu_trace
        from gpu_trace.collectors import nvtx as collector
        assert collector.injection_env("native") == {{}}
        gpu_trace.start({str(run)!r})
        from gpu_trace.tracer import recorder
        print([s.name for s in recorder.active._sources], os.environ["NVTX_INJECTION64_PATH"])
        gpu_trace.stop()
        """,
        env={"NVTX_INJECTION64_PATH": str(other)},
    )
    assert proc.stderr.count("another NVTX tool is attached") == 1
    assert f"['nvtx-python'] {other}" in proc.stdout


def test_injection_env_names_the_library(tmp_path: Path) -> None:
    _need_compiler()
    from gpu_trace.collectors import nvtx as collector

    env = collector.injection_env("native")
    path = Path(env["NVTX_INJECTION64_PATH"])
    assert path.is_file() and path == collector.library_path()
    assert collector.build_error() is None
