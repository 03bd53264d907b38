"""Human-readable output for the CLI: durations, counts, byte sizes, timestamps, safe text."""

from __future__ import annotations

import re
import time

#: Characters a terminal acts on instead of showing: C0 and C1 controls (ESC starts the escape
#: sequences that retitle or clear a terminal), DEL, and the invisible bidirectional and
#: zero-width marks that make text read other than it is.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def text(value: object, keep: str = "") -> str:
    """``value`` as text that is safe to print: every control character (but those in ``keep``)
    is shown as its escape (``\\x1b``, ``\\n``, ``\\u202e``) instead of acting on the terminal.

    Names, commands, hosts and messages come from recorded programs and the store; one of them
    must not retitle, clear or rewrite the terminal of whoever runs ``gpu-trace show``.
    """
    s = str(value)

    def escape(m: re.Match[str]) -> str:
        c = m.group()
        return c if c in keep else c.encode("unicode_escape").decode("ascii")

    return _CONTROL.sub(escape, s)


def duration(ns: float) -> str:
    """``1.23 ms`` style: three significant digits, unit by magnitude."""
    ns = float(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.0f} ns"


def count(n: int) -> str:
    return f"{n:,}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 request``, ``3 requests``, ``1,024 files``: a count and its noun, singular for one."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def size(n: int | None) -> str:
    """``1.5 GiB`` style (powers of 1024); ``-`` for None."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{n} B"


def wall_time(ns: int | None) -> str:
    if not ns:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """A plain aligned text table; every cell is :func:`text` (one line, nothing a terminal runs)."""
    right = right or set()
    headers = [text(h) for h in headers]
    rows = [[text(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(row: list[str]) -> str:
        cells = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])
