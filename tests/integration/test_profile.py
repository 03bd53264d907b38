"""``gpu_trace.profile()`` and reading runs back from Python, on a real chDB store.

A block is recorded in this process, closed and ingested when it ends (also when it raised), and
read back through ``Run``: the store's summary, spans and counters as DataFrames, read-only SQL,
the dashboard's timeline figure, a Chrome trace. The samplers run in a process of their own.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace import config
from gpu_trace.framework_patches import hooks
from gpu_trace.tracer.run import RunInfo
from tests.conftest import REPO

pytest.importorskip("pandas")


def quiet(**kwargs: object) -> gpu_trace.profiling.Profile:
    """A block without samplers and NVTX capture (most tests need neither; one test checks the
    samplers): a fresh GPU_TRACE_HOME would build the NVTX library first."""
    settings: dict[str, object] = {"nvml": False, "host": False, "nvtx": "off", **kwargs}
    return gpu_trace.profile(**settings)  # type: ignore[arg-type]


def work(steps: int = 3) -> None:
    for i in range(steps):
        gpu_trace.step(i)
        with gpu_trace.range("outer", i=i), gpu_trace.range("inner"):
            time.sleep(0.001)
        gpu_trace.counter("loss", 1.0 / (i + 1))


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> gpu_trace.Run:
    """One run the read-only tests share, in a store of its own (the Run keeps its DSN)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPU_TRACE_HOME", str(tmp_path_factory.mktemp("profile-home")))
        with quiet(name="basic") as run:
            work()
    return run


def test_a_block_is_stored_and_read_back(recorded_run: gpu_trace.Run) -> None:
    run = recorded_run
    row = run.row
    assert row.status == "finished" and row.command == "basic"
    assert row.attrs["started_by"] == "profile" and row.attrs["torch"] == "module"
    assert row.attrs["recorder_pid"] == str(os.getpid())
    summary = run.summary()
    top = summary.by_total.set_index("name")
    assert top.loc["outer", "count"] == 3 and top.loc["outer", "lane"] == "nvtx/gpu_trace"
    assert top.loc["inner", "self_ns"] == top.loc["inner", "total_ns"]
    assert top.loc["outer", "self_ns"] < top.loc["outer", "total_ns"], "inner is outer's child"
    assert list(summary.steps["name"]) == [f"ProfilerStep#{i}" for i in range(3)]
    assert set(summary.lanes["lane"]) == {"nvtx/gpu_trace", "steps"}
    loss = summary.counters.set_index("metric").loc["loss"]
    assert loss["count"] == 3 and loss["max"] == 1.0
    assert summary.forwarded.empty
    assert "outer" in repr(summary) and "outer" in summary._repr_html_()
    assert "finished" in repr(run) and "basic" in run._repr_html_()


