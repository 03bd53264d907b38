"""Recording never changes what a program computes: seeded programs print the same bytes plain
and under `gpu-trace record` at every level.

The programs in ``seeded/`` print floats as hex, hashes of their weights and draws from every
generator they use (Python's ``random``, NumPy's, torch's, TensorFlow's) after training; any draw
the recorder or a patch makes from the program's generators, and any change to its threads'
names, warning filters or ``sys.path``, shows as a different line. Runs use ``--no-ingest`` and no
samplers: the store plays no part in what the program sees.
"""

from __future__ import annotations

import _thread
import difflib
import os
import pty
import random
import re
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import recorded
from tests.integration.test_record import gpu_trace, script

SEEDED = Path(__file__).resolve().parent / "seeded"
RECORD = ("record", "--no-ingest", "--no-nvml", "--host-hz", "0")
CLOSING = "gpu-trace: run "  # the closing line `gpu-trace record` itself writes to stderr
#: What recording adds to the program's environment (docs/frameworks.md, "What recording leaves
#: untouched"): each one is there so child processes are recorded too.
ENVIRONMENT = {
    "GPU_TRACE_NVTX",
    "GPU_TRACE_RUN_DIR",
    "GPU_TRACE_RUN_ID",
    "GPU_TRACE_SIGNAL_ECHO",  # the pipe it tells record its signals on (signal_echo.py)
    "GPU_TRACE_TF",
    "GPU_TRACE_TORCH",
    "NVTX_INJECTION64_PATH",  # when the NVTX injection library could be built
    "PYTHONPATH",  # when it was not set already
    "TRACEPARENT",
}


def _wait_readable(fd: object, timeout: float) -> bool:
    """Whether ``fd`` turns readable within ``timeout`` s (poll: select() refuses descriptors past
    1024, which a long test process holds)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(timeout * 1000)))


def plain(prog: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(prog)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=240,
    )


#: The head of TensorFlow's (absl's) log lines, ``I0000 00:00:1795559045.651840    5978 ``:
#: a time and a thread id that differ from run to run.
ABSL_HEAD = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", re.MULTILINE)


def program_stderr(out: subprocess.CompletedProcess | str) -> str:
    """What the program itself wrote to stderr: the record command's closing line left out,
    and the heads of TensorFlow's log lines."""
    text = out if isinstance(out, str) else out.stderr
    kept = "".join(line for line in text.splitlines(True) if not line.startswith(CLOSING))
    return ABSL_HEAD.sub("", kept)


def assert_same(
    prog: Path, levels: dict[str, tuple[str, ...]], env: dict[str, dict[str, str]] | None = None
) -> None:
    """``prog`` prints the same stdout and stderr plain and under `gpu-trace record` with each
    of ``levels``' flags (``env``: extra settings per level)."""
    want = plain(prog)
    assert want.returncode == 0, want.stderr
    differ: list[str] = []
    for label, flags in levels.items():
        got = gpu_trace(
            *RECORD, *flags, "--", sys.executable, str(prog), env=(env or {}).get(label)
        )
        assert got.returncode == 0, f"{label}: {got.stderr}"
        if got.stdout != want.stdout:
            diff = difflib.unified_diff(
                want.stdout.splitlines(), got.stdout.splitlines(), lineterm=""
            )
            differ.append(f"{label} (stdout):\n" + "\n".join(list(diff)[2:12]))
        if program_stderr(got) != program_stderr(want):
            differ.append(f"{label} (stderr):\n{program_stderr(got)[-600:]}")
    assert not differ, "recording changed the program's output at:\n" + "\n".join(differ)


def test_recorder_ids_leave_random_alone() -> None:
    """A thread buffer's and a forwarding client's span-id prefixes come from the OS, not from
    the program's ``random`` (which a seeded program's later draws depend on)."""
    from gpu_trace.runtime.client.trace import ClientTrace
    from gpu_trace.tracer.buffer import ThreadBuffer

    state = random.getstate()
    client = ClientTrace(None, None)  # type: ignore[arg-type]  # no connection: ids only
    prefixes = {ThreadBuffer(8).prefix >> 32 for _ in range(64)}
    client.new_span_id()
    assert random.getstate() == state
    assert len(prefixes) == 64 and all(p & 1 for p in prefixes)  # odd, never the C ids


