"""A Chrome trace file as `gpu-trace import` reads it, whoever wrote it: the file's bytes
(gzipped or not, a gzip bomb refused), its JSON with floats kept as their text, its times as
exact integer nanoseconds (:func:`to_ns`), the event fields every reader takes the same way, and
what a reader makes of the file (:class:`Converted`): the run as the store's rows.

The readers are :mod:`gpu_trace.store.kineto_trace` (what ``torch.profiler`` wrote) and
:mod:`gpu_trace.store.exported_trace` (what ``gpu-trace export`` wrote);
:mod:`gpu_trace.store.importer` picks one and stores the run.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import sys
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pyarrow as pa

from gpu_trace.tracer.run import RunInfo, new_trace_id

__all__ = [
    "TraceImportError",
    "Converted",
    "Progress",
    "teller",
    "READ_CHUNK",
    "EVENTS_CHUNK",
    "read_trace",
    "to_ns",
    "value_text",
    "event_int",
    "take_names",
    "w3c_trace_id",
]

#: Microseconds with three decimals: nanoseconds once the point is taken out.
_THREE_DECIMALS = re.compile(r"-?[0-9]+\.[0-9]{3}")


class TraceImportError(ValueError):
    """The file cannot be imported; the message says why in one line. Nothing was stored."""


@dataclass
class Converted:
    """A trace as the store's rows: the run, its spans and threads, and what was left out."""

    info: RunInfo
    spans: pa.Table
    threads: list[tuple[str, int, int, str, str]]  # host, pid, tid, process name, thread name
    counts: dict[str, int]
    skipped: Counter[str] = field(default_factory=Counter)
    linked: int = 0  # device spans whose launching call is in the trace
    backward_pairs: int = 0  # backward ops marked with their forward op (fwdbwd flows)
    counters: pa.Table | None = None  # counter samples (a gpu-trace export's)


#: ``progress(phase, done, total)``: what an import tells of its work (total None: unknown).
Progress = Callable[[str, int, "int | None"], None]


def teller(progress: Progress | None, total: int) -> Callable[[int], None] | None:
    """``progress`` for the converting phase of ``total`` events (None: nothing to tell)."""
    if progress is None:
        return None
    return lambda done: progress("converting events", done, total)


# ---- reading ------------------------------------------------------------------------------------


#: Most a gzipped trace may grow by when decompressed (traces compress about 10x, Kineto's up to
#: about 30x); beyond it the file is refused as a likely gzip bomb, with what to do if it is real.
MAX_GZIP_RATIO = 100
#: ... though a small file may always grow to this much.
MIN_GZIP_LIMIT = 256 << 20


#: Bytes read (and decompressed) between two calls of an import's ``progress``.
READ_CHUNK = 8 << 20
#: Events converted between two calls of an import's ``progress``.
EVENTS_CHUNK = 1 << 16


def _read(path: Path, progress: Progress | None) -> bytes:
    """The file's bytes, read in :data:`READ_CHUNK` pieces with ``progress`` told (MiB)."""
    if progress is None:
        return path.read_bytes()
    size = path.stat().st_size
    out = bytearray()
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            out += chunk
            progress("reading MiB", _mib(len(out)), _mib(max(size, len(out))))
    return bytes(out)


def _mib(n: int) -> int:
    """``n`` bytes in MiB, rounded up (a last piece of a file counts: 0 only for nothing)."""
    return -(-n >> 20)


def _gunzip(path: Path, raw: bytes, progress: Progress | None = None) -> bytes:
    """``raw`` decompressed (every gzip member), at most :data:`MAX_GZIP_RATIO` times its size."""
    limit = max(MIN_GZIP_LIMIT, MAX_GZIP_RATIO * len(raw))
    out: list[bytes] = []
    total, rest = 0, raw
    told = 0
    try:
        while rest:
            d = zlib.decompressobj(wbits=31)  # one gzip member
            while True:
                chunk = d.decompress(rest, 1 << 20)
                total += len(chunk)
                if progress is not None and total - told >= READ_CHUNK:
                    told = total
                    done = len(raw) - len(d.unconsumed_tail)  # a suffix of raw is left
                    progress("decompressing MiB", _mib(done), _mib(len(raw)))
                if total > limit:
                    raise TraceImportError(
                        f"{path.name}: decompresses to more than {limit >> 20} MiB"
                        f" ({MAX_GZIP_RATIO}x its size): refused as a likely gzip bomb; if it is"
                        " a real trace, gunzip it and import the .json"
                    )
                out.append(chunk)
                rest = d.unconsumed_tail
                if d.eof or not rest:
                    break
            if not d.eof:
                raise TraceImportError(f"{path.name}: the gzip stream is truncated")
            rest = d.unused_data
            if rest.strip(b"\0") == b"":  # padding after the last member
                rest = b""
    except zlib.error as exc:
        raise TraceImportError(f"{path.name}: not a readable gzip file ({exc})") from None
    return b"".join(out)