def test_spans_and_counters_filter(recorded_run: gpu_trace.Run) -> None:
    run = recorded_run
    every = run.spans()
    assert len(every) == 9 and set(every["category"]) == {"nvtx", "step"}
    assert (every["start_ms"] >= 0).all() and (every["dur_ns"] >= 0).all()
    outer = run.spans(name="outer")
    assert list(outer["name"]) == ["outer"] * 3
    assert [a["i"] for a in outer["attrs"]] == ["0", "1", "2"]
    assert set(run.spans(lane="nvtx/*")["name"]) == {"outer", "inner"}
    assert set(run.spans(category="step")["lane"]) == {"steps"}
    assert run.spans(name="out?r", lane="steps").empty
    assert len(run.spans(limit=2)) == 2
    second = outer.iloc[1]
    window = run.spans(start=int(second["start_ns"]), end=int(second["end_ns"]))
    assert "ProfilerStep#1" in set(window["name"]) and "ProfilerStep#0" not in set(window["name"])
    loss = run.counters(name="user/loss")
    assert list(loss["value"]) == [1.0, 0.5, 1.0 / 3] and set(loss["series"]) == {"user/loss"}
    assert len(run.counters(name="loss")) == 3
    assert len(run.counters(end=int(loss["ts_ns"].iloc[1]))) == 1
    with pytest.raises(ValueError, match="integer ns"):
        run.spans(start=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty window"):
        run.counters(start=10, end=10)


def test_sql_reads_and_refuses_writes(recorded_run: gpu_trace.Run) -> None:
    run = recorded_run
    df = run.sql(
        "SELECT name, count() AS n FROM spans WHERE run_id = {run_id:String} AND lane = {lane:String}"
        " GROUP BY name ORDER BY name",
        lane="nvtx/gpu_trace",
    )
    assert df.to_dict("records") == [{"name": "inner", "n": 3}, {"name": "outer", "n": 3}]
    with pytest.raises(ValueError, match="read-only"):
        run.sql("INSERT INTO spans (name) VALUES ('x')")
    with pytest.raises(ValueError, match="read-only"):
        run.sql("SELECT * FROM file('/etc/passwd')")
    assert run.sql("SELECT count() AS n FROM spans WHERE run_id = {run_id:String}")["n"][0] == 9


def test_timeline_and_export(recorded_run: gpu_trace.Run, tmp_path: Path) -> None:
    run = recorded_run
    fig = run.timeline()
    bundle = fig.to_plotly_json()
    bars = [t for t in bundle["data"] if t["type"] == "bar"]
    assert bars and "meta" not in bundle["layout"]
    names = [t for t in bundle["data"] if t.get("mode") == "text"][0]["text"]
    assert "outer" in names, "bar names are a text trace (the dashboard's script is not there)"
    assert "user/loss" in json.dumps(bundle["layout"]["annotations"])
    with pytest.raises(ValueError, match="no counter nvml/x"):
        run.timeline(counters=["nvml/x"])
    path = run.export(tmp_path / "trace.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    assert {"outer", "inner", "ProfilerStep#2"} <= {e.get("name") for e in events}
    with pytest.raises(ValueError, match=r"\.json"):
        run.export(tmp_path / "trace.txt")


def test_runs_and_run_by_reference() -> None:
    with quiet(name="first") as first:
        gpu_trace.mark("m")
    with quiet(name="second") as second:
        gpu_trace.mark("m")
    listed = gpu_trace.runs()
    assert list(listed["run_id"]) == [second.id, first.id]
    assert list(listed["name"]) == ["second", "first"]
    assert gpu_trace.run("last").id == second.id
    assert gpu_trace.run(first.id).row.command == "first"
    assert gpu_trace.runs(search="first")["run_id"].tolist() == [first.id]
    with pytest.raises(LookupError, match=f"no run 'nope'.*{second.id}"):
        gpu_trace.run("nope")


def test_repeated_blocks_are_runs_of_their_own() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ids, modules = [], []
    for _ in range(2):
        with quiet() as run:
            model(torch.randn(2, 4)).sum().backward()
        ids.append(run.id)
        modules.append(run.spans(category="module"))
        assert not hooks.is_patched(), "patches go in with a block and out at its end"
    assert len(set(ids)) == 2
    for found in modules:
        assert {"Sequential", "Sequential.0", "Sequential.2"} <= set(found["name"])
        assert (found["name"] == "Sequential").sum() == 1, "each run holds only its own block"
    plain = model(torch.randn(2, 4))  # after the blocks nothing is patched (the leak check too)
    assert plain.shape == (2, 1)


def test_an_exception_in_the_block_is_stored_and_goes_on_unchanged() -> None:
    error = KeyError("boom")
    with pytest.raises(KeyError) as caught, quiet() as run:
        with gpu_trace.range("before"):
            pass
        raise error
    assert caught.value is error
    assert run.row.status == "failed" and run.row.attrs["reason"] == "KeyError: 'boom'"
    assert list(run.spans()["name"]) == ["before"]
    with pytest.raises(KeyboardInterrupt), quiet() as killed:
        raise KeyboardInterrupt
    assert killed.row.status == "killed"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_an_exception_without_text_still_closes_and_stores_the_run() -> None:
    with pytest.raises(Unprintable), quiet() as run:
        gpu_trace.mark("before")
        raise Unprintable
    assert run.row.status == "failed" and run.row.attrs["reason"] == "Unprintable"
    assert list(run.spans()["name"]) == ["before"]


def test_blocks_do_not_nest_nor_mix_with_start(tmp_path: Path) -> None:
    with quiet() as outer:
        with pytest.raises(ValueError, match="do not nest"), quiet():
            pass
        with pytest.raises(ValueError, match=f"profile\\(\\) is recording run {outer.id}"):
            gpu_trace.start(tmp_path / "other")
        with pytest.raises(ValueError, match="stops when its with block ends"):
            gpu_trace.stop()
        with pytest.raises(RuntimeError, match="still recording"):
            outer.spans()
        gpu_trace.mark("still recorded")
    assert list(outer.spans()["name"]) == ["still recorded"]
    gpu_trace.start(tmp_path / "manual")
    try:
        with pytest.raises(ValueError, match="already recording"), quiet():
            pass
    finally:
        gpu_trace.stop()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"torch": "layer"}, "GPU_TRACE_TORCH must be one of module, op, off"),
        ({"tf": "module"}, "GPU_TRACE_TF must be one of layer, op, off"),
        ({"nvtx": "always"}, "nvtx"),
        ({"nvml": -1}, "samples per second"),
        ({"host": "fast"}, "samples per second"),
        ({"name": 3}, "name"),
        ({"keep_spool": "yes"}, "keep_spool"),
        ({"store": "ftp://store.example:21"}, "chdb://, http:// or https://"),
        ({"store": "nowhere"}, "not a store DSN"),
    ],
)
def test_bad_arguments_are_refused_before_the_block(kwargs: dict, message: str) -> None:
    ran = []
    with pytest.raises(ValueError, match=message):
        with gpu_trace.profile(**kwargs):
            ran.append(1)
    assert not ran and not config.runs_dir().exists()


