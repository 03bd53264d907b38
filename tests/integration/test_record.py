"""`gpu-trace record` end to end: a real child program, real spool files, the real chDB store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def gpu_trace(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=240,
    )


@pytest.fixture
def cpu_hog() -> object:
    """Busy processes on every core (two at least) while the test runs: a machine as loaded as
    CI's often is, where the program and the recorder's flusher wait for a core."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(max(2, os.cpu_count() or 2))
    ]
    yield
    for p in hogs:
        p.kill()
        p.wait()


def script(tmp_path: Path, body: str, name: str = "prog.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def sql_json(query: str, **params: str) -> list[dict]:
    args = ["sql", "--json", query]
    for k, v in params.items():
        args += ["-p", f"{k}={v}"]
    out = gpu_trace(*args)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def last_run() -> dict:
    out = gpu_trace("show", "last", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_record_python_program_end_to_end(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        import sys
        # instrumentation is in place before the first line of the program
        from gpu_trace.tracer import recorder
        assert recorder.active is not None, "not recording at the first line"
        import gpu_trace
        for i in range(3):
            gpu_trace.step(i)
            with gpu_trace.range("outer", i=i):
                with gpu_trace.range("inner"):
                    pass
            gpu_trace.counter("loss", 1.0 / (i + 1))
        gpu_trace.mark("done")
        sys.exit(3)
        """,
    )
    out = gpu_trace("record", "--", sys.executable, str(prog))
    assert out.returncode == 3, out.stderr
    summary = out.stderr.strip().splitlines()[-1]
    assert (
        summary.startswith("gpu-trace: run ") and " events, 0 dropped, stored in chdb://" in summary
    )

    shown = last_run()
    run = shown["run"]
    assert run["status"] == "failed" and run["attrs"]["exit_code"] == "3"
    names = {r["name"] for lane in shown["summary"]["lanes"] for r in lane["ranges"]}
    assert {"outer", "inner", "ProfilerStep"} <= names, "steps are listed by kind"
    assert [(s["kind"], s["count"]) for s in shown["summary"]["steps"]] == [("ProfilerStep", 3)]
    assert shown["summary"]["events"] == run["spans"] + run["counters"]
    rows = sql_json(
        "SELECT name, depth, parent_span_id != 0 AS has_parent FROM gpu_trace.spans WHERE run_id = {r:String} AND name = 'inner'",
        r=run["run_id"],
    )
    assert len(rows) == 3 and all(r["depth"] == 1 and r["has_parent"] for r in rows)

    ls = json.loads(gpu_trace("ls", "--json").stdout)
    assert ls[0]["run_id"] == run["run_id"]

    trace = tmp_path / "t.json"
    exported = gpu_trace("export", "last", "-o", str(trace))
    assert exported.returncode == 0, exported.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "inner" and e.get("ph") == "X") == 3


def test_children_processes_are_recorded(tmp_path: Path) -> None:
    child = script(
        tmp_path, "import gpu_trace\nwith gpu_trace.range('in-subprocess'):\n    pass\n", "child.py"
    )
    prog = script(
        tmp_path,
        f"""
        import multiprocessing as mp, subprocess, sys
        import gpu_trace

        def work(tag):
            with gpu_trace.range("in-" + tag):
                return tag

        if __name__ == "__main__":
            with gpu_trace.range("parent"):
                subprocess.run([sys.executable, {str(child)!r}], check=True)
                for method in ("fork", "spawn"):
                    with mp.get_context(method).Pool(1) as pool:
                        assert pool.apply(work, (method,)) == method
                    p = mp.get_context(method).Process(target=work, args=(method + "-process",))
                    p.start(); p.join()
        """,
    )
    out = gpu_trace("record", "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    run_id = last_run()["run"]["run_id"]
    rows = sql_json(
        "SELECT name, pid FROM gpu_trace.spans WHERE run_id = {r:String} AND lane = 'nvtx/gpu_trace'",
        r=run_id,
    )
    by_name = {r["name"]: r["pid"] for r in rows}
    expected = {
        "parent",
        "in-subprocess",
        "in-fork",
        "in-spawn",
        "in-fork-process",
        "in-spawn-process",
    }
    assert expected <= set(by_name), by_name
    assert len({by_name[n] for n in expected}) == len(expected), "each child is its own process"
    trace_ids = sql_json(
        "SELECT DISTINCT trace_id FROM gpu_trace.spans WHERE run_id = {r:String}", r=run_id
    )
    assert len(trace_ids) == 1, "every process of the run shares the run's trace id"


def test_every_lane_keeps_its_threads_name(tmp_path: Path) -> None:
    """The main thread's lanes are named MainThread and an ended thread's lanes keep its name,
    however the flushes fall. threading takes the main thread for stopped once the program's
    last line has run (before it joins non-daemon threads and runs atexit): a flush then dropped
    its buffer, so the run's last stats had no name for it (Chrome lanes "thread <tid>", 23 of
    151 real traces) and the step closed at exit was lost; and the stats named only the threads
    whose buffers were still there. Here a non-daemon thread outlives the main one by many flush
    intervals, so a flush falls in that window every time."""
    prog = script(
        tmp_path,
        """
        import os, threading, time
        import gpu_trace

        gpu_trace.step(0)  # closed when recording stops, at exit, on the main thread's buffer
        with gpu_trace.range("main-work"):
            pass
        def short(i):
            with gpu_trace.range(f"short-{i}"):
                pass
        for i in range(6):  # threads that end long before the run does
            t = threading.Thread(target=short, args=(i,), name=f"short-{i}")
            t.start()
            t.join()
        time.sleep(0.3)  # flushes drain and drop the ended threads' buffers
        threading.Thread(target=time.sleep, args=(0.5,), name="late").start()  # non-daemon
        print(os.getpid(), threading.get_native_id())
        """,
    )
    for _ in range(2):
        out = gpu_trace(
            "record", "--", sys.executable, str(prog), env={"GPU_TRACE_FLUSH_INTERVAL": "0.05"}
        )
        assert out.returncode == 0, out.stderr
        pid, main_tid = map(int, out.stdout.split())
        run_id = last_run()["run"]["run_id"]
        spans = sql_json(
            "SELECT name, tid FROM gpu_trace.spans WHERE run_id = {r:String} AND pid = {p:UInt32}",
            r=run_id,
            p=str(pid),
        )
        threads = sql_json(
            "SELECT tid, thread_name FROM gpu_trace.threads FINAL"
            " WHERE run_id = {r:String} AND pid = {p:UInt32}",
            r=run_id,
            p=str(pid),
        )
        names = {int(t["tid"]): t["thread_name"] for t in threads}
        by_span = {s["name"]: names.get(int(s["tid"])) for s in spans}
        assert by_span["main-work"] == "MainThread" and names.get(main_tid) == "MainThread"
        assert by_span.get("ProfilerStep#0") == "MainThread", "the step closed at exit is lost"
        assert {by_span[f"short-{i}"] for i in range(6)} == {f"short-{i}" for i in range(6)}


@pytest.mark.parametrize("source", ["native", "kineto"])
def test_op_spans_lanes_are_named(tmp_path: Path, source: str) -> None:
    """Spans a source makes (PyTorch's ops at op level) name their thread too: a program of bare
    ops records nothing on the main thread's buffer, and its op lanes were "thread <tid>"."""
    pytest.importorskip("torch")
    prog = script(
        tmp_path,
        """
        import os, threading
        import torch

        a = torch.randn(16, 16)
        for _ in range(20):
            a = torch.tanh(a @ a)
        print(os.getpid(), threading.get_native_id())
        """,
    )
    env = {"GPU_TRACE_TORCH_OPS": source}
    out = gpu_trace("record", "--torch", "op", "--", sys.executable, str(prog), env=env)
    assert out.returncode == 0, out.stderr
    pid, main_tid = map(int, out.stdout.split())
    run_id = last_run()["run"]["run_id"]
    tids = sql_json(
        "SELECT DISTINCT tid FROM gpu_trace.spans WHERE run_id = {r:String} AND pid = {p:UInt32}"
        " AND name = 'aten::tanh'",
        r=run_id,
        p=str(pid),
    )
    assert [int(t["tid"]) for t in tids] == [main_tid]
    threads = sql_json(
        "SELECT thread_name FROM gpu_trace.threads FINAL WHERE run_id = {r:String}"
        " AND pid = {p:UInt32} AND tid = {t:UInt64}",
        r=run_id,
        p=str(pid),
        t=str(main_tid),
    )
    assert [t["thread_name"] for t in threads] == ["MainThread"]


def test_uncaught_exception_and_sigterm_still_flush(tmp_path: Path) -> None:
    crash = script(
        tmp_path,
        "import gpu_trace\nwith gpu_trace.range('before-crash'):\n    pass\nraise RuntimeError('boom')\n",
    )
    out = gpu_trace("record", "--", sys.executable, str(crash))
    assert out.returncode == 1 and "RuntimeError: boom" in out.stderr
    assert "before-crash" in {
        r["name"] for lane in last_run()["summary"]["lanes"] for r in lane["ranges"]
    }

    term = script(
        tmp_path,
        "import os, signal, gpu_trace\nwith gpu_trace.range('before-term'):\n    pass\nos.kill(os.getpid(), signal.SIGTERM)\n",
        "term.py",
    )
    out = gpu_trace("record", "--", sys.executable, str(term))
    assert out.returncode == 128 + signal.SIGTERM
    shown = last_run()
    assert shown["run"]["status"] == "killed"
    assert "before-term" in {
        r["name"] for lane in shown["summary"]["lanes"] for r in lane["ranges"]
    }


def test_sigkill_keeps_everything_flushed_before_it(tmp_path: Path, cpu_hog: object) -> None:
    """What a flush wrote survives a SIGKILL, on a loaded machine too. The program waits until
    a flush has written its 1,000 ranges (the stats file each flush rewrites says so) rather
    than sleeping for "several flush intervals", which is what a loaded machine broke: the first
    flush imported pandas (1.4-1.7 s there, until 03071e3), a second was not enough, and 0 of
    1,000 were stored. Also checked: the flush imported no pandas."""
    prog = script(
        tmp_path,
        """
        import json, os, signal, sys, time, gpu_trace
        from pathlib import Path

        for i in range(1000):
            with gpu_trace.range("flushed"):
                pass

        def written():  # what this process's flushes wrote, rewritten after each (stats/)
            stats = Path(os.environ["GPU_TRACE_RUN_DIR"]) / "stats" / f"{os.getpid()}.json"
            try:
                return json.loads(stats.read_text())["events"]
            except (OSError, ValueError):
                return 0

        deadline = time.monotonic() + 120
        while written() < 1000 and time.monotonic() < deadline:
            time.sleep(0.05)  # the flusher writes them within an interval (0.1 s) of a core
        assert "pandas" not in sys.modules, "a flush imported pandas"
        with gpu_trace.range("lost"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    out = gpu_trace(
        "record", "--", sys.executable, str(prog), env={"GPU_TRACE_FLUSH_INTERVAL": "0.1"}
    )
    assert out.returncode == 128 + signal.SIGKILL, out.stderr
    run_id = last_run()["run"]["run_id"]
    rows = sql_json(
        "SELECT name, count() AS n FROM gpu_trace.spans WHERE run_id = {r:String} GROUP BY name",
        r=run_id,
    )
    assert {r["name"]: r["n"] for r in rows}.get("flushed") == 1000


def test_trace_context_is_honoured(tmp_path: Path) -> None:
    prog = script(tmp_path, "import os\nprint(os.environ['TRACEPARENT'])\n")
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    out = gpu_trace("record", "--", sys.executable, str(prog), env={"TRACEPARENT": incoming})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert last_run()["run"]["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    # a malformed incoming context is ignored: a fresh trace id, no error
    out = gpu_trace("record", "--", sys.executable, str(prog), env={"TRACEPARENT": "garbage"})
    assert out.returncode == 0, out.stderr
    assert len(last_run()["run"]["trace_id"]) == 32


def test_command_not_found_is_one_line_and_127(tmp_path: Path) -> None:
    out = gpu_trace("record", "--", "no-such-command-xyz")
    assert out.returncode == 127
    assert out.stderr.strip().splitlines() == ["gpu-trace: command not found: no-such-command-xyz"]


def test_unwritable_store_is_reported_before_the_program_starts(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    prog = script(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = gpu_trace("record", "--store", f"chdb://{blocker}/store", "--", sys.executable, str(prog))
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("gpu-trace: cannot record: the store ") and str(blocker) in line
    assert line.count(f"{blocker}/store") == 1  # the store named once
    assert not marker.exists()


def test_failed_ingest_keeps_the_spool_for_gpu_trace_ingest(tmp_path: Path) -> None:
    prog = script(tmp_path, "import gpu_trace\nwith gpu_trace.range('kept'):\n    pass\n")
    run_dir = tmp_path / "run"
    out = gpu_trace(
        "record", "--run-dir", str(run_dir), "--no-ingest", "--", sys.executable, str(prog)
    )
    assert out.returncode == 0 and f"gpu-trace ingest {run_dir}" in out.stderr
    bad = gpu_trace("ingest", str(run_dir), "--store", "http://default:@127.0.0.1:9/")
    assert bad.returncode != 0 and "spool kept" in bad.stderr
    assert list((run_dir / "spool").glob("*.arrow"))
    ok = gpu_trace("ingest", str(run_dir))
    assert ok.returncode == 0, ok.stderr
    again = gpu_trace("ingest", str(run_dir))
    assert again.returncode == 0
    rows = sql_json("SELECT count() AS n FROM gpu_trace.spans WHERE name = 'kept'")
    assert rows[0]["n"] == 1


def test_unknown_run_lists_recent_runs(tmp_path: Path) -> None:
    prog = script(tmp_path, "pass\n")
    assert gpu_trace("record", "--", sys.executable, str(prog)).returncode == 0
    out = gpu_trace("show", "no-such-run")
    assert out.returncode == 1
    assert "no-such-run" in out.stderr and last_run()["run"]["run_id"] in out.stderr


def test_sql_is_read_only() -> None:
    out = gpu_trace("sql", "DROP TABLE gpu_trace.spans")
    assert out.returncode != 0
    assert (
        sql_json(
            "SELECT count() AS n FROM system.tables WHERE database = 'gpu_trace' AND name = 'spans'"
        )[0]["n"]
        == 1
    )


@pytest.mark.parametrize("args", [["record"], ["record", "--"], ["export", "last", "-o", "x.txt"]])
def test_bad_arguments_are_clear(args: list[str]) -> None:
    out = gpu_trace(*args)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("gpu-trace: ")


def test_opentelemetry_spans_join_the_run(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        import gpu_trace

        provider = TracerProvider()
        tracer = provider.get_tracer("app.training")
        with gpu_trace.range("around"):
            with tracer.start_as_current_span("otel-outer"):
                with tracer.start_as_current_span("otel-inner", attributes={"batch": 7}):
                    pass
        provider.shutdown()
        """,
    )
    out = gpu_trace("record", "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    run = last_run()["run"]
    rows = sql_json(
        "SELECT name, lane, category, span_id, parent_span_id, attrs['batch'] AS batch, attrs['otel.trace_id'] AS tid"
        " FROM gpu_trace.spans WHERE run_id = {r:String} AND category = 'otel' ORDER BY start_ns",
        r=run["run_id"],
    )
    assert [r["name"] for r in rows] == ["otel-outer", "otel-inner"]
    outer, inner = rows
    assert outer["lane"] == "otel/app.training"
    assert inner["parent_span_id"] == outer["span_id"] and inner["batch"] == "7"
    assert outer["tid"] == run["trace_id"], "the program's OTel spans carry the run's trace id"
    around = sql_json(
        "SELECT start_ns, end_ns FROM gpu_trace.spans WHERE run_id = {r:String} AND name = 'around'",
        r=run["run_id"],
    )[0]
    times = sql_json(
        "SELECT start_ns, end_ns FROM gpu_trace.spans WHERE run_id = {r:String} AND category = 'otel'",
        r=run["run_id"],
    )
    # same clock: the OTel spans lie inside the range around them (1 ms slack for the wall-clock mapping)
    assert all(
        around["start_ns"] - 1_000_000
        <= t["start_ns"]
        <= t["end_ns"]
        <= around["end_ns"] + 1_000_000
        for t in times
    )


def test_a_run_that_cannot_be_stored_exits_75_unless_the_program_failed(tmp_path: Path) -> None:
    """record that cannot store its run says NOT stored, keeps the spool, names the command that
    stores it later, and exits 75 (EX_TEMPFAIL); a program's own non-zero status wins. Before,
    a run that was not stored exited 0, as if it had been."""
    store = tmp_path / "store"
    for status, expected in ((0, 75), (3, 3)):
        # The program takes the store away: its directory becomes a file.
        prog = script(
            tmp_path,
            f"""
            import shutil, sys
            from pathlib import Path
            store = Path({str(store)!r})
            shutil.rmtree(store, ignore_errors=True)
            store.write_text("not a store any more")
            sys.exit({status})
            """,
            name=f"exit{status}.py",
        )
        run_dir = tmp_path / f"run{status}"
        out = gpu_trace("record", "--store", f"chdb://{store}", "--run-dir", str(run_dir),
                        "--", sys.executable, str(prog))  # fmt: skip
        assert out.returncode == expected, out.stderr
        line = out.stderr.splitlines()[-1]
        assert " NOT stored: " in line and f"gpu-trace ingest {run_dir}" in line, line
        assert list((run_dir / "spool").glob("*.arrow"))
        store.unlink()
    stored = gpu_trace("ingest", str(run_dir), "--store", f"chdb://{store}")
    assert stored.returncode == 0, stored.stderr
