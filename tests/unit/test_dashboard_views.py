"""The timeline's views: span search, the address that holds a view, the first view of a run.

On a real chDB store holding the sample runs (sample_traces/runs) and runs built with exact
times (tests/dashboard_data.py); the callback is posted as the Dash renderer posts it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from urllib.parse import parse_qs

import pytest

pytest.importorskip("dash")

from gpu_trace.dashboard import (  # noqa: E402
    address,
    callbacks,
    reports,
    samples,
    timeline,
)
from gpu_trace.dashboard.address import Address  # noqa: E402
from gpu_trace.dashboard.readonly_store import ReadOnlyStore  # noqa: E402
from gpu_trace.plots import figures  # noqa: E402
from gpu_trace.query import matches as search  # noqa: E402
from gpu_trace.query.source import rows as query_rows
from gpu_trace.store.client import Store  # noqa: E402
from tests.dashboard_data import (  # noqa: E402
    XSS,
    add_counters,
    add_run,
    forwarded_run,
    lod_run,
)

H100 = "20261124-174647-9ad8eb"  # 13.2 s: start-up, then 70 steps in its last 1.7 s
TABS = callbacks.TAB_VALUES


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadOnlyStore]:
    store = Store(f"chdb://{tmp_path_factory.mktemp('views') / 'store'}")
    samples.load_samples(store)
    lod_run(store)  # no steps
    forwarded_run(store)
    # Spans whose names hold LIKE's own wildcards and a quote, and three sharing one start.
    names = ["50% done", "50 done", "a_b", "axb", "it's", "same", "same", "same", XSS]
    spans = [
        {"name": n, "lane": "nvtx/a", "start_ns": 1000 * (i if n != "same" else 10),
         "end_ns": 1000 * (i if n != "same" else 10) + 500, "span_id": 7 + i}
        for i, n in enumerate(names)
    ]  # fmt: skip
    add_run(store, "names", spans, 0, 20_000)
    # One tenant (named like a script tag) with two sessions, each holding memory.
    add_run(store, "two-sessions", [{"name": "s", "lane": "nvtx/a", "start_ns": 0,
                                     "end_ns": 10_000}], 0, 10_000)  # fmt: skip
    add_counters(
        store,
        "two-sessions",
        [
            {"metric": "session_memory_bytes", "ts_ns": ts, "value": v,
             "labels": {"tenant": XSS, "session": session}}
            for session, points in (("1", ((1000, 1.0), (5000, 2.0))),
                                    ("3", ((2000, 10.0), (6000, 20.0))))
            for ts, v in points
        ],
    )  # fmt: skip
    src = ReadOnlyStore(store=store)
    yield src
    src.close()


def names_of(source: ReadOnlyStore, run: str) -> list[dict]:
    return query_rows(
        source,
        "SELECT toString(span_id) AS id, span_id AS n, name, start_ns FROM __db__.spans"
        " WHERE run_id = {r:String}",
        {"r": run},
    )


def brute(rows: list[dict], term: str) -> list[dict]:
    """The spans ``term`` matches, by the rule the page states: any case; a substring, or a glob
    over the whole name where the term holds * or ?; in (start, span id) order."""
    t = term.lower()
    if "*" in term or "?" in term:
        found = [r for r in rows if fnmatch.fnmatchcase(r["name"].lower(), t)]
    else:
        found = [r for r in rows if t in r["name"].lower()]
    return sorted(found, key=lambda r: (int(r["start_ns"]), int(r["n"])))


# ---- search ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "run,term",
    [
        (H100, "train_step"),
        (H100, "NORM1"),  # any case: norm1 and norm1.backward in 6 layers
        (H100, "LM.blocks.*.norm1"),  # a glob: the whole name
        (H100, "*backward"),
        (H100, "LM.blocks.layers.?.dropout"),
        (H100, "nothing like it"),
        ("names", "50%"),  # % is a character, not LIKE's wildcard
        ("names", "a_b"),  # and _ too (it would match axb)
        ("names", "it's"),
        ("names", "') OR 1=1 --"),  # a parameter, never SQL
        ("names", XSS),
        ("forwarded-two-tenants", "execute"),
    ],
)
def test_the_count_is_every_span_whose_name_matches(source: ReadOnlyStore, run, term) -> None:
    expected = brute(names_of(source, run), term)
    assert search.count(source, run, term) == len(expected)


def test_a_search_counts_the_sample_runs_spans_as_their_names_say(source: ReadOnlyStore) -> None:
    assert search.count(source, H100, "train_step") == 70  # one per step
    assert search.count(source, H100, "LM.blocks.*.norm1") == 6 * 70
    assert search.count(source, H100, "norm1") == 2 * 6 * 70
    assert search.count(source, "names", "50%") == 1 and search.count(source, "names", "a_b") == 1
    assert search.describe("aten::*") == "glob, any case"
    assert search.describe("mm") == "name contains, any case"


@pytest.mark.parametrize("run,term", [(H100, "train_step"), ("names", "same"), ("names", "a")])
def test_next_and_previous_walk_every_match_in_time_order_and_go_round(
    source: ReadOnlyStore, run, term
) -> None:
    expected = [(int(r["start_ns"]), r["id"]) for r in brute(names_of(source, run), term)]
    seen = []
    hit = search.neighbour(source, run, term)
    for _ in range(len(expected)):
        assert hit is not None and hit.index == len(seen)
        seen.append((hit.start_ns, hit.span_id))
        hit = search.neighbour(source, run, term, after=(hit.start_ns, int(hit.span_id)))
    assert seen == expected  # spans sharing a start included, each once
    assert hit is not None and hit.index == 0  # past the last: the first
    back = search.neighbour(source, run, term, before=(hit.start_ns, int(hit.span_id)))
    assert back is not None and (back.start_ns, back.span_id, back.index) == (
        *expected[-1], len(expected) - 1
    )  # fmt: skip
    walked = [expected[-1]]
    for _ in range(len(expected) - 1):
        back = search.neighbour(source, run, term, before=(back.start_ns, int(back.span_id)))
        assert back is not None
        walked.append((back.start_ns, back.span_id))
    assert walked == expected[::-1]


def test_a_search_starts_from_the_window(source: ReadOnlyStore) -> None:
    steps = timeline.steps_extent(source, H100)
    assert steps is not None
    t0, t1 = steps[0], steps[1]
    first = search.from_window(source, H100, "train_step", t0, t1, forward=True)
    # The first train_step starts just before the first step: the first in the window is #2.
    assert first is not None and first.index == 1 and first.start_ns >= t0
    last = search.from_window(source, H100, "train_step", t0, t1, forward=False)
    assert last is not None and last.index == 69 and last.start_ns < t1
    run = timeline.run(source, H100)
    early = run["started_ns"], run["started_ns"] + 10**9  # before any train_step
    assert search.from_window(source, H100, "train_step", *early, forward=False).index == 69
    assert search.from_window(source, H100, "train_step", *early, forward=True).index == 0
    assert search.neighbour(source, H100, "nothing like it") is None


# ---- the address ------------------------------------------------------------------------------


def test_an_address_is_read_as_written() -> None:
    view = Address(run="r1", tab="summary", window=(-5, 1_000), counters=("nvml/a", "host/b"),
                   query="aten::* & 'x'")  # fmt: skip
    written = address.write(view)
    assert written.startswith("?run=r1&tab=summary&t0=-5&t1=1000&counter=nvml/a&counter=host/b")
    assert address.parse(written, TABS) == view
    assert address.parse(address.write(Address(run="r1", counters=())), TABS).counters == ()
    assert address.parse("?run=r1&tab=timeline", TABS) == Address(run="r1", tab="timeline")
    assert address.parse(None, TABS) == address.parse("", TABS) == Address()


@pytest.mark.parametrize(
    "query",
    [
        "t0=abc&t1=100",  # not a number
        "t0=1.5&t1=100",
        "t0=100&t1=100",  # empty
        "t0=200&t1=100",  # backwards
        "t0=100",  # one end only
        "t0=0&t1=99999999999999999999999",  # past any clock
        "tab=nope",
        "q=" + "x" * 201,  # too long
        "q=a%00b",  # a control character
        "q=%20%20",  # blank
        "counter=no-slash",
        "counter=nvml/gpu_util_pct&counter=" + "n/" + "x" * 300,
        "run=",
        "&".join(f"f{i}=1" for i in range(100)),  # more fields than any page writes
    ],
)
def test_what_an_address_cannot_say_is_left_out(query: str) -> None:
    assert address.parse("?" + query, TABS) == Address()


def test_a_window_must_show_some_of_the_run() -> None:
    dur = 1000
    assert address.window_in_run((0, 1000), dur) == (0, 1000)
    assert address.window_in_run((-500, 100), dur) == (-500, 100)  # panned a little past
    assert address.window_in_run((900, 1900), dur) == (900, 1900)
    for outside in ((1000, 1500), (-300, 0), (-5000, 10), (10, 5000)):
        assert address.window_in_run(outside, dur) is None, outside


def window_of(view: dict) -> tuple[int, int]:
    win = view[("window", "data")]
    return win["t0"] - win["base"], win["t1"] - win["base"]


def test_a_run_opens_on_its_steps_with_the_whole_run_a_click_away(source: ReadOnlyStore) -> None:
    """The H100 sample is 13.2 s, its 70 steps the last 1.7 s: it opened with 80% of its width
    on start-up before training."""
    timeline.prepare(source, H100)
    view = callbacks.first_view(source, f"?run={H100}", 1600)
    steps = query_rows(
        source,
        "SELECT min(start_ns) AS lo, max(end_ns) AS hi FROM __db__.spans"
        " WHERE run_id = {r:String} AND category = 'step'",
        {"r": H100},
    )[0]
    win = view[("window", "data")]
    assert (win["t0"], win["t1"]) == (steps["lo"], steps["hi"])
    assert (win["start"], win["end"]) != (win["t0"], win["t1"])
    assert view[("window-text", "children")].endswith("(1.68 s) · the run's 70 steps")
    assert view[("steps", "disabled")] is False
    bars = {b["name"] for b in timeline.window(source, H100, win["t0"], win["t1"], 1270).bars}
    assert sum(n.startswith("ProfilerStep#") for n in bars) == 70
    # A run without steps opens on all of it, and its Steps button is off.
    timeline.prepare(source, "lod")
    plain = callbacks.first_view(source, "?run=lod", 1600)
    assert window_of(plain) == (0, 10_000_000) and plain[("steps", "disabled")] is True
    assert plain[("window-text", "children")].endswith("· the whole run")


def test_the_address_restores_the_window_the_counters_and_the_search(
    source: ReadOnlyStore,
) -> None:
    timeline.prepare(source, H100)
    asked = f"?run={H100}&t0=1000000000&t1=2500000000&counter=host/cpu_util_pct&q=train_step"
    view = callbacks.first_view(source, asked, 1600)
    assert window_of(view) == (1_000_000_000, 2_500_000_000)
    assert view[("counter-pick", "value")] == ["host/cpu_util_pct"]
    assert view[("search", "value")] == "train_step"
    assert view[("search-count", "children")] == "70 matches · name contains, any case"
    assert view[("search-hit", "data")] == {"run": H100, "q": "train_step", "total": 70,
                                            "index": None}  # fmt: skip
    assert view[("window", "data")]["search"] == asked  # the page shows what it asks for
    panels = [a["text"] for a in view[("timeline", "figure")]["layout"]["annotations"]]
    assert panels == ["host/cpu_util_pct"]
    none = callbacks.first_view(source, f"?run={H100}&counter=", 1600)
    assert none[("counter-pick", "value")] == []


@pytest.mark.parametrize(
    "query",
    [
        "t0=x&t1=2",
        "t0=2000000000&t1=1000000000",
        "t0=99000000000&t1=99500000000",  # after the run's end
        "t0=-99000000000&t1=-98000000000",  # before its start
        "counter=nvml/no_such_counter",
        "counter=bad",
        "q=" + "y" * 300,
        "tab=nope",
    ],
)
def test_bad_values_in_the_address_give_the_default_view(source: ReadOnlyStore, query) -> None:
    timeline.prepare(source, H100)
    default = callbacks.first_view(source, f"?run={H100}", 1600)
    view = callbacks.first_view(source, f"?run={H100}&{query}", 1600)
    assert window_of(view) == window_of(default)
    assert view[("counter-pick", "value")] == default[("counter-pick", "value")] == [
        "nvml/gpu_util_pct", "nvml/mem_used_bytes", "host/cpu_util_pct"
    ]  # fmt: skip
    assert view[("search", "value")] == "" and view[("search-hit", "data")] is None
    assert view[("tabs", "value")] == "timeline"
    assert view[("message", "children")] == ""


# ---- the callback, as the page posts it ------------------------------------------------------


@pytest.fixture(scope="module")
def client(source: ReadOnlyStore) -> Iterator[tuple]:
    from gpu_trace.dashboard.app import create_app

    app = create_app(source)
    yield app, app.server.test_client()


def post(client: tuple, changed: str, values: dict) -> dict:
    """Post the timeline callback as the renderer does (``changed``: ``id.property``); what it
    updated."""
    app, http = client
    key = next(k for k in app.callback_map if "timeline.figure" in k)
    spec = app.callback_map[key]

    def given(deps: list) -> list:
        return [
            [] if isinstance(d["id"], dict) else
            {"id": d["id"], "property": d["property"],
             "value": values.get(f"{d['id']}.{d['property']}")}
            for d in deps
        ]  # fmt: skip

    r = http.post(
        "/_dash-update-component",
        json={
            "output": key,
            "outputs": [{"id": c, "property": p} for c, p in callbacks.TIMELINE_OUTPUTS],
            "inputs": given(spec["inputs"]),
            "changedPropIds": [changed],
            "state": given(spec["state"]),
        },
    )
    assert r.status_code in (200, 204), r.get_data(as_text=True)
    return (r.get_json(silent=True) or {}).get("response", {})


def page_of(view: dict, location: str) -> dict:
    """The page's values once it shows ``view`` at ``location``."""
    return {
        "url.search": location,
        "run.value": view[("run", "value")],
        "counter-pick.value": view[("counter-pick", "value")],
        "search.value": view[("search", "value")],
        "search-hit.data": view[("search-hit", "data")],
        "window.data": view[("window", "data")],
        "tabs.value": "timeline",
        "viewport.data": 1600,
    }


