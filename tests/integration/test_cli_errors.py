"""The CLI's bad cases, each one clear line (the real `gpu-trace` entry point, the real chDB store):
stored names that would drive a terminal, an export to a missing directory, a port out of range,
a DSN that is a bare word, an unreachable server, processes sharing an embedded store, and ingest
problems printed once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_trace import _format

ATTACK = "\x1b]0;PWNED\x07\x1b[2J"


def cli(*args: str, home: Path, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_HOME": str(home), **env},
        cwd=cwd,
        timeout=240,
    )


def one_line(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("gpu-trace: ") and "Traceback" not in out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home whose store holds one run with a range (and attribute) named to drive a terminal."""
    home = tmp_path_factory.mktemp("cli-home")
    prog = home / "prog.py"
    prog.write_text(
        textwrap.dedent(
            f"""
            import gpu_trace
            with gpu_trace.range({ATTACK!r}, note={ATTACK!r}):
                pass
            """
        )
    )
    out = cli("record", "--", sys.executable, str(prog), home=home)
    assert out.returncode == 0, out.stderr
    yield home


def test_stored_names_cannot_drive_the_terminal(recorded: Path) -> None:
    shown = cli("show", "last", home=recorded)
    assert shown.returncode == 0, shown.stderr
    assert "\\x1b]0;PWNED\\x07\\x1b[2J" in shown.stdout  # shown, escaped
    queried = cli("sql", "SELECT name, attrs['note'] AS note FROM spans", home=recorded)
    assert queried.returncode == 0, queried.stderr
    assert "\\x1b]0;PWNED" in queried.stdout
    missing = cli("show", ATTACK, home=recorded)
    assert missing.returncode == 1
    for out in (shown, queried, missing, cli("ls", home=recorded)):
        assert "\x1b" not in out.stdout + out.stderr and "\x07" not in out.stdout + out.stderr


def test_ls_says_a_search_matched_nothing_and_refuses_a_limit_below_one(recorded: Path) -> None:
    out = cli("ls", "--search", "no-such-run", home=recorded)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no run's id or command contains 'no-such-run'"
    for limit in ("0", "-1"):
        refused = cli("ls", "--limit", limit, home=recorded)
        assert refused.returncode == 2
        assert one_line(refused) == f"gpu-trace: --limit must be 1 or more, got {limit}"
    assert "no runs yet" not in cli("ls", home=recorded).stdout  # one is stored


def test_a_ranks_export_says_its_rank_and_world_size(recorded: Path, tmp_path: Path) -> None:
    """docs/export.md's `export RUN --rank 3 -o traces/rank-3.json` was a traceback (the world
    size stayed 1); Run.export the same."""
    out = cli("export", "last", "--rank", "3", "-o", str(tmp_path / "r3.json"), home=recorded)
    assert out.returncode == 0, out.stderr
    info = json.loads((tmp_path / "r3.json").read_text())["distributedInfo"]
    assert info == {"rank": 3, "world_size": 4}
    out = cli("export", "last", "--rank", "1", "--world-size", "8", "-o", str(tmp_path / "r1.json"),
              home=recorded)  # fmt: skip
    assert out.returncode == 0, out.stderr
    info = json.loads((tmp_path / "r1.json").read_text())["distributedInfo"]
    assert info == {"rank": 1, "world_size": 8}
    out = cli("export", "last", "--rank", "3", "--world-size", "2", "-o", str(tmp_path / "x.json"),
              home=recorded)  # fmt: skip
    assert out.returncode == 2
    assert one_line(out) == "gpu-trace: --world-size must be more than --rank (3), got 2"


def test_the_sanitizer_shows_what_it_escapes() -> None:
    assert _format.text(ATTACK) == "\\x1b]0;PWNED\\x07\\x1b[2J"
    assert _format.text("a\u202eb\nc", keep="\n") == "a\\u202eb\nc"
    assert _format.text("plain é ✓") == "plain é ✓"
    assert _format.table(["N"], [["x\ny"]]).splitlines()[2] == "x\\ny"


