"""Errors the forwarding client raises into the program, and the op error a server sends back."""

from __future__ import annotations

import os
import traceback
from typing import Any

#: Frames in these directories are left out of a client stack (the runtime, torch itself).
_SKIP = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)


def user_frames(raw: tuple | list, keep: int = 8) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` outermost first, from ``(code, lasti, code, lasti, ...)``
    innermost first (frames' code objects and last instruction offsets, as the client keeps
    them per op)."""
    skip: tuple[str, ...] = _SKIP
    try:
        import torch

        skip = (*skip, os.path.dirname(torch.__file__))
    except ImportError:
        pass
    out = [
        (code.co_filename, _line(code, lasti), code.co_name)
        for code, lasti in zip(raw[::2], raw[1::2])
        if not code.co_filename.startswith(skip)
    ]
    return list(reversed(out[:keep]))


def _line(code: Any, lasti: int) -> int:
    """The source line of the instruction at byte offset ``lasti`` (what ``f_lineno`` says)."""
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line if line is not None else code.co_firstlineno
    return code.co_firstlineno


class RemoteError(RuntimeError):
    """Base of the forwarding runtime's errors."""


class RemoteOpError(RemoteError):
    """An op failed on the server.

    Ops run asynchronously, so this is raised at the next sync point (``.item()``, ``.cpu()``,
    printing, synchronize), like a CUDA error: ``op`` names the failed op and ``client_stack``
    is where the program issued it. The session stays usable.
    """

    def __init__(self, op: str, message: str, client_stack: list[tuple[str, int, str]]) -> None:
        self.op = op
        self.server_message = message
        self.client_stack = client_stack
        where = "".join(traceback.format_list([(f, n, name, None) for f, n, name in client_stack]))
        text = f"{op} failed on the server: {message}"
        if where:
            text += f"\nissued at (most recent call last):\n{where.rstrip()}"
        super().__init__(text)


class QuotaExceeded(RemoteOpError):
    """An op failed because its output would take the tenant over its memory quota (or the
    server's device over its capacity, ``kind == "capacity"``).

    ``used``, ``asked`` and ``limit`` are bytes: what the tenant held, what the op wanted, and
    the quota. Like any op error it is raised at the next sync point and the session stays
    usable: free tensors (``del``) and go on.
    """

    def __init__(
        self,
        op: str,
        message: str,
        client_stack: list[tuple[str, int, str]],
        quota: dict[str, Any],
    ) -> None:
        super().__init__(op, message, client_stack)
        self.tenant = str(quota.get("tenant", ""))
        self.used = int(quota.get("used", 0))
        self.asked = int(quota.get("asked", 0))
        self.limit = int(quota.get("limit", 0))
        self.kind = str(quota.get("kind", "quota"))


class ServerGone(RemoteError):
    """The server closed the connection, stopped answering, or refused the session."""


class ProtocolMismatch(RemoteError):
    """The server speaks another protocol version, or rejected the client's credentials."""


class OpError(Exception):
    """An op of a batch failed on the server; the message goes back to the client (an ERROR
    frame the client raises as :class:`RemoteOpError`)."""
