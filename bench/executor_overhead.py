"""The server executor's own time per op, next to the same ATen ops run bare, in one run.

    python bench/executor_overhead.py [--steps 30] [--rounds 3] [--before PATH] [--models mlp,lm]

The forwarding server spends time per op in Python on top of the op itself: finding the op's
tensors by handle, its bounds rules, its memory check and account, keeping its outputs' handles.
On a launch-bound GPU step (hundreds of small kernels) that time is the step's time once the
client pipelines, so this bench measures it apart from the wire and the client:

1. *record*: a real client trains a model through a real server on loopback (the CPU device) and
   every work item the server's executor runs is kept (template calls, JSON ops, frees, uploads);
2. *replay*: the kept items run again, in order, on a fresh session of a server that is built but
   not listening (same process, same thread, no socket), timing each batch of the steps after
   the warm-up ones;
3. *peer*: the same ATen ops of those batches, decoded once by this bench's own small
   interpreter, called in a loop with the same tensors (``OpOverload._op``, as the executor calls
   them): what the ops cost without the executor.

Overhead per op = (replayed batch time - bare loop time) / ops. The breakdown comes from
replays with one part turned off each (the part's cost is what the time drops by): the bounds
rules, sizing and the quota check, the memory accounting that follows every handle change, and
a traced session's spans (on: one span per op). Decoding the op stream (``expand``, the
connection's thread) is timed over the recorded streams.

``--before PATH`` (and ``--after PATH``, else this tree): also run a second tree (a ``git worktree`` of an older commit), in child
processes interleaved with this tree's, round after round: the same measurement before and after
a change, in one run. Each child records its own stream (the client's code is the tree's too).

Models: ``mlp``, six Linear+ReLU of ``--width`` (default 64, batch 64: small ops, as a
launch-bound GPU step's are to the CPU) and SGD with momentum;
``lm``, a small GPT-style model (embedding, two pre-norm ``TransformerEncoderLayer``, d=64, four
heads, a linear head, AdamW), batch 8 x 32 tokens.

``--device cuda:0`` runs the server (recording and replays) and the bare loop on the GPU: the
times are then those of the thread that launches the kernels (the device is drained between
parts; both wait for it at the step's ``.item()``), the server's side of a launch-bound step.
The ``lm`` model's server-side autograd (``rt::fn``) is refused on CUDA in a process shared with
a client, so on a GPU use ``--models mlp``.

Times are the replaying thread's CPU time (``time.thread_time_ns``): the machine is shared and
noisy, and CPU time leaves out the time the thread waits for a CPU (not what other processes
do to its caches). Compare figures within one run, peers against each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import checkout

TOKEN = "bench-executor-token-0123456789"

#: The replays and the bare loop run on one thread: its CPU time, not the wall clock, so that
#: time the thread spends descheduled on this shared machine is not counted (the record step's
#: client and server threads are not timed).
CLOCK = time.thread_time_ns


# ---- models --------------------------------------------------------------------------------------


def _mlp(torch: Any, device: Any, width: int) -> Any:
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, width).to(device)
    y = torch.randint(0, 10, (64,)).to(device)

    def step() -> float:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


def _lm(torch: Any, device: Any, width: int) -> Any:
    del width
    torch.manual_seed(0)
    nn = torch.nn
    vocab, d, seq, batch = 512, 64, 32, 8

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(seq, d))
            layer = nn.TransformerEncoderLayer(
                d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens: Any) -> Any:
            return self.head(self.blocks(self.emb(tokens) + self.pos))

    model = LM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (batch, seq + 1)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        opt.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


MODELS = {"mlp": _mlp, "lm": _lm}


# ---- record --------------------------------------------------------------------------------------


def record(
    model: str, width: int, warm: int, steps: int, device: str = "cpu"
) -> tuple[list[Any], list[Any], int]:
    """Train ``model`` through a loopback server; the executor's work items and the op streams
    the connection expanded, and the index of the first item of the timed steps."""
    import threading

    import torch

    from gpu_trace.runtime.client.device import connect, disconnect
    from gpu_trace.runtime.server import conversation as server_module
    from gpu_trace.runtime.server.server import Server

    srv = Server("127.0.0.1:0", token=TOKEN, spin_us=0, device=device).start()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    items: list[Any] = []
    streams: list[Any] = []
    run = srv.executor.run
    expand = server_module.expand

    def kept_run(session: Any, work: Any) -> None:
        items.append((work.kind, work.head, work.data))
        run(session, work)

    def kept_expand(templates: Any, stream: Any, ops: Any) -> Any:
        streams.append((templates, bytes(stream), ops))
        return expand(templates, stream, ops)

    srv.executor.run = kept_run  # type: ignore[method-assign]
    server_module.expand = kept_expand  # type: ignore[assignment]
    try:
        dev = connect(f"127.0.0.1:{srv.port}", token=TOKEN)
        try:
            step = MODELS[model](torch, dev, width)
            for _ in range(warm):
                step()
            first = len(items)
            first_stream = len(streams)
            for _ in range(steps):
                step()
        finally:
            disconnect()
    finally:
        server_module.expand = expand  # type: ignore[assignment]
        srv.close()
    items = [i for i in items if i[0] not in ("bye", "close")]
    return items, streams[first_stream:], first


# ---- replay --------------------------------------------------------------------------------------


class Replay:
    """The recorded items run on fresh sessions of a server built for it (never listening)."""

    def __init__(self, items: list[Any], first: int, device: str = "cpu") -> None:
        from gpu_trace.runtime.server.server import Server

        self.items, self.first = items, first
        self.server = Server("127.0.0.1:0", token=TOKEN, spin_us=0, device=device)
        self.ops = sum(len(head["ops"]) for kind, head, _ in items[first:] if kind == "batch")
        self.batches = sum(1 for kind, _, _ in items[first:] if kind == "batch")
        #: Sessions whose tensors are still used (the bare loop's).
        self.keep: list[Any] = []
        #: ``rt::`` ops in the timed batches (the runtime's own: autograd on the server...).
        self.rt_ops = 0

    def empty_batches(self, n: int) -> float:
        """Seconds of ``n`` batches without ops or frees: what every batch costs."""
        from gpu_trace.runtime.sharing.scheduler import Work
        from gpu_trace.runtime.sharing.sessions import Session

        srv = self.server
        session = Session({}, lambda *a: None, srv.tenants[0])
        session.binary = True
        srv.memory.attach(session)
        t0 = CLOCK()
        for seq in range(n):
            srv.executor.run(session, Work("batch", {"seq": seq, "ops": [], "free": []}))
        took = CLOCK() - t0
        srv.executor.run(session, Work("close"))
        srv.memory.detach(session)
        return took / 1e9

    def templates(self) -> list[Any]:
        from gpu_trace.runtime.protocol.templates import TOp

        seen: dict[int, Any] = {}
        for kind, head, _ in self.items:
            if kind == "batch":
                for op in head["ops"]:
                    if type(op) is TOp:
                        seen[id(op.t)] = op.t
        return list(seen.values())

    def once(self, trace: bool = False) -> float:
        """One replay: the timed batches' seconds, less their ``rt::`` ops' (not ATen ops: no
        bare peer; counted in :attr:`rt_ops`)."""
        from gpu_trace.runtime.server import op_runner as ex
        from gpu_trace.runtime.sharing.scheduler import Work
        from gpu_trace.runtime.sharing.sessions import Session

        run_pseudo = ex.run_pseudo
        in_rt = [0, 0]
        clock = CLOCK

        def timed_pseudo(*args: Any) -> Any:
            t0 = clock()
            try:
                return run_pseudo(*args)
            finally:
                in_rt[0] += clock() - t0
                in_rt[1] += 1

        for t in self.templates():  # each replay prepares its templates again
            t.prep = None
        srv = self.server
        srv.executor._ops.clear()  # and resolves its ops again (a part turned off: see _ablate)
        session = Session({"trace": trace}, lambda *a: None, srv.tenants[0])
        session.trace = trace
        session.binary = True
        srv.memory.attach(session)
        executor = srv.executor
        total = 0
        for n, (kind, head, data) in enumerate(self.items):
            work = Work(kind, head, data)
            if n >= self.first and kind == "batch":
                if in_rt[1] == 0 and n == self.first:
                    ex.run_pseudo = timed_pseudo  # type: ignore[assignment]
                t0 = clock()
                executor.run(session, work)
                total += clock() - t0
            else:
                executor.run(session, work)
            if session.closed:
                raise RuntimeError("the replayed session failed (a protocol error)")
        ex.run_pseudo = run_pseudo  # type: ignore[assignment]
        executor.run(session, Work("close"))
        srv.memory.detach(session)
        self.rt_ops = in_rt[1]
        return (total - in_rt[0]) / 1e9


# ---- peer: the same ATen ops, bare ---------------------------------------------------------------


def bare_calls(replay: Replay) -> list[Any]:
    """The timed batches' ATen ops as ``(callable, args, kwargs)`` with real tensors, decoded
    by a small interpreter of the recorded stream (its ``rt::`` ops run by the server's own code,
    on a session of its own, so that their outputs exist; they are not in the loop)."""
    from gpu_trace.runtime.protocol.templates import TOp
    from gpu_trace.runtime.protocol.values import ArgDecoder
    from gpu_trace.runtime.server import allowlist
    from gpu_trace.runtime.server.pseudo_ops import run_pseudo
    from gpu_trace.runtime.sharing.sessions import Session

    srv = replay.server
    session = Session({}, lambda *a: None, srv.tenants[0])
    replay.keep.append(session)  # its tensors are the loop's
    handles = session.handles
    decoder = ArgDecoder(handles.get, session.blobs.take, srv.executor.device)
    calls: list[Any] = []

    def keep(value: Any, outs: Any) -> None:
        if outs is None:
            return
        values = value if isinstance(value, tuple) else (value,)  # as the executor reads them
        for v, h in zip(values, outs):
            if type(h) is int:
                handles.put(h, v)
            elif type(h) is list:
                for vv, hh in zip(v, h):
                    if hh is not None:
                        handles.put(hh, vv)

    for n, (kind, head, data) in enumerate(replay.items):
        if kind == "put-inline":
            session.blobs.add(head, *data)
        elif kind == "put":
            session.blobs.begin(head, *data)
        elif kind == "chunk":
            session.blobs.chunk(*data)
        if kind != "batch":
            continue
        for op in head["ops"]:
            if type(op) is TOp:
                op = op.materialize()
            name, args, kwargs, outs = op
            if name.startswith("rt::"):
                run_pseudo(srv.executor, session, decoder, name, args, outs)
                continue
            target = allowlist.resolve(name)
            a = decoder.decode_args(args)
            k = decoder.decode_kwargs(kwargs) if kwargs else {}
            call = getattr(target, "_op", target)
            if n >= replay.first:
                calls.append((call, a, k))
            keep(call(*a, **k), outs)
        session.free_many(head.get("free", []))
    return calls


def _drain(device: str) -> None:
    """Wait for the device's queued work (outside the timed parts: on CUDA they time the
    launching thread, and the next part starts with an idle device)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_bare(calls: list[Any]) -> float:
    t0 = CLOCK()
    for call, a, k in calls:
        call(*a, **k)
    return (CLOCK() - t0) / 1e9


