"""``/metrics``: a shared server's numbers in the Prometheus text exposition format (0.0.4).

:class:`MetricsServer` is a small threaded HTTP server in the serve process (``gpu-trace serve
--metrics HOST:PORT``; by default 127.0.0.1 and the listen port + 1). It renders
:func:`gpu_trace.runtime.server.admin.snapshot` on every scrape, so it shows what ``gpu-trace
tenants`` shows to an admin: server-wide numbers, per tenant (its live sessions plus the counters of
its ended ones, so tenant counters never go down) and per live session. Bound to a loopback address
anyone on the machine may read it; bound to any other, a request needs ``Authorization: Bearer
<an admin tenant's token>`` (401 otherwise).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import socket
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpu_trace.runtime.server import admin

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "gpu_trace_"

#: Usage counters: (key in a listing row, metric name after the prefix, help, scale).
COUNTERS = (
    ("busy_ns", "busy_seconds_total", "Device time of its batches", 1e-9),
    (
        "gpu_busy_ns",
        "gpu_busy_seconds_total",
        "GPU time its kernels kept the device busy (absent: not measured)",
        1e-9,
    ),
    ("queue_ns", "queue_wait_seconds_total", "Time its batches waited for the device", 1e-9),
    ("batches", "batches_total", "Batches run", 1),
    ("ops", "ops_total", "Ops run", 1),
    ("bytes_in", "bytes_in_total", "Tensor bytes uploaded by its clients", 1),
    ("bytes_out", "bytes_out_total", "Tensor bytes downloaded by its clients", 1),
    ("evictions", "evictions_total", "Times its tensors were paged out to host memory", 1),
    ("restores", "restores_total", "Times its tensors were paged back to the device", 1),
    ("quota_waits", "quota_waits_total", "Ops that waited for memory", 1),
    ("quota_errors", "quota_errors_total", "Ops that failed on the memory quota", 1),
)
#: Memory gauges: (key in a listing row, metric name after the prefix, help).
MEMORY = (
    ("memory_bytes", "memory_bytes", "Bytes of device memory held (paged-out bytes included)"),
    ("memory_limit_bytes", "memory_limit_bytes", "Memory quota in bytes (absent: no quota)"),
    ("memory_peak_bytes", "memory_peak_bytes", "Most bytes held at once"),
    ("evicted_bytes", "evicted_bytes", "Bytes paged out to host memory now"),
)


class Family:
    """One metric family: its name, type, help and samples ``(suffix, labels, value)``."""

    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name = PREFIX + name
        self.kind = kind
        self.help = help_text
        self.samples: list[tuple[dict[str, str], float | int]] = []

    def add(self, labels: dict[str, Any], value: float | int | None) -> None:
        if value is not None:
            self.samples.append(({k: str(v) for k, v in labels.items()}, value))


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def exposition(families: Iterable[Family]) -> str:
    """Families as Prometheus text: ``# HELP``, ``# TYPE``, then the samples."""
    lines: list[str] = []
    for fam in families:
        if not fam.samples:
            continue
        lines.append(f"# HELP {fam.name} {escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            if labels:
                inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
                lines.append(f"{fam.name}{{{inner}}} {format_value(value)}")
            else:
                lines.append(f"{fam.name} {format_value(value)}")
    return "\n".join(lines) + "\n"


def families(snap: dict[str, Any]) -> list[Family]:
    """The metric families of an admin :func:`~gpu_trace.runtime.server.admin.snapshot`."""
    out: list[Family] = []

    def fam(name: str, kind: str, help_text: str) -> Family:
        f = Family(name, kind, help_text)
        out.append(f)
        return f

    server = snap["server"]
    fam("info", "gauge", "The server: its device and scheduling policy").add(
        {"device": server["device"], "policy": server["policy"]}, 1
    )
    fam("device_memory_bytes", "gauge", "Device memory that quota fractions are taken of").add(
        {"device": server["device"]}, server.get("device_memory_bytes")
    )
    fam("sessions", "gauge", "Connected sessions").add({}, server.get("sessions"))
    fam("queue_depth", "gauge", "Work items queued for the device").add(
        {}, server.get("queue_depth")
    )
    fam("server_batches_total", "counter", "Batches the server has run").add(
        {}, server.get("batches")
    )
    fam("protocol_errors_total", "counter", "Connections closed for a protocol error").add(
        {}, server.get("protocol_errors")
    )
    fam(
        "worker_deaths_total",
        "counter",
        "Sessions ended by their worker process's death, lost CUDA context or batch limit",
    ).add({}, server.get("worker_deaths"))
    uptime = server.get("uptime_ns")
    fam("uptime_seconds", "gauge", "Seconds since the server started").add(
        {}, uptime / 1e9 if uptime is not None else None
    )

    tenants = snap["tenants"]
    info = fam("tenant_info", "gauge", "A tenant: its compute weight, priority and admin flag")
    for t in tenants:
        info.add(
            {
                "tenant": t["tenant"],
                "weight": format_value(float(t["weight"])),
                "priority": t["priority"],
                "admin": str(t["admin"]).lower(),
            },
            1,
        )
    per_tenant = [
        ("sessions", "tenant_sessions", "gauge", "The tenant's connected sessions", 1),
        (
            "sessions_opened",
            "tenant_sessions_opened_total",
            "counter",
            "Sessions the tenant has opened",
            1,
        ),
        ("waiting", "tenant_waiting_sessions", "gauge", "Its sessions waiting for memory", 1),
        *((key, f"tenant_{name}", "gauge", f"{h}, by the tenant", 1) for key, name, h in MEMORY),
        *(
            (key, f"tenant_{name}", "counter", f"{h}, by the tenant's sessions", scale)
            for key, name, h, scale in COUNTERS
        ),
    ]
    for key, name, kind, help_text, scale in per_tenant:
        f = fam(name, kind, help_text)
        for t in tenants:
            value = t.get(key)
            f.add({"tenant": t["tenant"]}, None if value is None else _scaled(value, scale))

    sessions = snap["sessions"]
    f = fam("session_info", "gauge", "A connected session: its tenant, client and state")
    for s in sessions:
        f.add(
            {
                "tenant": s["tenant"],
                "session": s["session"],
                "host": s["host"],
                "pid": s["pid"],
                "state": s["state"],
            },
            1,
        )
    per_session = [
        ("connected_ns", "session_connected_seconds", "gauge", "Seconds since it connected", 1e-9),
        ("queued", "session_queued", "gauge", "Its work items queued for the device", 1),
        *((key, f"session_{name}", "gauge", h, 1) for key, name, h in MEMORY),
        *((key, f"session_{name}", "counter", h, scale) for key, name, h, scale in COUNTERS),
    ]
    for key, name, kind, help_text, scale in per_session:
        f = fam(name, kind, help_text)
        for s in sessions:
            value = s.get(key)
            labels = {"tenant": s["tenant"], "session": s["session"]}
            f.add(labels, None if value is None else _scaled(value, scale))
    return out


def _scaled(value: float | int, scale: float | int) -> float | int:
    return value if scale == 1 else value * scale


def render(server: admin.ListedServer) -> str:
    """The server's ``/metrics`` page."""
    return exposition(families(admin.snapshot(server)))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsServer:
    """``/metrics`` of ``server`` over HTTP on ``listen`` (``HOST:PORT``), on its own threads."""

    def __init__(self, server: admin.ListedServer, listen: str) -> None:
        from gpu_trace.runtime.protocol.addresses import parse_address

        self.server = server
        self.host, self.port = parse_address(listen)
        self.open = is_loopback(self.host)
        self._tokens = [t.token.encode() for t in server.tenants if t.admin]
        if not self.open and not self._tokens:
            raise ValueError(
                f"metrics on {self.host}, not a loopback address, need an admin tenant (requests "
                "carry its token); add one to the tenants file or keep --metrics on 127.0.0.1"
            )
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def authorized(self, header: str | None) -> bool:
        """Whether ``Authorization: header`` carries an admin tenant's token (every token is
        compared, in constant time each)."""
        if self.open:
            return True
        scheme, _, credential = (header or "").partition(" ")
        got = credential.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for token in self._tokens:
            ok |= hmac.compare_digest(token, got)
        return ok and bool(got)

    def start(self) -> MetricsServer:
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "gpu-trace"

            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self._reply(404, b"not found: the metrics are at /metrics\n")
                elif not metrics.authorized(self.headers.get("Authorization")):
                    self._reply(
                        401,
                        b"an admin tenant's token is needed: Authorization: Bearer TOKEN\n",
                        {"WWW-Authenticate": 'Bearer realm="gpu-trace"'},
                    )
                else:
                    try:
                        body = render(metrics.server).encode()
                    except Exception:  # a scrape must not take the server down
                        log.exception("gpu-trace serve: rendering /metrics failed")
                        self._reply(500, b"rendering the metrics failed\n")
                        return
                    self._reply(200, body, {"Content-Type": CONTENT_TYPE})

            def _reply(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                for k, v in {
                    "Content-Type": "text/plain; charset=utf-8",
                    **(headers or {}),
                }.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("gpu-trace serve: metrics: " + format, *args)

        class HTTPServer(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in metrics.host else socket.AF_INET
            daemon_threads = True

        httpd = HTTPServer((self.host, self.port), Handler)
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="gpu-trace-metrics", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
