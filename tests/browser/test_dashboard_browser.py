"""The dashboard in real headless Chromium: load a sample run, zoom, click a span, read its
details, switch tabs, export; names render as text; bad input gives a message in the page.

Screenshots go to test-artifacts/browser/.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("dash")

from gpu_trace.dashboard import samples  # noqa: E402
from gpu_trace.dashboard.app import Server  # noqa: E402
from gpu_trace.dashboard.readonly_store import ReadOnlyStore  # noqa: E402
from gpu_trace.store.client import Store  # noqa: E402
from tests.browser.conftest import ARTIFACTS  # noqa: E402
from tests.dashboard_data import (  # noqa: E402
    XSS,
    forwarded_run,
    gpu_run,
    minute_run,
    ranked_run,
    tenants_run,
)

TIMEOUT = 60_000
#: The run with a span named like a script tag, on its whole 3 ms (the span comes after the
#: steps, which a run's first view frames): the window in the address.
XSS_WHOLE = "xss&t0=0&t1=3000000"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    store = Store(f"chdb://{tmp_path_factory.mktemp('ui') / 'store'}")
    samples.load_samples(store)
    forwarded_run(store, "xss")
    tenants_run(store, "tenants-xss", ("alice", XSS))
    minute_run(store)
    gpu_run(store)
    ranked_run(store)
    source = ReadOnlyStore(store=store)
    server = Server(source, "127.0.0.1", 0).start()
    yield server
    server.close()
    source.close()


@pytest.fixture
def page(browser, app: Server) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1500, "height": 1000}, accept_downloads=True)
    pg = context.new_page()
    pg.dialogs = []
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    pg.set_default_timeout(TIMEOUT)
    yield pg
    context.close()


def bars(pg) -> object:
    return pg.locator("#timeline g.barlayer g.point path")


def open_run(pg, app: Server, run: str) -> None:
    pg.goto(f"{app.url}/?run={run}")
    bars(pg).first.wait_for(state="attached")
    pg.wait_for_function("document.querySelector('#lod').innerText.length > 0")
    pg.wait_for_timeout(500)  # let Dash settle (the figure's first relayout) before clicking


def click_bar(pg, index: int | None = None) -> None:
    """Click a bar (the widest one by default) with the mouse, as a user would."""
    plot = pg.locator("#timeline g.draglayer rect.nsewdrag").first.bounding_box()
    # The part of each bar on the plot (a bar may run past the window's edges).
    boxes = []
    for i in range(bars(pg).count()):
        b = bars(pg).nth(i).bounding_box()
        if b:
            left, right = (
                max(b["x"], plot["x"]),
                min(b["x"] + b["width"], plot["x"] + plot["width"]),
            )
            boxes.append({**b, "x": left, "width": max(0.0, right - left)})
    box = boxes[index] if index is not None else max(boxes, key=lambda b: b["width"])
    for attempt in range(3):  # a click while Dash is still redrawing can miss; a user clicks again
        pg.mouse.click(box["x"] + min(box["width"] / 2, 20), box["y"] + box["height"] / 2)
        try:
            pg.locator("#details-name").wait_for(timeout=15_000)
            return
        except Exception:
            if attempt == 2:
                raise


def test_timeline_zoom_click_details_and_tabs(page, app: Server) -> None:
    open_run(page, app, "forwarded-two-tenants")
    page.screenshot(path=str(ARTIFACTS / "timeline.png"), full_page=True)
    lod_before = page.inner_text("#lod")
    assert "as bars" in lod_before and "density" in lod_before
    assert "forwarded-call links" in lod_before
    assert "SYNTHETIC" in page.inner_text("#timeline-message")
    assert "clock ±" in page.inner_text("#timeline")
    # Whose lanes: each client process's its tenant and session; the session-memory panel's two
    # lines each named in its legend.
    labels = page.evaluate(
        "[...document.querySelectorAll('#timeline g.yaxislayer-above g.ytick text')]"
        ".map(t => t.textContent)"
    )
    assert any(t.endswith("steps · tenant alice (session 2)") for t in labels)
    assert any(t.endswith("steps · tenant bob (session 1)") for t in labels)
    legend = page.evaluate(
        # A panel's own legend: plotly's classes legend<N>, legend<N>text.
        "[...document.querySelectorAll('#timeline text[class^=legend][class$=text]')]"
        ".map(t => t.textContent)"
    )
    assert {"tenant alice session 2", "tenant bob session 1"} <= set(legend)

    # Zoom: a relayout of the x axis (what a drag-zoom sends) re-queries the window.
    before = page.inner_text("#window-text")
    page.evaluate(
        """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
                   const [a, b] = gd.layout.xaxis.range;
                   Plotly.relayout(gd, {'xaxis.range[0]': a + (b - a) * 0.70,
                                        'xaxis.range[1]': a + (b - a) * 0.78}); }"""
    )
    page.wait_for_function(
        "t => document.querySelector('#window-text').innerText !== t", arg=before
    )
    bars(page).first.wait_for(state="attached")
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "timeline-zoomed.png"), full_page=True)
    assert page.inner_text("#lod") != lod_before
    assert page.evaluate(TITLES_OVER_AXES) == []  # four counter and clock panels

    click_bar(page)
    details = page.inner_text("#details")
    assert "duration" in details and "parent" in details and "children" in details
    assert "same range in other steps" in details
    page.locator("#details").screenshot(path=str(ARTIFACTS / "details.png"))

    for tab, probe in (
        ("Summary", "#summary-forwarding"),
        ("Tenants", "#tenants-paging .scatterlayer .trace"),
        ("Runs", "#runs-table td a"),
        ("Export", "#export-button"),
    ):
        page.click(f"#tab-{tab.lower()}")
        page.locator(probe).first.wait_for()
        page.wait_for_timeout(300)
        page.screenshot(path=str(ARTIFACTS / f"{tab.lower()}.png"), full_page=True)
        assert page.evaluate(TITLES_OVER_AXES) == [], tab  # every chart of the tab
    page.click("#tab-tenants")
    page.locator("#tenants-summary table").wait_for()
    body = page.inner_text("#tenants-body")
    assert "alice" in body and "bob" in body and "512 MiB" in body and "256 MiB" in body
    assert "bob quota 256 MiB" in page.inner_text("#tenants-memory")  # the quota line's legend
    assert "bob page-out spans" in page.inner_text("#tenants-paging")


def test_the_first_timeline_comes_with_the_page(browser, page, app: Server) -> None:
    """No callback is needed for the first view of a run the server has read (gpu-trace ui reads
    the newest at start; here, a first page): with every Dash callback request refused, the page
    still draws the run's bars, density, labels and the line above the chart."""
    open_run(page, app, "forwarded-two-tenants")  # drawn by the callback: the run is read now
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    pg = context.new_page()
    refused: list[str] = []

    def refuse(route) -> None:
        refused.append(route.request.url)
        route.abort()

    pg.route("**/_dash-update-component*", refuse)
    pg.on("console", lambda m: None)  # Dash logs the refused callbacks
    pg.goto(f"{app.url}/?run=forwarded-two-tenants")
    bars(pg).first.wait_for(state="attached", timeout=TIMEOUT)
    assert "as bars" in pg.inner_text("#lod") and "density" in pg.inner_text("#lod")
    assert pg.locator("#timeline .heatmaplayer image").count() == 1  # the density cells
    assert pg.locator("#timeline svg.gpu-trace-labels text").count() > 0  # names on wide bars
    assert "clock ±" in pg.inner_text("#timeline")
    # It frames the run's steps (they start 13.3 s into the 18 s run).
    assert pg.inner_text("#window-text").endswith("(2.74 s) · the run's 12 steps")
    pg.wait_for_timeout(500)
    assert refused  # the page did ask (the list of runs, ...): it was drawn without the answers
    pg.screenshot(path=str(ARTIFACTS / "timeline-first-paint.png"), full_page=True)
    context.close()