def test_export_to_a_missing_directory_is_one_line(recorded: Path, tmp_path: Path) -> None:
    target = tmp_path / "nonexistent" / "dir" / "x.json"
    out = cli("export", "last", "-o", str(target), home=recorded)
    assert out.returncode == 2
    assert one_line(out) == (
        f"gpu-trace: cannot write {target}: there is no directory {target.parent}"
    )
    assert not target.parent.exists()


@pytest.mark.parametrize("command", ["ui", "demo"])
@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_refused(tmp_path: Path, command: str, port: str) -> None:
    out = cli(command, "--port", port, home=tmp_path / "home")
    assert out.returncode == 2
    assert one_line(out) == f"gpu-trace: --port must be 0-65535 (0 picks a free port), got {port}"


def test_a_negative_standby_pool_is_refused(tmp_path: Path) -> None:
    out = cli("serve", "--device", "cpu", "--standby", "-1", home=tmp_path / "home")
    assert out.returncode == 2
    assert one_line(out) == "gpu-trace: cannot serve: --standby must be 0 or more"


@pytest.mark.parametrize("n", ["0", "-3"])
def test_a_server_no_client_could_join_is_refused(tmp_path: Path, n: str) -> None:
    out = cli("serve", "--device", "cpu", "--max-sessions", n, home=tmp_path / "home")
    assert out.returncode == 2
    assert one_line(out) == f"gpu-trace: cannot serve: --max-sessions must be 1 or more, got {n}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--las-thresholds", "1"], "--las-thresholds is for --policy las, not fair"),
        (
            ["--policy", "las", "--las-thresholds", "1,x"],
            "--las-thresholds takes seconds separated by commas (like 1,10,100), got '1,x'",
        ),
        (
            ["--policy", "las", "--las-thresholds", "10,1"],
            "--las-thresholds must be positive and increasing, got '10,1'",
        ),
        (
            ["--policy", "las", "--las-thresholds", "0,nan"],
            "--las-thresholds must be positive and increasing, got '0,nan'",
        ),
    ],
    ids=["not-las", "not-a-number", "decreasing", "zero"],
)
def test_bad_las_thresholds_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    out = cli("serve", "--device", "cpu", *args, home=tmp_path / "home")
    assert out.returncode == 2
    assert one_line(out) == f"gpu-trace: cannot serve: {message}"


def test_a_negative_rank_is_refused_before_the_store_is_read(tmp_path: Path) -> None:
    out = cli("export", "last", "-o", str(tmp_path / "t.json"), "--rank", "-1", home=tmp_path / "h")
    assert out.returncode == 2
    assert one_line(out) == "gpu-trace: --rank must be 0 or more, got -1"
    assert not (tmp_path / "t.json").exists()


def test_tenants_without_a_token_says_where_tokens_come_from(tmp_path: Path) -> None:
    out = cli("tenants", "127.0.0.1:9", home=tmp_path / "home")
    assert out.returncode == 2
    line = one_line(out)
    assert line.startswith("gpu-trace: no remote token: give the server's (--token on the")
    assert "token=..." not in line and "a --tenants server's are in its tenants file" in line


def test_a_missing_nvml_replay_file_stops_record_before_the_program(tmp_path: Path) -> None:
    """As a missing GPU_TRACE_NVML_REPLAY does (test_record_settings): it only warned."""
    marker = tmp_path / "ran"
    out = cli(
        "record", "--nvml-replay", str(tmp_path / "nope.jsonl"), "--",
        sys.executable, "-c", f"open({str(marker)!r}, 'w')", home=tmp_path / "home",
    )  # fmt: skip
    assert out.returncode == 2
    assert one_line(out) == (
        f"gpu-trace: --nvml-replay must be an existing file, got {str(tmp_path / 'nope.jsonl')!r}"
    )
    assert not marker.exists() and not (tmp_path / "home" / "runs").exists()