# ---- one child: record, replay, peers ------------------------------------------------------------


def _ablate(part: str) -> Any:
    """Turn one part of the executor off (for the breakdown); returns how to turn it on again."""
    from gpu_trace.runtime.server import allowlist
    from gpu_trace.runtime.server import op_runner as ex
    from gpu_trace.runtime.sharing.memory import Memory

    if part == "rules":
        saved = allowlist.rule
        allowlist.rule = lambda op: None  # type: ignore[assignment]
        return lambda: setattr(allowlist, "rule", saved)
    if part == "sizing":  # what an op will allocate, and the quota check of it
        saved = ex.sizer
        ex.sizer = lambda target: None  # type: ignore[assignment]
        return lambda: setattr(ex, "sizer", saved)
    if part == "accounting":  # per-tenant sums after every change, and the check after ops
        saved_over, saved_attach = Memory.over, Memory.attach

        def attach(self: Any, session: Any) -> None:
            saved_attach(self, session)
            session.account.on_change = None

        Memory.over = lambda self, session: False  # type: ignore[assignment,method-assign]
        Memory.attach = attach  # type: ignore[method-assign]

        def undo() -> None:
            Memory.over, Memory.attach = saved_over, saved_attach  # type: ignore[method-assign]

        return undo
    raise ValueError(part)


