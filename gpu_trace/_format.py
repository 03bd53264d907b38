"""Human-readable numbers for the CLI: durations, counts, byte sizes, timestamps."""

from __future__ import annotations

import time


def duration(ns: float) -> str:
    """``1.23 ms`` style: three significant digits, unit by magnitude."""
    ns = float(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.0f} ns"


def count(n: int) -> str:
    return f"{n:,}"


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
    """A plain aligned text table."""
    right = right or set()
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
