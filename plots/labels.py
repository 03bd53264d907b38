"""Labels of the timeline: track names down its left side and span names on or beside bars.

Plain functions of text and pixel widths (the names are escaped where plotly draws them:
:func:`esc`); :mod:`gpu_trace.plots.figures` places what they return.
"""

from __future__ import annotations

import bisect
import html
import math

from gpu_trace import _format as fmt
from gpu_trace.query.gpu_work import device_lane
from gpu_trace.query.timeline_tracks import TrackInfo

#: Bars at least this many pixels wide get their name written in them.
LABEL_PX = 40
LABEL_FONT_PX = 10
LABEL_PAD_PX = 3
#: A name written beside a narrow bar shows at least this many characters (or all of it).
BESIDE_MIN_CHARS = 8
#: Width of a label character in ems, generously (track label margin, names cut to fit bars).
CHAR_EM = 0.62
#: Characters of a track label at most (longer ones lose their start: host and process).
MAX_LABEL = 80


def esc(text: object) -> str:
    """Text for plotly labels and hovers, which render a subset of HTML: escaped, so it shows as is."""
    return html.escape(str(text), quote=False)


def track_label(t: TrackInfo) -> str:
    gpu = device_lane(t.lane)
    if gpu is not None:  # a GPU's stream: grouped under its GPU, whichever thread launched
        proc = t.process.split(" ")[0].rsplit("/", 1)[-1] if t.process else "pid"
        sub = t.lane.split("/", 2)[2] if t.lane.count("/") >= 2 else ""
        where = f"stream {gpu[1]}" if gpu[1] >= 0 else "context"
        label = f"GPU {gpu[0]} · {where}{' · ' + sub if sub else ''} · {proc} {t.pid}"
        if t.tid:  # synchronizations: a thread of the process waiting on the stream or context
            label += f" · waits of {t.thread or f'tid {t.tid}'}"
        return esc(f"{t.host} · {label}" if t.host else label)  # an imported trace has no host
    who = t.thread or (f"tid {t.tid}" if t.tid != t.pid else "main")
    proc = t.process.split(" ")[0].rsplit("/", 1)[-1] if t.process else "pid"
    label = f"{proc} {t.pid} · {who} · {t.lane}"
    label = f"{t.host} · {label}" if t.host else label  # an imported trace has no host
    owners = owners_text(t.owners) or (
        f"tenant{'s' if len(t.tenants) > 1 else ''} {_listed(t.tenants)}" if t.tenants else ""
    )
    if owners:  # whose work it holds: a server lane's spans, a client process's sessions
        label += f" · {owners}"
    if t.clock_uncertainty_ns:
        label += f" (clock ±{fmt.duration(t.clock_uncertainty_ns)})"
    return esc(label if len(label) <= MAX_LABEL else "…" + label[-(MAX_LABEL - 1) :])


def _listed(names: tuple[str, ...] | list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (", …" if len(names) > most else "")


def owners_text(owners: tuple[tuple[str, str], ...]) -> str:
    """Whose work a track holds, from its (tenant, session) pairs: ``tenant alice (session 2)``,
    ``tenant bob (sessions 1, 3)``; several tenants by name only, ``tenants alice, bob`` (each
    server span's hover names its own); ``session 4`` where the session has no tenant."""
    tenants: dict[str, list[str]] = {}
    for tenant, session in owners:
        tenants.setdefault(tenant, []).append(session)
    named = [t for t in tenants if t]
    if len(named) > 1:
        return f"tenants {_listed(named)}"
    parts = []
    for tenant, sessions in tenants.items():
        ids = sorted({s for s in sessions if s}, key=lambda s: (len(s), s))
        said = f"session{'s' if len(ids) > 1 else ''} {_listed(ids)}" if ids else ""
        parts.append(f"tenant {tenant}" + (f" ({said})" if said else "") if tenant else said)
    return ", ".join(p for p in parts if p)


def label_px(text: str) -> float:
    """Width of ``text`` written in a label, generously."""
    return len(text) * LABEL_FONT_PX * CHAR_EM


def place_labels(
    bars: list[tuple[int, float, float, str]], window_ns: int, ns_per_px: float
) -> list[tuple[int, float, str, bool]]:
    """Where bar names are written: ``(row, x px, text, beside)`` for bars given as ``(row, left
    px, right px, name)`` (their visible part).

    A bar at least :data:`LABEL_PX` wide has its name inside it, cut to fit. Then, longest bar
    first, a narrower bar has its name written just right of it where its row has room up to
    the next name or wide bar (``beside``, dark on a white halo): so the longest ranges of a
    window are named at any zoom, a run's steps and top modules in its first view included.
    Names never overlap.
    """
    width = window_ns / ns_per_px
    taken: dict[int, list[tuple[float, float]]] = {}  # per row, sorted, non-overlapping
    out: list[tuple[int, float, str, bool]] = []

    def free(row: int, a: float, b: float) -> float:
        """How far right of ``a`` the row is free, up to ``b`` (``a`` itself taken: -1)."""
        spans = taken.get(row, [])
        i = bisect.bisect_right(spans, (a, math.inf))
        if i and spans[i - 1][1] > a:
            return -1.0
        return min(b, spans[i][0]) if i < len(spans) else b

    def take(row: int, a: float, b: float) -> None:
        bisect.insort(taken.setdefault(row, []), (a, b))

    narrow = []
    for row, left, right, name in bars:
        if right - left >= LABEL_PX:
            take(row, left, right)
            text = fit_label(name, right - left)
            if text:
                out.append((row, left + LABEL_PAD_PX, text, False))
        else:
            narrow.append((right - left, row, left, right, name))
    narrow.sort(key=lambda b: -b[0])
    for _, row, left, right, name in narrow:
        a = right + LABEL_PAD_PX
        room = free(row, left, width) - a - LABEL_PAD_PX
        text = fit_label(name, room + 2 * LABEL_PAD_PX) if room > 0 else ""
        if not text or len(text) < min(len(name), BESIDE_MIN_CHARS + 1):
            continue
        take(row, left, a + label_px(text) + LABEL_PAD_PX)
        out.append((row, a, text, True))
    return out


def fit_label(name: str, width_px: float) -> str:
    """``name`` cut to fit a bar ``width_px`` wide ('' if the bar is narrower than LABEL_PX)."""
    if width_px < LABEL_PX:
        return ""
    room = int((width_px - 2 * LABEL_PAD_PX) / (LABEL_FONT_PX * CHAR_EM))
    if len(name) <= room:
        return name
    return name[: max(1, room - 1)] + "…"
