"""Where OTLP requests go: an OpenTelemetry collector's URL, over HTTP/protobuf or gRPC.

``http(s)://host:port`` with no path posts to ``/v1/traces`` (the OTLP/HTTP default); a URL with a
path posts to that path as given. ``grpc://host:port`` (plaintext) and ``grpcs://host:port`` (TLS)
call the collector's ``TraceService/Export`` over gRPC, which needs grpcio and the proto's service
stubs (the ``otlp-grpc`` extra); without them :func:`parse_url` says which extra to install.

A request that gets 429, 502, 503 or 504 (the collector is busy or restarting) or times out is
retried with exponential backoff (honouring ``Retry-After``) until :attr:`Endpoint.deadline_s` is
spent; a refused connection, a 4xx or any other answer is final. :meth:`Endpoint.send` never
raises: it returns None or one line saying what went wrong, for the caller to report.

The sleep between retries and the clock are seams (tests give ones that do not wait).
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
CONTENT_TYPE = "application/x-protobuf"
#: Statuses the OTLP specification calls retryable.
RETRYABLE = frozenset({429, 502, 503, 504})
#: Seconds one request may take.
REQUEST_TIMEOUT_S = 10.0
#: Seconds to keep retrying one batch.
DEADLINE_S = 30.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0

PROTO_MISSING = "OTLP export needs the opentelemetry-proto package: pip install 'gpu-trace[otlp]'"
GRPC_MISSING = (
    "OTLP over gRPC needs grpcio and the OTLP gRPC exporter package: "
    "pip install 'gpu-trace[otlp-grpc]'"
)


@dataclass(frozen=True)
class Target:
    """A parsed OTLP URL."""

    protocol: str  # "http" or "grpc"
    url: str  # the POST URL (http), or host:port (grpc)
    secure: bool = False

    def display(self) -> str:
        return (
            self.url
            if self.protocol == "http"
            else f"grpc{'s' if self.secure else ''}://{self.url}"
        )


def parse_url(url: str) -> Target:
    """The target of an OTLP URL; ``ValueError`` with one clear line when it is not usable
    (including a gRPC URL without the gRPC packages, and no opentelemetry-proto at all)."""
    text = url.strip()
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https", "grpc", "grpcs"):
        raise ValueError(
            f"OTLP URL must start with http://, https://, grpc:// or grpcs://, got {url!r}"
        )
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"OTLP URL has a bad port: {url!r}") from None
    if not parts.hostname:
        raise ValueError(f"OTLP URL has no host: {url!r}")
    if parts.username is not None or parts.password is not None:
        # Not sent by urllib, and the URL is printed in closing lines: credentials go in headers.
        raise ValueError(
            "an OTLP URL takes no user:password@; give credentials as a header "
            "(--otlp-header Authorization=... or OTEL_EXPORTER_OTLP_HEADERS)"
        )
    if not proto_available():
        raise ValueError(PROTO_MISSING)
    if scheme.startswith("grpc"):
        if not grpc_available():
            raise ValueError(GRPC_MISSING)
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"a gRPC OTLP URL is grpc://HOST:PORT, without a path: {url!r}")
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        return Target("grpc", f"{host}:{port or 4317}", secure=scheme == "grpcs")
    path = parts.path if parts.path not in ("", "/") else TRACES_PATH
    query = f"?{parts.query}" if parts.query else ""
    return Target("http", f"{scheme}://{parts.netloc}{path}{query}", secure=scheme == "https")


def parse_headers(text: str, source: str) -> dict[str, str]:
    """``K=V,K2=V2`` (values URL-encoded, as ``OTEL_EXPORTER_OTLP_HEADERS`` has them); ``source``
    names where they came from in the ``ValueError`` for a malformed entry."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = unquote(key.strip())
        if not sep or not key or any(c in key for c in " \t\r\n:"):
            raise ValueError(f"{source}: a header is KEY=VALUE, got {item.strip()!r}")
        value = unquote(value.strip())
        if any(c in value for c in "\r\n"):
            raise ValueError(f"{source}: header {key!r} has a line break in its value")
        out[key.lower()] = value
    return out