def test_goto_links_move_the_window_to_another_step(page, app: Server) -> None:
    open_run(page, app, XSS_WHOLE)
    click_bar(page)  # the widest bar: a step
    assert page.inner_text("#details-name") == "ProfilerStep#0"
    before = page.inner_text("#window-text")
    page.locator("#details button.goto", has_text="ProfilerStep#2").click()
    page.wait_for_function(
        "t => document.querySelector('#window-text').innerText !== t", arg=before
    )
    page.wait_for_function(
        "() => document.querySelector('#details-name').innerText === 'ProfilerStep#2'"
    )
    assert page.inner_text("#window-text").startswith("+1.55 ms to +3.35 ms")  # padded by half


def test_script_names_render_as_text(page, app: Server) -> None:
    open_run(page, app, XSS_WHOLE)
    assert "<b>lane</b>" in page.inner_text("#timeline")  # the lane label, as text
    assert page.locator("#timeline b").count() == 0
    boxes = [bars(page).nth(i).bounding_box() for i in range(bars(page).count())]
    rightmost = max(range(len(boxes)), key=lambda i: boxes[i]["x"] + boxes[i]["width"])
    click_bar(page, rightmost)
    assert page.inner_text("#details-name") == XSS
    assert XSS in page.inner_text("#details")  # the attribute value too
    assert page.locator("#details script").count() == 0
    page.wait_for_timeout(500)
    assert page.dialogs == []
    page.screenshot(path=str(ARTIFACTS / "xss.png"), full_page=True)


