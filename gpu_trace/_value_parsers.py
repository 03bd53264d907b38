"""The parsers of the ``GPU_TRACE_*`` settings' values, one kind of value each.

:data:`gpu_trace.config.CHECKS` gives every variable one of these, used by its getter and by
:func:`~gpu_trace.config.check_environment`, so a value is judged the same way before the program
starts (`gpu-trace record`, `gpu_trace.start()`) and where it is read. A parser returns the typed
value or raises :class:`Invalid` saying what it accepts; :func:`gpu_trace.config.parse` adds the
variable and the value to make the message. The variables, their meanings and which parser each
takes stay in :mod:`gpu_trace.config`, the one home for settings; how a kind of value is checked
is here.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable
from pathlib import Path


class Invalid(ValueError):
    """What a value should have been (the caller names the variable and the value)."""


def number(
    lo: float, hi: float, what: str, *, lo_open: bool = False, integer: bool = False
) -> Callable[[str], float]:
    bounds = f"{'(' if lo_open else '['}{plain(lo)}, {plain(hi)}]"
    expected = f"a {'whole ' if integer else ''}number of {what} in {bounds}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise Invalid(expected) from None
        # NaN fails every comparison and infinity every bound: both are refused here.
        if not math.isfinite(value) or not (lo < value if lo_open else lo <= value) or value > hi:
            raise Invalid(expected)
        if integer and not value.is_integer():
            raise Invalid(expected)
        return int(value) if integer else value

    return parse


def plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise Invalid(f"one of {', '.join(options)}")
        return value

    return parse


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise Invalid(f"one of {', '.join(_TRUE + _FALSE)}")
    return value in _TRUE


def directory(text: str) -> Path:
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise Invalid("a directory (this path is something else)")
    return path


def new_file(text: str) -> Path:
    path = Path(text).expanduser()
    if path.is_dir() or not path.parent.is_dir():
        raise Invalid("a file path in an existing directory")
    return path


def file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise Invalid("an existing file")
    return path


def dsn(text: str) -> str:
    from gpu_trace.store.dsn import parse_dsn

    try:
        parse_dsn(text)
    except ValueError as exc:
        raise Invalid(f"chdb:///path or http(s)://user:password@host:port ({exc})") from None
    return text


_CLUSTER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def cluster(text: str) -> str:
    if not _CLUSTER.match(text):
        raise Invalid("a cluster name (letters, digits, _ . -)")
    return text


def address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise Invalid("HOST:PORT with a port in [1, 65535]")
    return text


def token(text: str) -> str:
    if len(text) < 16:
        raise Invalid("at least 16 characters")
    return text


def command(text: str) -> str:
    # A compiler that is not there is not refused: the builds it is for fall back (native NVTX
    # capture off with a note, the Python gpu_trace.range), as documented.
    try:
        words = shlex.split(text)
    except ValueError:
        words = []
    if not words:
        raise Invalid("a command line (shell quoting)")
    return text


_RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def run_id(text: str) -> str:
    if not _RUN_ID.match(text) or text in (".", ".."):
        raise Invalid("1 to 128 letters, digits and _ . : -")
    return text


def job(text: str) -> str:
    if not text.strip() or len(text) > 200 or not text.isprintable():
        raise Invalid("a job id: 1 to 200 printable characters")
    return text


def signal_echo(text: str) -> str:
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise Invalid("FD:PID:INODE, set by gpu-trace record for the program it starts")
    return text


def anything(text: str) -> str:
    return text


def nvml_families(text: str) -> frozenset[str]:
    from gpu_trace.collectors.nvml.families import ALL, parse

    try:
        return parse(text)
    except ValueError:
        raise Invalid(f"NVML families from {', '.join(sorted(ALL))}, default, all") from None