def from_settings(
    url: str | None, headers: list[str] | None = None
) -> tuple[Target, dict[str, str]]:
    """The target and headers of ``--otlp URL`` and ``--otlp-header K=V`` (repeated).

    Without a URL, OpenTelemetry's ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (as given) or
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` appended); headers are
    ``OTEL_EXPORTER_OTLP_HEADERS``, then ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, then the flags, the
    later winning. ``ValueError`` with one line for anything unusable.
    """
    from gpu_trace import config

    if not url:
        url = config.otlp_setting("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not url:
            base = config.otlp_setting("OTEL_EXPORTER_OTLP_ENDPOINT")
            if not base:
                raise ValueError(
                    "--otlp needs a URL (or OTEL_EXPORTER_OTLP_ENDPOINT): e.g. http://localhost:4318"
                )
            url = base if base.lower().startswith("grpc") else base.rstrip("/") + TRACES_PATH
    target = parse_url(url)
    merged: dict[str, str] = {}
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        text = config.otlp_setting(name)
        if text:
            merged.update(parse_headers(text, name))
    for item in headers or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if (
            not sep
            or not key
            or any(c in key for c in " \t\r\n:")
            or any(c in value for c in "\r\n")
        ):
            raise ValueError(f"--otlp-header takes KEY=VALUE, got {item!r}")
        merged[key.lower()] = value.strip()
    return target, merged


def proto_available() -> bool:
    try:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: F401
    except ImportError:
        return False
    return True


def grpc_available() -> bool:
    try:
        import grpc  # type: ignore[import-untyped]  # noqa: F401
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: F401
    except ImportError:
        return False
    return True


class Endpoint(Protocol):
    """What the OTLP exporter and the stream send requests through."""

    def send(self, request: ExportTraceServiceRequest) -> str | None:
        """Deliver one request (retrying what is worth retrying); None or why it failed."""

    def close(self) -> None: ...


class _Attempt(Exception):
    """A try that failed: ``retry`` says whether another may succeed, ``after`` how soon."""

    def __init__(self, message: str, retry: bool, after: float | None = None) -> None:
        super().__init__(message)
        self.retry = retry
        self.after = after


class Collector:
    """An OTLP endpoint (HTTP/protobuf or gRPC) with retries; an :class:`Endpoint`."""

    def __init__(
        self,
        target: Target,
        headers: Mapping[str, str] | None = None,
        *,
        timeout_s: float = REQUEST_TIMEOUT_S,
        deadline_s: float = DEADLINE_S,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._sleep = sleep
        self._clock = clock
        self._channel: object = None
        self._stub: object = None
        self.requests = 0
        self.retries = 0

    def send(self, request: ExportTraceServiceRequest) -> str | None:
        try:
            body = request.SerializeToString()
        except Exception as exc:  # a span the proto refuses: say so, never raise
            return f"could not encode the request: {exc}"
        end = self._clock() + self.deadline_s
        delay = FIRST_BACKOFF_S
        while True:
            try:
                if self.target.protocol == "grpc":
                    self._grpc(request)
                else:
                    self._post(body)
                self.requests += 1
                return None
            except _Attempt as failed:
                wait = failed.after if failed.after is not None else delay
                if not failed.retry or self._clock() + wait > end:
                    return f"{self.target.display()}: {failed}"
                self.retries += 1
                log.info(
                    "gpu-trace: %s: %s; retrying in %.1f s", self.target.display(), failed, wait
                )
                self._sleep(wait)
                delay = min(delay * 2, MAX_BACKOFF_S)
            except Exception as exc:  # the boundary: anything else is one line, not a traceback
                log.debug("gpu-trace: OTLP request failed", exc_info=True)
                return f"{self.target.display()}: {exc}"

    def _post(self, body: bytes) -> None:
        headers = {**self.headers, "content-type": CONTENT_TYPE}
        req = urllib.request.Request(self.target.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            status = exc.code
            detail = _detail(exc)
            retry_after = _retry_after(exc.headers.get("Retry-After") if exc.headers else None)
            raise _Attempt(
                f"HTTP {status} {exc.reason}{detail}", status in RETRYABLE, retry_after
            ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, ConnectionRefusedError):
                raise _Attempt("connection refused (is a collector listening?)", False) from None
            if isinstance(reason, TimeoutError):
                raise _Attempt("timed out", True) from None
            raise _Attempt(str(getattr(reason, "strerror", None) or reason), False) from None
        except TimeoutError:
            raise _Attempt("timed out", True) from None
        except ConnectionError as exc:
            raise _Attempt(f"connection lost ({exc.__class__.__name__})", True) from None

    def _grpc(self, request: ExportTraceServiceRequest) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        if self._stub is None:
            if self.target.secure:
                channel = grpc.secure_channel(self.target.url, grpc.ssl_channel_credentials())
            else:
                channel = grpc.insecure_channel(self.target.url)
            self._channel = channel
            self._stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
        metadata = tuple(self.headers.items())
        try:
            self._stub.Export(request, timeout=self.timeout_s, metadata=metadata)  # type: ignore[attr-defined]
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = getattr(code, "name", "UNKNOWN")
            details = exc.details() if hasattr(exc, "details") else ""
            retry = name in ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED")
            if name == "UNAVAILABLE" and "refused" in (details or "").lower():
                retry = False
            raise _Attempt(f"gRPC {name}: {details}", retry) from None

    def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()  # type: ignore[attr-defined]


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read(300).decode("utf-8", "replace").strip()
    except Exception:
        return ""
    line = text.splitlines()[0] if text else ""
    printable = "".join(c for c in line if c.isprintable())[:200]
    return f": {printable}" if printable else ""


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, min(float(value), MAX_BACKOFF_S * 4))
    except ValueError:
        return None