def child(
    model: str, width: int, warm: int, steps: int, repeat: int, device: str = "cpu"
) -> dict[str, Any]:
    import torch

    from gpu_trace.runtime.protocol.templates import expand

    torch.set_num_threads(1)
    items, streams, first = record(model, width, warm, steps, device)
    replay = Replay(items, first, device)
    calls = bare_calls(replay)
    runs: dict[str, list[float]] = {
        k: []
        for k in ("exec", "bare", "traced", "rules", "sizing", "accounting", "expand", "batch")
    }
    replay.once()  # warm
    time_bare(calls)
    _drain(device)
    for _ in range(repeat):  # interleaved: each variant once per round
        runs["exec"].append(replay.once())
        _drain(device)
        runs["bare"].append(time_bare(calls))
        _drain(device)
        runs["traced"].append(replay.once(trace=True))
        _drain(device)
        for part in ("rules", "sizing", "accounting"):
            undo = _ablate(part)
            try:
                runs[part].append(replay.once())
                _drain(device)
            finally:
                undo()
        t0 = CLOCK()
        for templates, stream, json_ops in streams:
            expand(templates, stream, json_ops)
        runs["expand"].append((CLOCK() - t0) / 1e9)
        runs["batch"].append(replay.empty_batches(replay.batches))
    ops = replay.ops - replay.rt_ops
    us = {k: min(v) / max(ops, 1) * 1e6 for k, v in runs.items()}  # best of the rounds
    return {
        "model": model,
        "ops": ops,
        "ops_per_step": replay.ops / steps,
        "rt_ops_per_step": replay.rt_ops / steps,
        "exec_us": us["exec"],
        "bare_us": us["bare"],
        "overhead_us": us["exec"] - us["bare"],
        "rules_us": us["exec"] - us["rules"],
        "sizing_us": us["exec"] - us["sizing"],
        "accounting_us": us["exec"] - us["accounting"],
        "spans_us": us["traced"] - us["exec"],
        "expand_us": us["expand"],
        "batch_us": us["batch"],
        "per_op_us": us["exec"] - us["bare"] - us["batch"],
        "ops_per_batch": ops / max(replay.batches, 1),
        "median_exec_us": statistics.median(runs["exec"]) / max(ops, 1) * 1e6,
    }


