"""`gpu-trace import` of the real H100 PyTorch profiler trace into a real chDB store, and what
works on the imported run: show (top kernels), sql, export in the Kineto dialect (HTA gives the
original's analyses), the dashboard's reads. A run appears whole or not at all."""

from __future__ import annotations

import functools
import gzip
import json
import shutil
from collections import Counter, defaultdict
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from gpu_trace.cli import main
from gpu_trace.query import reads
from gpu_trace.query.gpu import gpu_summary
from gpu_trace.store.client import Store, StoreError
from gpu_trace.store.importer import import_trace

DATA = Path(__file__).resolve().parents[1] / "data"
FULL = DATA / "kineto-h100-lm.json.gz"
SLICE = DATA / "kineto-h100-lm-5steps.json.gz"  # its first 5 steps (make_kineto_slice.py)

# HTA 0.5 calls pandas APIs that pandas 3 deprecates; those warnings are HTA's, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def events(path: Path) -> list[dict]:
    """The trace's events, floats as Decimal (exact, as the text says)."""
    return _events(path)


@functools.cache
def _events(path: Path) -> list[dict]:
    # Decimal's own parser: exact, and independent of the importer's (text, then to_ns).
    with gzip.open(path, "rt") as f:
        return json.load(f, parse_float=Decimal)["traceEvents"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with Store(f"chdb://{tmp_path_factory.mktemp('import') / 'store'}") as s:
        yield s


@pytest.fixture(scope="module")
def full_run(store: Store) -> str:
    return import_trace(store, FULL).run_id


@pytest.fixture(scope="module")
def slice_run(store: Store) -> str:
    return import_trace(store, SLICE).run_id


def test_every_event_of_the_original_is_a_span(store: Store, full_run: str) -> None:
    original = Counter(e.get("cat") for e in events(FULL) if e.get("ph") == "X")
    assert original["cpu_op"] == 218_520 and original["kernel"] == 26_520
    stored = dict(
        store.query(
            "SELECT category, count() FROM __db__.spans WHERE run_id = {r:String} GROUP BY category",
            {"r": full_run},
        ).result_rows
    )
    assert stored == {
        "op": original["cpu_op"],
        "kernel": original["kernel"],
        "memset": original["gpu_memset"],
        "memcpy": original["gpu_memcpy"],
        "cuda_api": original["cuda_runtime"] + original["cuda_driver"],  # 37,027 + 1,860
        "nvtx": original["user_annotation"] + original["gpu_user_annotation"],
    }
    apis = dict(
        store.query(
            "SELECT attrs['api'], count() FROM __db__.spans WHERE run_id = {r:String}"
            " AND category = 'cuda_api' GROUP BY 1",
            {"r": full_run},
        ).result_rows
    )
    assert apis == {"runtime": 37_027, "driver": 1_860}
    run = reads.run(store, full_run)
    assert run["status"] == "finished" and run["trace_id"] == "25a8c11b34694816a5defc448fc21b4f"
    assert run["attrs"]["kineto.cuda_runtime_version"] == "13000"
    # Wall-clock time from baseTimeNanoseconds: the trace was taken on 2026-11-24.
    first_ts = min(e["ts"] for e in events(FULL) if e.get("cat") == "cpu_op")
    assert run["started_wall_ns"] == 1_790_857_026_000_000_000 + int(first_ts * 1000)


def test_show_top_kernel_equals_the_originals(
    store: Store, full_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    per_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in events(FULL):
        if e.get("cat") == "kernel":
            per_name[e["name"]][0] += 1
            per_name[e["name"]][1] += int(e["dur"] * 1000)
    name, (count, total) = max(per_name.items(), key=lambda kv: kv[1][1])
    (gpu0,) = gpu_summary(store, full_run, top=3)["devices"]
    top = gpu0["top"][0]
    assert (top["name"], top["count"], top["total_ns"]) == (name, count, total)
    assert gpu0["kernels"] == 26_520 and gpu0["kernel_ns"] == sum(t for _, t in per_name.values())
    assert 0 < gpu0["busy_ns"] < gpu0["window_ns"] and gpu0["work"] == 26_520 + 2_160 + 1_080

    assert main(["show", full_run, "--store", store.dsn, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "gpu0: 26,520 kernels" in out and "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n" in out


def test_times_are_exact_and_every_launch_is_linked(store: Store, slice_run: str) -> None:
    original = [e for e in events(SLICE) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    (starts, ends, n), = store.query(
        "SELECT sum(toInt128(start_ns)), sum(toInt128(end_ns)), count() FROM __db__.spans WHERE run_id = {r:String}"
        " AND category IN ('kernel', 'memcpy', 'memset')",
        {"r": slice_run},
    ).result_rows  # fmt: skip
    assert n == len(original)
    assert starts == sum(int(e["ts"] * 1000) for e in original)
    assert ends == sum(int((e["ts"] + e["dur"]) * 1000) for e in original)
    # Each kernel, copy and memset is the child of the CUDA call with its correlation.
    (linked, unlinked), = store.query(
        """
        SELECT countIf(a.category = 'cuda_api' AND a.attrs['correlation'] = d.attrs['correlation']),
               countIf(a.span_id = 0)
        FROM __db__.spans AS d
        LEFT JOIN (SELECT span_id, category, attrs FROM __db__.spans WHERE run_id = {r:String})
            AS a ON a.span_id = d.parent_span_id
        WHERE d.run_id = {r:String} AND d.category IN ('kernel', 'memcpy', 'memset')
        """,
        {"r": slice_run},
    ).result_rows  # fmt: skip
    assert (linked, unlinked) == (len(original), 0)


def test_a_second_import_is_refused_with_the_run(
    store: Store, slice_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(reads.runs(store, limit=100))
    assert main(["import", str(SLICE), "--store", store.dsn]) == 0
    assert f"already imported as run {slice_run}" in capsys.readouterr().out
    assert len(reads.runs(store, limit=100)) == before


def test_sql_reads_the_imported_run(
    store: Store, slice_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    query = f"SELECT count() FROM spans WHERE run_id = '{slice_run}' AND category = 'kernel'"
    assert main(["sql", query, "--store", store.dsn]) == 0
    kernels = sum(1 for e in events(SLICE) if e.get("cat") == "kernel")
    assert str(kernels) in capsys.readouterr().out


def hta(trace_dir: Path) -> object:
    from hta.trace_analysis import TraceAnalysis

    return TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)


def test_hta_on_the_export_gives_the_originals_analyses(
    store: Store,
    slice_run: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("hta.trace_analysis")
    # HTA rounds each event inward to whole microseconds by default, which moves a 1 us memset
    # by up to 100% depending on where the file's time base puts it: compared with nanoseconds.
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    original, exported = tmp_path / "original", tmp_path / "exported"
    original.mkdir()
    exported.mkdir()
    shutil.copy(SLICE, original / "rank-0.json.gz")
    out = exported / "rank-0.json.gz"
    assert main(["export", slice_run, "-o", str(out), "--store", store.dsn]) == 0
    capsys.readouterr()
    with gzip.open(out, "rt") as f:
        trace = json.load(f)
    assert trace["deviceProperties"][0]["name"] == "NVIDIA H100 80GB HBM3"
    cats = Counter(e.get("cat") for e in trace["traceEvents"])
    source = Counter(e.get("cat") for e in events(SLICE))
    for cat in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cpu_op"):
        assert cats[cat] == source[cat], cat
    assert cats["ac2g"] == 2 * (source["kernel"] + source["gpu_memcpy"] + source["gpu_memset"])
    assert cats["fwdbwd"] == source["fwdbwd"]  # forward op -> backward op, as the original

    a, b = hta(original), hta(exported)
    (types_a, kernels_a), (types_b, kernels_b) = (
        x.get_gpu_kernel_breakdown(visualize=False) for x in (a, b)
    )
    assert list(types_a["kernel_type"]) == list(types_b["kernel_type"])
    assert types_b["sum"].to_numpy() == pytest.approx(types_a["sum"].to_numpy(), rel=0.01)
    by_name_a = kernels_a.set_index("name")["sum (us)"]
    by_name_b = kernels_b.set_index("name")["sum (us)"]
    assert set(by_name_a.index) == set(by_name_b.index)
    assert by_name_b[by_name_a.index].to_numpy() == pytest.approx(by_name_a.to_numpy(), rel=0.01)

    temporal_a, temporal_b = (x.get_temporal_breakdown(visualize=False) for x in (a, b))
    for column in ("idle_time(us)", "compute_time(us)", "kernel_time(us)"):
        assert temporal_b[column].iloc[0] == pytest.approx(temporal_a[column].iloc[0], rel=0.01)
    idle_a, idle_b = (x.get_idle_time_breakdown(visualize=False)[0] for x in (a, b))
    assert list(idle_a["idle_category"]) == list(idle_b["idle_category"])
    assert idle_b["idle_time"].sum() == pytest.approx(idle_a["idle_time"].sum(), rel=0.01)
    launches_a, launches_b = (x.get_cuda_kernel_launch_stats(visualize=False)[0] for x in (a, b))
    assert sorted(launches_a["correlation"]) == sorted(launches_b["correlation"])
    assert launches_b["gpu_duration"].sum() == pytest.approx(
        launches_a["gpu_duration"].sum(), rel=0.01
    )


def test_the_export_imports_back_as_the_same_run(
    store: Store, slice_run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Our export of the imported trace (Kineto's dialect: device work on the GPU's tracks) reads
    back as the imported run, row for row: span ids, parents, pids, tids, lanes, depths,
    attributes (Kineto's numbers as their text), times to the nanosecond."""
    out = tmp_path / "again.json.gz"
    assert main(["export", slice_run, "-o", str(out), "--store", store.dsn]) == 0
    capsys.readouterr()
    again = import_trace(store, out).run_id

    def rows(run_id: str) -> list[tuple]:
        result = store.query(
            "SELECT * EXCEPT (run_id) FROM __db__.spans WHERE run_id = {run_id:String}",
            {"run_id": run_id},
        )
        return sorted(
            (tuple(sorted(v.items()) if isinstance(v, dict) else v for v in r)
             for r in result.result_rows),
            key=repr,
        )  # fmt: skip

    assert rows(again) == rows(slice_run)
    before, after = reads.run(store, slice_run), reads.run(store, again)
    for key in ("trace_id", "started_ns", "ended_ns", "started_wall_ns", "hosts", "status"):
        assert after[key] == before[key], key
    assert dict(after["attrs"])["source_run_id"] == slice_run


def test_the_dashboards_reads_find_the_device_lanes(store: Store, slice_run: str) -> None:
    pytest.importorskip("dash")
    from gpu_trace.dashboard import timeline
    from gpu_trace.dashboard.readonly_store import ReadOnlyStore

    source = ReadOnlyStore(store=store)
    lanes = {t.lane for t in timeline.tracks(source, slice_run)["tracks"]}
    assert {"gpu0/stream7", "cuda_api", "torch/ops"} <= lanes
    run = reads.run(store, slice_run)
    window = timeline.window(source, slice_run, run["started_ns"], run["ended_ns"])
    assert window.density_spans + len(window.bars) > 0


def test_bad_input_is_one_line_and_stores_nothing(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(reads.runs(store, limit=100))
    bad = tmp_path / "t.json.gz"
    bad.write_bytes(SLICE.read_bytes()[:100_000])
    assert main(["import", str(bad), "--store", store.dsn]) == 1
    err = capsys.readouterr().err
    assert err == "gpu-trace: import: t.json.gz: the gzip stream is truncated; nothing was stored\n"
    assert len(reads.runs(store, limit=100)) == before


def test_a_store_failure_leaves_no_part_of_the_run(
    store: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def refuse(info: object) -> None:
        raise StoreError("writing to runs failed: disk full")

    monkeypatch.setattr(store, "upsert_run", refuse)
    copy = tmp_path / "again.json.gz"  # another file: not refused as imported before
    copy.write_bytes(gzip.compress(gzip.decompress(SLICE.read_bytes()) + b" "))
    with pytest.raises(StoreError, match="disk full"):
        import_trace(store, copy)
    (orphans,) = store.query(
        "SELECT count() FROM __db__.spans WHERE run_id NOT IN (SELECT run_id FROM __db__.runs)"
    ).result_rows[0]
    (threads,) = store.query(
        "SELECT count() FROM __db__.threads WHERE run_id NOT IN (SELECT run_id FROM __db__.runs)"
    ).result_rows[0]
    assert (orphans, threads) == (0, 0)


def test_last_is_the_run_stored_last_not_the_newest_start(tmp_path: Path) -> None:
    """The documented import -> show last -> export last reads the imported run, though the trace
    (November 2026 on the H100) started before a run recorded first; before, ``last`` was the
    newest start, and show and export read the recorded run instead."""
    import json
    import os
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", "gpu_trace", *args], capture_output=True,
                             text=True, timeout=240, env=dict(os.environ))  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out

    prog = tmp_path / "newer.py"
    prog.write_text("import gpu_trace\nwith gpu_trace.range('recorded-first'):\n    pass\n")
    cli("record", "--keep-spool", "--", sys.executable, str(prog))
    recorded = json.loads(cli("show", "last", "--json").stdout)["run"]
    cli("import", str(SLICE))
    shown = json.loads(cli("show", "last", "--json").stdout)["run"]
    assert shown["run_id"] != recorded["run_id"] and shown["command"].startswith("import ")
    assert shown["started_wall_ns"] < recorded["started_wall_ns"]  # the older trace
    assert shown["stored_ns"] > recorded["stored_ns"]
    out = tmp_path / "last.json"
    cli("export", "last", "-o", str(out))
    exported = json.loads(out.read_text())
    assert any(e.get("cat") == "kernel" for e in exported["traceEvents"])
    assert not any(e.get("name") == "recorded-first" for e in exported["traceEvents"])
    # Python's view and the dashboard's default agree (in a process of their own: this one has
    # the module's store open, and chDB opens one directory per process).
    views = (
        "import gpu_trace\n"
        "from gpu_trace.dashboard.callbacks import first_view\n"
        "from gpu_trace.dashboard.readonly_store import ReadOnlyStore\n"
        "source = ReadOnlyStore()\n"
        "print(gpu_trace.run('last').id, first_view(source, '', 1500)[('run', 'value')])\n"
        "source.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", views], capture_output=True, text=True,
                         timeout=240, env=dict(os.environ))  # fmt: skip
    assert out.stdout.split() == [shown["run_id"]] * 2, out.stderr
    # Ingesting the recorded run again (its runs row written anew) does not make it last.
    cli(
        "ingest",
        "--keep-spool",
        str(Path(os.environ["GPU_TRACE_HOME"]) / "runs" / recorded["run_id"]),
    )
    again = json.loads(cli("show", recorded["run_id"], "--json").stdout)["run"]
    assert again["stored_ns"] == recorded["stored_ns"]
    assert json.loads(cli("show", "last", "--json").stdout)["run"]["run_id"] == shown["run_id"]


def test_import_tells_its_progress(
    store: Store, slice_run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `gpu-trace import` draws on a terminal (gpu_trace/_progress.py's PhaseProgress):
    each phase in order, the events converted counted up to all of them, the run as without."""
    from gpu_trace.store import trace_file

    monkeypatch.setattr(trace_file, "READ_CHUNK", 1 << 16)
    monkeypatch.setattr(trace_file, "EVENTS_CHUNK", 1 << 8)
    with gzip.open(SLICE, "rt") as f:
        data = json.load(f)
    data["note"] = "a copy"  # another file's bytes: imported as a run of its own
    copy = tmp_path / "copy.json.gz"
    copy.write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))
    told: list[tuple[str, int, int | None]] = []
    run_id = import_trace(store, copy, progress=lambda *a: told.append(a)).run_id
    phases = [phase.split()[0] for phase, _, _ in told]
    assert list(dict.fromkeys(phases)) == [
        "reading", "decompressing", "parsing", "converting", "storing"
    ]  # fmt: skip
    assert phases == sorted(
        phases, key=["reading", "decompressing", "parsing", "converting", "storing"].index
    )
    n = len(data["traceEvents"])
    converting = [(done, total) for phase, done, total in told if phase.startswith("converting")]
    assert converting == [(i, n) for i in range(0, n, 1 << 8)]
    reading = [(done, total) for phase, done, total in told if phase.startswith("reading")]
    assert reading[-1][0] == reading[-1][1]  # all of it, in MiB
    count = "SELECT count() FROM __db__.spans WHERE run_id = {r:String}"
    assert (
        store.query(count, {"r": run_id}).result_rows
        == store.query(count, {"r": slice_run}).result_rows
    )
