"""The Dash app and its web server: ``create_app(source)``, ``serve(...)`` (``gpu-trace ui``).

Binds ``127.0.0.1`` unless told otherwise. Dash is an optional dependency (the ``ui`` extra); a
missing one is an ImportError naming the extra.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from gpu_trace.dashboard.readonly_store import ReadOnlyStore

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050
#: The plotly.js trace types the dashboard draws: dashboard/static holds plotly.js with only these
#: (scripts/build_plotly_bundle.sh), evaluated in a sixth of the full bundle's time.
PLOTLY_TRACES = ("scatter", "bar", "heatmap", "icicle")
PLOTLY_BUNDLE = Path(__file__).resolve().parent / "static" / "plotly-dashboard.min.js"
#: Cookie in which the page tells the server, before Dash asks for the layout, what its address
#: asks for and how wide the window is: the layout is then sent with that view drawn.
VIEW_COOKIE = "gpu_trace_view"
LABELS_JS = Path(__file__).resolve().parent / "static" / "labels.js"
#: Shift+Enter in the span search box: the previous match.
SEARCH_JS = Path(__file__).resolve().parent / "static" / "search.js"
#: Run first in the page: stores the view cookie, then asks for Dash's layout and callback list
#: at once (Dash asks only once all its scripts, plotly.js included, have run: about a second on
#: a small machine) and hands Dash those answers when it asks.
_HEAD_SCRIPT = """<script>(function () {
  document.cookie = "%(cookie)s=" + encodeURIComponent(JSON.stringify(
    {search: location.search, width: window.innerWidth})) + "; path=/; SameSite=Strict";
  var fetch0 = window.fetch, early = {};
  %(paths)s.forEach(function (url) {
    early[url] = fetch0(url, {credentials: "same-origin",
      headers: {Accept: "application/json", "Content-Type": "application/json"}});
  });
  window.fetch = function (url, opts) {
    var got = typeof url === "string" && early[url];
    if (!got || (opts && opts.method && opts.method !== "GET")) {
      return fetch0.apply(this, arguments);
    }
    delete early[url];
    if (!Object.keys(early).length) window.fetch = fetch0;
    return got.catch(function () { return fetch0(url, opts); });
  };
})();</script>"""


#: Dash's copy of @babel/polyfill: core-js (for browsers older than any Dash supports) and
#: regenerator-runtime, which Dash's and dcc's scripts use as a global. The page gets only the
#: latter: evaluating core-js took 0.15-0.3 s of the first page load here.
_POLYFILL_TAG = re.compile(r'<script src="[^"]*/deps/polyfill@[^"]*"></script>')
_REGENERATOR_END = 'try{regeneratorRuntime=e}catch(t){Function("r","regeneratorRuntime = r")(e)}'


def _regenerator_runtime() -> str | None:
    """regenerator-runtime as cut from Dash's polyfill bundle, as a script that sets the global
    (None where that bundle is not laid out as expected: the page then loads all of it)."""
    from dash import _dash_renderer

    deps = Path(_dash_renderer.__file__).parent
    try:
        path = deps / _dash_renderer._js_dist_dependencies[0]["relative_package_path"]["prod"][0]
        bundle = path.read_text(encoding="utf-8")
    except (OSError, LookupError, TypeError):
        return None
    # The bundle is browserify's: {id: [function(require, module, exports){...}, {deps}], ...};
    # regenerator-runtime is the module without dependencies that ends by setting the global.
    end = bundle.find(_REGENERATOR_END + "},{}]")
    start = bundle.rfind(":[function(t,n,r){", 0, end)
    if end < 0 or start < 0:
        return None
    body = bundle[start + len(":[function(t,n,r){") : end + len(_REGENERATOR_END)]
    if "[function(" in body or "regeneratorRuntime.mark" in bundle[:start]:
        return None  # more than one module, or another module needing the global
    return (
        "<script>(function () { var n = {exports: {}}; (function (t, n, r) {"
        + body
        + "})(null, n, n.exports); })();</script>"
    )


def _dash() -> Any:
    try:
        import dash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the dashboard needs Dash and plotly: pip install 'gpu-trace[ui]'"
        ) from exc
    return dash


def create_app(source: ReadOnlyStore) -> Any:
    """A Dash app on ``source`` (nothing is asked of the store until a page loads)."""
    dash = _dash()
    from gpu_trace.dashboard import callbacks, layout, warmup

    app = dash.Dash(
        __name__,
        title="gpu-trace",
        update_title=None,
        suppress_callback_exceptions=True,
        serve_locally=True,
    )
    prefix = app.config.requests_pathname_prefix
    plotly_url = prefix + "_dash-component-suites/plotly/package_data/plotly.min.js"
    if plotly_bundle_version() == _plotly_version():
        plotly_url = f"{prefix}_gpu-trace/{PLOTLY_BUNDLE.name}?v={_plotly_version()}"

        @app.server.route(f"/_gpu-trace/{PLOTLY_BUNDLE.name}")
        def _plotly_bundle() -> Any:
            from flask import send_file

            return send_file(PLOTLY_BUNDLE, mimetype="text/javascript", max_age=365 * 86400)

    else:
        log.warning(
            "gpu-trace: %s is not plotly.js %s (scripts/build_plotly_bundle.sh rebuilds it); "
            "the full plotly.js is used",
            PLOTLY_BUNDLE,
            _plotly_version(),
        )
    # Dash would fetch plotly.js and the code of dcc.Graph and dcc.Dropdown only once the layout
    # is drawn, one more round trip; here they load with the page, before Dash's renderer starts
    # (webpack finds its chunks already loaded, and dcc.Graph finds window.Plotly). They must run
    # before it: the head script has the layout on its way, and a renderer started earlier could
    # draw the graph before plotly.js is there (dcc.Graph would then fetch the full plotly.js).
    scripts = [f"{prefix}_dash-component-suites/dash/dcc/{chunk}" for chunk in _dcc_chunks()]
    scripts.append(plotly_url)
    head = _HEAD_SCRIPT % {
        "cookie": VIEW_COOKIE,
        "paths": json.dumps([prefix + "_dash-layout", prefix + "_dash-dependencies"]),
    }
    app.index_string = app.index_string.replace(
        "{%css%}", "{%css%}<style>" + layout.CSS + "</style>" + head
    ).replace(
        "{%renderer%}",
        "".join(f"<script src='{u}'></script>" for u in scripts)
        + "<script>"
        + LABELS_JS.read_text(encoding="utf-8")
        + SEARCH_JS.read_text(encoding="utf-8")
        + "</script>{%renderer%}",
    )
    regenerator = _regenerator_runtime()
    if regenerator is not None:
        interpolate = app.interpolate_index

        def interpolate_index(**kwargs: Any) -> str:
            kwargs["scripts"] = _POLYFILL_TAG.sub(lambda _: regenerator, kwargs["scripts"], 1)
            return str(interpolate(**kwargs))

        app.interpolate_index = interpolate_index
    display = source.display()
    views = FirstViews(
        lambda search, width: callbacks.first_view(source, search, width),
        lambda view: _zoom_ahead(source, view),
    )

    def page() -> Any:
        from flask import has_request_context, request

        view: dict = {}
        # Dash also builds the layout once on its first request, to check it: only the layout
        # request itself gets the view.
        if has_request_context() and request.path.endswith("/_dash-layout"):
            asked = _asked(request.cookies.get(VIEW_COOKIE))
            if asked is not None:
                view = views.take(*asked)
        return layout.page(display, view)

    app.layout = page
    app.warmer = warmup.Warmer(source)
    callbacks.register(app, source, app.warmer)

    @app.server.before_request
    def _start_first_view() -> None:
        # The page itself (any path Dash answers with it): its first view is built while the
        # browser loads and runs the scripts, for the width of its last visit (the cookie) or
        # the usual one; the layout request picks it up if the width is right.
        from flask import request

        if request.method == "GET" and not request.path.startswith(_NOT_PAGES):
            asked = _asked(request.cookies.get(VIEW_COOKIE))
            query = request.query_string.decode("latin-1")
            width = asked[1] if asked else callbacks.DEFAULT_VIEWPORT
            views.start("?" + query if query else "", width)

    @app.server.after_request
    def _headers(response: Any) -> Any:
        # Nothing on the page comes from elsewhere, and no other site may frame it.
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        return response

    return app


_NOT_PAGES = ("/_dash", "/_gpu-trace", "/_favicon", "/_reload", "/assets")


class FirstViews:
    """First views started when a page is asked for, taken by that page's layout request.

    ``build(search, width)`` runs on one background thread; what no layout request takes within
    :data:`KEEP_S` is dropped (and at most :data:`KEEP` are kept). ``then(view)``, if given,
    runs on the same thread after each build (reading ahead what the view's zooms need).
    """

    KEEP = 8
    KEEP_S = 30.0

    def __init__(self, build: Any, then: Callable[[dict], None] | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._build = build
        self._then = then
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-trace-view")
        self._lock = threading.Lock()
        self._started: dict[tuple[str, int | None], tuple[float, Any]] = {}

    def start(self, search: str, width: int | None) -> None:
        key = (search, width)
        now = time.monotonic()
        with self._lock:
            for k, (at, _) in list(self._started.items()):
                if now - at > self.KEEP_S:
                    del self._started[k]
            if key not in self._started:
                while len(self._started) >= self.KEEP:
                    self._started.pop(next(iter(self._started)))
                built = self._pool.submit(self._build, search, width)
                self._started[key] = (now, built)
                if self._then is not None:
                    self._pool.submit(self._after, built)

    def _after(self, built: Future[dict]) -> None:
        try:
            if self._then is not None:
                self._then(built.result())
        except Exception as exc:  # ahead of time only: the page reports its own errors
            log.debug("gpu-trace: reading ahead after a first view failed: %s", exc)

    def take(self, search: str, width: int | None) -> dict:
        with self._lock:
            found = self._started.pop((search, width), None)
        if found is not None:
            try:
                return found[1].result()
            except Exception as exc:  # built again below, where the error reaches the page
                log.debug("gpu-trace: first view built ahead failed: %s", exc)
        return self._build(search, width)


def _dcc_chunks() -> list[str]:
    """dcc's lazily loaded chunks the first page needs (those this Dash has)."""
    from dash import dcc

    here = Path(dcc.__file__).parent
    return [c for c in ("async-graph.js", "async-dropdown.js") if (here / c).is_file()]


def _plotly_version() -> str:
    from plotly.offline import get_plotlyjs_version

    return str(get_plotlyjs_version())


def plotly_bundle_version() -> str | None:
    """The plotly.js version of the dashboard's own bundle (None if it is missing)."""
    try:
        with PLOTLY_BUNDLE.open(encoding="utf-8") as f:
            head = f.read(300)
    except OSError:
        return None
    found = re.search(r"plotly\.js v(\S+)", head)
    return found.group(1) if found else None


def _asked(cookie: str | None) -> tuple[str, int | None] | None:
    """The address's query string and the window's width from the page's cookie."""
    try:
        asked = json.loads(unquote(cookie or ""))
        width = asked.get("width")
        return str(asked["search"]), int(width) if isinstance(width, (int, float)) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _zoom_ahead(source: ReadOnlyStore, view: dict) -> None:
    """After a run's first view: its fine overview, ahead of the first zoom that needs it."""
    from gpu_trace.dashboard import timeline

    run_id = view.get(("run", "value"))
    if isinstance(run_id, str) and run_id and timeline.prepared(source, run_id):
        timeline.prepare_zoom(source, run_id)


class Server:
    """The app behind a threaded WSGI server; ``port=0`` picks a free port (tests)."""

    def __init__(
        self, source: ReadOnlyStore, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT
    ) -> None:
        from werkzeug.serving import WSGIRequestHandler, make_server

        class QuietHandler(WSGIRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:  # no line per request
                pass

        self.app = create_app(source)
        try:
            self._server = make_server(
                host, port, self.app.server, threaded=True, request_handler=QuietHandler
            )
        except SystemExit:  # werkzeug exits when the address is taken
            raise OSError(f"{host}:{port} is in use or can't be bound") from None
        self.host = host
        self.port = int(self._server.server_port)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def start(self) -> Server:
        """Serve on a background thread (tests, the demo)."""
        self._thread = threading.Thread(target=self.serve_forever, name="gpu-trace-ui", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever, so only if it runs
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()