def test_foreign_threads_stay_unregistered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range on a thread that ``threading`` did not start (tf.data's C++ threads running eager
    ops at ``--tf op``; here one from ``_thread``) registers no ``Dummy-N`` thread: the program's
    ``threading.enumerate()``, and the number in its next ``Thread-N``, are as plain."""
    import gpu_trace

    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        before = threading.Thread().name
        done = threading.Event()

        def foreign() -> None:
            with gpu_trace.range("foreign"):
                pass
            done.set()

        _thread.start_new_thread(foreign, ())
        assert done.wait(60)
        after = threading.Thread().name
        names = [t.name for t in threading.enumerate()]
    finally:
        gpu_trace.stop()
    assert [n for n in names if n.startswith("Dummy")] == []
    assert int(after.removeprefix("Thread-")) == int(before.removeprefix("Thread-")) + 1
    assert [s["name"] for s in recorded(run_dir)] == ["foreign"]


def test_boot_steps_aside(tmp_path: Path) -> None:
    """Recording starts from a ``sitecustomize`` on PYTHONPATH, yet the program's ``sys.path`` and
    ``sys.modules["sitecustomize"]`` are what they are plain: none, or the user's own (which still
    runs, after recording started). Its environment gains only the documented variables."""
    prog = tmp_path / "where.py"
    prog.write_text(
        "import os, sys\n"
        "import gpu_trace\n"
        "with gpu_trace.range('first'):\n"
        "    site = sys.modules.get('sitecustomize')\n"
        "print(sys.path, getattr(site, '__file__', None), getattr(site, 'MARK', None))\n"
        "print(*sorted(os.environ), file=sys.stderr)\n"
    )
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("MARK = 'user'\n")
    package = tmp_path / "package" / "sitecustomize"  # a package is a sitecustomize too
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("MARK = 'package'\n")
    for n, pythonpath in enumerate(("", str(user), str(package.parent))):
        want = plain(prog, {"PYTHONPATH": pythonpath})
        run_dir = tmp_path / f"run{n}"
        got = gpu_trace(
            *RECORD, "--run-dir", str(run_dir), "--", sys.executable, str(prog),
            env={"PYTHONPATH": pythonpath},
        )  # fmt: skip
        assert (got.returncode, got.stdout) == (0, want.stdout), got.stderr
        assert [s["name"] for s in recorded(run_dir)] == ["first"]
        added = set(program_stderr(got).split()) - set(want.stderr.split())
        assert {"GPU_TRACE_RUN_DIR", "TRACEPARENT"} <= added <= ENVIRONMENT


def test_numpy_program_unchanged() -> None:
    assert_same(SEEDED / "seeded_numpy.py", {"default": ()})


def test_torch_program_unchanged_at_every_level() -> None:
    """A module on a new thread and in DataLoader workers (shuffled, 2 workers), draws of all
    three generators after training; at op level one profiler session is cycled mid-run, so
    the flusher makes its spans while the program still draws."""
    pytest.importorskip("torch")
    op_env = {"SEEDED_PAUSE": "2.2", "GPU_TRACE_FLUSH_INTERVAL": "0.05"}
    assert_same(
        SEEDED / "seeded_torch.py",
        {
            "--torch off": ("--torch", "off"),
            "--torch module": ("--torch", "module"),
            "--torch op": ("--torch", "op"),
        },
        env={"--torch op": op_env},
    )


def test_keras_program_unchanged_at_every_level() -> None:
    """Keras ``fit`` (validation split, shuffle, dropout) and a GradientTape loop: Keras draws
    its layers' default seeds from Python's ``random``, so a recorder draw before them (op level
    records the first eager op, when the model is built) changed every loss."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    assert_same(
        SEEDED / "seeded_keras.py",
        {
            "--tf off": ("--tf", "off"),
            "--tf layer": ("--tf", "layer"),
            "--tf op": ("--tf", "op"),
        },
    )