LABELS = "#timeline svg.gpu-trace-labels text"
#: Each drawn name's text and whether it is where it belongs (static/labels.js draws them): on
#: its bar, or, for a name beside a narrow bar, starting just right of a bar's end.
NAMES_ON_BARS = """() => {
    const bars = [...document.querySelectorAll('#timeline g.barlayer g.point path')]
        .map(b => b.getBoundingClientRect());
    return [...document.querySelectorAll('#timeline svg.gpu-trace-labels text')].map(t => {
        const r = t.getBoundingClientRect(), x = r.left + 2, y = r.top + r.height / 2;
        const row = b => b.top <= y && y <= b.bottom;
        if (t.classList.contains('beside'))
            return [t.textContent, bars.some(b => row(b) && b.right <= r.left + 1
                                                  && r.left - b.right <= 6)];
        return [t.textContent, bars.some(b => b.left <= x && x <= b.right && row(b))];
    });
}"""


def test_bar_names_are_drawn_on_their_bars_as_text_and_follow_zooms(page, app: Server) -> None:
    open_run(page, app, XSS_WHOLE)
    names = page.evaluate(NAMES_ON_BARS)
    assert "ProfilerStep#0" in [n for n, _ in names] and all(on for _, on in names)
    # Zoom onto the span named like a script tag (the last 50 µs of the run): its name is drawn
    # in full, as text, on its bar; no element is made of it and no dialog opens.
    before = page.inner_text("#window-text")
    page.evaluate(
        """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
                   const [a, b] = gd.layout.xaxis.range;
                   Plotly.relayout(gd, {'xaxis.range[0]': a + (b - a) * 0.965,
                                        'xaxis.range[1]': b}); }"""
    )
    page.wait_for_function(
        "t => document.querySelector('#window-text').innerText !== t", arg=before
    )
    page.wait_for_function(
        "x => [...document.querySelectorAll('#timeline svg.gpu-trace-labels text')]"
        ".some(t => t.textContent === x)",
        arg=XSS,
    )
    names = page.evaluate(NAMES_ON_BARS)
    assert (XSS, True) in [tuple(n) for n in names] and all(on for _, on in names)
    assert page.locator("#timeline svg.gpu-trace-labels *").count() == page.locator(LABELS).count()
    assert page.locator("#timeline script").count() == 0
    page.wait_for_timeout(300)
    assert page.dialogs == []
    page.screenshot(path=str(ARTIFACTS / "labels-xss.png"), full_page=True)


