"""The page's address: what a link to a view holds, read from it and written back to it.

``?run=RUN&tab=TAB&t0=NS&t1=NS&counter=SOURCE/METRIC&counter=...&q=TERM``

- ``run``: a run id, an id prefix or ``last`` (the page writes the run's full id);
- ``tab``: the tab open (the page writes it only for another tab than the timeline);
- ``t0``, ``t1``: the window, integer nanoseconds since the run started (what the line above the
  chart and the time axis count), so a link reads the same whatever clock the run was recorded on;
- ``counter``: each counter panel under the timeline, in order; ``counter=`` alone: none;
- ``q``: the span search's term.

A value that can't be read (not a number, an empty window, a term too long) is dropped, and the
view falls back to its default for it; a window that misses the run is dropped by
:func:`window_in_run`. The page writes the address with each change of the window, the counters
or the search (``callbacks.update_timeline``), so reloading the page or opening the link shows
the same view, and the browser's back and forward buttons step through the views.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode

#: The longest search term, counter name and run reference the address is read with.
MAX_TEXT = 200
#: Counter panels read from an address at most.
MAX_COUNTERS = 16
_INT = re.compile(r"^-?[0-9]{1,19}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Address:
    """What an address asks for; None where it asks nothing (the view's default)."""

    run: str = "last"
    tab: str | None = None
    #: The window, ns since the run started (``t0 < t1``).
    window: tuple[int, int] | None = None
    #: The counter panels, in order (empty: none).
    counters: tuple[str, ...] | None = None
    query: str | None = None


def text(value: str | None) -> str | None:
    """``value`` stripped, or None if it is empty, too long or holds control characters."""
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_TEXT or _CONTROL.search(value):
        return None
    return value


def parse(search: str | None, tabs: tuple[str, ...] = ()) -> Address:
    """The address ``?...`` as asked; what can't be read is left out (never an error)."""
    try:
        q = parse_qs((search or "").lstrip("?"), keep_blank_values=True, max_num_fields=64)
    except ValueError:  # more fields than any page writes
        return Address()

    def first(key: str) -> str | None:
        values = q.get(key)
        return values[0] if values else None

    tab = first("tab")
    window = None
    t0, t1 = first("t0"), first("t1")
    if t0 is not None and t1 is not None and _INT.match(t0.strip()) and _INT.match(t1.strip()):
        a, b = int(t0), int(t1)
        if a < b and max(abs(a), abs(b)) < 2**62:
            window = (a, b)
    counters = None
    if "counter" in q:
        picked = [text(c) for c in q["counter"]]
        valid = [c for c in picked if c is not None and "/" in c]
        # Only blanks: no counters, as asked. Something unreadable: the default panels.
        if len(valid) == sum(1 for c in q["counter"] if c.strip()):
            counters = tuple(dict.fromkeys(valid))[:MAX_COUNTERS]
    return Address(
        run=text(first("run")) or "last",
        tab=tab if tab in tabs else None,
        window=window,
        counters=counters,
        query=text(first("q")),
    )


def write(address: Address) -> str:
    """The address as ``?...`` (the form :func:`parse` reads)."""
    fields: list[tuple[str, str | int]] = [("run", address.run)]
    if address.tab:
        fields.append(("tab", address.tab))
    if address.window is not None:
        fields += [("t0", address.window[0]), ("t1", address.window[1])]
    if address.counters is not None:
        fields += [("counter", c) for c in address.counters] or [("counter", "")]
    if address.query:
        fields.append(("q", address.query))
    return "?" + urlencode(fields, safe="/:*")


def window_in_run(window: tuple[int, int] | None, duration_ns: int) -> tuple[int, int] | None:
    """``window`` if it shows some of a run ``duration_ns`` long and reaches no further than a
    run's length past either end (a pan can go a little past them); else None."""
    if window is None:
        return None
    t0, t1 = window
    dur = max(1, int(duration_ns))
    if t1 <= 0 or t0 >= dur or t0 < -dur or t1 > 2 * dur:
        return None
    return window
