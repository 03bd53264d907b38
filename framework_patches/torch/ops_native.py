"""Op ranges in PyTorch from a native RecordFunction observer (``observer.cpp``).

Why: op level's Kineto sessions (:mod:`.ops`) have PyTorch process each session's events inside
the stop, on the program's thread (2-5 µs an event), and their conversion to spans costs the
flusher about 3 µs a span holding the GIL. A global RecordFunction callback in C++ writes each
op's record (name id, start and end on CLOCK_MONOTONIC, autograd sequence number, thread, depth,
parent) to a buffer of its thread when the op ends, with no Python and no GIL; the flusher takes
them in bulk as one NumPy array and makes the span columns with NumPy (bench/native_ops_probe.py:
about 0.3 µs an op on a one-thread CPU LSTM loop, where torch.profiler costs about twice that).

The spans are op level's (:mod:`.ops`): ``category`` ``op``, lane ``torch/ops``, the same names,
nesting and depth, an autograd node's ``evaluate_function`` range carrying its node's sequence
number. Module backward ranges are matched the same way (:mod:`.backward`): the owner's module
calls are cut into batches at top-level module calls at least :data:`~.ops.HARVEST_INTERVAL_S`
apart (a "cut", the sessions' counterpart: nothing stops there), and the records that ended
before a cut are matched to the calls kept so far (:class:`.backward.Kept`: by count, not time).
A cut is made where the owner runs no backward pass, so a pass's nodes are matched whole, once,
however long it ran; at op level, op spans of records no cut came for in
:data:`~.ops.MAX_WAIT_S` are made then, and their nodes wait for the next cut.
Records of every thread are taken, not only the owner's and the autograd engine's. Input shapes
are not recorded here: ``GPU_TRACE_TORCH_SHAPES`` keeps the Kineto sessions.

The library is compiled with the system C++ compiler (``CXX``, else ``g++``) against the installed
torch's headers and libraries, about 4 s, and cached under ``GPU_TRACE_HOME/lib`` named by the
hash of its source, torch's version and C++ ABI. A program that finds no build starts one in the
background and uses the Kineto sessions for this run (:func:`available`); the
``GPU_TRACE_TORCH_OPS`` setting forces either source (``native`` builds first and waits).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa

from gpu_trace import _cbuild, config
from gpu_trace.framework_patches.torch import backward as torch_backward
from gpu_trace.framework_patches.torch import ops as kineto_ops
from gpu_trace.framework_patches.torch.backward import EVALUATE
from gpu_trace.framework_patches.torch.modules import DOMAIN, ModuleRef
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.buffer import private_bits
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.columns import columns_to_table, spans_to_table
from gpu_trace.tracer.records import ATTRS, MODULE, OP, numeric_column, string_column

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("observer.cpp")
#: One record of observer.cpp (struct Rec), field for field.
RECORD = np.dtype(
    [
        ("start", "<i8"),
        ("end", "<i8"),
        ("seq", "<i8"),
        ("id", "<u8"),
        ("parent", "<u8"),
        ("root", "<u8"),
        ("fwd_tid", "<u8"),
        ("task", "<i8"),
        ("name", "<i4"),
        ("tid", "<i4"),
        ("depth", "<i4"),
        ("scope", "<i4"),
    ]
)

#: Records taken from the library at a time.
CHUNK = 1 << 16
#: Records a thread keeps between drains; more are dropped and counted (72 bytes each).
CAPACITY = 1 << 22
_BW = {"pass": "backward"}  # a module backward range's attrs, as module level's
#: Nodes only (module level): cuts at top-level module calls at least this far apart. Op level
#: cuts as its sessions do (every 20 ms: Kineto's stops).
CUT_INTERVAL_S = 0.1
#: gt_start's flags (observer.cpp): record_function ranges too; autograd nodes only.
USER_SCOPES, NODES_ONLY = 1, 2
#: at::RecordScope::BACKWARD_FUNCTION: an autograd node's own record (``AddmmBackward0``).
BACKWARD_FUNCTION = 1

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_building: threading.Thread | None = None


def torch_root() -> Path:
    """The installed torch's folder, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ImportError("torch is not installed")
    return Path(spec.origin).parent