def moved(page: dict, changed: dict) -> dict:
    """The page after a callback's answer."""
    out = dict(page)
    for cid, props in changed.items():
        for prop, value in props.items():
            out[f"{cid}.{prop}"] = value
    return out


def test_enter_frames_and_selects_the_next_match_and_the_address_follows(
    client: tuple, source: ReadOnlyStore
) -> None:
    timeline.prepare(source, H100)
    location = f"?run={H100}"
    page = page_of(callbacks.first_view(source, location, 1600), location)
    expected = brute(names_of(source, H100), "train_step")
    page["search.value"] = "train_step"
    changed = post(client, "search.n_submit", page)  # Enter
    # The first match in the window (the steps): the second train_step, framed and selected.
    hit = expected[1]
    win = changed["window"]["data"]
    s, e = int(hit["start_ns"]), int(hit["start_ns"]) + 1
    assert win["t0"] < s < win["t1"] and changed["selected"]["data"] == {
        "span_id": hit["id"], "start_ns": int(hit["start_ns"])
    }  # fmt: skip
    span = timeline.span(source, H100, hit["id"], int(hit["start_ns"]))
    e = int(span["end_ns"])
    pad = (e - s) // 2
    assert (win["t0"], win["t1"]) == (s - pad, e + pad)  # the span fills the middle half
    assert changed["search-count"]["children"] == "2 of 70 · name contains, any case"
    assert any(t["type"] == "bar" for t in changed["timeline"]["figure"]["data"])
    # The address holds the window (ns since the run started), the counters and the term.
    written = changed["url"]["search"]
    assert written == win["search"]
    q = parse_qs(written.lstrip("?"))
    base = win["base"]
    assert q["run"] == [H100] and q["q"] == ["train_step"]
    assert (int(q["t0"][0]), int(q["t1"][0])) == (win["t0"] - base, win["t1"] - base)
    assert q["counter"] == page["counter-pick.value"]
    # Opening that address shows the same window (the view a link or a reload gets).
    again = callbacks.first_view(source, written, 1600)
    assert window_of(again) == (win["t0"] - base, win["t1"] - base)
    assert again[("search-count", "children")] == "70 matches · name contains, any case"

    # Next, and back past the first: round to the last.
    page = moved(page, changed)
    changed = post(client, "search-next.n_clicks", page)
    assert changed["search-count"]["children"].startswith("3 of 70")
    assert changed["selected"]["data"]["span_id"] == expected[2]["id"]
    page = moved(page, changed)
    for want in ("2 of 70", "1 of 70", "70 of 70"):
        changed = post(client, "search-prev.n_clicks", page)
        assert changed["search-count"]["children"].startswith(want)
        page = moved(page, changed)
    assert page["selected.data"]["span_id"] == expected[69]["id"]