def test_tenant_names_render_as_text(page, app: Server) -> None:
    page.goto(f"{app.url}/?run=tenants-xss&tab=tenants")
    page.locator("#tenants-summary table").wait_for()
    page.locator("#tenants-paging .scatterlayer .trace").first.wait_for(state="attached")
    assert XSS in page.inner_text("#tenants-summary")
    assert XSS in page.inner_text("#tenants-memory")  # a legend entry, as text
    assert page.locator("#tenants-body script").count() == 0
    page.wait_for_timeout(500)
    assert page.dialogs == []


def test_export_downloads_the_visible_window(page, app: Server, tmp_path: Path) -> None:
    open_run(page, app, XSS_WHOLE)
    page.click("#tab-export")
    with page.expect_download() as info:
        page.click("#export-button")
    path = tmp_path / "w.json"
    info.value.save_as(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert XSS in {e.get("name") for e in events}


def test_compare_two_runs(page, app: Server) -> None:
    page.goto(f"{app.url}/?run=local-training&tab=compare")
    page.locator("#runs-table a").first.wait_for(state="attached")  # the run list is in
    for box, text in (("#compare-a", "local-training"), ("#compare-b", "forwarded-two")):
        page.click(box)
        # The dropdown focuses its search box after it opens: a key typed before that is lost.
        page.wait_for_function(
            "document.activeElement && document.activeElement.tagName == 'INPUT'"
        )
        page.keyboard.type(text)
        page.get_by_role("option").filter(has_text=text).first.click()
    page.locator("#compare-body table").first.wait_for()
    assert "B - A" in page.inner_text("#compare-body")
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)


def test_unknown_run_is_a_message_not_a_traceback(page, app: Server) -> None:
    page.goto(f"{app.url}/?run=no-such-run")
    page.locator("#message .message").wait_for()
    text = page.inner_text("#message")
    assert "no run 'no-such-run'" in text and "Traceback" not in page.content()


def test_unreachable_store_is_a_message(browser) -> None:
    source = ReadOnlyStore("http://127.0.0.1:9", lock_timeout_s=0)
    server = Server(source, "127.0.0.1", 0).start()
    try:
        pg = browser.new_page()
        pg.goto(server.url + "/")
        pg.locator("#message .message").wait_for(timeout=TIMEOUT)
        assert "127.0.0.1:9" in pg.inner_text("#message")
        assert "Traceback" not in pg.content()
        pg.screenshot(path=str(ARTIFACTS / "unreachable.png"))
        pg.close()
    finally:
        server.close()


#: Every title drawn over an axis, in every plot shown: [title text, what it covers]. A title is a
#: figure title or an annotation (the timeline's counter panels); an axis is a plot area, axis
#: line, tick mark or tick label.
TITLES_OVER_AXES = """() => {
    const box = e => e.getBoundingClientRect();
    const shown = r => r.width > 0 && r.height > 0;
    const over = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom
                           && b.top < a.bottom;
    const found = [];
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
        const all = s => [...gd.querySelectorAll(s)];
        const axes = all('g.draglayer rect.nsewdrag, path.xtick, path.ytick, g.xtick text,'
                         + ' g.ytick text, path.xlines-above, path.ylines-above')
            .map(e => [e.getAttribute('class') || e.tagName, box(e)]).filter(a => shown(a[1]));
        for (const t of all('g.annotation text, g.g-gtitle text')) {
            const r = box(t);
            if (!shown(r)) continue;
            for (const [what, a] of axes) if (over(r, a)) found.push([t.textContent, what]);
        }
    }
    return found;
}"""


