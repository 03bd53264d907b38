"""`gpu-trace ui`: serves the dashboard on 127.0.0.1, read-only, and stops on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from gpu_trace.query import reads

pytest.importorskip("dash")


def test_ui_serves_on_loopback_and_stops_on_sigint(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu_trace", "ui", "--store", f"chdb://{tmp_path / 's'}",
         "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "dashboard on http://127.0.0.1:" in line, line
        url = line.split("dashboard on ")[1].split()[0]
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert "<title>gpu-trace</title>" in page
        layout = urllib.request.urlopen(url.rstrip("/") + "/_dash-layout", timeout=30).read()
        assert b"panel-timeline" in layout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == 0


def test_ui_on_a_busy_port_is_a_usage_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "gpu_trace", "ui", "--store", f"chdb://{tmp_path / 's'}",
             "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )  # fmt: skip


def _post_callback(url: str, output: str, values: dict[str, object], changed: str) -> dict:
    """POST one of the page's callbacks as Dash's renderer does (its inputs and state from
    ``/_dash-dependencies``, values by ``id.property``); what it updated ({} for nothing)."""
    deps = json.loads(urllib.request.urlopen(url + "/_dash-dependencies", timeout=60).read())
    (dep,) = [d for d in deps if output in d["output"]]

    def props(items: list[dict]) -> list[dict]:
        return [{**i, "value": values.get(f"{i['id']}.{i['property']}")} for i in items]

    outputs = [dict(zip(("id", "property"), o.rsplit(".", 1)))
               for o in dep["output"].strip(".").split("...")]  # fmt: skip
    body = {"output": dep["output"], "outputs": outputs, "inputs": props(dep["inputs"]),
            "state": props(dep["state"]), "changedPropIds": [changed]}  # fmt: skip
    request = urllib.request.Request(
        url + "/_dash-update-component", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read() or b"{}").get("response", {}) if r.status == 200 else {}


def test_an_open_dashboard_leaves_the_store_to_every_command(tmp_path: Path) -> None:
    """The dashboard stays open on the embedded store while record stores runs and ls, show,
    sql, export, import and rm work; its open page's run list (the periodic refresh) gets the new
    runs without a restart. Before, chDB's one-process lock kept the store to the dashboard:
    record waited 10 s and said NOT stored, the others failed."""
    prog = tmp_path / "tiny.py"
    prog.write_text("import gpu_trace\nwith gpu_trace.range('while-the-ui-runs'):\n    pass\n")
    ui = subprocess.Popen(
        [sys.executable, "-m", "gpu_trace", "ui", "--port", "0"],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        assert ui.stderr is not None
        line = ui.stderr.readline()
        url = line.split("dashboard on ")[1].split()[0].rstrip("/")
        assert b"panel-timeline" in urllib.request.urlopen(url + "/_dash-layout", timeout=60).read()
        page = {"runs-refresh.n_intervals": 1}
        shown = _post_callback(url, "runs-table.children", page, "runs-refresh.n_intervals")
        assert shown["run"]["options"] == []  # no runs yet, and the ui holds the store now

        recorded = _cli("record", "--", sys.executable, str(prog))
        assert recorded.returncode == 0, recorded.stderr
        assert "stored in chdb://" in recorded.stderr and "NOT stored" not in recorded.stderr
        run_id = json.loads(_cli("show", "last", "--json").stdout)["run"]["run_id"]
        listed = _cli("ls")
        assert listed.returncode == 0 and run_id in listed.stdout, listed.stderr
        queried = _cli("sql", "--json", "SELECT count() AS n FROM spans WHERE name = {n:String}",
                       "-p", "n=while-the-ui-runs")  # fmt: skip
        assert queried.returncode == 0 and json.loads(queried.stdout)["n"] == 1, queried.stderr
        out = tmp_path / "last.json"
        exported = _cli("export", "last", "-o", str(out))
        assert exported.returncode == 0, exported.stderr
        assert "while-the-ui-runs" in out.read_text()
        data = Path(__file__).resolve().parents[1] / "data" / "kineto-h100-lm-5steps.json.gz"
        imported = _cli("import", str(data), "--name", "imported-while-the-ui-runs")
        assert imported.returncode == 0, imported.stderr
        import_id = json.loads(_cli("show", "last", "--json").stdout)["run"]["run_id"]
        assert import_id != run_id

        # The open page's next tick lists both runs (the same page: no reload, no restart).
        stamp = shown["runs-stamp"]["data"]
        deadline = time.monotonic() + 60
        while True:
            page = {"runs-refresh.n_intervals": page["runs-refresh.n_intervals"] + 1,
                    "runs-stamp.data": stamp}  # fmt: skip
            got = _post_callback(url, "runs-table.children", page, "runs-refresh.n_intervals")
            ids = {o["value"] for o in got.get("run", {}).get("options", [])}
            if {run_id, import_id} <= ids or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {run_id, import_id} <= ids, got
        # ... and stays quiet when nothing changed.
        page = {"runs-refresh.n_intervals": page["runs-refresh.n_intervals"] + 1,
                "runs-stamp.data": got["runs-stamp"]["data"]}  # fmt: skip
        assert _post_callback(url, "runs-table.children", page, "runs-refresh.n_intervals") == {}
        # The new run's timeline is drawn by the ui that was open before it was recorded.
        cookie = "gpu_trace_view=" + urllib.parse.quote(
            json.dumps({"search": f"?run={run_id}", "width": 1500})
        )
        request = urllib.request.Request(url + "/_dash-layout", headers={"Cookie": cookie})
        layout = urllib.request.urlopen(request, timeout=120).read().decode()
        assert run_id in layout

        removed = _cli("rm", import_id)
        assert removed.returncode == 0, removed.stderr
        page = {"runs-refresh.n_intervals": page["runs-refresh.n_intervals"] + 1,
                "runs-stamp.data": got["runs-stamp"]["data"]}  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            got = _post_callback(url, "runs-table.children", page, "runs-refresh.n_intervals")
            ids = {o["value"] for o in got.get("run", {}).get("options", [])}
            if ids == {run_id} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ids == {run_id}, got
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=60)
        assert ui.stderr is not None
        ui.stderr.close()
    assert ui.returncode == 0


def test_the_dashboard_reopens_a_store_it_gave_up_only_when_runs_changed(tmp_path: Path) -> None:
    """The dashboard's store gives an embedded store up to a command that waits for it, and its
    run list's check opens it again only once a run was stored: each chDB engine start costs the
    process memory that chDB keeps (about 2.5 MiB here), so `ls` and the like must not."""
    from gpu_trace.dashboard.readonly_store import ReadOnlyStore

    dsn = f"chdb://{tmp_path / 'store'}"
    source = ReadOnlyStore(dsn, enforce_readonly=True, lock_timeout_s=60)
    try:
        empty = source.runs_stamp()
        assert (source.opens, source.yields) == (1, 0)
        listed = _cli("ls", "--store", dsn)
        assert listed.returncode == 0, listed.stderr
        assert source.yields == 1  # given up to ls, which could not have run otherwise
        assert source.runs_stamp(timeout_s=0) == empty and source.opens == 1  # not reopened
        stored = subprocess.run(
            [sys.executable, "-c",
             "from gpu_trace.store.client import Store\n"
             "from gpu_trace.tracer.run import RunInfo\n"
             f"with Store({dsn!r}) as s:\n"
             "    s.upsert_run(RunInfo(run_id='new', trace_id='0' * 32, started_ns=0))\n"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert stored.returncode == 0, stored.stderr
        changed = source.runs_stamp(timeout_s=30)
        assert changed != empty and source.opens == 2
        assert [r["run_id"] for r in reads.runs(source)] == ["new"]
        assert source.runs_stamp(timeout_s=0) == changed and source.opens == 2
    finally:
        source.close()