def test_leaving_the_box_counts_without_moving_and_a_blank_term_clears(
    client: tuple, source: ReadOnlyStore
) -> None:
    timeline.prepare(source, H100)
    location = f"?run={H100}"
    view = callbacks.first_view(source, location, 1600)
    page = {**page_of(view, location), "search.value": "LM.blocks.*.norm1"}
    changed = post(client, "search.n_blur", page)
    assert changed["search-count"]["children"] == "420 matches · glob, any case"
    assert "timeline" not in changed and "selected" not in changed  # not moved, not redrawn
    assert "q=LM.blocks.*.norm1" in changed["url"]["search"]
    page = moved(page, changed)
    assert post(client, "search.n_blur", page) == {}  # the same term: nothing to do
    changed = post(client, "search.n_submit", {**page, "search.value": "  "})
    assert changed["search-count"]["children"] == "" and changed["search-hit"]["data"] is None
    assert "q=" not in changed["url"]["search"]
    nothing = post(client, "search.n_submit", {**page, "search.value": "no such name"})
    assert nothing["search-count"]["children"] == "no span matches · name contains, any case"
    assert "timeline" not in nothing and "selected" not in nothing  # nowhere to go


def test_zoom_whole_run_and_steps_write_the_address(client: tuple, source: ReadOnlyStore) -> None:
    timeline.prepare(source, "fwd")
    location = "?run=fwd"
    view = callbacks.first_view(source, location, 1600)
    page = page_of(view, location)
    zoom = {"xaxis.range[0]": 1_000_000, "xaxis.range[1]": 1_500_000}
    changed = post(client, "zoom.data", {**page, "zoom.data": zoom})
    assert changed["url"]["search"].startswith("?run=fwd&t0=1000000&t1=1500000&counter=")
    page = moved(page, changed)
    changed = post(client, "reset.n_clicks", {**page, "reset.n_clicks": 1})
    assert "t0=0&t1=3000000" in changed["url"]["search"]
    assert changed["window-text"]["children"].endswith("· the whole run")
    page = moved(page, changed)
    changed = post(client, "steps.n_clicks", {**page, "steps.n_clicks": 1})
    assert "t0=0&t1=2900000" in changed["url"]["search"]
    assert changed["window-text"]["children"].endswith("· the run's 3 steps")
    # The page's own address coming back (Dash's first call, a reload): nothing redrawn.
    page = moved(page, changed)
    assert post(client, "url.search", page) == {}
    # Another address (the back button): that view.
    changed = post(client, "url.search", {**page, "url.search": "?run=fwd&t0=5&t1=500005"})
    assert changed["window"]["data"]["t0"] == 5 and "timeline" in changed
    # A run picked in the page: its own address, written.
    changed = post(client, "run.value", {**page, "run.value": "lod"})
    assert changed["url"]["search"] == "?run=lod" == changed["window"]["data"]["search"]