def test_a_bad_setting_is_refused_before_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_TRACE_FLUSH_INTERVAL", "abc")
    with pytest.raises(ValueError, match="GPU_TRACE_FLUSH_INTERVAL"):
        quiet()


def test_an_interrupt_while_the_block_starts_leaves_no_live_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C while the sampler process starts: a real SIGINT, from the process started in its
    # place, arrives while profile() waits for it.
    impatient = tmp_path / "impatient"
    impatient.write_text("#!/bin/sh\nkill -INT $PPID\nexec sleep 30\n")
    impatient.chmod(0o755)
    python = sys.executable
    monkeypatch.setattr(sys, "executable", str(impatient))
    with pytest.raises(KeyboardInterrupt), gpu_trace.profile(nvml=False, nvtx="off"):
        pytest.fail("the block ran")
    [run_dir] = config.runs_dir().iterdir()
    info = RunInfo.load(run_dir)
    assert info.status == "failed", "a run left 'running' by this live process never closes"
    assert info.attrs["reason"].startswith("could not start: KeyboardInterrupt")
    monkeypatch.setattr(sys, "executable", python)
    with quiet() as after:  # nothing is left recording
        gpu_trace.mark("after")
    assert list(after.spans()["name"]) == ["after"]


NVTX_IN_A_KERNEL = """
import gpu_trace, nvtx
if {before}:
    with nvtx.annotate("before any block"):
        pass
for _ in range(2):
    with gpu_trace.profile(nvml=False, host=False) as run:
        with nvtx.annotate("inside", domain="mine"):
            pass
    print(run.row.attrs["nvtx"], *run.spans()["lane"])
"""


@pytest.mark.parametrize(("before", "mode"), [(False, "native"), (True, "python")])
def test_nvtx_native_capture_needs_the_first_block_before_nvtx_is_used(
    before: bool, mode: str, python: str
) -> None:
    # A process of its own: NVTX reads its injection variable once per process.
    script = NVTX_IN_A_KERNEL.format(before=before)
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"{mode} nvtx/mine"] * 2
    assert ("NVTX was initialized in this process before recording started" in out.stderr) == before


def test_a_store_that_fails_at_the_end_keeps_the_spool(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with quiet(store=str(store)) as run:
        gpu_trace.mark("kept")
        shutil.rmtree(store, ignore_errors=True)
        store.write_text("not a directory any more")
    assert run.dir is not None and list((run.dir / "spool").glob("spans-*.arrow"))
    with pytest.raises(RuntimeError, match=f"NOT stored.*gpu-trace ingest {run.dir}"):
        run.spans()
    assert "NOT stored" in repr(run)


def test_the_spool_goes_once_the_store_holds_the_run() -> None:
    with quiet() as run:
        gpu_trace.mark("stored")
    assert run.dir is not None and not list((run.dir / "spool").glob("*.arrow"))
    assert (run.dir / "ingested.json").is_file() and list(run.spans()["name"]) == ["stored"]
    with quiet(keep_spool=True) as kept:
        gpu_trace.mark("kept")
    assert kept.dir is not None and list((kept.dir / "spool").glob("spans-*.arrow"))


def test_samplers_run_in_a_process_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_TRACE_NVML_REPLAY", str(REPO / "tests/data/nvml-synthetic-h100.jsonl"))
    me = os.getpid()
    with gpu_trace.profile(nvml=20, host=20) as run:
        assert run.dir is not None
        deadline = time.monotonic() + 60
        # Until the sampler has flushed samples of its own (it flushes every 2 s at most).
        while not [p for p in (run.dir / "spool").glob("counters-*") if f"-{me}-" not in p.name]:
            assert time.monotonic() < deadline, "the sampler process wrote nothing"
            time.sleep(0.1)
    counters = run.counters()
    assert {"nvml", "host"} <= set(counters["source"])
    row = run.row
    assert row.attrs["nvml_hz"] == "20" and row.attrs["host_hz"] == "20"
    # Sampled into the run by another process...
    stats = [json.loads(p.read_text()) for p in (run.dir / "stats").glob("*.json")]
    sampler = {f"pid{s['pid']}" for s in stats} - {f"pid{me}"}
    assert sampler, "the samples came from the sampler's process"
    # ...which is not counted as part of the program (it detached from it).
    per_process = set(counters[counters["metric"] == "process_rss_bytes"]["device"])
    assert f"pid{me}" in per_process and not per_process & sampler
