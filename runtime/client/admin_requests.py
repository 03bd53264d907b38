"""The client side of ADMIN: ``gpu-trace tenants``' requests and the listing's text.

An admin client does the usual CHALLENGE/HELLO handshake with ``"mode": "admin"`` (it opens no
session), sends ``ADMIN {op, ...}`` and gets ``ADMIN_REPLY {ok, ...}``; what the server answers,
and who may ask what, is :mod:`gpu_trace.runtime.server.admin`.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from gpu_trace.runtime.protocol import auth
from gpu_trace.runtime.protocol.addresses import parse_address
from gpu_trace.runtime.protocol.errors import ProtocolMismatch, RemoteError, ServerGone
from gpu_trace.runtime.protocol.wire import (
    ConnectionClosed,
    FrameWriter,
    MsgType,
    ProtocolError,
    decode_json,
    frame,
    json_frame,
)


class AdminError(RemoteError):
    """The server refused an admin request (not an admin tenant, no such session)."""


def format_listing(listing: dict[str, Any]) -> str:
    """A listing as text (``gpu-trace tenants``): one line on the server, a table of tenants,
    a table of sessions."""
    from gpu_trace import _format as fmt

    server = listing.get("server", {})
    head = [f"device {server.get('device')}", f"policy {server.get('policy')}"]
    if server.get("device_memory_bytes"):
        head.append(f"{fmt.size(server['device_memory_bytes'])} of device memory")
    if "sessions" in server:
        head.append(f"{server['sessions']} sessions, {server['queue_depth']} work items queued")
    who = listing.get("viewer")
    lines = [f"{server.get('address', '')} {', '.join(head)}".strip()]
    if not listing.get("admin"):
        lines[0] += f" (tenant {who}: its own sessions only)"
    lines.append("")
    rows = [
        [
            t["tenant"] + (" (admin)" if t.get("admin") else ""),
            fmt.count(t["sessions"]),
            fmt.size(t["memory_bytes"]),
            fmt.size(t["memory_limit_bytes"]),
            fmt.size(t["memory_peak_bytes"]),
            fmt.size(t["evicted_bytes"]),
            fmt.duration(t["busy_ns"]),
            _gpu_busy(t),
            fmt.duration(t["queue_ns"]),
            fmt.count(t["ops"]),
            f"{t['weight']:g}",
            str(t["priority"]),
        ]
        for t in listing.get("tenants", [])
    ]
    heads = ["TENANT", "SESSIONS", "MEMORY", "LIMIT", "PEAK", "PAGED OUT", "BUSY", "GPU BUSY"]
    heads += ["QUEUE WAIT"]
    lines.append(fmt.table([*heads, "OPS", "WEIGHT", "PRIORITY"], rows, right=set(range(1, 12))))
    sessions = listing.get("sessions", [])
    lines.append("")
    if not sessions:
        lines.append("no sessions")
        return "\n".join(lines)
    rows = [
        [
            str(s["session"]),
            s["tenant"],
            f"{s['host']}:{s['pid']}",
            fmt.duration(s["connected_ns"]),
            s["state"],
            fmt.size(s["memory_bytes"]),
            fmt.size(s["memory_limit_bytes"]),
            fmt.size(s["memory_peak_bytes"]),
            fmt.size(s["evicted_bytes"]),
            fmt.duration(s["busy_ns"]),
            _gpu_busy(s),
            fmt.duration(s["queue_ns"]),
            fmt.count(s["ops"]),
            fmt.size(s["bytes_in"]),
            fmt.size(s["bytes_out"]),
            f"{s['evictions']}/{s['restores']}",
        ]
        for s in sessions
    ]
    heads = ["SESSION", "TENANT", "CLIENT", "CONNECTED", "STATE", "MEMORY", "LIMIT", "PEAK"]
    heads += ["PAGED OUT", "BUSY", "GPU BUSY", "QUEUE WAIT", "OPS", "IN", "OUT", "EVICT/RESTORE"]
    lines.append(fmt.table(heads, rows, right={0, *range(3, 4), *range(5, 16)}))
    return "\n".join(lines)


def request(
    address: str, req: dict[str, Any], token: str | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Send one ADMIN request to the server at ``address`` and return its reply.

    ``token``: explicit, ``GPU_TRACE_REMOTE_TOKEN``, or the token file (as any client). Raises
    :class:`ServerGone` if the server can't be reached, :class:`ProtocolMismatch` if it refuses the
    token, :class:`AdminError` if it refuses the request.
    """
    host, port = parse_address(address)
    token = auth.client_token(token)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise ServerGone(f"cannot connect to {address}: {exc}") from None
    with sock:
        writer = FrameWriter(sock)
        client = {"host": socket.gethostname(), "pid": str(os.getpid())}
        try:
            reader, _ = auth.client_handshake(sock, address, token, client, mode="admin")
            writer.send(json_frame(MsgType.ADMIN, req))
            mtype, body = reader.read()
            if mtype == MsgType.ERROR:
                raise AdminError(f"{address}: {decode_json(body).get('message')}")
            if mtype != MsgType.ADMIN_REPLY:
                raise ProtocolMismatch(f"unexpected {MsgType(mtype).name} from {address}")
            reply = decode_json(body)
            writer.send(frame(MsgType.BYE))
        except (ConnectionClosed, ProtocolError, TimeoutError, OSError, ValueError) as exc:
            raise ServerGone(f"admin request to {address} failed: {exc}") from None
    if not reply.get("ok"):
        raise AdminError(str(reply.get("error", "refused"))[:500])
    return reply


def list_sessions(address: str, token: str | None = None) -> dict[str, Any]:
    """The server's listing as the token's tenant may see it
    (:func:`gpu_trace.runtime.server.admin.snapshot`)."""
    return request(address, {"op": "list"}, token)


def page_out(address: str, session: int, token: str | None = None) -> int:
    """Page session ``session``'s tensors out to host memory now (an admin tenant's token only),
    as if it had been idle; its next op brings them back. The bytes moved (0: the session had
    work queued or nothing on the device)."""
    reply = request(address, {"op": "page-out", "session": int(session)}, token)
    return int(reply.get("bytes", 0))


def evict(address: str, session: int, token: str | None = None) -> None:
    """Close session ``session`` (needs an admin tenant's token): its client gets
    "session evicted by an administrator" at its next sync point, and its memory is freed."""
    request(address, {"op": "evict", "session": int(session)}, token)


def _gpu_busy(row: dict[str, object]) -> str:
    """GPU busy time from kernels; ``-`` where it is not measured (no GPU activity capture),
    which is not the same as no time."""
    from gpu_trace import _format as fmt

    value = row.get("gpu_busy_ns")
    return fmt.duration(value) if isinstance(value, int) else "-"
