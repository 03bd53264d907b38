"""A program's own ``torch.profiler`` under `gpu-trace record`, at every level and op source.

The program profiles itself with ``with_stack=True``, ``profile_memory=True`` and
``record_shapes=True``, while gpu-trace records it, then reads its profile every way PyTorch
offers (``key_averages`` grouped by stack, ``table``, ``export_chrome_trace``). What used to
happen: ``key_averages()`` failed with ``UnicodeDecodeError`` and the profile showed the
recorder's flusher thread. PyTorch's Python tracer traces every Python thread and keeps pointers
to the names of the code objects it sees; the flusher, traced, imported pandas at its first flush
(pyarrow asks for it in ``to_numpy``), about 350 module bodies that are freed once run, and
their names were garbage by the time the profile was read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.test_record import gpu_trace, last_run, script, sql_json

PROGRAM = """
    import json, os, sys, threading
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)

    def step():
        with record_function("my_step"):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()

    if os.environ.get("WARM_UP"):
        # PyTorch imports torch.profiler._cupti_monitor at the first record_function: a module
        # body run inside the profile, which its own tracer can mis-name (plain too). gpu-trace
        # imports it when it patches; with --torch off, nothing of ours runs, so warm up here.
        step()
    step()  # recorded before the profile
    with profile(
        activities=[ProfilerActivity.CPU],
        with_stack=True,
        profile_memory=True,
        record_shapes=True,
    ) as prof:
        for _ in range(40):  # several flush intervals (GPU_TRACE_FLUSH_INTERVAL below)
            step()
    step()  # recorded after it
    averages = prof.key_averages(group_by_stack_n=5)
    table = averages.table(sort_by="self_cpu_time_total", row_limit=-1)
    prof.key_averages().table(row_limit=5)
    prof.export_chrome_trace(sys.argv[1])
    events = json.load(open(sys.argv[1]))["traceEvents"]
    ours = sorted(
        {m.__file__ for n, m in list(sys.modules.items())
         if n.startswith("gpu_trace") and getattr(m, "__file__", None)}
    )
    frames = [e for e in events if e.get("cat") == "python_function"]
    main = threading.main_thread().native_id
    print(json.dumps({
        "ops": sorted({e["name"] for e in events if e.get("cat") in ("cpu_op", "user_annotation")}),
        "memory": sum(1 for e in events if e.get("cat") == "cpu_instant_event"),
        "table": "my_step" in table,
        "frames": len(frames),
        "other_threads": sorted({e["name"] for e in frames if e.get("tid") not in (main, os.getpid())}),
        "ours": sorted({e["name"] for e in frames if any(f in e["name"] for f in ours)}),
    }))
"""

#: The flusher's work, which never shows in the program's profile (at module and op level the
#: hooks that make the ranges run on the program's thread, in Python, and show as any library's
#: code does: docs/frameworks.md).
FLUSHER = (
    "): flush",
    "): _flush",
    "): drain",
    "): _table",
    "): _run_step",
    "spool.py(",
    "columns.py(",
)


@pytest.mark.parametrize(
    "level, source",
    [("off", None), ("module", None), ("op", "native"), ("op", "kineto")],
)
def test_the_programs_profiler_works_beside_ours(
    tmp_path: Path, level: str, source: str | None
) -> None:
    prog = script(tmp_path, PROGRAM)
    # many flushes during the profile where ours record (off: nothing to flush, none runs long)
    env = {"WARM_UP": "1"} if level == "off" else {"GPU_TRACE_FLUSH_INTERVAL": "0.05"}
    if source is not None:
        env["GPU_TRACE_TORCH_OPS"] = source
    trace = tmp_path / "trace.json"
    out = gpu_trace(
        "record", "--torch", level, "--", sys.executable, str(prog), str(trace), env=env
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "disableProfiler" not in out.stderr, out.stderr
    got = json.loads(out.stdout)
    assert {"aten::addmm", "my_step", "Optimizer.step#SGD.step"} <= set(got["ops"])
    assert got["memory"] > 0 and got["table"] and got["frames"] > 0
    # the flusher (the only other thread of ours) is not in the program's profile
    assert got["other_threads"] == []
    if level == "off":
        assert got["ours"] == []  # nothing of ours runs on the program's thread
    else:
        assert [f for f in got["ours"] if any(w in f for w in FLUSHER)] == []
    if level == "op":
        # ours: the steps before and after the program's profile (with the kineto sessions, not
        # those inside it: PyTorch runs one profiler session at a time, and it is the program's)
        run_id = last_run()["run"]["run_id"]
        rows = sql_json(
            "SELECT count() AS n FROM gpu_trace.spans WHERE run_id = {r:String}"
            " AND name = 'aten::addmm'",
            r=run_id,
        )
        steps = 42 if source == "native" else 2  # the kineto sessions: the two outside
        assert int(rows[0]["n"]) == 2 * steps  # two Linear layers a step


def test_the_flusher_imports_nothing_into_the_program(tmp_path: Path) -> None:
    """The spool's checksums and the op spans' columns are made from buffers: pyarrow's
    ``to_numpy`` and ``pa.array`` ask whether pandas is installed and import it, which the
    flusher did at its first flush, in the middle of the program (about 350 modules)."""
    pytest.importorskip("pandas")
    prog = script(
        tmp_path,
        """
        import sys
        import torch
        from torch import nn
        import gpu_trace
        from gpu_trace.tracer import recorder

        before = set(sys.modules)
        model = nn.Linear(4, 4)
        for _ in range(3):
            with gpu_trace.range("step", attrs="yes"):
                model(torch.randn(2, 4)).sum().backward()
        gpu_trace.counter("loss", 1.0)
        recorder.active.flush()
        print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "pandas"))
        """,
    )
    out = gpu_trace(
        "record",
        "--torch",
        "op",
        "--",
        sys.executable,
        str(prog),
        env={"GPU_TRACE_TORCH_OPS": "native"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    names = {
        r["name"]
        for r in sql_json(
            "SELECT DISTINCT name FROM gpu_trace.spans WHERE run_id = {r:String}",
            r=last_run()["run"]["run_id"],
        )
    }
    assert {"step", "Linear", "aten::linear"} <= names
