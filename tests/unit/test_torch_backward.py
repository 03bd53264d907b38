"""Module backward ranges: made from backward-node events (op level) on made-up events, and
recorded at both levels on models whose modules are called many times per step."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_trace.framework_patches.torch.backward import Kept, chain, owners, ranges

# Forward: Net [0, 10) holds a [0, 4) (a.x [1, 3)) and b [5, 9); seq 4 and 9 are Net's own ops.
NET, A, AX, B = "Net", "a", "a.x", "b"
CALLS = [(1, 3, AX, -1), (0, 4, A, -1), (5, 9, B, -1), (0, 10, NET, -1)]  # as calls return


def made(events, passes=(), calls=CALLS):
    ids = itertools.count(100)
    out = ranges(events, calls, passes, ids.__next__)
    by_id = {r[0]: r for r in out}
    return sorted(
        (
            calls[r[3]][2],
            r[4],
            r[5],
            calls[by_id[r[1]][3]][2] if r[1] in by_id else r[1],
            r[6],
        )
        for r in out
    )


def test_chain_finds_the_innermost_call_and_its_parents() -> None:
    index = owners(CALLS)
    names = {s: [CALLS[i][2] for i in chain(s, CALLS, index)] for s in range(12)}
    assert names[0] == [NET, A] and names[2] == [NET, A, AX] and names[3] == [NET, A]
    assert names[4] == [NET] and names[7] == [NET, B] and names[9] == [NET]
    assert names[10] == [] and names[11] == []


def test_a_wrapper_with_its_childs_numbers_is_outside_it_and_a_recompute_under_its_anchor():
    # wrap's forward only calls inner (same numbers, returned later); block was recomputed in
    # backward (checkpointing) inside the node numbered 1, which Net made.
    calls = [(0, 2, "inner", -1), (0, 2, "wrap", -1), (0, 4, NET, -1), (10, 12, "block", 1)]
    index = owners(calls)
    assert [calls[i][2] for i in chain(1, calls, index)] == [NET, "wrap", "inner"]
    assert [calls[i][2] for i in chain(11, calls, index)] == [NET, "wrap", "inner", "block"]
    assert chain(12, calls, index) == []


def test_nodes_in_reverse_forward_order_nest_like_the_modules() -> None:
    # (thread, start, end, seq): backward runs b, Net's op, a.x, a; AccumulateGrad (-1) between.
    events = [(1, 10, 20, 8), (1, 21, 25, -1), (1, 30, 40, 4), (1, 41, 50, 2), (1, 51, 60, 0)]
    assert made(events) == [
        (NET, 10, 60, 0, 0),
        (A, 41, 60, NET, 1),
        (AX, 41, 50, A, 2),
        (B, 10, 25, NET, 1),  # AccumulateGrad after b's last node is still b's
    ]


def test_nodes_outside_modules_and_forward_ops_end_ranges() -> None:
    events = [
        (1, 0, 5, 11),  # the loss, made outside any module
        (1, 10, 20, 7),
        (1, 30, 35, None),  # a forward op: the next iteration
        (1, 40, 45, -1),  # AccumulateGrad of another pass: extends nothing
        (1, 50, 60, 7),
    ]
    assert made(events) == [
        (NET, 10, 20, 0, 0),
        (NET, 50, 60, 0, 0),
        (B, 10, 20, NET, 1),
        (B, 50, 60, NET, 1),
    ]


def test_a_call_interleaved_with_another_gets_no_second_range_in_a_pass() -> None:
    # b's nodes run on both sides of a's: the second goes to Net (a second b would be wrong).
    events = [(1, 10, 20, 7), (1, 21, 30, 2), (1, 31, 40, 8), (1, 41, 45, None), (1, 50, 60, 7)]
    assert made(events) == [
        (NET, 10, 40, 0, 0),
        (NET, 50, 60, 0, 0),
        (A, 21, 30, NET, 1),
        (AX, 21, 30, A, 2),
        (B, 10, 20, NET, 1),
        (B, 50, 60, NET, 1),  # after a forward op: another pass, another range
    ]


def test_a_module_called_twice_gets_a_range_per_call_and_threads_are_apart() -> None:
    calls = [(0, 2, "cell", -1), (2, 4, "cell", -1)]
    events = [(1, 0, 10, 3), (1, 11, 20, 1), (2, 0, 5, 1)]
    assert made(events, calls=calls) == [
        ("cell", 0, 5, 0, 0),
        ("cell", 0, 10, 0, 0),
        ("cell", 11, 20, 0, 0),
    ]


def test_a_pass_puts_its_ranges_under_its_range_and_skips_calls_still_running() -> None:
    # Tensor.backward (span 7, depth 1) called inside Net's forward: Net gets no range.
    passes = [[5, 100, 7, 1, {NET}]]
    events = [(1, 10, 20, 2), (1, 21, 30, 0), (1, 200, 210, 2)]
    assert made(events, passes) == [
        (NET, 200, 210, 0, 0),  # after the pass: a later pass of the same graph, no record
        (A, 10, 30, 7, 1),
        (A, 200, 210, NET, 1),
        (AX, 10, 20, A, 2),
        (AX, 200, 210, A, 2),
    ]


def test_no_calls_no_ranges() -> None:
    assert ranges([(1, 0, 1, 0)], [], [], iter(range(5)).__next__) == []


def test_kept_calls_are_found_by_number_however_old_and_forgotten_by_count() -> None:
    """Calls are kept by count, not time: a node finds its call's batch (and the batches of
    the calls a recomputed call nests in) however many batches came after it, until KEEP_CALLS
    newer calls were made."""
    import numpy as np

    kept = Kept(limit=6)
    kept.add([(1, 3, AX, -1), (0, 4, A, -1)])  # a batch: a cut's or a session's calls
    kept.add([])
    kept.add([(5, 7, "b", -1), (4, 8, B, -1)])
    kept.add([(10, 12, "block", 1)])  # recomputed in backward inside the node numbered 1
    names = lambda seqs: [c[2] for c in kept.select(np.array(seqs))]  # noqa: E731
    assert names([6]) == ["b", B]
    assert names([11]) == [AX, A, "block"]  # with the batch its anchor is in, in order
    assert names([2, 7, 100]) == [AX, A, "b", B]
    assert names([-1, 9, 50]) == [] and names([]) == []
    for i in range(3):  # 2 + 2 + 1 + 3 = 8 calls: the oldest batch goes, 6 are left
        kept.add([(20 + i, 21 + i, f"x{i}", -1)])
    assert len(kept) == 6 and names([2]) == [] and names([6, 22]) == ["b", B, "x2"]
    with pytest.raises(ValueError):
        Kept(limit=0)


def records(rows: list[tuple[int, int, int, int | None]]):
    """Observer records (ops_native.RECORD) for events (thread, start, end, seq): seq None is a
    forward op, the rest autograd nodes."""
    import numpy as np

    from gpu_trace.framework_patches.torch.ops_native import RECORD

    b = np.zeros(len(rows), dtype=RECORD)
    for i, (tid, start, end, seq) in enumerate(rows):
        b[i]["tid"], b[i]["start"], b[i]["end"] = tid, start, end
        b[i]["seq"] = -1 if seq is None else seq
    return b, np.array([seq is not None for _, _, _, seq in rows], dtype=bool)


@given(
    st.lists(
        st.tuples(st.sampled_from([1, 2]), st.sampled_from([None, -1, *range(12)])),
        max_size=40,
    ),
    st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_runs_of_a_calls_nodes_make_the_ranges_their_nodes_make(steps, windowed) -> None:
    """The native source gives the walk each run of nodes of one innermost call (and the
    AccumulateGrad nodes after it) as one event: the ranges are those of the nodes one by one."""
    from gpu_trace.framework_patches.torch.ops_native import _runs

    rows = sorted(
        ((tid, 10 * i, 10 * i + 5, seq) for i, (tid, seq) in enumerate(steps)),
        key=lambda r: (r[0], r[1]),
    )
    passes = [[0, 10 * len(rows) // 2, 7, 1, set(), None]] if windowed else []
    b, is_node = records(rows)
    one_by_one = ranges(rows, CALLS, passes, itertools.count(100).__next__)
    events = _runs(b, is_node, CALLS, passes, None)
    assert ranges(events, CALLS, passes, itertools.count(100).__next__) == one_by_one
    assert len(events) <= len(rows)


# ---- recorded: module level (hooks) and op level (collected ops) on shapes that re-enter ------

torch = pytest.importorskip("torch")
nn = torch.nn


class Cells(nn.Module):
    """PyTorch's time-sequence-prediction example, small: two LSTMCells and a Linear per step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm1, self.lstm2, self.linear = nn.LSTMCell(1, 8), nn.LSTMCell(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        outs = []
        h1 = c1 = h2 = c2 = torch.zeros(x.size(0), 8)
        for t in x.split(1, dim=1):
            h1, c1 = self.lstm1(t, (h1, c1))
            h2, c2 = self.lstm2(h1, (h2, c2))
            outs.append(self.linear(h2))
        return torch.cat(outs, 1)