# ---- whose lanes, and legends ----------------------------------------------------------------

TWO = "forwarded-two-tenants"


def test_a_two_tenant_runs_lanes_name_their_tenant_and_session(source: ReadOnlyStore) -> None:
    """Its lanes showed pids only (which is tenant A?): each client process's lanes name the
    tenant and session its batches ran in, each server lane whose work it holds."""
    sessions = {
        (s["host"], s["pid"]): (t["key"], s["session"])
        for t in reports.tenants(source, TWO)["tenants"]
        for s in t["sessions"]
    }
    assert sorted(sessions.values()) == [("alice", "2"), ("bob", "1")]
    tracks = timeline.tracks(source, TWO)["tracks"]
    clients = [t for t in tracks if (t.host, t.pid) in sessions]
    assert {t.lane for t in clients} >= {"steps", "forward/batch", "nvtx/torch"}
    for t in clients:
        tenant, session = sessions[(t.host, t.pid)]
        assert t.owners == ((tenant, session),)
        assert figures.track_label(t).endswith(f" · tenant {tenant} (session {session})")
    stamped = query_rows(
        source,
        "SELECT lane, arraySort(groupUniqArray((attrs['tenant'], attrs['session']))) AS o"
        " FROM __db__.spans WHERE run_id = {r:String} AND category = 'server' GROUP BY lane",
        {"r": TWO},
    )
    server = {t.lane: t for t in tracks if t.lane.startswith("server/")}
    assert {r["lane"]: [tuple(x) for x in r["o"]] for r in stamped} == {
        lane: list(t.owners) for lane, t in server.items()
    }
    assert " · tenants alice, bob (clock ±" in figures.track_label(server["server/execute"])
    assert " · tenant bob (session 1) (clock ±" in figures.track_label(server["server/evict"])
    others = [t for t in tracks if (t.host, t.pid) not in sessions and t not in server.values()]
    assert others and all(not t.owners and "tenant" not in figures.track_label(t) for t in others)