COUNT_SIGINTS = """
import signal, time
n = 0
def count(signum, frame):
    global n
    n += 1
signal.signal(signal.SIGINT, count)
print("ready", flush=True)
deadline = time.monotonic() + 60
while not n and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.5)  # where a second SIGINT would land
print("sigints", n, flush=True)
"""

# Makes the pty it was given as stdin its controlling terminal, then runs the command: a real
# terminal, whose ^C the kernel sends to the whole foreground process group.
WITH_TERMINAL = "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
WITH_TERMINAL += "os.execvp(sys.argv[1], sys.argv[1:])"
NOT_FORWARDED = "SIGINT from the terminal reached the program too: not forwarded"


def at_terminal(argv: list[str]) -> str:
    """Run ``argv`` in a new session on a pseudo-terminal, type ^C once it printed ``ready``;
    everything it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", WITH_TERMINAL, *argv],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    out = b""
    try:
        while _wait_readable(master, 120):
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the session ended
                break
            if not chunk:
                break
            if b"ready" not in out and b"ready" in out + chunk:
                os.write(master, b"\x03")
            out += chunk
    finally:
        os.close(master)
        proc.wait(timeout=120)
    return out.decode(errors="replace")


def test_interrupt_reaches_the_program_once(tmp_path: Path) -> None:
    """^C at a terminal reaches the program once under `gpu-trace record`, as plain: the kernel
    sends it to the whole process group, the program included, so the runner does not forward it
    again (a program cleaning up after its first KeyboardInterrupt was interrupted again; whether
    the program sees two depends on timing, so the runner's debug log says what it did). A
    SIGINT sent to the runner alone is still forwarded."""
    prog = script(tmp_path, COUNT_SIGINTS)
    record = [sys.executable, "-m", "gpu_trace", "-v", *RECORD, "--", sys.executable, str(prog)]
    at_tty = at_terminal(record)
    assert "sigints 1" in at_tty and NOT_FORWARDED in at_tty, at_tty
    assert "forwarding SIGINT" not in at_tty
    runner = subprocess.Popen(
        record, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert runner.stdout is not None and runner.stdout.readline() == "ready\n"
    runner.send_signal(signal.SIGINT)
    out, err = runner.communicate(timeout=120)
    assert out == "sigints 1\n" and f"forwarding SIGINT (sent by pid {os.getpid()})" in err, err


COUNT_SIGTERMS = COUNT_SIGINTS.replace("SIGINT", "SIGTERM").replace("sigints", "sigterms")


@pytest.mark.parametrize(
    ("program", "signum"),
    [(COUNT_SIGINTS, signal.SIGINT), (COUNT_SIGTERMS, signal.SIGTERM)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_sent_to_the_process_group_reaches_the_program_once(
    tmp_path: Path, program: str, signum: signal.Signals
) -> None:
    """`kill -INT -PGID` (GNU timeout, a scheduler) reaches the runner and the program; the
    program tells the runner it got it (gpu_trace/signal_echo.py), so it is not forwarded a
    second time (it was: two KeyboardInterrupts, the second inside the first's handling)."""
    prog = script(tmp_path, program)
    record = [sys.executable, "-m", "gpu_trace", "-v", *RECORD, "--", sys.executable, str(prog)]
    runner = subprocess.Popen(
        record, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert runner.stdout is not None and runner.stdout.readline() == "ready\n"
    os.killpg(runner.pid, signum)
    out, err = runner.communicate(timeout=120)
    name = signum.name
    assert out == f"{name.lower()}s 1\n", err
    assert f"{name} (sent by pid {os.getpid()}) reached the program too: not forwarded" in err, err
    assert f"forwarding {name}" not in err, err
