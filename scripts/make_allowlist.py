"""Generate ``runtime/server/allowed_ops.txt``: the ATen overloads real programs' forwarding sends.

The server runs only the overloads named in that file (``runtime/server/allowlist.py``; those that
also pass its schema and deny checks). Every other op a tenant could name is attack surface that
no program needs: an internal ATen kernel trusting its arguments is one tenant reading or writing
another's memory, or the whole server killed. So the list is collected, not derived:

1. **Programs** (:mod:`scripts.allowlist_programs`): common models built here from ``torch.nn``
   (a GPT-style transformer, LSTM/GRU/RNN and their cells, a CNN with batch norm, pooling and
   dropout, embeddings, attention, the usual losses), trained forward and backward with SGD, Adam,
   AdamW, RMSprop, Adagrad and LBFGS (foreach and fused), AMP (bfloat16 autocast, GradScaler),
   ``clip_grad_norm_``, ``torch.fft``, indexing, sorting, scans and the Tensor methods of training
   loops. Each runs three ways: on the ``remote`` device against a server on loopback in this
   process (explicit mode), in transparent mode (a CUDA build without a GPU,
   ``tests/cuda_build.py``: the program says ``cuda``), each recording the names the server is asked
   for (``allowlist.recorder``); and on CPU tensors under a ``TorchDispatchMode`` (what
   ``__torch_dispatch__`` sees of the same program, which is what a remote tensor forwards).
2. **Named**: every ``aten::name.overload`` the server's code and the tests spell out, and every
   overload but the ``out=`` forms of the ops the rules name (``bounds.BY_NAME``,
   ``kernel_checks.BY_NAME``, ``allowlist.RULES``) or a name spelled without its overload; not
   from the tests whose names are attacks (:data:`NOT_NAMED_IN`). CPU-only kernels
   (:data:`CPU_ONLY`) are left out.
3. **The forwarding tests**: ``tests/unit`` and ``tests/integration`` files that forward (a client
   through ``runtime.connect`` or ``record --remote``), run under pytest with
   ``GPU_TRACE_RECORD_OPS`` set, so every server they start appends what it is asked for. Tests
   that speak the protocol themselves (hostile clients) are not run: what they send is not what
   programs send. A test that fails because an op it needs was missing from the file still records
   that op's name; the file is then rewritten and the tests run again, until nothing new comes.

The file is the sorted union of the three, minus what the schema and deny checks refuse (they
stay the second guard). The programs' first call of each listed op on CPU tensors goes to
``tests/data/op_samples.json``: the op fuzzer's structured cases start from them; every call
they make goes through its op's rules, and a rule that refuses one stops the generator.
Deterministic: programs are seeded, nothing depends on timing. The programs take about a minute
on a CPU, each run of the forwarding tests 8-17 minutes on a 2-core VM (``--check`` runs the
programs only)::

    .venv/bin/python scripts/make_allowlist.py            # rewrite the file
    .venv/bin/python scripts/make_allowlist.py --check    # exit 1 if the programs need more

Rerun it when torch changes, and when a program's forwarding is refused an op it needs (add that
program to :mod:`scripts.allowlist_programs` first). It prints what was added and removed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runtime" / "server" / "allowed_ops.txt"
#: Test files whose programs forward through the client (runtime.connect, record --remote).
FORWARDING_TESTS = (
    "tests/unit/test_cuda_emulation.py",
    "tests/unit/test_remote_amp.py",
    "tests/unit/test_forward_gpu_bench.py",
    "tests/integration/test_remote_client.py",
    "tests/integration/test_remote_issuing.py",
    "tests/integration/test_remote_record.py",
    "tests/integration/test_remote_store.py",
    "tests/integration/test_remote_gpu_activity.py",
    "tests/integration/test_pager_pinning.py",
    "tests/integration/test_sharing_memory.py",
    "tests/integration/test_sharing_pager.py",
    "tests/integration/test_sharing_admin.py",
    "tests/integration/test_sharing_faults.py",
    "tests/integration/test_serve_shutdown.py",
    "tests/integration/test_serving_process.py",
    "tests/integration/test_otlp_export.py",
)
#: Where op names are spelled out: the server's code and the tests.
NAMED_IN = ("runtime", "tests")
#: ...except where they are attacks the server must refuse (the op fuzzer's hostile cases, the
#: allow-list's refusals, the worker isolation's crashers; tests/unit/test_allowlist.py checks
#: that issue 25's ops stay off the list).
NOT_NAMED_IN = (
    "tests/op_cases.py",
    "tests/unit/test_allowlist.py",
    "tests/integration/test_worker_isolation.py",
)
#: Kernels only a CPU tensor dispatches to (a remote one stands for a GPU's): seen in the CPU
#: traces, never sent (``F.scaled_dot_product_attention`` travels whole), and they trust their
#: callers (an empty key was a SIGSEGV).
CPU_ONLY = re.compile(r"_for_cpu")
_NAME = re.compile(r"aten::([A-Za-z0-9_]+)(?:\.([A-Za-z0-9_]+))?")
HEADER = """\
# The ATen overloads a gpu-trace server runs: what real programs' forwarding sends.
# Generated by scripts/make_allowlist.py (see there); do not edit by hand.
# The server also refuses any of these its schema and deny checks refuse (allowlist.py).
"""


def _setup_path() -> None:
    for p in (str(REPO), str(REPO / "scripts")):
        if p not in sys.path:
            sys.path.insert(0, p)


# ---- 1. programs ------------------------------------------------------------------------------


@contextlib.contextmanager
def _recording(names: set[str]) -> Iterator[None]:
    """Every name the server is asked for goes into ``names``; the server meanwhile allows
    everything admissible (so that one missing op does not cut a program short)."""
    from gpu_trace.runtime.server import allowlist

    saved = allowlist.recorder, allowlist._allowed, dict(allowlist._resolved)
    allowlist.recorder = names.add
    allowlist._allowed = allowlist.admissible()
    allowlist._resolved.clear()
    try:
        yield
    finally:
        allowlist.recorder, allowlist._allowed = saved[0], saved[1]
        allowlist._resolved.clear()
        allowlist._resolved.update(saved[2])


def _named(name: str, program: Callable[..., None], env: Any) -> Callable[[], None]:
    def run() -> None:
        program(env)

    run.__qualname__ = name
    return run


def _run_all(
    programs: dict[str, Callable[..., None]], env: Any, say: Callable[[str], None]
) -> None:
    import torch

    for name, program in programs.items():
        torch.manual_seed(0)
        env.attempt(_named(name, program, env))
    for failure in env.failures:  # one program's failure must not hide the others' ops
        say(f"{env.kind}: {failure}")


def from_programs(
    say: Callable[[str], None], calls: dict[str, Any], refused: dict[str, str]
) -> tuple[set[str], set[str]]:
    """(names the server was sent, names CPU dispatch saw) over every program; ``calls`` gets
    each op's first call on CPU (:func:`tests.op_cases.recorder`), ``refused`` what a rule
    refused of any call there."""
    _setup_path()
    import allowlist_programs as programs
    import torch

    from gpu_trace import runtime
    from gpu_trace.runtime.client import cuda
    from gpu_trace.runtime.server.server import Server
    from tests import op_cases
    from tests.cuda_build import CudaBuild

    sent: set[str] = set()
    token = "make-allowlist-token-0123"
    with Server("127.0.0.1:0", token=token) as server, _recording(sent):
        address = server.address
        # Synchronous: an op that fails ends its part of a program there, always (with
        # batching, the ops issued before its error came back would depend on timing).
        dev = runtime.connect(address, token=token, sync=True)
        try:
            _run_all(programs.PROGRAMS, programs.Env("remote", dev, "remote"), say)
        finally:
            runtime.disconnect()
        with CudaBuild():
            runtime.connect(address, token=token, sync=True)
            cuda.patch()
            try:
                _run_all(programs.PROGRAMS, programs.Env("transparent", "cuda", "cuda"), say)
            finally:
                cuda.unpatch()
                runtime.disconnect()

    # On CPU tensors each op's first call is kept too: the op fuzzer's structured cases
    # (tests/op_cases.py) start from it. And every call goes through its op's rules, which
    # must let what programs send through.
    with op_cases.recorder(torch, calls, lambda name: True, _rules_pass(refused)):
        _run_all(programs.PROGRAMS, programs.Env("cpu", torch.device("cpu"), "cpu"), say)
    return sent | programs.SENT_PAST_A_CPU_SERVER, set(calls)


def _rules_pass(refused: dict[str, str]) -> Callable[[str, list[Any], dict[str, Any]], None]:
    """A check of one call against its op's rules: a refusal goes into ``refused`` (by op)."""
    import torch

    from gpu_trace.runtime.protocol.errors import OpError
    from gpu_trace.runtime.server import allowlist

    def check(name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        if name in refused or name not in allowlist.admissible():
            return
        base, _, overload = name[len("aten::") :].partition(".")
        rule = allowlist.rule(getattr(getattr(torch.ops.aten, base), overload))
        if rule is None:
            return
        try:
            rule(list(args), dict(kwargs))
        except OpError as exc:
            refused[name] = str(exc)

    return check


# ---- 2. named ---------------------------------------------------------------------------------


def named() -> set[str]:
    """Overloads spelled out in the server's code and the tests; every overload but the
    ``out=`` forms of a name spelled without one there or in the rules."""
    import torch

    from gpu_trace.runtime.server import allowlist, bounds, kernel_checks

    admissible = allowlist.admissible()
    out_forms = {
        f"{s.name}.{s.overload_name or 'default'}"
        for s in torch._C._jit_get_all_schemas()
        if any(a.is_out for a in s.arguments)
    }
    by_base: dict[str, set[str]] = {}
    for n in admissible:
        by_base.setdefault(n.partition(".")[0], set()).add(n)
    out: set[str] = set()
    bases = set(bounds.BY_NAME) | set(kernel_checks.BY_NAME) | set(allowlist.RULES)
    for folder in NAMED_IN:
        for path in sorted((REPO / folder).rglob("*.py")):
            if str(path.relative_to(REPO)) in NOT_NAMED_IN:
                continue
            for base, overload in _NAME.findall(path.read_text(errors="replace")):
                if overload:
                    out.add(f"aten::{base}.{overload}")
                else:
                    bases.add(f"aten::{base}")
    for base in bases:  # their overloads clients send: not the ``out=`` forms
        out |= {n for n in by_base.get(base, set()) if n not in out_forms}
    return out


# ---- 3. the forwarding tests ------------------------------------------------------------------


def from_tests(say: Callable[[str], None]) -> set[str]:
    """Names the servers of the forwarding tests were asked for (one pytest run)."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "ops.txt"
        env = {**os.environ, "GPU_TRACE_RECORD_OPS": str(record)}
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
        argv += [t for t in FORWARDING_TESTS if (REPO / t).exists()]
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        say(f"forwarding tests: {tail[0]}")
        if proc.returncode not in (0, 1):
            raise SystemExit(f"pytest could not run the forwarding tests:\n{proc.stdout[-3000:]}")
        if proc.returncode == 1:
            failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
            say("  " + "\n  ".join(failed[:20]))
        return set(record.read_text().split()) if record.exists() else set()


# ---- the file ---------------------------------------------------------------------------------


def write(names: set[str], path: Path = OUT) -> None:
    path.write_text(HEADER + "".join(f"{n}\n" for n in sorted(names)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="run the programs only (no tests) and exit 1 if the file lacks any op they send",
    )
    p.add_argument("--passes", type=int, default=3, help="most runs of the tests (default 3)")
    ns = p.parse_args(argv)
    _setup_path()
    from gpu_trace.runtime.server import allowlist

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    admissible = allowlist.admissible()
    before = allowlist.listed() if allowlist.ALLOWED_OPS_FILE.exists() else frozenset()
    calls: dict[str, Any] = {}
    refused: dict[str, str] = {}
    sent, seen = from_programs(say, calls, refused)
    if refused:  # a rule that refuses what programs send is a bug: fix it before the list
        for name, why in sorted(refused.items()):
            say(f"a rule refused a program's call of {name}: {why}")
        return 2
    names = named()
    say(
        f"programs: {len(sent & admissible)} sent, {len(seen & admissible)} seen on CPU "
        f"({len((seen - sent) & admissible)} only there); named: {len(names & admissible)}"
    )
    found = {n for n in (sent | seen | names) & admissible if not CPU_ONLY.search(n)}
    if ns.check:
        missing = found - before
        if missing:
            say(f"{len(missing)} not in {OUT.name}: {' '.join(sorted(missing))}")
        return 1 if missing else 0
    for _ in range(ns.passes):
        write(found)
        new = (from_tests(say) & admissible) - found
        say(f"the forwarding tests sent {len(new)} more: {' '.join(sorted(new))}")
        if not new:
            break
        found |= new
    write(found)
    from tests import op_cases

    op_cases.write_samples({n: c for n, c in calls.items() if n in found})
    say(
        f"{OUT.relative_to(REPO)}: {len(found)} overloads of {len(admissible)} admissible "
        f"(added {len(found - before)}, removed {len(before - found)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
