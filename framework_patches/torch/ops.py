"""Op ranges in PyTorch: every ATen op, backward ops included, from the profiler's C++ collection.

A Python hook per op (a ``TorchDispatchMode`` adds ~6.5 µs an op, a ``TorchFunctionMode``
~1.5 µs) costs more than the op on small models, and the NVTX ranges of ``emit_nvtx`` need a CUDA
build. The profiler's own collection (Kineto, CPU activity only) records each op in C++ for a
fraction of that, with nesting, and optionally input shapes and dtypes. So op level runs that
collection in sessions: at a top-level module call at least :data:`HARVEST_INTERVAL_S` after
the last, the session is stopped and a new one started, and the recorder's flusher turns the
finished session's event tree into spans (``category`` ``op``, lane ``torch/ops``) on the run's
clock. The last session is harvested when recording stops.

Why sessions are short, and when their spans are made: stopping a session is where PyTorch
processes what it collected (about 2-4 µs an event, in C++ on the program's thread, with the
GIL released), so a session of 2 s of small ops stopped the program for seconds at once. Short
sessions (:data:`HARVEST_INTERVAL_S`, 20 ms; starting and stopping an empty one costs about
0.3 ms) spread that cost over the steps: with sessions as long as a few steps, windows of ten
steps hold stops of similar sizes (at 0.1 s, steps of a few milliseconds got windows with no
stop and windows with two, three times the CPU time). The flusher's conversion of the previous
session (Python, about 3 µs an event, holding the GIL) is done while the program's thread is
inside the next stop, which releases the GIL: the program is waiting then anyway, so the
conversion does not contend with it (:meth:`OpSource.harvest` wakes the flusher just before the
stop; a session waits at most :data:`MAX_WAIT_S` for one, and a conversion at most
:data:`PAUSE_S` in all for the next stops once the last has ended). Kineto's ``profiler_start`` and
``profiler_stop`` lines are kept off the program's stderr (:mod:`.kineto`).

Module backward ranges come from the same collection at this level (no autograd hooks, see
:mod:`.backward`): the module wrapper notes each module call's range of autograd sequence
numbers in :attr:`OpSource.calls`, and a session's backward-node events are matched to them when
its spans are made, with the calls of the sessions before it (:class:`.backward.Kept`: the last
``KEEP_CALLS`` calls, by count, so however long after its forward a graph's backward runs). A
session is stopped only where the owner runs no backward pass, so it holds its passes whole.

No session is cycled inside a ``record_function`` range the program has open (its own, around
a step, say): PyTorch would end the range in the wrong session, where its end lands on another
op. :class:`OpSource` counts the open ones on each thread (``record_function.__enter__`` and
``__exit__`` wrapped while op level is on) and waits for them to close, up to
:data:`MAX_SESSION_S`.

The profiler records the thread that started it and the autograd threads working for it; ops of
other threads are not captured.

PyTorch runs one profiler session at a time, and preparing one ends the one running (its events
are lost, and stopping it then logs a warning). So when the program starts its own,
:class:`OpSource` steps aside (:mod:`.program_profiler` sees it coming): its session is stopped
(and converted as any other) before the program's is prepared, and the next starts when the
program's has ended. While the program profiles, op level records no op ranges and no module
backward ranges; the program's profile has all the ops.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from gpu_trace.framework_patches.torch import backward as torch_backward
from gpu_trace.framework_patches.torch.backward import EVALUATE
from gpu_trace.framework_patches.torch.kineto import quietly
from gpu_trace.framework_patches.torch.modules import DOMAIN
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.buffer import private_bits
from gpu_trace.tracer.clock import anchor, now_ns
from gpu_trace.tracer.columns import spans_to_table
from gpu_trace.tracer.records import (
    MODULE,
    OP,
)

log = logging.getLogger(__name__)

LANE = "torch/ops"
#: Seconds a session runs at least before a top-level module call cycles it.
HARVEST_INTERVAL_S = 0.02
#: Seconds a finished session waits at most for the next stop before the flusher converts it.
MAX_WAIT_S = 1.0
#: Seconds a session runs at most while the program holds a record_function range open.
MAX_SESSION_S = 10.0
#: The flusher looks whether the owner is inside a stop every SLICE_MASK + 1 events, and waits
#: for one at most PAUSE_S seconds a drain (holding the flush lock, which a fork waits for).
SLICE_MASK = (1 << 11) - 1
PAUSE_S = 0.2
_MARKER = "gpu_trace#thread"
_BW = {"pass": "backward"}  # a module backward range's attrs, as module level's


class OpSource:
    """Runs the profiler's op collection and is the recorder's source for its spans."""

    name = "torch-ops"

    def __init__(self, torch: Any, *, shapes: bool = False) -> None:
        from torch._C import _autograd as A
        from torch._C import _profiler as P

        self._torch = torch
        self._A = A
        self._scopes = threading.local()  # .open: record_function ranges open on a thread
        self._scoped: tuple[type, Callable[..., object], Callable[..., object]] | None = None
        self._config = P.ProfilerConfig(
            P.ProfilerState.KINETO,
            bool(shapes),
            False,
            False,
            False,
            False,
            # No external correlation ids: they tie CPU ops to GPU activity, which is not collected
            # here; pushing one per op cost about 1% of a small LSTM's step.
            P._ExperimentalConfig(disable_external_correlation=True),
        )
        self._activities = {P.ProfilerActivity.CPU}
        self.shapes = bool(shapes)
        self.owner = threading.get_ident()
        self._tid = threading.get_native_id()
        self._offset = 0  # Kineto's Unix-epoch ns minus CLOCK_MONOTONIC ns, per session
        #: The owner's module calls this session, (first, end, module): see torch_backward.
        self.calls: list[tuple[int, int, Any]] = []
        #: The owner's Tensor.backward passes: [start_ns, end_ns, parent, depth, running].
        self.passes: list[list[int]] = []
        # the owner's calls of the sessions so far, to match nodes to (kept by count)
        self._kept = torch_backward.Kept()
        # finished sessions: (result, offset, tid, calls, passes, stopped_ns)
        self._results: list[tuple[Any, int, int, list, list, int]] = []
        self._lock = threading.Lock()
        self._due = False  # the flusher converts now: the owner is about to stop a session
        self._in_stop = threading.Event()  # set while the owner is inside a stop
        self._pause_left = 0.0  # seconds the current drain may still wait for the owner's stops
        self._on = False
        self._aside = False  # the program's own profiler runs (module docstring)
        self._last = 0
        self._dropped = 0

    # ---- sessions -----------------------------------------------------------------------------

    def start(self) -> bool:
        """Start a collection session on this thread; False (logged) if PyTorch refuses."""
        if self._on:
            return True
        try:
            self._A._prepare_profiler(self._config, self._activities)
            a = anchor()
            quietly(lambda: self._A._enable_profiler(self._config, self._activities))
        except Exception as exc:
            log.warning("gpu-trace: PyTorch op ranges are not captured: %s", exc)
            return False
        self._offset = a.wall_ns - a.mono_ns
        self.owner = threading.get_ident()
        self._tid = threading.get_native_id()
        self._on = True
        self._last = now_ns()
        if self._scoped is None:
            self._track_scopes()  # undone by close()
        ops = self._torch.ops.profiler
        ops._record_function_exit._RecordFunction(ops._record_function_enter_new(_MARKER, None))
        return True

    def stop(self) -> None:
        """End the session, keeping its result for the next drain (only on the starting thread)."""
        if not self._on or threading.get_ident() != self.owner:
            return
        self._on = False
        self._in_stop.set()
        try:
            result = quietly(self._A._disable_profiler)
        except Exception:
            log.exception("gpu-trace: stopping PyTorch op collection failed")
            return
        finally:
            self._in_stop.clear()
        calls, self.calls = self.calls, []
        passes, self.passes = self.passes, []
        with self._lock:
            self._results.append((result, self._offset, self._tid, calls, passes, now_ns()))

    def harvest(self, force: bool = False) -> None:
        """Stop the session and start the next if it has run long enough (or ``force``)."""
        if not self._on or threading.get_ident() != self.owner:
            return
        age = now_ns() - self._last
        if not force and age < HARVEST_INTERVAL_S * 1e9:
            return
        if getattr(self._scopes, "open", 0) > 0 and age < MAX_SESSION_S * 1e9:
            return  # inside the program's own record_function range (module docstring)
        if self._results:  # convert the last session while this thread waits in the stop
            self._due = True
            rec = _recorder.active
            if rec is not None:
                rec.wake()
        self.stop()
        self.start()

    # ---- the program's own profiler ----------------------------------------------------------

    def step_aside(self) -> None:
        """The program is about to prepare a profiler of its own: end this session first (only
        the thread that started it can; on another thread PyTorch ends it, unconverted)."""
        if self._on and threading.get_ident() == self.owner:
            self.stop()
            self._aside = True
            self._untrack_scopes()  # no frame of ours around the program's record_function

    def step_back(self) -> None:
        """The program's profiler has ended: start the next session (on the owner's thread)."""
        if not self._aside or threading.get_ident() != self.owner:
            return
        try:
            if self._A._profiler_enabled():
                return  # one of the program's is still on (nested, or started again)
        except Exception:
            return
        self._aside = False
        self._scopes = threading.local()  # counts of ranges opened while untracked are gone
        self.start()

    def _track_scopes(self) -> None:
        """Count the record_function ranges open on each thread (see the module docstring)."""
        cls = self._torch.autograd.profiler.record_function
        enter, exit_ = cls.__enter__, cls.__exit__
        scopes = self._scopes

        def __enter__(rf: object) -> object:
            got = enter(rf)
            scopes.open = getattr(scopes, "open", 0) + 1
            return got

        def __exit__(rf: object, *exc: object) -> object:
            scopes.open = max(0, getattr(scopes, "open", 0) - 1)
            return exit_(rf, *exc)

        __enter__.__wrapped__ = enter  # type: ignore[attr-defined]
        __exit__.__wrapped__ = exit_  # type: ignore[attr-defined]
        cls.__enter__, cls.__exit__ = __enter__, __exit__
        self._scoped = (cls, enter, exit_)

    def _untrack_scopes(self) -> None:
        if self._scoped is not None:
            cls, enter, exit_ = self._scoped
            setattr(cls, "__enter__", enter)  # noqa: B010 (a class's dunder, put back)
            setattr(cls, "__exit__", exit_)  # noqa: B010
            self._scoped = None

    # ---- Source protocol ----------------------------------------------------------------------

    def drain(self) -> Iterable[tuple[str, pa.Table]]:
        closing = _recorder.active is None
        if closing and threading.get_ident() == self.owner:
            self.stop()  # the recorder is closing on the program's thread: take the last session
        with self._lock:
            waited = bool(self._results) and now_ns() - self._results[0][5] > MAX_WAIT_S * 1e9
            if not (closing or self._due or waited):
                return  # wait for the owner's next stop (see the module docstring)
            self._due = False
            results, self._results = self._results, []
        self._pause_left = 0.0 if closing else PAUSE_S  # for all of this drain's sessions
        for result, offset, tid, calls, passes, _ in results:
            table = self._table(result, offset, tid, calls, passes)
            if table is not None:
                yield "spans", table

    def dropped(self) -> int:
        return self._dropped

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._in_stop = threading.Event()
        with self._lock:
            self._results = []
        self.calls, self.passes = [], []
        self._kept.clear()

    def close(self) -> None:
        self.stop()
        self._aside = False
        self._untrack_scopes()
        with self._lock:
            self._results = []
        self._kept.clear()

    # ---- events to spans ----------------------------------------------------------------------

    def _pause(self, budget: float) -> float:
        """Wait (the GIL released) until the owner is inside a stop, within ``budget`` seconds;
        returns what is left of it (0 once spent: the conversion then goes straight on)."""
        if _recorder.active is None:
            return 0.0  # the recorder is closing: no more stops to wait for
        if self._in_stop.is_set():
            return budget
        t = now_ns()
        self._in_stop.wait(budget)
        return max(0.0, budget - (now_ns() - t) / 1e9)

    def _table(
        self, result: Any, offset: int, tid: int, calls: list, passes: list
    ) -> pa.Table | None:
        """The spans of a finished session, made while the owner's thread is inside a stop (the
        GIL is free then) as far as :attr:`_pause_left` lets the conversion wait for one."""
        rows: list[tuple] = []  # Span records
        rtids: list[int] = []  # the thread of each
        marker_tid = None
        # A node's children run on its thread: only the roots' thread is read (each attribute
        # read costs about a microsecond). With CPU activity only, and neither memory nor
        # stacks, every event is a TorchOp: the tag is not read either.
        todo = [(e, 0, 0, -1, e.start_tid) for e in reversed(result.experimental_event_tree())]
        seq = 0
        prefix = (private_bits(31) | 1) << 32  # as a ThreadBuffer's: odd, never the C ids
        # For module backward ranges: backward nodes, and top-level forward ops (made with
        # grad on, so outside any backward pass: they end the ranges) unless a backward node is
        # inside them (a program's own range around forward and backward).
        nodes: list[tuple] = []
        tops: list[list] = []
        pause = self._pause_left if _recorder.active is not None else 0.0
        while todo:
            event, parent, depth, top, etid = todo.pop()
            name = event.name
            if name == _MARKER:
                marker_tid = etid
                continue
            seq += 1
            if not seq & SLICE_MASK and pause:
                pause = self._pause_left = self._pause(pause)
            sid = prefix + seq
            start, end = event.start_time_ns - offset, event.end_time_ns - offset
            if name.startswith(EVALUATE):
                nodes.append((etid, start, end, event.extra_fields.sequence_number))
                if top >= 0:
                    tops[top][3] = -1
            elif depth == 0 and event.extra_fields.sequence_number >= 0:
                top = len(tops)
                tops.append([etid, start, end, None])
            attrs = self._shapes(event) if self.shapes else None
            rows.append((sid, parent, LANE, OP, name, start, end, depth, attrs))
            rtids.append(etid)
            children = event.children
            if children:
                depth += 1
                todo.extend([(c, sid, depth, top, etid) for c in reversed(children)])
        self._kept.add(calls)
        seqs = np.fromiter((n[3] for n in nodes), dtype=np.int64, count=len(nodes))
        both = self._kept.select(seqs[seqs >= 0])
        if both:
            # tops are lists (marked in place above); ranges only reads them
            nodes.extend(t for t in tops if t[3] is None)  # type: ignore[misc]
            ids = iter(range(prefix + seq + 1, prefix + (1 << 32)))
            made = torch_backward.ranges(nodes, both, passes, ids.__next__)
            for sid, parent, rtid, call, start, end, depth in made:
                name = both[call][2].bw_name
                rows.append((sid, parent, DOMAIN.lane, MODULE, name, start, end, depth, _BW))
                rtids.append(rtid)
        if not rows:
            return None
        threads = np.asarray(rtids, dtype=np.uint64)
        tids = np.where(threads == marker_tid, tid, threads) if marker_tid is not None else threads
        return spans_to_table(rows, os.getpid(), tids)

    @staticmethod
    def _shapes(event: Any) -> dict[str, str] | None:
        try:
            inputs = event.extra_fields.inputs
        except AttributeError:
            return None
        shapes, dtypes = [], []
        for i in inputs:
            sizes = getattr(i, "sizes", None)
            if sizes is not None:
                shapes.append(str(list(sizes)))
                dtypes.append(str(i.dtype).replace("torch.", ""))
            elif isinstance(i, list) and i and hasattr(i[0], "sizes"):
                shapes.append(str([list(t.sizes) for t in i]))
                dtypes.append(str(i[0].dtype).replace("torch.", ""))
            else:
                shapes.append("")
                dtypes.append("")
        if not any(shapes):
            return None
        return {"input_shapes": "[" + ", ".join(shapes) + "]", "input_dtypes": ",".join(dtypes)}
