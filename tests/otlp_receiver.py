"""A real OTLP/HTTP endpoint for tests: an http.server on 127.0.0.1 that decodes each POST with
OpenTelemetry's own proto package and keeps the spans, as a collector would receive them.

``status`` answers (e.g. ``[503, 200]``: the first request is refused as busy) let tests drive
retries; ``seen`` is set when the first span arrives.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Received:
    """One span as the endpoint decoded it, with its resource's attributes."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start: int
    end: int
    attrs: dict[str, object]
    resource: dict[str, object]
    status: int


def _value(v: object) -> object:
    which = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, which) if which else None


@dataclass
class Receiver:
    url: str = ""
    requests: list[ExportTraceServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    seen: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def spans(self) -> list[Received]:
        out = []
        with self.lock:
            requests = list(self.requests)
        for req in requests:
            for rs in req.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(
                            Received(
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.name,
                                s.kind,
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                {kv.key: _value(kv.value) for kv in s.attributes},
                                resource,
                                s.status.code,
                            )
                        )
        return out


@contextmanager
def otlp_receiver(status: list[int] | None = None) -> Iterator[Receiver]:
    """A running endpoint on a free loopback port; ``url`` is its base URL."""
    receiver = Receiver(status=list(status or []))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with receiver.lock:
                code = receiver.status.pop(0) if receiver.status else 200
                receiver.paths.append(self.path)
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                receiver.content_types.append(self.headers.get("Content-Type", ""))
            if code != 200:
                self.send_response(code)
                self.send_header("Content-Length", "4")
                self.end_headers()
                self.wfile.write(b"busy")
                return
            request = ExportTraceServiceRequest.FromString(body)
            with receiver.lock:
                receiver.requests.append(request)
            if any(ss.spans for rs in request.resource_spans for ss in rs.scope_spans):
                receiver.seen.set()
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
