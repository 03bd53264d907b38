"""One job over two hosts (issue 28 item 3): each rank under its own `gpu-trace record --job`, one
on a second "host" (its own UTS namespace, so its own host name, and its own time namespace, so a
CLOCK_MONOTONIC 1,000,000 s ahead of this one's: what two machines' clocks are, boots apart), each
with its own GPU_TRACE_HOME; the two run directories ingested into one store make one run, on one
clock, the offset bounded by the job's own all-reduces.

Needs root and util-linux's unshare with time namespaces (Linux 5.6+); skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_record import gpu_trace, script

pytest.importorskip("torch.distributed")

AHEAD_S = 1_000_000  # the second host's monotonic clock, ahead of ours

RANK = """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1024)
    for _ in range(8):
        dist.all_reduce(t)
    dist.barrier()
    print("sum", int(t[0]))
    dist.destroy_process_group()
"""


def _namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--uts", "--time", "--monotonic", "5", "--fork", "true"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


two_hosts = pytest.mark.skipif(
    not _namespaces_work(), reason="needs root and unshare --uts --time (time namespaces)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _record(
    home: Path, prog: Path, rank: int, port: int, other_host: str | None, ingest: bool = False
):
    env = {
        **os.environ,
        "GPU_TRACE_HOME": str(home),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "GPU_TRACE_NVML_HZ": "0",
    }
    cmd = [sys.executable, "-m", "gpu_trace", "record", "--job", "two-hosts"]
    cmd += [] if ingest else ["--no-ingest"]
    cmd += ["--", sys.executable, str(prog)]
    if other_host is not None:  # the second host: its own name and a monotonic clock far ahead
        inner = f"hostname {other_host} && exec " + " ".join(f"'{c}'" for c in cmd)
        cmd = ["unshare", "--uts", "--time", "--monotonic", str(AHEAD_S), "--fork"]
        cmd += ["sh", "-c", inner]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _part_dir(home: Path) -> Path:
    (part,) = [d for d in (home / "runs").iterdir() if d.name.startswith("job-two-hosts.")]
    return part


def test_ranks_each_under_their_own_record_make_one_run(tmp_path: Path) -> None:
    # mpirun -n 2 gpu-trace record -- python train.py on one machine: each record ingests at its
    # end into the same store (they take turns at it), into the one run of the job.
    prog = script(tmp_path, RANK)
    port = _free_port()
    home = tmp_path / "home"
    procs = [_record(home, prog, rank, port, None, ingest=True) for rank in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        assert "sum 256" in out and "run job-two-hosts:" in err
    listed = gpu_trace("ls", "--json", env={"GPU_TRACE_HOME": str(home)})
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)
    assert run["run_id"] == "job-two-hosts" and run["attrs"]["job_parts"] == "2"
    assert run["hosts"] == [socket.gethostname()] and run["status"] == "finished"
    assert not any(k.startswith("clock.") for k in run["attrs"])  # one host: one clock
    shown = gpu_trace("show", "job-two-hosts", "--json", env={"GPU_TRACE_HOME": str(home)})
    ranks = json.loads(shown.stdout)["ranks"]
    assert [r["rank"] for r in ranks["ranks"]] == [0, 1]
    assert {c["op"]: c["count"] for c in ranks["collectives"]}["all_reduce"] == 8
    # Both parts' directories are the run's: rm takes them with it.
    assert len(list((home / "runs").glob("job-two-hosts.*"))) == 2
    removed = gpu_trace("rm", "job-two-hosts", env={"GPU_TRACE_HOME": str(home)})
    assert removed.returncode == 0, removed.stderr
    assert list((home / "runs").glob("job-two-hosts.*")) == []


@two_hosts
def test_two_hosts_land_in_one_run_on_one_clock(tmp_path: Path) -> None:
    prog = script(tmp_path, RANK)
    port = _free_port()
    procs = [
        _record(tmp_path / "home-a", prog, 0, port, None),
        _record(tmp_path / "home-b", prog, 1, port, "gpu-trace-host-b"),
    ]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        assert "sum 256" in out  # the program's own result and output, untouched
    store = {"GPU_TRACE_HOME": str(tmp_path / "store-home")}
    # The second host's part first: the run's clock is whichever part is stored first.
    for home in ("home-b", "home-a"):
        done = gpu_trace("ingest", str(_part_dir(tmp_path / home)), env=store)
        assert done.returncode == 0, done.stderr

    shown = gpu_trace("show", "job-two-hosts", "--json", env=store)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    run = data["run"]
    here = socket.gethostname()
    assert sorted(run["hosts"]) == sorted([here, "gpu-trace-host-b"])
    assert run["attrs"]["job_parts"] == "2" and run["status"] == "finished"
    assert run["attrs"]["clock_host"] == "gpu-trace-host-b"
    note = run["attrs"][f"clock.{here}"]
    assert "collectives bound it" in note, note  # the all-reduces linked the hosts

    ranks = data["ranks"]
    assert [r["rank"] for r in ranks["ranks"]] == [0, 1]
    assert {r["host"] for r in ranks["ranks"]} == {here, "gpu-trace-host-b"}

    # On one clock: every all-reduce's enters and ends overlap across the two hosts (no rank can
    # finish one before the other entered it), which 1,000,000 s apart they could not.
    rows = _sql(
        store,
        "SELECT attrs['seq'] AS seq, host, start_ns, end_ns FROM gpu_trace.spans "
        "WHERE run_id = 'job-two-hosts' AND lane = 'torch/collectives' AND name = 'all_reduce' "
        "ORDER BY seq, host",
    )
    by_seq: dict[str, list[dict]] = {}
    for r in rows:
        by_seq.setdefault(r["seq"], []).append(r)
    assert len(by_seq) == 8 and all(len(v) == 2 for v in by_seq.values())
    for pair in by_seq.values():
        assert max(int(r["start_ns"]) for r in pair) <= min(int(r["end_ns"]) for r in pair)

    # The offset found is the namespace's, to within the bound it states.
    (sample,) = _sql(
        store,
        "SELECT any(offset_ns) AS offset, any(rtt_ns) AS rtt FROM gpu_trace.clock_sync "
        "WHERE run_id = 'job-two-hosts' AND peer = {here:String}",
        here=here,
    )
    offset, bound = int(sample["offset"]), int(sample["rtt"]) // 2
    # peer (this host) minus the run's clock (host b, ahead): -1,000,000 s, within the bound
    # and the anchors' read of the wall clock both namespaces share.
    assert abs(offset + AHEAD_S * 1_000_000_000) <= bound + 5_000_000


def _sql(env: dict[str, str], query: str, **params: str) -> list[dict]:
    args = ["sql", "--json", query]
    for k, v in params.items():
        args += ["-p", f"{k}={v}"]
    out = gpu_trace(*args, env=env)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
