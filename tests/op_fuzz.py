"""A memory-safety fuzzer for the server's allow-listed ATen ops (docs/remote.md, Security).

Each op gets random arguments drawn from its schema (hypothesis): sizes, strides, offsets and
dims that are negative, zero, small or huge (their products overflow int64), tensors of a
"session" and index tensors holding out-of-range values. It runs the way the server runs it:
resolved against the allow-list, its rule (:func:`gpu_trace.runtime.server.allowlist.rule`) applied,
then called. The session's tensors live in one byte arena between canary regions that
stand for "another tenant's" memory; after each call nothing may have

- written a canary (it is compared byte for byte),
- read one (no output, and no session tensor, holds the canary's distinctive bytes),
- made a tensor reaching outside its own storage (offset and extent checked against the
  storage's size), or a sparse or quantized one.

Random shapes rarely reach the kernels that trust their indices, so a second, structured mode
(``--structured``, :mod:`tests.op_cases`) starts from the calls real programs make, recorded, and
changes one index, offset, size or tensor at a time to a hostile value; it also runs the calls
that crashed the server or reached another tenant's memory (issue 25), which must be refused.

Ops run in a worker process, so a crash names the op and its last example instead of taking the
caller down; the worker is restarted after the crashed op, which is run again alone (a crash it
does not repeat alone is marked so). ``python -m tests.op_fuzz --examples 200`` runs a larger
search than the test suite's over the ops taking integers or returning an alias (``--ops REGEX``
narrows it, ``--start``/``--stop`` bound it by name, ``--others`` takes the other allowed ops,
``--all`` every one).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

_INT_TYPES = ("int", "List[int]", "Optional[int]", "Optional[List[int]]")
#: 8 distinctive bytes; any 4-aligned half of them found in an output is a read of a canary.
#: Each example has its own (:meth:`Arena.make`): uninitialized memory an op returns (``empty``,
#: an ``out=`` resized) may hold an earlier example's canary, freed, never this one's.
CANARY = bytes.fromhex("deadbeef0badf00d")
#: Where the worker writes each example before it runs it (what a crash leaves behind): one file
#: kept open and rewritten in place (opening it per example cost milliseconds each).
_EXAMPLE_OUT: Any = None
_ADDRESS_SPACE = 3 << 29  # the worker's address space limit
_GAP = 256  # canary bytes before, between and after the session's storages


def fuzz_targets(every: bool = False) -> list[str]:
    """Allowed ops taking integers (sizes, strides, offsets, dims, indices) or returning an
    alias of an input; with ``every``, all allowed ops."""
    import torch

    from gpu_trace.runtime.server import allowlist

    allowed = allowlist.allowed()
    out = []
    for schema in torch._C._jit_get_all_schemas():
        name = f"{schema.name}.{schema.overload_name or 'default'}"
        if name not in allowed:
            continue
        ints = any(str(a.type) in _INT_TYPES for a in schema.arguments)
        alias = any(r.alias_info is not None for r in schema.returns)
        if every or ints or alias:
            out.append(name)
    return sorted(set(out))


# ---- the worker: arguments, the call, the checks ---------------------------------------------------


_EXTREME = (
    -(1 << 63),
    -(1 << 62),
    -(1 << 31) - 1,
    -(1 << 31),
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) + 1,
    1 << 40,
    1 << 62,
    (1 << 63) - 1,
)
_STRINGS = ("none", "mean", "sum", "left", "right", "reflect", "floor", "max", "tanh", "", "xx")


def _strategies() -> dict[str, Any]:
    from hypothesis import strategies as st

    small = st.integers(-4, 12)
    ints = st.one_of(small, small, small, st.sampled_from(_EXTREME))
    floats = st.sampled_from((0.0, 1.0, -1.0, 0.5, 3.0, float("nan"), float("inf"), 1e300))
    return {"int": ints, "float": floats, "small": small, "st": st}


def _arg_strategy(arg: Any, n_tensors: int, s: dict[str, Any]) -> Any:
    """A strategy for one schema argument; tensors are ``("T", index)`` into the session's."""
    st = s["st"]
    ty = str(arg.real_type)
    optional = ty.startswith("Optional[")
    if optional:
        ty = ty[len("Optional[") : -1]
    # An out= tensor is a resizable copy: the arena's storages cannot grow, and a server's can
    # (a storage that cannot grow takes other paths in ATen).
    tag = "O" if arg.is_out else "T"
    tensor = st.tuples(st.just(tag), st.integers(0, n_tensors - 1))
    if ty in ("int", "SymInt"):
        base = s["int"]
    elif ty in ("List[int]", "List[SymInt]") or ty.startswith("List[int]") or ty == "int[]":
        base = st.lists(s["int"], max_size=5)
    elif ty == "Tensor":
        base = tensor
    elif ty == "List[Tensor]":
        base = st.lists(tensor, max_size=4)
    elif ty == "List[Optional[Tensor]]":
        base = st.lists(st.one_of(st.none(), tensor), max_size=4)
    elif ty == "bool":
        base = st.booleans()
    elif ty == "List[bool]":
        base = st.lists(st.booleans(), max_size=4)
    elif ty == "float":
        base = s["float"]
    elif ty == "List[float]":
        base = st.lists(s["float"], max_size=4)
    elif ty in ("Scalar", "number"):
        base = st.one_of(s["int"], s["float"], st.booleans())
    elif ty == "List[Scalar]":
        base = st.lists(st.one_of(s["int"], s["float"]), max_size=4)
    elif ty == "complex":
        base = st.just(complex(1.0, -1.0))
    elif ty == "List[complex]":
        base = st.lists(st.just(complex(0.5, 2.0)), max_size=3)
    elif ty == "str":
        base = st.sampled_from(_STRINGS)
    elif ty == "List[str]":
        base = st.lists(st.sampled_from(_STRINGS), max_size=3)
    elif ty == "ScalarType":
        # Decoded dtypes, and raw integers (what a client sending a bare int gets through).
        base = st.one_of(st.sampled_from(("float32", "int64", "uint8")), s["small"])
        base = base.map(lambda v: ("D", v) if type(v) is str else v)
    elif ty in ("Layout", "MemoryFormat"):
        base = st.one_of(st.just(("E", ty)), s["small"])
    elif ty == "Device":
        base = st.just(("DEV",))
    elif ty == "Generator":
        return st.none()
    else:
        base = st.none()
    return st.one_of(st.none(), base) if optional else base


