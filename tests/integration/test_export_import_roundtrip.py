"""`gpu-trace export` then `gpu-trace import` of our own file gives the run back: a real recording
(steps, nested ranges, NVTX domains, PyTorch modules, a second thread, marks, counters with
devices and labels, host samples) into a temporary store, exported, imported, and compared with
the original row by row. The export writes nanoseconds exactly (three decimals of a
microsecond), so nothing is allowed to differ but what an import is: a new run id, its command,
the attributes that say where it came from."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_trace.query import reads
from gpu_trace.store.client import Store
from tests.integration.test_record import gpu_trace, script

PROGRAM = """
    import threading
    import gpu_trace, nvtx
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))

    def worker():
        with gpu_trace.range("load", shard="3"):
            with gpu_trace.range("decode"):
                pass

    for step in range(3):
        gpu_trace.step(step)
        with gpu_trace.range("forward", batch=step):
            with gpu_trace.range("inner", span_id="mine", depth="deep", **{"attr.x": "y"}):
                gpu_trace.mark("here", k=step)
            model(torch.randn(2, 4))
        with nvtx.annotate("backward", domain="model"):
            pass
        t = threading.Thread(target=worker, name="loader")
        t.start()
        t.join()
        gpu_trace.counter("loss", 1 / (step + 3))
        gpu_trace.counter("mem", 1e9 + step / 7, device="gpu0", pool="cached")
    gpu_trace.counter("delta", -0.0)
    gpu_trace.counter("lr", 1e-300)
"""

#: What an import adds to the run's attributes (docs/import.md).
SOURCE_ATTRS = {"source", "source_file", "source_run_id", "source_command", "import_sha256"}


def rows(store: Store, table: str, run_id: str) -> list[tuple]:
    """Every row of ``run_id`` in ``table``, less ``run_id`` (and threads' ``updated_ns``),
    sorted: the two runs' rows compare as multisets."""
    final = " FINAL" if table == "threads" else ""
    result = store.query(
        f"SELECT * FROM __db__.{table}{final} WHERE run_id = {{run_id:String}}",
        {"run_id": run_id},
    )
    drop = {"run_id", "updated_ns"}
    keep = [i for i, c in enumerate(result.column_names) if c not in drop]
    out = []
    for row in result.result_rows:
        out.append(
            tuple(sorted(v.items()) if isinstance(v, dict) else v for v in (row[i] for i in keep))
        )
    return sorted(out, key=repr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path, list[dict]]:
    """The recorded run's id, the imported run's id, the folder of their store, and what
    `gpu-trace show --json` says of each (asked before this process opens the store: chDB lets
    one process at a time have a directory)."""
    pytest.importorskip("torch")
    pytest.importorskip("nvtx")
    tmp = tmp_path_factory.mktemp("roundtrip")
    env = {"GPU_TRACE_HOME": str(tmp / "home"), "GPU_TRACE_STORE": f"chdb://{tmp / 'store'}"}
    prog = script(tmp, PROGRAM)
    out = gpu_trace("record", "--no-nvml", "--", sys.executable, str(prog), env=env)
    assert out.returncode == 0, out.stderr
    recorded = re.search(r"run (\S+): ", out.stderr)
    assert recorded, out.stderr
    path = tmp / "trace.json.gz"
    out = gpu_trace("export", recorded.group(1), "-o", str(path), env=env)
    assert out.returncode == 0, out.stderr
    out = gpu_trace("import", str(path), env=env)
    assert out.returncode == 0, out.stderr
    imported = re.match(r"run (\S+): ", out.stdout)
    assert imported, out.stdout
    shown = []
    for run_id in (recorded.group(1), imported.group(1)):
        out = gpu_trace("show", run_id, "--json", env=env)
        assert out.returncode == 0, out.stderr
        shown.append(json.loads(out.stdout)["summary"])
    return recorded.group(1), imported.group(1), tmp, shown


Runs = tuple[str, str, Path, list[dict]]


@pytest.fixture(scope="module")
def store(runs: Runs) -> Iterator[Store]:
    with Store(f"chdb://{runs[2] / 'store'}") as s:
        yield s


def test_counters_come_back_row_by_row(store: Store, runs: Runs) -> None:
    original, imported, *_ = runs
    before = rows(store, "counters", original)
    # host, source, device, metric, ts_ns, value, labels: exact (the value's shortest text, the
    # time's nanoseconds); before, an import left out every counter event.
    assert rows(store, "counters", imported) == before
    by_metric = {r[3]: r for r in before}
    assert {"loss", "mem", "delta", "lr"} <= by_metric.keys()
    assert by_metric["mem"][2] == "gpu0" and dict(by_metric["mem"][6]) == {"pool": "cached"}
    assert by_metric["loss"][1] == "user" and by_metric["loss"][0]  # source and host
    assert str(by_metric["delta"][5]) == "-0.0" and by_metric["lr"][5] == 1e-300


def test_spans_come_back_with_their_ids_threads_lanes_and_nesting(store: Store, runs: Runs) -> None:
    original, imported, *_ = runs
    before = rows(store, "spans", original)
    after = rows(store, "spans", imported)
    # trace_id, span_id, parent_span_id, host, pid, tid, lane, category, name, start_ns, end_ns,
    # depth, attrs: all as recorded. Before, lanes became torch/annotations, tids synthetic, the
    # host empty, span ids renumbered and the exporter's own args attributes.
    assert after == before
    lanes = {r[6] for r in before}
    assert {"steps", "nvtx/gpu_trace", "nvtx/model"} <= lanes and any("torch" in x for x in lanes)
    assert len({r[5] for r in before}) >= 2  # the loader thread's spans keep their tid
    assert max(r[11] for r in before) >= 1  # nested: depths and parents
    attrs = {r[8]: dict(r[12]) for r in before}
    assert attrs["inner"] == {"span_id": "mine", "depth": "deep", "attr.x": "y"}
    assert {r[7] for r in before} >= {"step", "nvtx", "mark", "module"}


def test_the_run_keeps_its_host_times_and_threads(store: Store, runs: Runs) -> None:
    original, imported, *_ = runs
    assert rows(store, "threads", imported) == rows(store, "threads", original)
    before, after = (reads.run(store, r) for r in (original, imported))
    for key in ("trace_id", "started_ns", "ended_ns", "started_wall_ns", "hosts", "status"):
        assert after[key] == before[key], key
    assert before["hosts"] and after["command"] == "import trace.json.gz"
    attrs_before, attrs_after = dict(before["attrs"]), dict(after["attrs"])
    assert {k: v for k, v in attrs_after.items() if k not in SOURCE_ATTRS} == attrs_before
    assert attrs_after["source"] == "gpu-trace" and attrs_after["source_run_id"] == original
    assert attrs_after["source_command"] == before["command"]


def test_show_reads_the_same_run(runs: Runs) -> None:
    before, after = runs[3]
    assert (before.pop("run_id"), after.pop("run_id")) == runs[:2]
    assert after == before  # steps, lanes, top ranges, counters