def test_a_mistyped_command_gets_the_closest_one(tmp_path: Path) -> None:
    out = cli("shwo", "last", home=tmp_path / "home")
    assert out.returncode == 2
    assert one_line(out) == "gpu-trace: unknown command 'shwo': did you mean 'show'?"
    out = cli("zzzz", home=tmp_path / "home")
    assert out.returncode == 2
    assert one_line(out).startswith("gpu-trace: unknown command 'zzzz' (commands: record, serve,")


def test_a_bare_word_is_not_a_store(tmp_path: Path) -> None:
    out = cli("ls", "--store", "notadsn", home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 2
    line = one_line(out)
    assert "notadsn" in line and "chdb:///path" in line and "http(s)://" in line
    assert not (tmp_path / "notadsn").exists()
    env_out = cli("ls", home=tmp_path / "home", cwd=tmp_path, GPU_TRACE_STORE="notadsn")
    assert env_out.returncode == 2 and "chdb:///path" in one_line(env_out)
    assert not (tmp_path / "notadsn").exists()


def test_an_unreachable_server_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = cli("ls", "--store", f"http://127.0.0.1:{port}", home=tmp_path / "home")
    assert out.returncode == 1
    assert one_line(out) == (
        f"gpu-trace: cannot reach the store http://default@127.0.0.1:{port}/gpu_trace: "
        "Connection refused"
    )


def test_processes_sharing_an_embedded_store_wait_quietly(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert cli("ls", home=home).returncode == 0  # the store exists
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gpu_trace", "ls"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GPU_TRACE_HOME": str(home)},
        )
        for _ in range(4)
    ]
    for p in procs:
        _, stderr = p.communicate(timeout=240)
        assert p.returncode == 0 and stderr == "", stderr


def test_ingest_problems_are_printed_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    prog = tmp_path / "prog.py"
    prog.write_text("import gpu_trace\nfor i in range(500):\n    gpu_trace.counter('c', i)\n")
    home = tmp_path / "home"
    out = cli(
        "record",
        "--no-ingest",
        "--run-dir",
        str(run_dir),
        "--",
        sys.executable,
        str(prog),
        home=home,
    )
    assert out.returncode == 0, out.stderr
    spool = next((run_dir / "spool").glob("counters-*.arrow"))
    spool.write_bytes(spool.read_bytes()[: spool.stat().st_size // 2])
    for i, verbose in enumerate(([], ["-v"])):
        store = f"chdb://{tmp_path / f'store{i}'}"  # a new store each time: nothing skipped
        out = cli(*verbose, "ingest", str(run_dir), "--store", store, home=home)
        assert out.returncode == 0, out.stderr
        assert "gpu-trace: gpu-trace:" not in out.stderr
        if not verbose:  # -v adds the library's own log lines
            assert out.stderr.count(f"{spool.name}: kept") == 1, out.stderr


def test_export_to_a_disk_that_fills_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    # A run big enough that its trace does not fit in 64 KiB; the export fails while writing
    # (the trailer or the close), not before it starts.
    from tests.integration.test_record_disk_full import small_disk

    home = tmp_path / "home"
    home.mkdir()
    prog = home / "prog.py"
    prog.write_text(
        "import gpu_trace\n"
        "for i in range(5000):\n"
        "    with gpu_trace.range(f'r{i % 50}'):\n"
        "        pass\n"
    )
    assert cli("record", "--", sys.executable, str(prog), home=home).returncode == 0
    with small_disk("64k") as disk:
        target = disk / "x.json"
        out = cli("export", "last", "-o", str(target), home=home)
        assert out.returncode == 1
        assert one_line(out) == (
            f"gpu-trace: cannot write {target}: No space left on device; nothing was written"
        )
        assert list(disk.iterdir()) == []  # neither the file nor its temporary
