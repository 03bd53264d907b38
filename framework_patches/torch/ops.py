"""Op ranges in PyTorch: every ATen op, backward ops included, from the profiler's C++ collection.

A Python hook per op (a ``TorchDispatchMode`` adds ~6.5 µs an op, a ``TorchFunctionMode``
~1.5 µs) costs more than the op on small models, and the NVTX ranges of ``emit_nvtx`` need a CUDA
build. The profiler's own collection (Kineto, CPU activity only) records each op in C++ for a
fraction of that, with nesting, and optionally input shapes and dtypes. So op level runs that
collection in sessions: at a step boundary or a top-level module call at least
:data:`HARVEST_INTERVAL_S` after the last, the session is stopped and a new one started (a few
milliseconds), and the finished session's result waits for the recorder's flusher, which turns its
event tree into spans (``category`` ``op``, lane ``torch/ops``) on the run's clock. The last
session is harvested when recording stops.

Module backward ranges come from the same collection at this level (no autograd hooks, see
:mod:`.backward`): the module wrapper notes each module call's range of autograd sequence
numbers in :attr:`OpSource.calls`, and a session's backward-node events are matched to them when
its spans are made. A graph whose backward runs more than one session after its forward (over
:data:`HARVEST_INTERVAL_S` later, with top-level module calls in between) gets op ranges but no
module backward ranges.

The profiler records the thread that started it and the autograd threads working for it; ops of
other threads are not captured. A program that starts ``torch.profiler`` itself while op level
is on gets an error from PyTorch (only one profiler may run): use ``--torch module`` there.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from gpu_trace.framework_patches.torch import backward as torch_backward
from gpu_trace.framework_patches.torch.backward import EVALUATE
from gpu_trace.framework_patches.torch.modules import DOMAIN
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.clock import anchor, now_ns
from gpu_trace.tracer.columns import spans_to_table
from gpu_trace.tracer.records import (
    MODULE,
    OP,
)

log = logging.getLogger(__name__)

LANE = "torch/ops"
HARVEST_INTERVAL_S = 2.0
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
        self._TorchOp = P._EventType.TorchOp
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
        self._last_calls: list[tuple[int, int, Any]] = []  # the previous session's, for _table
        self._results: list[tuple[Any, int, int, list, list]] = []
        self._lock = threading.Lock()
        self._on = False
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
            self._A._enable_profiler(self._config, self._activities)
        except Exception as exc:
            log.warning("gpu-trace: PyTorch op ranges are not captured: %s", exc)
            return False
        self._offset = a.wall_ns - a.mono_ns
        self.owner = threading.get_ident()
        self._tid = threading.get_native_id()
        self._on = True
        self._last = now_ns()
        ops = self._torch.ops.profiler
        ops._record_function_exit._RecordFunction(ops._record_function_enter_new(_MARKER, None))
        return True

    def stop(self) -> None:
        """End the session, keeping its result for the next drain (only on the starting thread)."""
        if not self._on or threading.get_ident() != self.owner:
            return
        self._on = False
        try:
            result = self._A._disable_profiler()
        except Exception:
            log.exception("gpu-trace: stopping PyTorch op collection failed")
            return
        calls, self.calls = self.calls, []
        passes, self.passes = self.passes, []
        with self._lock:
            self._results.append((result, self._offset, self._tid, calls, passes))

    def harvest(self, force: bool = False) -> None:
        """Stop the session and start the next if it has run long enough (or ``force``)."""
        if not self._on or threading.get_ident() != self.owner:
            return
        if not force and now_ns() - self._last < HARVEST_INTERVAL_S * 1e9:
            return
        self.stop()
        self.start()

    # ---- Source protocol ----------------------------------------------------------------------

    def drain(self) -> Iterable[tuple[str, pa.Table]]:
        if threading.get_ident() == self.owner and _recorder.active is None:
            self.stop()  # the recorder is closing on the program's thread: take the last session
        with self._lock:
            results, self._results = self._results, []
        for result, offset, tid, calls, passes in results:
            table = self._table(result, offset, tid, calls, passes)
            if table is not None:
                yield "spans", table

    def dropped(self) -> int:
        return self._dropped

    def after_fork_in_child(self) -> None:
        with self._lock:
            self._results = []
        self.calls, self.passes, self._last_calls = [], [], []

    def close(self) -> None:
        self.stop()
        with self._lock:
            self._results = []
        self._last_calls = []

    # ---- events to spans ----------------------------------------------------------------------

    def _table(
        self, result: Any, offset: int, tid: int, calls: list, passes: list
    ) -> pa.Table | None:
        rows: list[tuple] = []  # Span records
        rtids: list[int] = []  # the thread of each
        marker_tid = None
        todo = [(e, 0, 0, -1) for e in reversed(result.experimental_event_tree())]
        seq = 0
        prefix = (random.getrandbits(31) | 1) << 32  # as a ThreadBuffer's: odd, never the C ids
        TorchOp = self._TorchOp
        # For module backward ranges: backward nodes, and top-level forward ops (made with
        # grad on, so outside any backward pass: they end the ranges) unless a backward node is
        # inside them (a program's own range around forward and backward).
        nodes: list[tuple] = []
        tops: list[list] = []
        while todo:
            event, parent, depth, top = todo.pop()
            if event.tag != TorchOp:
                continue
            name = event.name
            if name == _MARKER:
                marker_tid = event.start_tid
                continue
            seq += 1
            sid = prefix + seq
            start, end = event.start_time_ns - offset, event.end_time_ns - offset
            if name.startswith(EVALUATE):
                nodes.append((event.start_tid, start, end, event.extra_fields.sequence_number))
                if top >= 0:
                    tops[top][3] = -1
            elif depth == 0 and event.extra_fields.sequence_number >= 0:
                top = len(tops)
                tops.append([event.start_tid, start, end, None])
            attrs = self._shapes(event) if self.shapes else None
            rows.append((sid, parent, LANE, OP, name, start, end, depth, attrs))
            rtids.append(event.start_tid)
            for child in reversed(event.children):
                todo.append((child, sid, depth + 1, top))
        last, self._last_calls = self._last_calls, calls
        if nodes and (calls or last):
            # tops are lists (marked in place above); ranges only reads them
            nodes.extend(t for t in tops if t[3] is None)  # type: ignore[misc]
            both = last + calls
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