def library_name() -> str:
    """The build's name: the source, and torch's version and place (its build, so its ABI), hashed;
    found without importing torch (a test session looks for it)."""
    version = importlib.metadata.version("torch")
    key = f"{version}|{torch_root()}|".encode() + SOURCE.read_bytes()
    return f"libgpu_trace_ops-{hashlib.sha256(key).hexdigest()[:16]}.so"


def build(out: Path) -> Path:
    """Compile the observer to ``out`` (atomically); :class:`_cbuild.BuildError` says why not."""
    import torch

    # torch.utils.cpp_extension's paths for a CPU build, without importing it: it imports
    # setuptools, which changes the program's sys.path (this may run inside the program).
    root = torch_root()
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    cxx = shlex.split(os.environ.get("CXX", "") or "g++")
    abi = int(torch.compiled_with_cxx11_abi())
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [*cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-w"]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for inc in includes:
        cmd += ["-I", str(inc)]
    cmd += [str(SOURCE), "-o", tmp]
    lib = root / "lib"
    cmd += ["-L", str(lib), f"-Wl,-rpath,{lib}"]
    cmd += ["-lc10", "-ltorch_cpu"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_cbuild.BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        raise _cbuild.BuildError(f"running the C++ compiler {cxx[0]!r} failed: {exc}") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise _cbuild.BuildError(f"compiling {SOURCE.name} failed: {tail}")
    os.replace(tmp, out)
    return out


def _cached() -> Path | None:
    name = library_name()
    for path in (SOURCE.with_name(name), config.home() / "lib" / name):
        if path.is_file():
            return path
    return None


def available() -> bool:
    """Whether the library is built (loading it then); if not, a build starts in the background
    for the next run, and False says to use the Kineto sessions meanwhile."""
    global _building
    try:
        if _lib is not None or _cached() is not None:
            return library() is not None
    except (ImportError, OSError):
        return False
    with _lock:
        if _failed is None and _building is None:
            _building = threading.Thread(target=_build_quietly, name="gpu-trace-ops-build")
            _building.daemon = True
            _building.start()
    return False


def find_or_build() -> Path:
    """The library's build: prebuilt next to its source, cached, or built there now."""
    return _cbuild.find_or_build(SOURCE, library_name(), config.home() / "lib", build)


def _build_quietly() -> None:
    try:
        find_or_build()
    except Exception as exc:
        log.info("gpu-trace: building the native op observer failed: %s", exc)


def library() -> ctypes.CDLL | None:
    """The loaded observer library, built first if needed; None (logged once) if it cannot be."""
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed is not None:
            return _lib
        try:
            path = find_or_build()
            lib = ctypes.CDLL(str(path))
            lib.gt_record_size.restype = ctypes.c_size_t
            if lib.gt_record_size() != RECORD.itemsize:
                raise _cbuild.BuildError("the observer's record layout differs from RECORD")
            lib.gt_start.argtypes = [ctypes.c_int]
            lib.gt_thread_id.restype = ctypes.c_uint64
            lib.gt_drain.restype = ctypes.c_size_t
            lib.gt_drain.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.gt_count.restype = ctypes.c_size_t
            lib.gt_dropped.restype = ctypes.c_uint64
            lib.gt_set_capacity.argtypes = [ctypes.c_size_t]
            lib.gt_name_count.restype = ctypes.c_int32
            lib.gt_name.restype = ctypes.c_int64
            lib.gt_name.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
            lib.gt_set_capacity(CAPACITY)
        except (_cbuild.BuildError, OSError, ImportError, AttributeError) as exc:
            _failed = str(exc)
            log.warning("gpu-trace: the native op observer is not available: %s", exc)
            return None
        _lib = lib
        return lib


def name_list(lib: ctypes.CDLL, names: list[str]) -> list[str]:
    """``names`` (the library's interned names read so far) extended with those interned since;
    ids index it."""
    have = len(names)
    count = int(lib.gt_name_count())
    if count > have:
        text = ctypes.create_string_buffer(1024)
        for i in range(have, count):
            size = int(lib.gt_name(i, text, len(text)))
            if size >= len(text):
                text = ctypes.create_string_buffer(size + 1)
                lib.gt_name(i, text, len(text))
            names.append(text.value.decode("utf-8", "replace"))
    return names


class NativeOpSource:
    """Runs the native observer and is the recorder's source for its spans (the same interface
    as :class:`.ops.OpSource`: ``calls``, ``passes`` and ``owner`` for the module wrapper).

    ``nodes_only`` (module level): the observer records autograd nodes only (each op then costs
    PyTorch one scope check, no callback), and the source makes the module backward ranges from
    them and no op spans. Passes are told apart by the graph task running each node (at op level
    by the forward ops between them), and nodes whose forward ran on another thread (whose
    sequence numbers are that thread's: its module calls place hooks) are left out."""

    name = "torch-ops"
    shapes = False

    def __init__(self, lib: ctypes.CDLL, nodes_only: bool = False) -> None:
        self._lib = lib
        self.nodes_only = nodes_only
        self.owner = threading.get_ident()
        self._rf_owner = -1  # the owner's RecordFunction thread id (nodes' forwardThreadId)
        #: The owner's module calls since the last cut, (first, end, module, anchor).
        self.calls: list[tuple[int, int, ModuleRef, int]] = []
        #: The owner's Tensor.backward passes: [start_ns, end_ns, parent, depth, running].
        self.passes: list[list[object]] = []
        #: The owner's calls of the cuts so far, for matching nodes to (kept by count).
        self._kept = torch_backward.Kept()
        self._interval_ns = (CUT_INTERVAL_S if nodes_only else kineto_ops.HARVEST_INTERVAL_S) * 1e9
        self._cuts: list[tuple[int, list, list]] = []  # (cut_ns, calls, passes), in order
        self._pending = np.empty(0, dtype=RECORD)  # taken, not yet before a cut
        #: Op level: nodes and top-level ops whose op spans were made (no cut for a while), kept
        #: to be matched to module calls at the next cut, when their pass is sure to be over.
        self._held = np.empty(0, dtype=RECORD)
        self._names: list[str] = []
        self._lock = threading.Lock()
        self._on = False
        self._last = 0
        self._dropped0 = 0
        self._prefix = (private_bits(31) | 1) << 32  # as a ThreadBuffer's: odd, never C ids

    def start(self) -> bool:
        """Start observing; False (logged) if PyTorch refuses the callback."""
        if self._on:
            return True
        if self._lib.gt_start(NODES_ONLY if self.nodes_only else USER_SCOPES) != 0:
            what = "module backward" if self.nodes_only else "op"
            log.warning(
                "gpu-trace: PyTorch %s ranges are not captured: the observer did not start", what
            )
            return False
        self.owner = threading.get_ident()
        self._rf_owner = int(self._lib.gt_thread_id())
        self._dropped0 = int(self._lib.gt_dropped())
        self._on = True
        self._last = now_ns()
        return True

    def stop(self) -> None:
        if self._on:
            self._on = False
            self._lib.gt_stop()

    def harvest(self, force: bool = False) -> None:
        """At a top-level module call: cut the owner's module calls if the last cut is
        :data:`~.ops.HARVEST_INTERVAL_S` old (or ``force``); nothing waits here."""
        if not self._on or threading.get_ident() != self.owner:
            return
        t = now_ns()
        if force or t - self._last >= self._interval_ns:
            self._last = t
            self._cut(t)

    def _cut(self, t: int) -> None:
        calls, self.calls = self.calls, []
        passes, self.passes = self.passes, []
        with self._lock:
            self._cuts.append((t, calls, passes))

    # ---- Source protocol ----------------------------------------------------------------------

    def drain(self) -> Iterable[tuple[str, pa.Table]]:
        closing = _recorder.active is None
        if closing:
            self.stop()
            self._cut(now_ns())
        # The cuts before the records: a record that ended before a cut was in the library when
        # the cut was made (the owner pushes a node's record before it goes on), so every record
        # of a cut taken here is taken with it. Taken the other way round, a pass could end and
        # the next forward cut between the two (the flusher preempted on a loaded machine): the
        # pass's last nodes then went to a later cut, whose passes lack theirs, and made second
        # ranges of the calls they belong to (181 ``lstm2.backward`` for 180 calls).
        with self._lock:
            cuts, self._cuts = self._cuts, []
        records = self._take()
        if not cuts:
            if (
                not self.nodes_only
                and len(records)
                and now_ns() - int(records["end"].min()) > kineto_ops.MAX_WAIT_S * 1e9
            ):
                # No top-level module call for a while (a program of bare ops, or a long step):
                # the op spans now. Their autograd nodes wait for the next cut, where the owner
                # runs no pass: matched now, a pass still running would be cut in two (ranges
                # split, or partly overlapping the pass's reentrant ones).
                yield "spans", self._ops_table(records)
                if len(self.calls) or len(self._kept):  # else no module call to match them to
                    self._hold(records[self._matched(records)[0]])
                records = records[:0]
            # nodes only: they wait for a cut however long the pass (the newest CAPACITY)
            self._pending = records[-CAPACITY:] if self.nodes_only else records
            return
        # Each record goes to the first cut at or after its end; the rest wait for the next.
        ends = np.fromiter((c[0] for c in cuts), dtype=np.int64, count=len(cuts))
        where = np.searchsorted(ends, records["end"], side="left")
        done = where < len(cuts)
        self._pending = records[~done]
        records, where = records[done], where[done]
        if len(records) and not self.nodes_only:
            yield "spans", self._ops_table(records)
        if len(self._held):  # they ended before the first of these cuts
            records = np.concatenate([self._held, records])
            where = np.concatenate([np.zeros(len(self._held), dtype=where.dtype), where])
            self._held = self._held[:0]
        for table in self._backward_tables(records, where, cuts):
            yield "spans", table

    def _hold(self, b: np.ndarray) -> None:
        """Keep records ``b`` for the next cut's matching (the newest :data:`CAPACITY`)."""
        self._held = np.concatenate([self._held, b])[-CAPACITY:]

    def _take(self) -> np.ndarray:
        """The pending records and all the library holds now, in one array."""
        got = [self._pending]
        size = max(int(self._lib.gt_count()), 1024)
        while True:
            buf = np.empty(size, dtype=RECORD)
            n = self._lib.gt_drain(buf.ctypes.data_as(ctypes.c_void_p), size)
            if n:
                got.append(buf[:n])
            if n < size:
                break
            size = CHUNK
        return np.concatenate(got) if len(got) > 1 else got[0]

    def dropped(self) -> int:
        return int(self._lib.gt_dropped()) - self._dropped0

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._prefix = (private_bits(31) | 1) << 32
        self._cuts, self._pending = [], np.empty(0, dtype=RECORD)
        self._held = self._pending
        self.calls, self.passes = [], []
        self._kept.clear()

    def close(self) -> None:
        self.stop()
        buf = np.empty(CHUNK, dtype=RECORD)
        while self._lib.gt_drain(buf.ctypes.data_as(ctypes.c_void_p), CHUNK) == CHUNK:
            pass  # what is left is not wanted
        with self._lock:
            self._cuts = []
        self._pending = self._held = np.empty(0, dtype=RECORD)
        self._kept.clear()

    # ---- records to spans ---------------------------------------------------------------------

    def _name_list(self) -> list[str]:
        return name_list(self._lib, self._names)

    def _ops_table(self, b: np.ndarray) -> pa.Table:
        """The op spans of records ``b``, made with NumPy."""
        n = len(b)
        names = self._name_list()
        used, codes = np.unique(b["name"], return_inverse=True)
        # Columns from buffers, never pa.array: it imports pandas, on the flusher (records.py).
        dictionary = string_column([names[i] for i in used])
        # One prefix for the source's ids: a parent may end in a later drain than its children.
        prefix = np.uint64(self._prefix)
        low = np.uint64(0xFFFFFFFF)
        parents = b["parent"]
        columns = {
            "span_id": prefix + (b["id"] & low),
            "parent_span_id": np.where(parents == 0, np.uint64(0), prefix + (parents & low)),
            "tid": b["tid"].astype(np.uint64),
            "lane": _constant(LANE, n),
            "category": _constant(OP, n),
            "name": pa.DictionaryArray.from_arrays(numeric_column(codes, pa.int32()), dictionary),
            "start_ns": b["start"],
            "end_ns": b["end"],
            "depth": np.minimum(b["depth"], 0xFFFF).astype(np.uint16),
            "attrs": pa.MapArray.from_arrays(
                numeric_column(np.zeros(n + 1, dtype=np.int32), pa.int32()),
                string_column([]),
                string_column([]),
                type=ATTRS,
            ),
        }
        return columns_to_table(columns, os.getpid())

    def _backward_tables(
        self,
        b: np.ndarray,
        where: np.ndarray,
        cuts: list[tuple[int, list, list]],
    ) -> Iterable[pa.Table]:
        """Module backward ranges, cut by cut: each cut's autograd nodes matched to the kept
        module calls their numbers fall in (:class:`.backward.Kept`, the cut's own added first;
        as :meth:`.ops.OpSource._table` does a session's)."""
        keep, is_node = self._matched(b)
        sel, wsel, nsel = b[keep], where[keep], is_node[keep]
        order = np.argsort(wsel, kind="stable")
        sel, wsel, nsel = sel[order], wsel[order], nsel[order]
        bounds = np.searchsorted(wsel, np.arange(len(cuts) + 1), side="left")
        rows: list[tuple[object, ...]] = []
        rtids: list[int] = []
        for i, (_, calls, passes) in enumerate(cuts):
            self._kept.add(calls)
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if lo == hi or not nsel[lo:hi].any():
                continue
            seqs = sel["seq"][lo:hi][nsel[lo:hi]]
            both = self._kept.select(seqs[seqs >= 0])
            if both:
                self._backward(sel[lo:hi], nsel[lo:hi], both, passes, rows, rtids)
        if rows:  # one table a drain: making one costs about as much as walking a cut
            yield spans_to_table(rows, os.getpid(), np.asarray(rtids, dtype=np.uint64))

    def _matched(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of records ``b`` the matching reads (``keep``), and which are autograd nodes."""
        if self.nodes_only:
            # nodes made by the owner's forward, and those with no forward op (AccumulateGrad)
            is_node = b["scope"] == BACKWARD_FUNCTION
            keep = is_node & ((b["seq"] < 0) | (b["fwd_tid"] == np.uint64(self._rf_owner)))
        else:
            names = self._name_list()
            evaluate = np.array(
                [i for i, name in enumerate(names) if name.startswith(EVALUATE)], dtype=np.int32
            )
            is_node = np.isin(b["name"], evaluate)
            # top-level forward ops made with grad on, unless a node ran inside them
            top = (b["depth"] == 0) & (b["seq"] >= 0) & ~is_node
            top &= ~np.isin(b["id"], b["root"][is_node])
            keep = is_node | top
        return keep, is_node

    def _backward(
        self,
        b: np.ndarray,
        is_node: np.ndarray,
        both: list,
        passes: list,
        rows: list[tuple[object, ...]],
        rtids: list[int],
    ) -> None:
        """The module backward ranges of one cut's nodes and top-level forward ops ``b``, added
        to ``rows`` (span tuples) and ``rtids`` (their threads)."""
        # In time order per thread, a forward op right after another ends nothing more (the
        # first closed every open range): only the first of each run is kept. On a program of
        # many small ops that halves the walk (forward ops are as many as the nodes).
        order = np.lexsort((b["start"], b["tid"]))  # stable, as the walk's own sort
        b, is_node = b[order], is_node[order]
        after_top = np.zeros(len(b), dtype=bool)
        after_top[1:] = (b["tid"][1:] == b["tid"][:-1]) & ~is_node[:-1]
        keep = is_node | ~after_top
        b, is_node = b[keep], is_node[keep]
        sep = _passes_apart(b) if self.nodes_only else None
        index = torch_backward.owners(both)
        nodes = _runs(b, is_node, both, passes, sep, index)
        prefix = (private_bits(31) | 1) << 32
        ids = iter(range(prefix + 1, prefix + (1 << 32)))
        made = torch_backward.ranges(nodes, both, passes, ids.__next__, index)
        lane = DOMAIN.lane
        for sid, parent, rtid, call, start, end, depth in made:
            rows.append((sid, parent, lane, MODULE, both[call][2].bw_name, start, end, depth, _BW))
            rtids.append(rtid)


LANE = kineto_ops.LANE


def _passes_apart(b: np.ndarray) -> np.ndarray:
    """Nodes-only records ``b`` (sorted by thread and start): where a separator goes (an event
    with seq None, which ends the open ranges as a forward op does at op level), before each
    outermost node of another pass (graph task) than the outermost node before it on its
    thread. A pass run inside a node (reentrant checkpointing) is not apart from the one around
    it: its calls nest in that node's."""
    sep = np.zeros(len(b), dtype=bool)
    top = np.flatnonzero(b["depth"] == 0)
    if len(top) > 1:
        task, tid = b["task"][top], b["tid"][top]
        sep[top[1:][(task[1:] != task[:-1]) & (tid[1:] == tid[:-1])]] = True
    return sep


def _runs(
    b: np.ndarray,
    is_node: np.ndarray,
    calls: list,
    passes: list,
    sep: np.ndarray | None,
    index: tuple | None = None,
) -> list[tuple[int, int, int, int | None]]:
    """The walk's events (:func:`.backward.ranges`) for records ``b`` (sorted by thread and
    start), with each run of consecutive nodes of a thread that belong to the same innermost
    module call in the same pass given as one event (its first node's start and sequence number,
    its last end), and the nodes with no forward op (``AccumulateGrad``) that follow one joined
    to it. The walk makes the same ranges from them (a node of the call just made extends its
    open ranges, nothing else), for several times fewer events in Python: a module call's
    backward is several nodes. A forward op (seq None) is an event of its own, and ``sep`` marks
    where a separator (seq None) goes before a node."""
    n = len(b)
    seq, tid, start, end = b["seq"], b["tid"], b["start"], b["end"]
    # each node's innermost call, as backward.innermost finds it, for all nodes at once
    starts, order, parent = torch_backward.owners(calls) if index is None else index
    firsts = np.asarray(starts, dtype=np.int64)
    order_a = np.asarray(order, dtype=np.int64)
    parent_a = np.asarray([*parent, -1], dtype=np.int64)  # [-1]: "none" stays none
    ends = np.asarray([c[1] for c in calls] + [1 << 62], dtype=np.int64)
    k = np.searchsorted(firsts, seq, side="right") - 1
    inner = np.where(k >= 0, order_a[np.maximum(k, 0)], -1)
    while True:
        outside = (inner >= 0) & (ends[inner] <= seq)
        if not outside.any():
            break
        inner[outside] = parent_a[inner[outside]]
    # the pass window each node starts in (as the walk finds it), -1 for none
    if passes:
        w0 = np.asarray([p[0] for p in passes], dtype=np.int64)
        w1 = np.asarray([p[1] or (1 << 62) for p in passes], dtype=np.int64)
        byw = np.argsort(w0, kind="stable")
        w0, w1 = w0[byw], w1[byw]
        w = np.searchsorted(w0, start, side="right") - 1
        w = np.where((w >= 0) & (w1[np.maximum(w, 0)] >= start), w, -1)
    else:
        w = np.full(n, -1, dtype=np.int64)
    pos = np.arange(n)
    label = np.where(is_node, inner, -3 - pos)  # a forward op: a label of its own
    # a node with no forward op joins the run before it on its thread
    own = ~is_node | (seq >= 0)
    last = np.maximum.accumulate(np.where(own, pos, -1))
    join = ~own & (last >= 0)
    join &= tid == tid[np.maximum(last, 0)]
    label = np.where(join, label[np.maximum(last, 0)], np.where(own, label, -3 - pos))
    w = np.where(join, w[np.maximum(last, 0)], w)
    new = np.ones(n, dtype=bool)
    new[1:] = (tid[1:] != tid[:-1]) | (w[1:] != w[:-1]) | (label[1:] != label[:-1])
    if sep is not None:
        new |= sep
    first = np.flatnonzero(new)
    run_end = np.maximum.reduceat(end, first) if n else end
    seqs = seq[first].astype(object)
    seqs[~is_node[first]] = None
    events = list(zip(tid[first].tolist(), start[first].tolist(), run_end.tolist(), seqs.tolist()))
    if sep is None or not sep.any():
        return events
    out: list[tuple[int, int, int, int | None]] = []
    for e, s in zip(events, sep[first].tolist()):
        if s:
            out.append((e[0], e[1], e[1], None))
        out.append(e)
    return out


def _constant(value: str, n: int) -> pa.Array:
    return pa.DictionaryArray.from_arrays(
        numeric_column(np.zeros(n, dtype=np.int32), pa.int32()), string_column([value])
    )