def read_trace(path: str | Path, progress: Progress | None = None) -> tuple[dict[str, object], str]:
    """The parsed trace (a dict with ``traceEvents``) and the SHA-256 of the file's bytes.

    Floats are kept as their text so times convert to nanoseconds exactly. Raises
    :class:`TraceImportError` with one line for a file that is missing, not gzip or JSON, truncated,
    or not a Chrome trace. ``progress``: told of each phase (reading and decompressing in MiB).
    """
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # /dev/zero, a FIFO: read until memory ends
            raise TraceImportError(f"{path}: not a regular file")
        raw = _read(path, progress)
    except OSError as exc:
        raise TraceImportError(f"cannot read {path}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(path, raw, progress)
    if progress is not None:
        progress(f"parsing {len(raw) >> 20:,} MiB of JSON", 0, None)
    try:
        data = json.loads(raw, parse_float=str)
    except UnicodeDecodeError:
        raise TraceImportError(f"{path.name}: not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise TraceImportError(
            f"{path.name}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise TraceImportError(f"{path.name}: not a Chrome trace (nested too deeply)") from None
    except ValueError:  # an integer of more digits than Python converts
        limit = sys.get_int_max_str_digits()
        raise TraceImportError(
            f"{path.name}: not a Chrome trace (a number of more than {limit:,} digits)"
        ) from None
    if isinstance(data, list):  # the Trace Event Format's array form
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceImportError(f"{path.name}: not a Chrome trace (no traceEvents list)")
    return data, digest


def to_ns(value: object) -> int:
    """Kineto microseconds (an int, or a float's text as parsed) as integer nanoseconds,
    exactly; ValueError for anything else."""
    if type(value) is str and _THREE_DECIMALS.fullmatch(value):  # what Kineto writes
        return int(value[:-4] + value[-3:])
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value * 1000
    if not isinstance(value, str):
        raise ValueError(value)
    whole, dot, frac = value.partition(".")
    if dot and len(frac) <= 3 and frac.isdigit() and whole.lstrip("-").isdigit():
        ns = int(whole) * 1000
        part = int(frac.ljust(3, "0"))
        return ns - part if whole.startswith("-") else ns + part
    try:  # exponents, more than three decimals: exact decimal arithmetic, rounded half-even
        return int((Decimal(value) * 1000).to_integral_value())
    except (InvalidOperation, ValueError):
        raise ValueError(value) from None


def value_text(value: object) -> str:
    """An argument's value as an attribute's text: text as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def event_int(value: object, what: str, index: int) -> int:
    """An event's integer field (``what`` of event ``index``); TraceImportError if it is not one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    raise TraceImportError(f"event {index}: {what} is {value!r}, not an integer")


def take_names(
    ev: dict[str, object],
    process_names: dict[int, str],
    thread_names: dict[tuple[int, int], str],
) -> None:
    """Note the process or thread name a metadata event (``ph: M``) gives."""
    args = ev.get("args")
    label = args.get("name") if isinstance(args, dict) else None
    pid, tid = ev.get("pid"), ev.get("tid")
    if not isinstance(label, str) or not isinstance(pid, int):
        return
    if ev.get("name") == "process_name":
        process_names[pid] = label
    elif ev.get("name") == "thread_name" and isinstance(tid, int):
        thread_names[(pid, tid)] = label


def w3c_trace_id(value: object) -> str:
    """A trace's id as a W3C one (32 lower-case hex digits), a new one when it is not."""
    text = str(value or "").lower()
    if len(text) == 32 and all(c in "0123456789abcdef" for c in text) and int(text, 16):
        return text
    return new_trace_id()