class Shared(nn.Module):
    """The same modules called twice in one forward: in a row, and on one input side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.block = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        h = self.lin(x)
        return self.lin(self.block(h) + self.block(h))


class Recursive(nn.Module):
    """A module calling itself (its submodule re-entered at each depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, depth=2):
        y = self.lin(x)
        return self(y, depth - 1) if depth else y


class Checkpointed(nn.Module):
    """A block under activation checkpointing: recomputed in backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.pre, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        y = checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant)
        return self.head(y)


def one_step(model, x, grad: bool) -> None:
    if grad:  # a gradient penalty: torch.autograd.grad with a graph, then backward through it
        (g,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        g.square().sum().backward()
    else:
        model(x).square().mean().backward()


SHAPES = {
    "cell loop": (Cells, (3, 5), False),
    "shared": (Shared, (2, 4), False),
    "recursion": (Recursive, (2, 4), False),
    "checkpoint": (lambda: Checkpointed(True), (2, 4), False),
    "checkpoint, not reentrant": (lambda: Checkpointed(False), (2, 4), False),
    "autograd.grad": (Shared, (2, 4), True),
}
#: Backward ranges per forward call: passes per step (autograd.grad makes two).
PASSES = {"autograd.grad": 2}


def record_steps(tmp_path, monkeypatch, shape: str, level: str) -> list[dict]:
    import gpu_trace
    from tests.conftest import recorded

    make, size, grad = SHAPES[shape]
    monkeypatch.setenv("GPU_TRACE_TORCH", level.split("-")[0])
    # op, module: the native observer where built (tests/conftest.py builds it); op-kineto: the
    # sessions; module-hooks: Python hooks on the autograd nodes
    if level in ("op-kineto", "module-hooks"):
        monkeypatch.setenv("GPU_TRACE_TORCH_OPS", "kineto")
    else:
        monkeypatch.delenv("GPU_TRACE_TORCH_OPS", raising=False)
    torch.manual_seed(0)
    model, x = make(), torch.randn(*size, requires_grad=grad)
    run = tmp_path / f"run-{level}"
    gpu_trace.start(run)
    try:
        for _ in range(2):
            one_step(model, x, grad)
    finally:
        gpu_trace.stop()
    return sorted(recorded(run), key=lambda r: (r["start_ns"], r["depth"]))


def module_backward(rows: list[dict]) -> list[tuple[str, str, int, int]]:
    """(name, parent's name, depth, thread) of each module backward range."""
    by_id = {r["span_id"]: r for r in rows}
    return sorted(
        (r["name"], by_id.get(r["parent_span_id"], {}).get("name", ""), r["depth"], r["tid"])
        for r in rows
        if r["name"].endswith(".backward")
    )


def record_module(tmp_path, monkeypatch, name: str, body, ops: str | None = None) -> list[dict]:
    """Run ``body()`` recorded at module level (``ops``: ``GPU_TRACE_TORCH_OPS``)."""
    import gpu_trace
    from tests.conftest import recorded
    from tests.span_checks import problems

    monkeypatch.setenv("GPU_TRACE_TORCH", "module")
    if ops is None:
        monkeypatch.delenv("GPU_TRACE_TORCH_OPS", raising=False)
    else:
        monkeypatch.setenv("GPU_TRACE_TORCH_OPS", ops)
    gpu_trace.start(tmp_path / name)
    try:
        body()
    finally:
        gpu_trace.stop()
    rows = recorded(tmp_path / name)
    assert problems(rows) == []
    return rows


def test_module_level_takes_backward_ranges_from_autograd_nodes_without_hooks(
    tmp_path, monkeypatch
):
    """Module level with the native observer built places no Python hook on the graph's nodes
    (each cost the program's thread several µs per module call) and makes the same backward
    ranges from the nodes the observer records; ``GPU_TRACE_TORCH_OPS=kineto`` keeps the hooks."""
    torch.manual_seed(0)
    model, x = Shared(), torch.randn(2, 4)
    nodes = []

    def step() -> None:
        y = model(x)
        nodes.append(y.grad_fn)
        y.sum().backward()

    native = record_module(tmp_path, monkeypatch, "native", step)
    hooks = record_module(tmp_path, monkeypatch, "hooks", step, ops="kineto")
    assert "gpu_trace" not in nodes[0].metadata and "gpu_trace" in nodes[1].metadata
    assert module_backward(native) == module_backward(hooks)
    assert sum(r["name"] == "Shared.lin.backward" for r in native) == 2


def test_module_level_without_the_native_observer_uses_hooks(tmp_path, monkeypatch):
    """Where the observer cannot be built (no compiler), module level places hooks as before."""
    from gpu_trace.framework_patches.torch import ops_native

    monkeypatch.setattr(ops_native, "available", lambda: False)
    model, x = Shared(), torch.randn(2, 4)
    nodes = []

    def step() -> None:
        y = model(x)
        nodes.append(y.grad_fn)
        y.sum().backward()

    rows = record_module(tmp_path, monkeypatch, "fallback", step)
    assert "gpu_trace" in nodes[0].metadata
    assert sum(r["name"] == "Shared.lin.backward" for r in rows) == 2


def test_passes_over_one_graph_get_ranges_each(tmp_path, monkeypatch):
    """Two ``torch.autograd.grad`` passes over one graph (nothing run between them): each pass
    gets its ranges at module level from either source (the native one tells passes apart by
    the autograd graph task running the nodes)."""
    torch.manual_seed(0)
    model, x = Shared(), torch.randn(2, 4)

    def twice() -> None:
        loss = model(x).sum()
        params = list(model.parameters())
        torch.autograd.grad(loss, params, retain_graph=True)
        torch.autograd.grad(loss, params)

    native = record_module(tmp_path, monkeypatch, "native", twice)
    hooks = record_module(tmp_path, monkeypatch, "hooks", twice, ops="kineto")
    assert sum(r["name"] == "Shared.backward" for r in native) == 2
    assert module_backward(native) == module_backward(hooks)


def test_a_forward_on_another_thread_gets_its_ranges_once(tmp_path, monkeypatch):
    """A thread other than the one recording started on runs a forward and backward (its
    module calls place hooks): its nodes' sequence numbers are its own thread's, so the native
    source leaves them out rather than matching them to the first thread's calls (which hold the
    same numbers here: both threads are new) and making every range twice."""
    import threading

    torch.manual_seed(0)
    model, x = Shared(), torch.randn(2, 4)
    got: dict[str, list[dict]] = {}

    def step() -> None:
        model(x).sum().backward()

    def owner(ops: str | None) -> None:
        def body() -> None:
            step()
            other = threading.Thread(target=step)
            other.start()
            other.join()
            step()

        try:
            got[str(ops)] = record_module(tmp_path, monkeypatch, f"run-{ops}", body, ops)
        except BaseException as exc:  # checked on the test's thread
            failed.append(exc)

    failed: list[BaseException] = []
    for ops in (None, "kineto"):  # new threads: sequence numbers from 0 on both
        t = threading.Thread(target=owner, args=(ops,))
        t.start()
        t.join()
    if failed:
        raise failed[0]
    native, hooks = got["None"], got["kineto"]
    assert sum(r["name"] == "Shared.backward" for r in native) == 3
    assert [r[:3] for r in module_backward(native)] == [r[:3] for r in module_backward(hooks)]


LEVELS = ("module", "module-hooks", "op", "op-kineto")


def one_range_per_call(rows: list[dict], level: str, passes: int = 1) -> list[tuple]:
    """Check that each forward call that made a graph (a forward range outside every backward
    range) has ``passes`` backward ranges, each under its caller's (an enclosing module's, or
    its own when recursing) or the pass's; returns (name, parent's name, depth) of each."""
    by_id = {r["span_id"]: r for r in rows}
    mods = [r for r in rows if r["category"] == "module" and r["name"] != "Tensor.backward"]
    bw = [r for r in mods if r["name"].endswith(".backward")]
    calls: dict[str, int] = {}  # forward calls that made nodes, outside any backward
    for r in mods:
        if r not in bw and not any(b["start_ns"] <= r["start_ns"] < b["end_ns"] for b in bw):
            calls[r["name"] + ".backward"] = calls.get(r["name"] + ".backward", 0) + 1
    counts = {n: sum(1 for r in bw if r["name"] == n) for n in calls}
    assert counts == {n: c * passes for n, c in calls.items()}, level
    for r in bw:  # under its module's caller's backward (or its own, recursing)
        parent = by_id.get(r["parent_span_id"], {}).get("name")
        if parent not in (r["name"], "Tensor.backward", None):
            assert r["name"].startswith(parent.removesuffix("backward")), (level, r["name"])
    return sorted(
        (r["name"], by_id.get(r["parent_span_id"], {}).get("name", ""), r["depth"]) for r in bw
    )


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_backward_ranges_nest_one_per_call_at_both_levels(shape, tmp_path, monkeypatch) -> None:
    """One backward range per forward call that made a graph, each under its caller's, the
    same at module level (from autograd nodes natively or from Python hooks) and op level (from
    either op source), and nothing overlapping partially or negative."""
    from tests.span_checks import problems

    got = {}
    for level in LEVELS:
        rows = record_steps(tmp_path, monkeypatch, shape, level)
        assert problems(rows) == [], level
        got[level] = one_range_per_call(rows, level, PASSES.get(shape, 1))
    assert got["module-hooks"] == got["module"]
    assert got["op"] == got["module"]
    assert got["op-kineto"] == got["module"]


# ---- passes of seconds, graphs backwarded late, nested passes: decided by the engine ----------


class Slow(torch.autograd.Function):
    """The identity, whose backward node takes ``seconds``: a pass of seconds whatever the
    machine's load, with the flusher draining many times while it runs."""

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SlowCells(Cells):
    """The cell loop with a node of 0.15 s per time step between its cells."""

    def forward(self, x):
        outs = []
        h1 = c1 = h2 = c2 = torch.zeros(x.size(0), 8)
        for t in x.split(1, dim=1):
            h1, c1 = self.lstm1(t, (h1, c1))
            h2, c2 = self.lstm2(Slow.apply(h1, 0.15), (h2, c2))
            outs.append(self.linear(h2))
        return torch.cat(outs, 1)


class Block(nn.Module):
    """A transformer-ish block whose backward takes 0.4 s."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, h):
        return Slow.apply(h + self.mlp(self.norm(h)), 0.4)


class Layered(nn.Module):
    """Activation checkpointing as Hugging Face models do it: each layer's ``__call__`` under
    ``torch.utils.checkpoint`` (``use_reentrant=True`` is their default)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.emb, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(x)
        for layer in self.layers:
            h = checkpoint(layer.__call__, h, use_reentrant=self.reentrant)
        return self.head(h)


def record_at(tmp_path, monkeypatch, level: str, name: str, body) -> list[dict]:
    """``body()`` recorded at ``level`` (one of :data:`LEVELS`, sources as
    :func:`record_steps` picks them), the flusher draining every 50 ms; nothing may overlap
    partially or have a negative self time."""
    import gpu_trace
    from tests.conftest import recorded
    from tests.span_checks import problems

    monkeypatch.setenv("GPU_TRACE_TORCH", level.split("-")[0])
    if level in ("op-kineto", "module-hooks"):
        monkeypatch.setenv("GPU_TRACE_TORCH_OPS", "kineto")
    else:
        monkeypatch.delenv("GPU_TRACE_TORCH_OPS", raising=False)
    monkeypatch.setenv("GPU_TRACE_FLUSH_INTERVAL", "0.05")
    run = tmp_path / f"{name}-{level}"
    gpu_trace.start(run)
    try:
        body()
    finally:
        gpu_trace.stop()
    rows = sorted(recorded(run), key=lambda r: (r["start_ns"], r["depth"]))
    assert problems(rows) == [], level
    return rows


def backward_counts(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        if r["name"].endswith(".backward") and r["name"] != "Tensor.backward":
            counts[r["name"]] = counts.get(r["name"], 0) + 1
    return counts


def test_a_pass_of_seconds_gets_one_range_per_call(tmp_path, monkeypatch) -> None:
    """A backward pass of about 2 s, which the flusher drains about 40 times while it runs: one
    range per call at every level, the same at each. The native source matches a pass's nodes
    once the pass is over (at the next top-level module call, or the end); before, it matched
    what it had after a second with no cut, so each drain's part of the pass got ranges of its
    own (2-7 ``SlowCells.backward`` for one call)."""
    torch.manual_seed(0)
    model, x = SlowCells(), torch.randn(2, 12)
    got = {}
    for level in LEVELS:
        rows = record_at(tmp_path, monkeypatch, level, "long", lambda: model(x).sum().backward())
        got[level] = one_range_per_call(rows, level)
        assert backward_counts(rows) == {
            "SlowCells.backward": 1,
            "SlowCells.lstm1.backward": 12,
            "SlowCells.lstm2.backward": 12,
            "SlowCells.linear.backward": 12,
        }, level
    assert got["module-hooks"] == got["module"] == got["op"] == got["op-kineto"]


class Generator(nn.Sequential):
    pass


class Discriminator(nn.Sequential):
    pass


class Policy(nn.Sequential):
    pass


def test_a_graph_backwarded_long_after_its_forward_keeps_its_ranges(tmp_path, monkeypatch):
    """A generator's graph backwarded after eight discriminator steps, and an episode of
    policy calls backwarded at its end, with 0.11 s between top-level calls (an environment's
    steps): every call gets its range at every level. The calls a node may belong to are kept
    by count; before, they were kept for two cuts at module level (0.2-0.3 s) and six op
    sessions, and these calls had none (DCGAN's generator, REINFORCE's early policy calls)."""
    torch.manual_seed(0)
    gen = Generator(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    disc = Discriminator(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    policy = Policy(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    noise, real = torch.randn(2, 4), torch.randn(2, 4)

    def body() -> None:
        fake = gen(noise)
        for _ in range(8):
            disc(real).sum().backward()
            time.sleep(0.11)  # a cut (module level) and a new op session each
        disc(fake).sum().backward()
        logps = []
        for _ in range(8):
            logps.append(policy(real).log_softmax(1)[0, 0])
            time.sleep(0.11)
        torch.stack(logps).sum().backward()

    got = {}
    for level in LEVELS:
        rows = record_at(tmp_path, monkeypatch, level, "late", body)
        got[level] = one_range_per_call(rows, level)
        counts = backward_counts(rows)
        assert counts["Generator.backward"] == 1 and counts["Generator.0.backward"] == 1, level
        assert counts["Discriminator.backward"] == 9 and counts["Policy.backward"] == 8, level
    assert got["module-hooks"] == got["module"] == got["op"] == got["op-kineto"]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_layers_in_a_pass_of_seconds_nest_one_per_call(
    reentrant, tmp_path, monkeypatch
):
    """Hugging Face's gradient checkpointing (each layer's ``__call__`` checkpointed; with
    ``use_reentrant=True`` each layer's backward is a pass of its own run inside a node), in a
    pass of 1.2 s: one range per call, nested, the same at every level. Before, the flusher's
    mid-pass matching gave 2 ``Layered.backward`` per call and, reentrant, a parent's range ending
    inside its child's (partial overlaps, negative self times)."""
    torch.manual_seed(0)
    model, x = Layered(reentrant), torch.randn(2, 4)
    got = {}
    for level in LEVELS:
        rows = record_at(tmp_path, monkeypatch, level, "ckpt", lambda: model(x).sum().backward())
        got[level] = one_range_per_call(rows, level)
        counts = backward_counts(rows)
        assert counts["Layered.backward"] == 1, level
        assert all(counts[f"Layered.layers.{i}.mlp.0.backward"] == 1 for i in range(3)), level
    assert got["module-hooks"] == got["module"] == got["op"] == got["op-kineto"]


class Reversible(torch.autograd.Function):
    """Reformer's reversible layers, small: forward without a graph; backward recomputes each
    block with one and runs ``Tensor.backward`` through it, inside this node."""

    @staticmethod
    def forward(ctx, x1, x2, blocks):
        ctx.blocks = blocks
        with torch.no_grad():
            for f, g in blocks:
                x1 = x1 + f(x2)
                x2 = x2 + g(x1)
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = (t.detach() for t in ctx.saved_tensors)
        for f, g in reversed(ctx.blocks):
            with torch.enable_grad():
                y1.requires_grad_(True)
                gy1 = g(y1)
                gy1.backward(dy2)
            with torch.no_grad():
                x2, dx1 = y2 - gy1, dy1 + y1.grad
            with torch.enable_grad():
                x2.requires_grad_(True)
                fx2 = f(x2)
                fx2.backward(dx1)
            with torch.no_grad():
                x1, dx2 = y1 - fx2, dy2 + x2.grad
            y1, y2, dy1, dy2 = x1.detach(), x2.detach(), dx1, dx2
        return dy1, dy2, None


class Rev(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.fs = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.gs = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        a, b = Reversible.apply(h[:, :4], h[:, 4:], list(zip(self.fs, self.gs)))
        return self.head(torch.cat([a, b], 1))


def test_tensor_backward_inside_a_custom_function_nests_or_is_left_out(tmp_path, monkeypatch):
    """A custom Function calling ``Tensor.backward`` in its backward (Reformer): with hooks,
    module level nests the recomputed calls' ranges under that inner ``Tensor.backward``, under
    the node's module's range, and closes them before it returns; where ranges are made from the
    nodes after the fact (module level from the observer, op level from either source), the
    inner ``Tensor.backward`` is a range opened from Python inside a node, which those ranges
    could not hold, so that pass gets none (a later plain pass gets its own). Before, module
    level left the inner passes' ranges open past their ``Tensor.backward`` (partial
    overlaps), and op level made ranges holding it (negative self times)."""
    torch.manual_seed(0)
    model, plain, x = Rev(), Shared(), torch.randn(2, 4)

    def body() -> None:
        model(x).square().mean().backward()
        plain(torch.randn(2, 4)).sum().backward()

    for level in LEVELS:
        rows = record_at(tmp_path, monkeypatch, level, "rev", body)
        counts = backward_counts(rows)
        assert counts["Shared.backward"] == 1 and counts["Shared.lin.backward"] == 2, level
        rev = {n: c for n, c in counts.items() if n.startswith("Rev")}
        if level != "module-hooks":
            assert rev == {}, level
            continue
        by_id = {r["span_id"]: r for r in rows}
        parent = {r["name"]: by_id.get(r["parent_span_id"], {}).get("name") for r in rows}
        assert rev == {n: 1 for n in rev} and len(rev) == 3 + 4 * 3, rev
        assert parent["Rev.fs.0.backward"] == parent["Rev.gs.1.backward"] == "Tensor.backward"
        inner = [r for r in rows if r["name"] == "Tensor.backward" and r["parent_span_id"]]
        assert len(inner) == 4 and {by_id[r["parent_span_id"]]["name"] for r in inner} == {
            "Rev.backward"
        }


def test_lbfgs_closure_at_op_level_keeps_every_op_inside_its_parent(tmp_path, monkeypatch):
    """Module calls inside ``optimizer.step`` (LBFGS's closure) do not cycle the op collection:
    the optimizer's profiler range would end in the next session, and PyTorch would then write
    its end into another op (ops ending after their parents)."""
    import gpu_trace
    from gpu_trace.framework_patches.torch import ops as torch_ops
    from tests.conftest import recorded
    from tests.span_checks import problems

    monkeypatch.setattr(torch_ops, "HARVEST_INTERVAL_S", 0.0)  # every top-level call may cycle
    monkeypatch.setenv("GPU_TRACE_TORCH", "op")
    torch.manual_seed(0)
    model, x = Cells(), torch.randn(2, 4)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=4)

    def closure():
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    gpu_trace.start(tmp_path / "run")
    try:
        for _ in range(3):
            optimizer.step(closure)
    finally:
        gpu_trace.stop()
    rows = recorded(tmp_path / "run")
    assert sum(r["name"] == "Cells.backward" for r in rows) >= 3
    assert problems(rows) == []


def test_lbfgs_closure_at_module_level_gets_every_backward_range(tmp_path, monkeypatch):
    """Every module call of a program that trains only through LBFGS's closure runs inside
    ``optimizer.step``: the native source cuts there too (it has no session), so nodes drained
    while the step runs wait for the next cut (the next closure's forward) rather than being
    matched to no call."""
    from gpu_trace.framework_patches.torch import ops as torch_ops
    from gpu_trace.tracer import recorder

    monkeypatch.setattr(torch_ops, "MAX_WAIT_S", 0.0)  # a drain with no cut takes all records
    torch.manual_seed(0)
    model, x = Cells(), torch.randn(2, 4)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=3)
    closures = []

    def closure():
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        closures.append(None)
        recorder.active.flush()  # the flusher drains while the step runs
        return loss

    def body() -> None:
        for _ in range(2):
            optimizer.step(closure)

    rows = record_module(tmp_path, monkeypatch, "lbfgs", body)
    assert sum(r["name"] == "Cells.backward" for r in rows) == len(closures) > 2


def test_a_pass_that_raises_leaves_no_range_open_for_the_next_step(tmp_path, monkeypatch):
    """A backward pass that raises skips the engine's end-of-pass callback: its open module
    backward ranges close when the next forward starts, not around the next step's ranges."""
    import gpu_trace
    from tests.conftest import recorded
    from tests.span_checks import problems

    monkeypatch.setenv("GPU_TRACE_TORCH", "module")
    model, x = Shared(), torch.randn(2, 4)

    def fail(grad):
        raise RuntimeError("hook")

    gpu_trace.start(tmp_path / "run")
    try:
        y = model(x)
        model.lin.weight.register_hook(fail)  # raises once the pass reaches the first lin
        with pytest.raises(RuntimeError, match="hook"):
            torch.autograd.grad(y.sum(), list(model.block.parameters()) + [model.lin.weight])
        model.lin.weight._backward_hooks.clear()
        model(x).sum().backward()
    finally:
        gpu_trace.stop()
    rows = recorded(tmp_path / "run")
    by_id = {r["span_id"]: r for r in rows}
    second = max((r for r in rows if r["name"] == "Shared"), key=lambda r: r["start_ns"])
    assert second["parent_span_id"] not in by_id  # not inside a backward range left open
    assert problems(rows) == []


def test_detected_steps_are_roots_so_ranges_around_or_inside_them_stay_nested(
    tmp_path, monkeypatch
):
    """A step is known when it ends: inside a user range opened after it began, or inside a
    module backward range when an optimizer steps in a gradient hook. It is a root of the
    steps lane, not a child of either (which got a negative self time)."""
    import gpu_trace
    from tests.conftest import recorded
    from tests.span_checks import problems

    monkeypatch.setenv("GPU_TRACE_TORCH", "module")
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    each = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    gpu_trace.start(tmp_path / "run")
    try:
        for _ in range(2):  # the step begins at the forward, the user's range after it
            out = model(torch.randn(2, 4))
            with gpu_trace.range("update"):
                out.sum().backward()
                plain.step()
        for p in model.parameters():  # optimizer in backward
            p.register_post_accumulate_grad_hook(lambda p: each[p].step())
        model(torch.randn(2, 4)).sum().backward()
    finally:
        gpu_trace.stop()
    rows = recorded(tmp_path / "run")
    steps = [r for r in rows if r["name"].startswith("ProfilerStep#")]
    assert len(steps) >= 3 and all(r["parent_span_id"] == 0 for r in steps)
    assert problems(rows) == []