def test_a_minute_runs_first_view_is_named_laid_out_and_keeps_its_counter(
    page, app: Server
) -> None:
    """A one-minute run (60 steps, a module tree, 6,000 ops, batches, a counter sampled every
    500 ms) opened on its whole duration: its steps, modules and batches are named without
    zooming; no panel title covers an axis; zoomed to 100 ms between two counter samples, the
    counter panel still draws the value held, on its axis."""
    open_run(page, app, "minute")
    names = page.evaluate(NAMES_ON_BARS)
    drawn = [n for n, _ in names]
    assert sum(n.startswith("ProfilerStep#") for n in drawn) >= 6
    assert {"Net", "Net.backward", "batch", "aten::relu"} <= set(drawn)
    assert all(ok for _, ok in names)
    titles = "[...document.querySelectorAll('#timeline g.annotation')].map(a => a.textContent)"
    assert page.evaluate(titles) == ["nvml/gpu_util_pct"]
    assert page.evaluate(TITLES_OVER_AXES) == []
    page.screenshot(path=str(ARTIFACTS / "minute-first-view.png"), full_page=True)
    before = page.inner_text("#window-text")
    page.evaluate(
        """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
                   Plotly.relayout(gd, {'xaxis.range[0]': 10.1e9, 'xaxis.range[1]': 10.2e9}); }"""
    )
    page.wait_for_function(
        "t => document.querySelector('#window-text').innerText !== t", arg=before
    )
    page.wait_for_timeout(500)
    line = page.evaluate(
        """() => { const drag = document.querySelector('#timeline g.draglayer g.x2y2 rect');
                   if (!drag) return {ticks: 0, inside: false};  // no panel drawn at all
                   const area = drag.getBoundingClientRect();
                   const ticks = [...document.querySelectorAll('#timeline g.yaxislayer-above g.y2tick text')];
                   const paths = [...document.querySelectorAll('#timeline g.x2y2 g.trace path.js-line')]
                       .map(p => p.getBoundingClientRect()).filter(r => r.width > 0);
                   return {ticks: ticks.length,
                           inside: paths.some(r => r.left <= area.left + 1 && r.right >= area.right - 1)}; }"""
    )
    assert line == {"ticks": line["ticks"], "inside": True} and line["ticks"] >= 2
    page.screenshot(path=str(ARTIFACTS / "minute-between-samples.png"), full_page=True)


def test_gpu_lanes_are_grouped_and_a_kernel_shows_its_launching_op(page, app: Server) -> None:
    """A run with GPU activity: each GPU's stream rows together, under the thread's rows; a click
    on a kernel shows its API call and the op open at launch, draws a line from the call to the
    kernel, and a link goes to that op."""
    open_run(page, app, "gpu")
    labels = page.evaluate(
        "[...document.querySelectorAll('#timeline g.yaxislayer-above g.ytick text')]"
        ".map(t => t.textContent)"
    )
    gpu = [i for i, t in enumerate(labels) if " · GPU " in t]
    assert [labels[i].split(" · ")[1:3] for i in gpu] == [
        ["GPU 0", "stream 7"], ["GPU 0", "stream 13"], ["GPU 1", "stream 7"],
    ]  # fmt: skip
    assert gpu == list(range(len(labels) - 3, len(labels)))  # together, after the thread's rows
    box = page.evaluate(
        """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
                   const bars = gd.data.filter(t => t.type === 'bar');
                   const k = bars.findIndex(t => t.name === 'kernel');
                   const i = bars[k].customdata.findIndex(c => String(c[0]) === '1');
                   const trace = gd.querySelectorAll('g.barlayer g.trace')[k];
                   const r = trace.querySelectorAll('g.point path')[i].getBoundingClientRect();
                   return {x: r.x + r.width / 2, y: r.y + r.height / 2}; }"""
    )
    for attempt in range(3):  # a click while Dash is still redrawing can miss
        page.mouse.click(box["x"], box["y"])
        try:
            page.locator("#details-launch-op").wait_for(timeout=15_000)
            break
        except Exception:
            if attempt == 2:
                raise
    assert page.inner_text("#details-name").startswith("void at::native::vectorized_elementwise")
    assert page.inner_text("#details-launch-op") == "aten::mm"
    assert page.inner_text("#details-launch-call").startswith("cudaLaunchKernel · 10")
    # The line from the launching call to the kernel: call's start -> kernel's start, 50 µs.
    page.wait_for_function(
        "() => document.querySelector('#timeline .js-plotly-plot').data[0].x.length === 2"
    )
    link = page.evaluate(
        """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
                   const d = gd.data[0], ax = gd.layout.yaxis;
                   // A row's track: the last track label at or above it.
                   const track = y => ax.ticktext[ax.tickvals.filter(v => v <= y).length - 1];
                   return [d.x[1] - d.x[0], track(d.y[0]), track(d.y[1])]; }"""
    )
    assert link[0] == 50_000 and link[1].endswith("cuda_api")
    assert link[2].split(" · ")[1:3] == ["GPU 0", "stream 7"]
    page.screenshot(path=str(ARTIFACTS / "gpu-kernel-details.png"), full_page=True)
    page.locator("#details button.goto", has_text="aten::mm · torch/ops").click()
    page.wait_for_function("() => document.querySelector('#details-name').innerText === 'aten::mm'")