_DTYPES = ("float32", "int64", "uint8", "bool", "float64", "int32")


def _session_strategy(s: dict[str, Any]) -> Any:
    """Specs of the session's tensors: (dtype, shape, values)."""
    st = s["st"]
    shape = st.lists(st.integers(0, 4), max_size=3)
    spec = st.tuples(st.sampled_from(_DTYPES), shape, st.lists(s["int"], min_size=1, max_size=6))
    return st.lists(spec, min_size=3, max_size=3)


def _canary_filled(torch: Any, total: int, canary: bytes) -> bytearray:
    """``total`` bytes of ``canary`` over and over, written in place: no freed copy of them is
    left for an op's uninitialized result to find."""
    data = bytearray((total + 7) // 8 * 8)
    word = int.from_bytes(canary, sys.byteorder, signed=True)
    torch.frombuffer(data, dtype=torch.int64).fill_(word)
    return data


@dataclass
class Arena:
    """The session's tensors in one byte array, each storage between canary bytes."""

    data: bytearray
    tensors: list[Any]
    canaries: list[tuple[int, int]] = field(default_factory=list)
    canary: bytes = CANARY

    @classmethod
    def make(cls, torch: Any, specs: list[tuple[str, list[int], list[int]]]) -> Arena:
        sizes = []
        for dtype, shape, _ in specs:
            numel = 1
            for d in shape:
                numel *= d
            sizes.append(numel * getattr(torch, dtype).itemsize)
        total = _GAP + sum(((n + 7) // 8 * 8) + _GAP for n in sizes)
        canary = CANARY[:2] + os.urandom(2) + CANARY[4:6] + os.urandom(2)
        data = _canary_filled(torch, total, canary)
        tensors, canaries, at = [], [(0, _GAP)], _GAP
        for (dtype, shape, values), nbytes in zip(specs, sizes):
            dt = getattr(torch, dtype)
            numel = nbytes // dt.itemsize
            if numel:
                t = torch.frombuffer(data, dtype=dt, count=numel, offset=at).view(shape)
                src = [v % 5 if dtype == "uint8" else v for v in values[:numel]]
                src = (src * (numel // len(src) + 1))[:numel]
                if dtype == "bool":
                    t.copy_(torch.tensor([v & 1 for v in src], dtype=torch.bool).view(shape))
                elif dtype in ("float32", "float64"):
                    t.copy_(torch.tensor([float(v % 1000) - 3 for v in src]).view(shape))
                else:
                    info = torch.iinfo(dt)
                    clipped = [min(max(v, info.min), info.max) for v in src]
                    t.copy_(torch.tensor(clipped, dtype=torch.int64).to(dt).view(shape))
            else:
                t = torch.empty(shape, dtype=dt)  # nothing to place: an empty storage
            tensors.append(t)
            at += (nbytes + 7) // 8 * 8
            canaries.append((at, at + _GAP))
            at += _GAP
        return cls(data, tensors, canaries, canary)

    @classmethod
    def of(cls, torch: Any, tensors: list[Any]) -> Arena:
        """Copies of ``tensors`` in one byte array, each storage between canary bytes, each with
        its shape, strides and offset (its storage zeroed around them: its own bytes)."""
        extents = []
        for t in tensors:
            n = 0 if t.numel() == 0 else t.storage_offset() + 1
            n += sum((d - 1) * s for d, s in zip(t.shape, t.stride())) if t.numel() else 0
            extents.append(n)
        sizes = [n * t.element_size() for n, t in zip(extents, tensors)]
        total = _GAP + sum(((n + 7) // 8 * 8) + _GAP for n in sizes)
        canary = CANARY[:2] + os.urandom(2) + CANARY[4:6] + os.urandom(2)
        data = _canary_filled(torch, total, canary)
        placed, canaries, at = [], [(0, _GAP)], _GAP
        for t, n, nbytes in zip(tensors, extents, sizes):
            if n:
                # The span of its storage it reaches, gaps included (an expanded tensor's
                # elements share places: copied as the storage, not element by element).
                base = torch.frombuffer(data, dtype=t.dtype, count=n, offset=at)
                base.copy_(t.detach().as_strided((n,), (1,), 0))
                view = base.as_strided(t.shape, t.stride(), t.storage_offset())
            else:
                view = torch.empty(t.shape, dtype=t.dtype)
            placed.append(view)
            at += (nbytes + 7) // 8 * 8
            canaries.append((at, at + _GAP))
            at += _GAP
        return cls(data, placed, canaries, canary)

    def canary_intact(self) -> bool:
        for lo, hi in self.canaries:
            if self.data[lo:hi] != (self.canary * ((hi - lo) // 8 + 1))[: hi - lo]:
                return False
        return True


def _materialize(torch: Any, value: Any, arena: Arena) -> Any:
    if type(value) is tuple:
        if value[0] == "T":
            return arena.tensors[value[1]]
        if value[0] == "O":
            return arena.tensors[value[1]].clone()
        if value[0] == "D":
            return getattr(torch, value[1])
        if value[0] == "E":
            return torch.strided if value[1] == "Layout" else torch.contiguous_format
        if value[0] == "DEV":
            return torch.device("cpu")
    if type(value) is list:
        return [_materialize(torch, v, arena) for v in value]
    return value


def _tensors_in(value: Any, torch: Any, out: list[Any]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, torch, out)


def _reads_canary(torch: Any, t: Any, canary: bytes) -> bool:
    if t.numel() == 0:
        return False
    try:
        flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
        raw = flat.view(torch.uint8).numpy().tobytes()
    except Exception:  # a dtype numpy or copy_ cannot take: nothing to scan
        return False
    for word in (canary[:4], canary[4:]):
        at = raw.find(word)
        while at >= 0:
            if at % 4 == 0:
                return True
            at = raw.find(word, at + 1)
    return False


def outside_storage(t: Any) -> str | None:
    """Why tensor ``t`` reaches outside its storage (None: it does not)."""
    import torch

    if t.layout != torch.strided:
        return f"a {t.layout} tensor"
    if t.is_quantized:
        return "a quantized tensor"
    if t.numel() == 0:
        return None
    offset = t.storage_offset()
    if offset < 0 or any(s < 0 for s in t.stride()):
        return f"offset {offset}, strides {list(t.stride())}"
    last = offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    nbytes = t.untyped_storage().nbytes()
    if (last + 1) * t.element_size() > nbytes:
        return (
            f"shape {list(t.shape)}, strides {list(t.stride())}, offset {offset} reach byte "
            f"{(last + 1) * t.element_size()} of a {nbytes}-byte storage"
        )
    return None


def check_call(op_name: str, specs: Any, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    """Run one op as the server would (resolve, rule, call); what went wrong, or None."""
    import torch

    from gpu_trace.runtime.server import allowlist

    op = allowlist.resolve(op_name)
    rule = allowlist.rule(op) if hasattr(allowlist, "rule") else None
    if rule is None:
        rule = allowlist.RULES.get(op._schema.name)
    arena = Arena.make(torch, specs)
    a = [_materialize(torch, v, arena) for v in args]
    k = {n: _materialize(torch, v, arena) for n, v in kwargs.items()}
    result = None
    try:
        if rule is not None:
            rule(a, k)
        result = op(*a, **k)
    except Exception:  # an op error is the op refusing: fine
        result = None
    return _verdict(torch, arena, result)


def check_placed(
    op_name: str, args: list[Any], kwargs: dict[str, Any], must_refuse: bool = False
) -> str | None:
    """:func:`check_call` for a call given whole (tests/op_cases.py): its tensors copied into an
    arena first (an ``out=`` tensor is a resizable copy outside it). ``must_refuse``: anything
    but a refusal by the allow-list or a rule is a failure too."""
    import torch

    from gpu_trace.runtime.protocol.errors import OpError
    from gpu_trace.runtime.server import allowlist

    op = allowlist.resolve(op_name)
    if op is None:
        return None  # refused by name: nothing runs
    outs = {a.name for a in op._schema.arguments if a.is_out}
    found: list[Any] = []
    for v in (*args, *(v for n, v in kwargs.items() if n not in outs)):
        _tensors_in(v, torch, found)
    flat = list({id(t): t for t in found}.values())
    arena = Arena.of(torch, flat)
    placed = {id(t): p for t, p in zip(flat, arena.tensors)}

    def place(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return placed.get(id(v), v)
        if type(v) is list:
            return [place(x) for x in v]
        return v

    a = [place(v) for v in args]
    k = {n: v.clone() if n in outs else place(v) for n, v in kwargs.items()}
    rule = allowlist.rule(op)
    result = None
    refused = False
    try:
        if rule is not None:
            try:
                rule(a, k)
            except OpError:
                refused = True
                raise
        result = op(*a, **k)
    except Exception:  # an op error is the op refusing: fine
        result = None
    why = _verdict(torch, arena, result)
    if why is None and must_refuse and not refused:
        why = "ran: neither the allow-list nor a rule refused it"
    return why


def _verdict(torch: Any, arena: Arena, result: Any) -> str | None:
    """What a call that returned ``result`` did wrong to ``arena`` (None: nothing)."""
    if not arena.canary_intact():
        return "wrote a canary byte (another tenant's memory)"
    outs: list[Any] = []
    _tensors_in(result, torch, outs)
    for i, t in enumerate(outs):
        why = outside_storage(t)
        if why is not None:
            return f"output {i}: {why}"
        if _reads_canary(torch, t, arena.canary):
            return f"output {i} holds canary bytes (read another tenant's memory)"
    for i, t in enumerate(arena.tensors):
        if outside_storage(t) is None and _reads_canary(torch, t, arena.canary):
            return f"session tensor {i} holds canary bytes after the op"
    return None


def _fuzz_one(op_name: str, examples: Any) -> str | None:
    """Hypothesis over one op's arguments; the first failure's message (shrunk), or None."""
    import torch
    from hypothesis import HealthCheck, Phase, given, settings

    from gpu_trace.runtime.server import allowlist

    op = allowlist.resolve(op_name)
    schema = op._schema
    s = _strategies()
    st = s["st"]
    arg_strats = []
    for arg in schema.arguments:
        arg_strats.append(
            st.tuples(st.just(arg.name), st.just(arg.kwarg_only), _arg_strategy(arg, 3, s))
        )
    example = st.tuples(_session_strategy(s), st.tuples(*arg_strats))
    failure: list[str] = []

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=True,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(example)
    def run(ex: Any) -> None:
        specs, arg_values = ex
        args, kwargs = [], {}
        for name, kw_only, value in arg_values:
            if kw_only:
                kwargs[name] = value
            else:
                args.append(value)
        _note(f"{op_name} args {args!r} kwargs {kwargs!r} session {specs!r}")
        why = check_call(op_name, specs, args, kwargs)
        if why is not None:
            failure[:] = [f"{why}; args {args!r} kwargs {kwargs!r} session {specs!r}"]
            raise AssertionError(why)

    del torch
    try:
        run()
    except AssertionError:
        return failure[0] if failure else "failed"
    return None


def structured_targets() -> list[str]:
    """The structured fuzzer's targets (tests/op_cases.py): ``sample:OP`` for each allowed op
    with a recorded call, ``hostile:WHAT`` for each of the issue's crashing calls."""
    import torch

    from gpu_trace.runtime.server import allowlist
    from tests import op_cases

    allowed = allowlist.allowed()
    ops = [f"sample:{n}" for n in sorted(op_cases.load_samples()) if n in allowed]
    return ops + [f"hostile:{what}" for what in op_cases.hostile(torch)]


def _note(text: str) -> None:
    if _EXAMPLE_OUT is not None:
        _EXAMPLE_OUT.seek(0)
        _EXAMPLE_OUT.write(text)
        _EXAMPLE_OUT.truncate()
        _EXAMPLE_OUT.flush()


def _structured_one(target: str, samples: dict[str, Any]) -> str | None:
    """One structured target: its recorded call, then each variant with one hostile value (or
    the hostile call, which must be refused); the first failure, or None."""
    import torch

    from gpu_trace.runtime.protocol.errors import OpError
    from gpu_trace.runtime.server import allowlist
    from tests import op_cases

    kind, _, what = target.partition(":")
    if kind == "hostile":
        name, args, kwargs = op_cases.hostile(torch)[what]()
        _note(f"{name}: {what}")
        why = check_placed(name, args, kwargs, must_refuse=True)
        return None if why is None else f"{name} ({what}): {why}"
    op = allowlist.resolve(what)
    if op is None:
        return None
    gen = torch.Generator().manual_seed(0)
    args, kwargs = op_cases.decode_call(torch, samples[what], gen)
    rule = allowlist.rule(op)
    if rule is not None:  # what a program sent passes its rules
        try:
            rule(copy.copy(args), dict(kwargs))
        except OpError as exc:
            return f"its rule refused the recorded call: {exc}"
    calls = [("as recorded", args, kwargs), *op_cases.variants(torch, op._schema, args, kwargs)]
    for desc, a, k in calls:
        _note(f"{what} with {desc}")
        why = check_placed(what, a, k)
        if why is not None:
            return f"with {desc}: {why}"
    return None


def worker(examples: int, example_file: str = "", structured: bool = False) -> None:
    """Read op names (``structured``: structured targets) from stdin; for each, print ``start``
    then its ``done`` line (JSON). Each example is written to ``example_file`` before it runs
    (what a crash leaves behind)."""
    global _EXAMPLE_OUT
    if example_file:
        _EXAMPLE_OUT = open(example_file, "w")  # noqa: SIM115 (the worker's whole life)
    import warnings

    import torch

    from tests import op_cases

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    # A huge allocation fails at once instead of swapping the machine.
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))
    samples = op_cases.load_samples() if structured else {}
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        print(json.dumps({"start": name}), flush=True)
        try:
            fuzz_one = _structured_one if structured else _fuzz_one
            failure = fuzz_one(name, samples if structured else examples)
        except Exception as exc:  # the harness itself: report, go on
            failure = f"fuzzer error {type(exc).__name__}: {exc}"[:2000]
            failure = None if "Unsatisfiable" in failure else failure
        print(json.dumps({"done": name, "failure": failure}), flush=True)


# ---- the parent: workers, crashes --------------------------------------------------------------------


@dataclass
class Report:
    failures: dict[str, str] = field(default_factory=dict)  # op -> what went wrong
    crashes: dict[str, str] = field(default_factory=dict)  # op -> how the worker died
    stuck: list[str] = field(default_factory=list)  # ops that did not finish in time
    done: int = 0


def _worker_run(
    ops: list[str],
    examples: int,
    stuck_after_s: float,
    events: list[tuple[str, str, str]],
    structured: bool = False,
) -> list[str]:
    """One worker over ``ops`` until it ends or dies; appends ``(kind, op, detail)`` events
    (``done``, ``failure``, ``crash``, ``stuck``) and returns the ops it did not get to."""
    import selectors
    import tempfile

    todo = list(ops)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    with tempfile.TemporaryDirectory() as tmp:
        example_file = Path(tmp) / "example"
        with open(Path(tmp) / "stderr", "w+") as err:
            argv = [sys.executable, "-m", "tests.op_fuzz", "--worker"]
            argv += ["--examples", str(examples), "--example-file", str(example_file)]
            argv += ["--structured"] if structured else []
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("".join(f"{n}\n" for n in todo))
            proc.stdin.close()
            current = None
            fd = proc.stdout.fileno()
            sel = selectors.DefaultSelector()
            sel.register(fd, selectors.EVENT_READ)
            started = time.monotonic()
            pending = b""
            while True:
                if not sel.select(timeout=1.0):
                    if current is not None and time.monotonic() - started > stuck_after_s:
                        proc.kill()
                        events.append(("stuck", current, ""))
                        todo.remove(current)
                        break
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:  # the worker ended
                    proc.wait()
                    if current is not None:
                        err.seek(0)
                        tail = err.read()[-600:].strip()
                        example = example_file.read_text() if example_file.exists() else ""
                        why = f"exit {proc.returncode}; last example {example}; stderr: {tail}"
                        events.append(("crash", current, why))
                        todo.remove(current)
                    else:
                        todo = []
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    if "start" in msg:
                        current = msg["start"]
                        started = time.monotonic()
                    else:
                        todo.remove(msg["done"])
                        kind = "failure" if msg["failure"] else "done"
                        events.append((kind, msg["done"], msg["failure"] or ""))
                        current = None
            sel.close()
            proc.wait()
            proc.stdout.close()
    return todo


def fuzz(
    ops: list[str],
    examples: int,
    stuck_after_s: float = 60.0,
    say: Any = None,
    structured: bool = False,
) -> Report:
    """Fuzz ``ops`` in worker processes (``structured``: :func:`structured_targets`); a worker
    that dies is restarted after its op, and the op run again alone (a crash it does not repeat
    alone is put down to the ops before it). An op still running after ``stuck_after_s`` is
    listed as stuck (its worker replaced): that says nothing of memory safety either way."""
    report = Report()
    todo = list(ops)
    while todo:
        events: list[tuple[str, str, str]] = []
        todo = _worker_run(todo, examples, stuck_after_s, events, structured)
        for kind, op, detail in events:
            if kind == "crash":
                alone: list[tuple[str, str, str]] = []
                _worker_run([op], examples, stuck_after_s, alone, structured)
                if not any(k == "crash" for k, _, _ in alone):
                    detail = (
                        f"only after other ops (alone: {alone[0][0] if alone else '?'}); {detail}"
                    )
                report.crashes[op] = detail
            elif kind == "failure":
                report.failures[op] = detail
            elif kind == "stuck":
                report.stuck.append(op)
            if kind != "done" and say:
                say(f"{kind.upper():8}{op}: {report.crashes.get(op) or detail}")
            report.done += kind != "stuck"
            if say and kind == "done" and report.done % 200 == 0:
                say(f"...     {report.done} of {len(ops)}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.op_fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--examples", type=int, default=50, help="examples per op (default 50)")
    p.add_argument("--ops", default="", help="only ops whose name matches this regex")
    p.add_argument("--all", action="store_true", help="every allowed op")
    p.add_argument("--others", action="store_true", help="allowed ops the default leaves out")
    p.add_argument("--start", default="", help="only ops from this name on (sorted)")
    p.add_argument("--stop", default="\uffff", help="only ops up to this name (sorted)")
    p.add_argument(
        "--structured",
        action="store_true",
        help="recorded calls with one hostile value, and the issue's crashers (tests/op_cases.py)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--example-file", default="", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        worker(ns.examples, ns.example_file, ns.structured)
        return 0
    ops = structured_targets() if ns.structured else fuzz_targets(ns.all or ns.others)
    if ns.others:
        ops = sorted(set(ops) - set(fuzz_targets()))
    ops = [n for n in ops if re.search(ns.ops, n) and ns.start <= n <= ns.stop]
    t0 = time.monotonic()
    say = lambda line: print(line, flush=True)  # noqa: E731
    report = fuzz(ops, ns.examples, say=say, structured=ns.structured)
    print(
        f"{len(ops)} ops x {ns.examples} examples in {time.monotonic() - t0:.0f} s: "
        f"{len(report.failures)} unsafe, {len(report.crashes)} crashed, {len(report.stuck)} stuck"
    )
    return 1 if report.failures or report.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
