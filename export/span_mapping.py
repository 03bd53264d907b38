"""Our spans as OpenTelemetry spans: which kinds are sent, and :class:`SpanMapper`, which gives
each sent span its OTLP identity, parent and times (the rules are in :mod:`gpu_trace.export.otlp`'s
docstring); :mod:`~gpu_trace.export.otlp` builds the requests and sends them, the stream
(:mod:`~gpu_trace.export.streaming`) maps a recording run's spans as they come."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import pyarrow as pa

from gpu_trace.export.exporter import check_batch
from gpu_trace.query.nesting import Adopting, Enclosing, end_order, nests, order
from gpu_trace.tracer.records import (
    FORWARD,
    KERNEL,
    MARK,
    MEMCPY,
    MODULE,
    NVTX,
    OP,
    OTEL,
    SERVER,
    STEP,
)

if TYPE_CHECKING:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan


log = logging.getLogger(__name__)

#: What can be sent, by kind: ``steps`` (``ProfilerStep#N``), ``forward`` (forwarded batches:
#: the client's batch, serialize, send and wait spans, the server's receive, queue, execute and
#: reply), ``ranges`` (``gpu_trace.range``, NVTX user domains, marks), ``modules`` (top-level
#: modules and layers), ``submodules`` (every module), ``ops`` (framework ops and each forwarded
#: op, client and server), ``kernels`` (kernels, copies), ``otel`` (the program's own
#: OpenTelemetry spans, which it may already export itself), ``other`` (anything else).
KINDS = ("steps", "forward", "ranges", "modules", "submodules", "ops", "kernels", "otel", "other")
DEFAULT_KINDS = frozenset({"steps", "forward", "ranges", "modules"})
#: Spans per request (OTLP collectors take a few MB per request; this is about 0.5 MB).
BATCH_SPANS = 1024
#: Spans waiting for a parent not seen yet (or, in end order, for a span enclosing them); beyond
#: it the oldest go with the parent they name (or as top-level).
MAX_HELD = 100_000
#: Spans remembered as possible parents (their link and whether they are in a module).
MAX_SEEN = 1_000_000

_SPAN_KIND_CLIENT = 3
_SPAN_KIND_SERVER = 2
_SPAN_KIND_INTERNAL = 1


def parse_kinds(text: str) -> frozenset[str]:
    """Kinds from ``--otlp-spans``: a comma list of :data:`KINDS`, ``default``, ``all``.

    Raises ``ValueError`` naming what is accepted.
    """
    out: set[str] = set()
    for word in (w.strip().lower() for w in text.split(",")):
        if word == "all":
            out.update(KINDS)
        elif word == "default":
            out.update(DEFAULT_KINDS)
        elif word in KINDS:
            out.add(word)
        else:
            raise ValueError(
                f"unknown span kind {word!r}; accepted: {', '.join(KINDS)}, default, all "
                "(comma-separated)"
            )
    return frozenset(out)


def kind_of(category: str, lane: str, in_module: bool) -> str:
    """The :data:`KINDS` entry of a span; ``in_module``: an ancestor is a module span."""
    if category == STEP:
        return "steps"
    if category in (FORWARD, SERVER):
        return "ops" if lane in ("forward/op", "server/op") else "forward"
    if category in (NVTX, MARK):
        return "ranges"
    if category == MODULE:
        return "submodules" if in_module else "modules"
    if category == OP:
        return "ops"
    if category in (KERNEL, MEMCPY):
        return "kernels"
    if category == OTEL:
        return "otel"
    return "other"


class Row(NamedTuple):
    """One span as the mapper reads it (times on the run's clock, ns)."""

    span_id: int
    parent_span_id: int
    host: str
    pid: int
    tid: int
    lane: str
    category: str
    name: str
    start_ns: int
    end_ns: int
    attrs: tuple[tuple[str, str], ...]


def rows(batch: pa.Table) -> list[Row]:
    """The rows of a span batch (the exporter seam's columns, or a spool table plus ``host``)."""
    check_batch(batch)

    def column(name: str, empty: object) -> list[object]:
        col = batch.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if col.null_count:
            col = col.fill_null(empty)
        return col.to_pylist()  # type: ignore[no-any-return]

    fields = Row._fields[:-1]
    cols = [column(c, "" if c in _TEXT else 0) for c in fields]
    attrs = [_attrs(a) if a else () for a in batch.column("attrs").to_pylist()]
    return list(map(Row._make, zip(*cols, attrs)))


_TEXT = frozenset({"host", "lane", "category", "name"})


def _attrs(a: object) -> tuple[tuple[str, str], ...]:
    if isinstance(a, Mapping):
        return tuple((str(k), str(v)) for k, v in a.items())
    # a map column reads as a list of (key, value) pairs, or {key, value} structs
    pairs: Iterable[object] = a  # type: ignore[assignment]
    return tuple(
        (str(p["key"]), str(p["value"])) if isinstance(p, dict) else _pair(p) for p in pairs
    )


def _pair(p: object) -> tuple[str, str]:
    if isinstance(p, (tuple, list)) and len(p) == 2:
        return str(p[0]), str(p[1])
    raise ValueError(f"an attrs entry is a (key, value) pair, got {p!r}")


@dataclass
class RunFacts:
    """What the mapping needs to know about the run (from the store's ``runs`` row or run.json)."""

    run_id: str
    trace_id: str
    command: str = ""
    started_ns: int = 0
    ended_ns: int = 0
    status: str = ""
    attrs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, run: Mapping[str, object]) -> RunFacts:
        attrs = run.get("attrs") or {}
        return cls(
            run_id=str(run.get("run_id") or ""),
            trace_id=str(run.get("trace_id") or ""),
            command=str(run.get("command") or ""),
            started_ns=int(run.get("started_ns") or 0),  # type: ignore[call-overload]
            ended_ns=int(run.get("ended_ns") or 0),  # type: ignore[call-overload]
            status=str(run.get("status") or ""),
            attrs={str(k): str(v) for k, v in dict(attrs).items()},  # type: ignore[call-overload]
        )

    def wall_offset_ns(self) -> int:
        """What to add to a time on the run's clock for Unix-epoch ns (0 when unknown)."""
        try:
            return int(self.attrs["anchor_wall_ns"]) - int(self.attrs["anchor_mono_ns"])
        except (KeyError, ValueError):
            return 0

    def name(self) -> str:
        """The run's name, whole: the one it was given (``profile(name=...)``), an imported
        trace's command (``import --name``'s, or ``import FILE``), else the recorded command's
        program (``python train.py``)."""
        given = self.attrs.get("name", "")
        if given:
            return given
        if self.attrs.get("source") and self.command:  # imported: the command is its name
            return self.command
        if not self.command:
            return "run"
        args = self.command.split(" ", 2)
        name = args[0].rsplit("/", 1)[-1]
        if len(args) > 1 and name.startswith("python"):
            name = f"{name} {args[1]}"  # python train.py
        return name[:120]

    def root_span_id(self) -> int:
        """The run's root span id (run.json's ``root_span_id``, or one hashed from the run id)."""
        try:
            value = int(self.attrs.get("root_span_id", ""), 16)
        except ValueError:
            value = 0
        return value or _hashed_id(f"run/{self.run_id}")

    def trace_bytes(self) -> bytes:
        try:
            raw = bytes.fromhex(self.trace_id)
        except ValueError:
            raw = b""
        if len(raw) != 16 or not any(raw):
            raw = hashlib.blake2b(f"trace/{self.run_id}".encode(), digest_size=16).digest()
        return raw


