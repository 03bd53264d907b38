"""Programs in the idioms of real ones (issue 26), recorded as a user would: each run plain, under
`gpu-trace record` at every level, and the PyTorch ones forwarded to a real `gpu-trace serve
--device cpu` on loopback. Every run prints what the plain run prints, byte for byte, and exits
with its status; every stored run's spans nest (tests/span_checks.py); two recordings of one
program at one level hold the same ranges, name by name.

The programs (``programs/``) are ours, written in the idioms of pytorch/examples, nanoGPT and
minGPT, Hugging Face's checkpointing, Reformer's reversible layers, PyTorch's profiler recipe and
Keras's training-loop guide; each prints exact values (losses as ``float.hex``, a hash of the
final weights). ``GPU_TRACE_TEST_HOG=N`` runs the module beside N busy processes (read when the
module is imported: conftest clears ``GPU_TRACE_*`` for each test). docs/frameworks.md, "The
third-party check"."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_trace.query.source import rows as query_rows
from tests import serving
from tests.span_checks import check_stored

pytest.importorskip("torch")

PROGRAMS_DIR = Path(__file__).resolve().parent / "programs"
TOKEN = "thirdparty-test-token-0123"
HOG = int(os.environ.get("GPU_TRACE_TEST_HOG") or 0)
TIMEOUT_S = 240


@dataclass(frozen=True)
class Program:
    name: str
    status: int = 0  # the exit status it means to end with
    framework: str = "torch"

    @property
    def path(self) -> Path:
        return PROGRAMS_DIR / f"{self.name}.py"


PROGRAMS = {
    p.name: p
    for p in (
        Program("word_lm"),
        Program("tiny_gpt"),
        Program("dcgan"),
        Program("reinforce", status=3),
        Program("mnist_cnn"),
        Program("reversible"),
        Program("profiled"),
        Program("keras_loop", framework="tf"),
    )
}
MODES = {"torch": ("off", "module", "op", "forwarded"), "tf": ("off", "layer", "op")}

# Cases that fail because gpu-trace is wrong, each with what it does (strict: once fixed, they
# fail until taken off this list).
KNOWN: dict[tuple[str, str], str] = {}

# What a forwarded run prints differently, by design and documented: lines that start with the
# prefix are left out of both outputs (each must have them) before comparing.
FORWARDED_DIFFERS = {
    # docs/remote.md: optimizers take their foreach path on remote tensors, as PyTorch does on
    # CUDA, and the ops a profile lists are those the device's path dispatches
    "profiled": "ops ",
}


def _cases() -> Iterator[object]:
    for p in PROGRAMS.values():
        if p.framework == "tf" and not _importable("tensorflow"):
            continue
        for mode in MODES[p.framework]:
            marks = []
            if (p.name, mode) in KNOWN:
                marks.append(pytest.mark.xfail(reason=KNOWN[p.name, mode], strict=True))
            yield pytest.param(p.name, mode, id=f"{p.name}-{mode}", marks=marks)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _env(**more: str) -> dict[str, str]:
    env = {**os.environ, "GPU_TRACE_NVML_HZ": "0", "TF_CPP_MIN_LOG_LEVEL": "2", **more}
    env.pop("GPU_TRACE_REMOTE", None)
    return env


@pytest.fixture(scope="module", autouse=True)
def _hog() -> Iterator[None]:
    """GPU_TRACE_TEST_HOG busy processes for the whole module (none by default)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOG)]
    yield
    for p in hogs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def plain() -> dict[str, subprocess.CompletedProcess]:
    """Each program's plain run (``python prog.py``), made when a test first asks for it."""
    return {}


def _plain(
    cache: dict[str, subprocess.CompletedProcess], p: Program
) -> subprocess.CompletedProcess:
    if p.name not in cache:
        out = subprocess.run(
            [sys.executable, str(p.path)],
            capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S,
        )  # fmt: skip
        assert out.returncode == p.status, out.stderr[-4000:]
        assert out.stdout.strip(), out.stderr[-4000:]
        cache[p.name] = out
    return cache[p.name]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU-device server for every forwarded case."""
    home = tmp_path_factory.mktemp("server-home")
    with serving.served(home, TOKEN, device="cpu") as (address, _):
        yield address


def _record(p: Program, mode: str, address: str | None = None) -> list[str]:
    args = [sys.executable, "-m", "gpu_trace", "record"]
    if mode == "forwarded":
        args += ["--remote", str(address)]
    elif p.framework == "torch":
        args += ["--torch", mode]
    else:
        args += ["--tf", mode] + (["--torch", "off"] if mode == "off" else [])
    return [*args, "--", sys.executable, str(p.path)]


def _without(stdout: str, prefix: str) -> list[str]:
    lines = stdout.splitlines()
    assert any(line.startswith(prefix) for line in lines), stdout
    return [line for line in lines if not line.startswith(prefix)]


def _run_id(out: subprocess.CompletedProcess) -> str:
    ids = re.findall(r"^gpu-trace: run (\S+): ", out.stderr, re.M)
    assert len(ids) == 1, out.stderr[-4000:]
    return ids[0]


def _counts(store: object, run_id: str) -> dict[tuple[str, str], int]:
    rows = query_rows(
        store,  # type: ignore[attr-defined]
        "SELECT category, name, count() AS n FROM __db__.spans WHERE run_id = {run:String} "
        "GROUP BY category, name",
        {"run": run_id},
    )
    return {(r["category"], r["name"]): int(r["n"]) for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mode"), list(_cases()))
def test_program_runs_as_it_does_plain(
    name: str, mode: str, plain: dict, request: pytest.FixtureRequest
) -> None:
    """The program's output and exit status are its plain run's, byte for byte; its recorded
    spans nest; at a recording level, two runs (at once, each the other's load) hold the same
    ranges name by name."""
    from gpu_trace.store.client import Store

    p = PROGRAMS[name]
    expected = _plain(plain, p)
    env = _env()
    if mode == "forwarded":
        address = request.getfixturevalue("server")
        env["GPU_TRACE_REMOTE_TOKEN"] = TOKEN
    else:
        address = None
    times = 1 if mode in ("off", "forwarded") else 2
    procs = [
        subprocess.Popen(
            _record(p, mode, address),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for _ in range(times)
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        outs.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    for out in outs:
        assert out.returncode == p.status, out.stderr[-4000:]
        if mode == "forwarded" and name in FORWARDED_DIFFERS:
            differs = FORWARDED_DIFFERS[name]
            assert _without(out.stdout, differs) == _without(expected.stdout, differs), out.stderr
        else:
            assert out.stdout == expected.stdout, out.stderr[-4000:]
    with Store() as store:
        counts = []
        for out in outs:
            run_id = _run_id(out)
            check_stored(store, run_id)
            counts.append(_counts(store, run_id))
    if mode != "off":
        assert any(cat in ("module", "op") for cat, _ in counts[0]), counts[0]
    if len(counts) == 2:
        differ = {
            k: (counts[0].get(k), counts[1].get(k))
            for k in counts[0].keys() | counts[1].keys()
            if counts[0].get(k) != counts[1].get(k)
        }
        assert not differ, collections.OrderedDict(sorted(differ.items()))