def test_an_open_page_lists_runs_stored_while_it_is_open(browser, tmp_path: Path) -> None:
    """`gpu-trace ui` on the embedded store, a page open on its Runs tab: a run imported by
    another process meanwhile (the dashboard gives the store up to it) shows in the list and in
    the run picker without a reload, and opens from there."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "GPU_TRACE_STORE": f"chdb://{tmp_path / 'store'}"}
    ui = subprocess.Popen([sys.executable, "-m", "gpu_trace", "ui", "--port", "0"],
                          stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert ui.stderr is not None
        url = ui.stderr.readline().split("dashboard on ")[1].split()[0].rstrip("/")
        pg = browser.new_page(viewport={"width": 1500, "height": 1000})
        pg.set_default_timeout(TIMEOUT)
        pg.goto(url + "/?tab=runs")
        pg.locator("#runs-message .message").wait_for()  # "No runs yet"
        trace = Path(__file__).resolve().parents[1] / "data" / "kineto-h100-lm-5steps.json.gz"
        out = subprocess.run(
            [sys.executable, "-m", "gpu_trace", "import", str(trace), "--name", "while-open"],
            capture_output=True, text=True, env=env, timeout=240,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        run_id = out.stdout.split()[1].rstrip(":")
        link = pg.locator("#runs-table td a", has_text=run_id)
        link.wait_for()  # the page's periodic refresh; no reload
        # The page was opened on an empty store: the first run stored is opened, and the
        # "no runs yet" lines go.
        pg.wait_for_function(
            "id => document.querySelector('header').innerText.includes(id)", arg=run_id
        )
        assert pg.locator("#runs-message .message").count() == 0
        pg.wait_for_function("() => !document.querySelector('#message').innerText")
        pg.screenshot(path=str(ARTIFACTS / "runs-refreshed.png"), full_page=True)
        link.click()
        bars(pg).first.wait_for(state="attached")
        assert "as bars" in pg.inner_text("#lod")
        pg.close()
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=60)
        assert ui.stderr is not None
        ui.stderr.close()


H100 = "20261124-174647-9ad8eb"  # 13.2 s: start-up, then 70 steps in its last 1.7 s


def window_text_changed(pg, before: str) -> None:
    pg.wait_for_function("t => document.querySelector('#window-text').innerText !== t", arg=before)


def test_a_run_opens_on_its_steps_and_the_whole_run_is_one_click_away(page, app: Server) -> None:
    """The H100 sample opened with 80% of its width on start-up before training; it opens on
    its steps, and Whole run and Steps switch, each writing the address."""
    open_run(page, app, H100)
    first = page.inner_text("#window-text")
    assert first.startswith("+10.6 s to +12.3 s") and first.endswith("the run's 70 steps")
    assert sum(n.startswith("ProfilerStep#") for n, _ in page.evaluate(NAMES_ON_BARS)) >= 5
    page.click("#reset")
    window_text_changed(page, first)
    assert page.inner_text("#window-text").startswith("+0 ns to +13.2 s")
    assert "t0=0&t1=13229639417" in page.url
    page.screenshot(path=str(ARTIFACTS / "h100-whole-run.png"), full_page=True)
    whole = page.inner_text("#window-text")
    page.click("#steps")
    window_text_changed(page, whole)
    assert page.inner_text("#window-text") == first
    page.go_back()  # the address before: the whole run again
    window_text_changed(page, first)
    assert page.inner_text("#window-text") == whole


def test_an_address_with_a_window_and_a_search_term_restores_the_view(page, app: Server) -> None:
    """A link with a window and a search term opens on that window with the term counted;
    Enter and Shift+Enter go to the next and previous match (framed, its details shown), the
    address follows, and a reload shows the same view."""
    page.goto(f"{app.url}/?run={H100}&t0=11000000000&t1=11500000000&q=train_step")
    bars(page).first.wait_for(state="attached")
    page.wait_for_function("document.querySelector('#search-count').innerText.length > 0")
    assert page.inner_text("#window-text").startswith("+11 s to +11.5 s (500 ms)")
    assert page.inner_text("#search-count") == "70 matches · name contains, any case"
    box = page.locator("#search")
    assert box.input_value() == "train_step"
    axis = "() => document.querySelector('#timeline .js-plotly-plot').layout.xaxis.range"
    assert page.evaluate(axis) == [11_000_000_000, 11_500_000_000]
    page.screenshot(path=str(ARTIFACTS / "address-restored.png"), full_page=True)

    before = page.inner_text("#window-text")
    box.press("Enter")
    window_text_changed(page, before)
    page.wait_for_function(
        "() => document.querySelector('#details-name')?.innerText === 'train_step'"
    )
    at = page.inner_text("#search-count")
    index = int(at.split(" of ")[0])
    assert at == f"{index} of 70 · name contains, any case" and 1 <= index <= 70
    assert "q=train_step" in page.url and "t0=" in page.url
    moved = page.inner_text("#window-text")
    assert moved != before and bars(page).count() > 0

    box.press("Shift+Enter")
    page.wait_for_function(
        "t => document.querySelector('#search-count').innerText.startsWith(t)",
        arg=f"{index - 1 if index > 1 else 70} of 70",
    )
    page.wait_for_function("t => document.querySelector('#window-text').innerText !== t", arg=moved)
    shown = page.inner_text("#window-text")
    address = page.url
    page.reload()
    bars(page).first.wait_for(state="attached")
    page.wait_for_function("document.querySelector('#search-count').innerText.length > 0")
    assert page.url == address and page.inner_text("#window-text") == shown
    assert page.inner_text("#search-count") == "70 matches · name contains, any case"
    assert page.locator("#search").input_value() == "train_step"
    page.screenshot(path=str(ARTIFACTS / "search.png"), full_page=True)


def test_the_ranks_tab_shows_a_jobs_ranks_and_charts(page, app: Server) -> None:
    """A two-rank run's Ranks tab: the ranks with their waiting and NCCL overlap, the straggler,
    per-step figures and both charts drawn with their titles clear of the axes; a run without
    ranks says so."""
    page.goto(f"{app.url}/?run=ranked&tab=ranks")
    page.locator("#ranks-step-time .scatterlayer, #ranks-step-time .barlayer").first.wait_for()
    page.locator("#ranks-comm .scatterlayer .trace").first.wait_for()
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "ranks.png"), full_page=True)
    body = page.inner_text("#ranks-body")
    assert "straggler: rank 1" in body and "NCCL overlap" in body and "20.0%" in body
    assert "stragglers per step" in body
    assert page.evaluate(TITLES_OVER_AXES) == []
    page.goto(f"{app.url}/?run=minute&tab=ranks")
    page.locator("#ranks-none").wait_for()
    assert "This run has no ranks" in page.inner_text("#ranks-body")