def _hashed_id(text: str) -> int:
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return value or 1


class _Seen(NamedTuple):
    link: int  # the span itself when sent, else its nearest sent ancestor (0: the run's root)
    in_module: bool  # the span or an ancestor is a module


@dataclass
class MapperStats:
    spans_in: int = 0
    kept: int = 0
    held_out: int = 0  # held for a parent, then sent naming a parent never seen


class SpanMapper:
    """Rows in, OTLP spans out: parents by nesting, kind selection, nearest-sent-ancestor parents,
    ids, wall times.

    ``order`` says how rows come: ``"start"``, by start time (the store's order; within one
    :meth:`add` any order, but rows starting at the same time come in the same call), or
    ``"end"``, about as they end (the spool). Raises ``ValueError`` for another. Not thread-safe;
    one producer feeds it.
    """

    def __init__(
        self,
        run: RunFacts,
        kinds: frozenset[str] = DEFAULT_KINDS,
        *,
        order: Literal["start", "end"] = "start",
    ) -> None:
        if order not in ("start", "end"):
            raise ValueError(f"order is 'start' or 'end', got {order!r}")
        from opentelemetry.proto.common.v1 import common_pb2
        from opentelemetry.proto.trace.v1 import trace_pb2

        self._pb = trace_pb2
        self._common_pb = common_pb2
        self._kv: dict[tuple[str, str, int], bytes] = {}
        self.run = run
        self.kinds = kinds
        self.stats = MapperStats()
        self._trace = run.trace_bytes()
        self._root = run.root_span_id()
        self._offset = run.wall_offset_ns()
        self._seen: OrderedDict[int, _Seen] = OrderedDict()
        self._held: OrderedDict[int, Row] = OrderedDict()  # by a key of its own, oldest first
        self._waiting: dict[int, dict[int, None]] = {}  # parent id -> held keys, in order
        self._held_seq = 0
        # Start order: a span's enclosing span came before it. End order: it comes after.
        self._enclosing = Enclosing() if order == "start" else None
        self._adopting: Adopting[Row] | None = Adopting() if order == "end" else None
        self.last_end_ns = 0

    # ---- feeding --------------------------------------------------------------------------------

    def add(self, batch: Iterable[Row]) -> list[tuple[Row, OtlpSpan]]:
        """Map rows; returns the spans ready to send (with their rows, for grouping)."""
        out: list[tuple[Row, OtlpSpan]] = []
        enclosing, adopting = self._enclosing, self._adopting
        for row in sorted(batch, key=_by_start if enclosing is not None else _by_end):
            self.stats.spans_in += 1
            self.last_end_ns = max(self.last_end_ns, row.end_ns)
            thread = (row.host, row.pid, row.tid)
            if enclosing is not None:
                parent = enclosing.parent(
                    thread,
                    row.span_id,
                    row.parent_span_id,
                    row.category,
                    row.lane,
                    row.start_ns,
                    row.end_ns,
                )
                if parent != row.parent_span_id:
                    row = row._replace(parent_span_id=parent)
            elif adopting is not None:
                for child in adopting.adopt(
                    thread, row.span_id, row.category, row.lane, row.start_ns, row.end_ns
                ):
                    self._hold(child._replace(parent_span_id=row.span_id), out)
                if not row.parent_span_id and nests(row.category):
                    adopting.wait(thread, row.start_ns, row.end_ns, row)
                    self._make_room(out)
                    continue
            parent = row.parent_span_id
            if parent and parent != self._root and parent not in self._seen:
                self._hold(row, out)
                continue
            self._place(row, out)
        return out

    def release(self, ended_before_ns: int) -> list[tuple[Row, OtlpSpan]]:
        """In end order: the spans naming no parent that ended before ``ended_before_ns`` and
        no span enclosing them has come for, as top-level spans (and what waited for them)."""
        out: list[tuple[Row, OtlpSpan]] = []
        if self._adopting is not None:
            for row in self._adopting.release(ended_before_ns):
                self._place(row, out)
        return out

    def finish(self) -> list[tuple[Row, OtlpSpan]]:
        """Everything still held, with the parents it names (or as top-level when it waited for
        an enclosing span); then nothing is held."""
        out: list[tuple[Row, OtlpSpan]] = []
        if self._adopting is not None:
            for row in self._adopting.drain():
                self._place(row, out)
        while self._held:
            self._release_oldest(out)
        return out

    def root_span(self, end_ns: int = 0) -> tuple[Row, OtlpSpan]:
        """The run's own span, parent of every top-level span sent."""
        run = self.run
        start = run.started_ns
        end = max(run.ended_ns or end_ns or self.last_end_ns, start)
        attrs = {"gpu_trace.run_id": run.run_id, "gpu_trace.status": run.status}
        for key in ("exit_code", "reason", "remote"):
            if run.attrs.get(key):
                attrs[f"gpu_trace.{key}"] = run.attrs[key]
        row = Row(self._root, 0, "", 0, 0, "run", "run", run.name(), start, end, ())
        span = self._span(row, attrs=tuple(attrs.items()))
        try:
            incoming = int(run.attrs.get("parent_span_id", ""), 16)
        except ValueError:
            incoming = 0
        span.parent_span_id = incoming.to_bytes(8, "big") if incoming else b""
        if run.status in ("failed", "killed", "died"):
            span.status.code = self._pb.Status.STATUS_CODE_ERROR
        return row, span

    # ---- parents ----------------------------------------------------------------------------------

    def _hold(self, row: Row, out: list[tuple[Row, OtlpSpan]]) -> None:
        key = self._held_seq
        self._held_seq += 1
        self._held[key] = row
        self._waiting.setdefault(row.parent_span_id, {})[key] = None
        self._make_room(out)

    def _make_room(self, out: list[tuple[Row, OtlpSpan]]) -> None:
        """Keep at most MAX_HELD waiting: the oldest waiting for a parent goes naming it (the tree
        stays right if that parent is sent), else the oldest waiting to be enclosed goes on top."""
        adopting = self._adopting
        while len(self._held) + (adopting.count if adopting is not None else 0) > MAX_HELD:
            if self._held:
                self._release_oldest(out)
            elif adopting is not None:
                row = adopting.oldest()
                if row is None:
                    return
                self.stats.held_out += 1
                self._place(row, out)

    def _release_oldest(self, out: list[tuple[Row, OtlpSpan]]) -> None:
        key, row = self._held.popitem(last=False)
        keys = self._waiting.get(row.parent_span_id)
        if keys is not None:
            del keys[key]
            if not keys:
                del self._waiting[row.parent_span_id]
        self.stats.held_out += 1
        self._place(row, out, orphan=True)

    def _place(self, row: Row, out: list[tuple[Row, OtlpSpan]], orphan: bool = False) -> None:
        """Map ``row`` whose parent is known (or given up on), then the rows held for it."""
        stack = [(row, orphan)]
        while stack:
            current, lost = stack.pop()
            parent = current.parent_span_id
            if lost:  # the parent never came: name it, it may still be sent later
                link, in_module = parent, False
            elif parent and parent != self._root:
                seen = self._seen[parent]
                link, in_module = seen.link, seen.in_module
            else:
                link, in_module = 0, False
            kind = kind_of(current.category, current.lane, in_module)
            keep = kind in self.kinds
            if keep:
                self.stats.kept += 1
                out.append((current, self._span(current, parent=link)))
            sid = current.span_id
            if sid:
                here = _Seen(sid if keep else link, in_module or current.category == MODULE)
                self._seen[sid] = here
                if len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                for key in self._waiting.pop(sid, {}):
                    stack.append((self._held.pop(key), False))

    # ---- one span -----------------------------------------------------------------------------------

    def _span(
        self, row: Row, parent: int = 0, attrs: tuple[tuple[str, str], ...] | None = None
    ) -> OtlpSpan:
        pb = self._pb
        sid = row.span_id or _hashed_id(
            f"{row.host}/{row.pid}/{row.tid}/{row.lane}/{row.name}/{row.start_ns}/{row.end_ns}"
        )
        if attrs is None:
            # Lane, category and thread repeat: a span holding just them is parsed from cached
            # bytes (about half the cost of building three attribute messages per span).
            span: OtlpSpan = pb.Span.FromString(self._common(row))
        else:
            span = pb.Span()
        span.trace_id = self._trace
        span.span_id = sid.to_bytes(8, "big")
        span.parent_span_id = (parent or self._root).to_bytes(8, "big")
        span.name = row.name
        span.kind = _kind(row)  # type: ignore[assignment]
        span.start_time_unix_nano = max(0, row.start_ns + self._offset)
        span.end_time_unix_nano = max(0, max(row.end_ns, row.start_ns) + self._offset)
        kv = span.attributes
        for key, value in attrs if attrs is not None else row.attrs:
            kv.add(key=key).value.string_value = value
        if attrs is None and row.attrs and _failed(row.attrs):
            span.status.code = pb.Status.STATUS_CODE_ERROR
        return span

    def _common(self, row: Row) -> bytes:
        key = (row.lane, row.category, row.tid)
        found = self._kv.get(key)
        if found is None:
            common = self._common_pb
            found = self._pb.Span(
                attributes=[
                    common.KeyValue(
                        key="gpu_trace.lane", value=common.AnyValue(string_value=row.lane)
                    ),
                    common.KeyValue(
                        key="gpu_trace.category", value=common.AnyValue(string_value=row.category)
                    ),
                    common.KeyValue(key="thread.id", value=common.AnyValue(int_value=row.tid)),
                ]
            ).SerializeToString()
            if len(self._kv) < 4096:
                self._kv[key] = found
        return found


def _by_start(row: Row) -> tuple[int, int, int]:
    return order(row.start_ns, row.end_ns, row.span_id)


def _by_end(row: Row) -> tuple[int, int, int]:
    return end_order(row.start_ns, row.end_ns, row.span_id)


def _kind(row: Row) -> int:
    if row.lane == "forward/batch" or row.lane.startswith("forward/batch/"):
        return _SPAN_KIND_CLIENT
    if row.category == SERVER and row.lane != "server/op":
        return _SPAN_KIND_SERVER
    return _SPAN_KIND_INTERNAL


def _failed(attrs: tuple[tuple[str, str], ...]) -> bool:
    for key, value in attrs:
        if (key == "error" and value not in ("", "0")) or (
            key == "otel.status" and value == "ERROR"
        ):
            return True
    return False