def test_owners_are_said_shortly() -> None:
    assert figures.owners_text((("alice", "2"),)) == "tenant alice (session 2)"
    assert figures.owners_text((("bob", "10"), ("bob", "3"))) == "tenant bob (sessions 3, 10)"
    assert figures.owners_text((("alice", "2"), ("bob", "1"))) == "tenants alice, bob"
    assert figures.owners_text((("", "4"),)) == "session 4"
    assert figures.owners_text(()) == ""


def test_each_server_bar_names_its_tenant_and_session(source: ReadOnlyStore) -> None:
    """One server lane holds every tenant's work: each bar's hover says whose it is, as the
    server stamped the span."""
    run = timeline.run(source, TWO)
    t0, t1 = int(run["started_ns"]), int(run["ended_ns"])
    stamped = {
        (r["id"], int(r["start_ns"])): f"tenant {r['t']} (session {r['s']})"
        for r in query_rows(
            source,
            "SELECT toString(span_id) AS id, start_ns, attrs['tenant'] AS t,"
            " attrs['session'] AS s FROM __db__.spans"
            " WHERE run_id = {r:String} AND category = 'server'",
            {"r": TWO},
        )
    }
    for a, b in ((t0, t1), (t1 - (t1 - t0) // 5, t1 - (t1 - t0) // 6)):  # overview; store
        w = timeline.window(source, TWO, a, b, 1270)
        served = [x for x in w.bars if x["category"] == "server"]
        assert served
        fig = figures.timeline(run, timeline.tracks(source, TWO), w, None, {}, [], 1270)
        (bars,) = [t for t in fig["data"] if t["type"] == "bar" and t["name"] == "server"]
        for (span_id, start), hover in zip(bars["customdata"], bars["hovertext"]):
            assert hover.endswith("<br>" + stamped[(span_id, start)])
    w = timeline.window(source, "fwd", 0, 3_000_000, 1270)  # a run stored without them
    assert all(not b["tenant"] for b in w.bars if b["category"] == "server")


def test_a_panel_of_several_lines_has_a_legend_naming_each(source: ReadOnlyStore) -> None:
    """The session-memory panel of the two-tenant sample had two lines and no legend."""
    timeline.prepare(source, TWO)
    view = callbacks.first_view(source, f"?run={TWO}", 1600)
    fig = view[("timeline", "figure")]
    layout = fig["layout"]
    titles = [a["text"] for a in layout["annotations"]]
    row = titles.index("runtime/session_memory_bytes") + 2  # the panel's axis number
    lines = [t for t in fig["data"] if t.get("yaxis") == f"y{row}"]
    assert sorted(t["name"] for t in lines) == ["tenant alice session 2", "tenant bob session 1"]
    assert all(t["showlegend"] and t["legend"] == f"legend{row}" for t in lines)
    legend = layout[f"legend{row}"]
    top = layout[f"yaxis{row}"]["domain"][1]
    assert (legend["y"], legend["yanchor"], legend["x"], legend["xanchor"]) == (
        top, "bottom", 1, "right"
    )  # fmt: skip
    title = layout["annotations"][row - 2]
    assert (title["x"], title["xanchor"]) == (0.0, "left")  # out of the legend's way
    # A panel of one line has none.
    gpu = [t for t in fig["data"] if t.get("yaxis") == "y2"]
    assert len(gpu) == 1 and not gpu[0]["showlegend"] and "legend2" not in layout
    assert layout["annotations"][0]["xanchor"] == "center"


def test_two_sessions_of_one_tenant_are_two_lines(source: ReadOnlyStore) -> None:
    """A series was host, device and tenant: a tenant's two sessions were one line, their
    samples interleaved."""
    found = timeline.counters(source, "two-sessions", ["runtime/session_memory_bytes"], 0,
                              10_000, 400)["runtime/session_memory_bytes"]  # fmt: skip
    series = sorted({r["series"] for r in found})
    assert series == [f"gpu-box tenant {XSS} session 1", f"gpu-box tenant {XSS} session 3"]
    run = timeline.run(source, "two-sessions")
    w = timeline.window(source, "two-sessions", 0, 10_000, 400)
    tr = timeline.tracks(source, "two-sessions")
    fig = figures.timeline(run, tr, w, None, {"runtime/session_memory_bytes": found}, [], 400)
    lines = [t for t in fig["data"] if t.get("yaxis") == "y2"]
    assert [t["y"] for t in lines] == [[1.0, 2.0], [10.0, 20.0]]
    assert [t["name"] for t in lines] == [
        f"tenant {figures.esc(XSS)} session 1", f"tenant {figures.esc(XSS)} session 3"
    ]  # fmt: skip
    # Hovers name the line through its escaped name, never the name itself.
    assert all(XSS not in t["hovertemplate"] and XSS not in t["meta"] for t in lines)
