"""The Dash app and its web server: ``create_app(source)``, ``serve(...)`` (``gpu-trace ui``).

Binds ``127.0.0.1`` unless told otherwise. Dash is an optional dependency (the ``ui`` extra); a
missing one is an ImportError naming the extra.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from gpu_trace.dashboard.source import Source

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050


def _dash() -> Any:
    try:
        import dash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the dashboard needs Dash and plotly: pip install 'gpu-trace[ui]'"
        ) from exc
    return dash


def create_app(source: Source) -> Any:
    """A Dash app on ``source`` (nothing is asked of the store until a page loads)."""
    dash = _dash()
    from gpu_trace.dashboard import callbacks, layout

    app = dash.Dash(
        __name__,
        title="gpu-trace",
        update_title=None,
        suppress_callback_exceptions=True,
        serve_locally=True,
    )
    app.index_string = app.index_string.replace(
        "{%css%}", "{%css%}<style>" + layout.CSS + "</style>"
    )
    app.layout = layout.page(source.display())
    callbacks.register(app, source)
    _warm_plotly()

    @app.server.after_request
    def _headers(response: Any) -> Any:
        # Nothing on the page comes from elsewhere, and no other site may frame it.
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        return response

    return app


def _warm_plotly() -> None:
    """Build one small timeline: plotly loads its validators on a process's first figure
    (a few hundred ms), better at start than on the first page."""
    from gpu_trace.dashboard import figures
    from gpu_trace.dashboard.queries import Window

    run = {"run_id": "", "started_ns": 0}
    figures.timeline(run, {"tracks": [], "rows": 1}, Window(0, 1000, 10), None, {}, [], 100)


def warm(source: Source, run: str | None = None) -> None:
    """Read a run's overview and tracks ahead of its first page (the newest run by default).

    Runs on a background thread of ``gpu-trace ui``; a failure here is the page's to report.
    """
    from gpu_trace.dashboard import queries

    try:
        run_id = source.call("resolve_run", run or "last")
        queries.tracks(source, run_id)
    except Exception as exc:  # the page shows store errors; nothing to do here
        log.debug("gpu-trace: warming the dashboard failed: %s", exc)


class Server:
    """The app behind a threaded WSGI server; ``port=0`` picks a free port (tests)."""

    def __init__(self, source: Source, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
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