# ---- driver --------------------------------------------------------------------------------------


def _run_child(tree: str | None, args: argparse.Namespace, model: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", model]
    cmd += ["--width", str(args.width), "--steps", str(args.steps), "--repeat", str(args.repeat)]
    cmd += ["--device", args.device]
    if tree is not None:
        cmd += ["--tree", tree]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"bench child failed ({tree or 'this tree'}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


ROWS = (
    ("ops_per_step", "ops per step", "{:.0f}"),
    ("ops_per_batch", "ops per batch", "{:.1f}"),
    ("exec_us", "replayed batches, µs/op", "{:.2f}"),
    ("bare_us", "peer: bare ATen loop, µs/op", "{:.2f}"),
    ("overhead_us", "executor overhead, µs/op", "{:.2f}"),
    ("batch_us", "  a batch's own (an empty batch's)", "{:.2f}"),
    ("per_op_us", "  the ops' own", "{:.2f}"),
    ("rules_us", "  bounds rules", "{:.2f}"),
    ("sizing_us", "  sizing + quota check", "{:.2f}"),
    ("accounting_us", "  memory accounting", "{:.2f}"),
    ("spans_us", "  + spans (traced session)", "{:.2f}"),
    ("expand_us", "op stream decode (expand), µs/op", "{:.2f}"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed training steps")
    parser.add_argument("--warm", type=int, default=3, help="warm-up steps (not timed)")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per tree")
    parser.add_argument("--repeat", type=int, default=3, help="replays per child (best kept)")
    parser.add_argument("--width", type=int, default=64, help="the MLP's width")
    parser.add_argument("--models", default="mlp,lm")
    parser.add_argument(
        "--device", default="cpu", help="the server's device (cuda:0: the launching thread's time)"
    )
    parser.add_argument("--before", help="another tree to measure too (a git worktree)")
    parser.add_argument("--after", help="the tree to measure (default: this one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tree:
        checkout.use_tree(args.tree)
    if args.child:
        result = child(args.child, args.width, args.warm, args.steps, args.repeat, args.device)
        print(json.dumps(result))
        return
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"bench/executor_overhead.py: no CUDA device here for --device {args.device}")
            sys.exit(2)
    trees: list[tuple[str, str | None]] = [
        ("after", os.path.abspath(args.after) if args.after else None)
    ]
    if args.before:
        trees.insert(0, ("before", os.path.abspath(args.before)))
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for model in args.models.split(","):
            for label, tree in trees if r % 2 == 0 else trees[::-1]:
                results.setdefault((model, label), []).append(_run_child(tree, args, model))
    runs = f"median of {args.rounds} child runs, each the best of {args.repeat} replays"
    print(f"executor overhead per op ({runs}); this machine is shared: compare within the run")
    for model in args.models.split(","):
        labels = [label for label, _ in trees]
        print(f"\n{model}: " + " | ".join(labels))
        for key, title, fmt in ROWS:
            cells = [
                fmt.format(statistics.median(r[key] for r in results[(model, lab)]))
                for lab in labels
            ]
            print(f"  {title:<38} " + " | ".join(cells))
        if len(labels) == 2:
            b = statistics.median(r["overhead_us"] for r in results[(model, "before")])
            a = statistics.median(r["overhead_us"] for r in results[(model, "after")])
            print(f"  {'overhead after / before':<38} {a / b:.2f}x")
        rt = results[(model, labels[-1])][0]["rt_ops_per_step"]
        if rt:
            print(f"  ({rt:.0f} rt:: ops a step: timed apart and left out of both)")


if __name__ == "__main__":
    main()
