"""Client authentication: a shared token proven by HMAC over a fresh server nonce.

The token never crosses the wire: the server sends a random 32-byte nonce in its CHALLENGE, the
client answers with ``HMAC-SHA256(token, "gpu-trace/1" + nonce)``, and the server compares in
constant time. A server with many tenants (:mod:`gpu_trace.runtime.sharing.tenants`) checks the
answer against every tenant's token, each in constant time and all of them every time
(:func:`match`), so neither the answer nor its timing says which tenants exist. A server started
without a token makes one and keeps it in ``GPU_TRACE_HOME/remote-token`` (mode 0600), where clients
on the same machine find it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from gpu_trace import config

if TYPE_CHECKING:
    from gpu_trace.runtime.protocol.wire import FrameReader

DOMAIN = b"gpu-trace/1"
NONCE_BYTES = 32
MIN_TOKEN = 16


class HasToken(Protocol):
    """Whatever holds a token (a server's tenant): the protocol needs its token, nothing else."""

    @property
    def token(self) -> str: ...  # read-only, so a frozen dataclass's field matches


T = TypeVar("T", bound=HasToken)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(token: str, nonce: bytes) -> str:
    """The client's answer to a challenge, as hex."""
    return hmac.new(token.encode(), DOMAIN + nonce, hashlib.sha256).hexdigest()


def _answer_bytes(answer: object) -> bytes | None:
    """A well-formed answer (64 ASCII characters) as bytes, else None."""
    if isinstance(answer, str) and len(answer) == 64 and answer.isascii():
        return answer.encode()
    return None


def verify(token: str, nonce: bytes, answer: object) -> bool:
    got = _answer_bytes(answer)
    expected = mac(token, nonce).encode()
    return hmac.compare_digest(expected, got if got is not None else bytes(64)) and got is not None


def match(tenants: Sequence[T], nonce: bytes, answer: object) -> T | None:
    """The tenant whose token produced ``answer`` to ``nonce``, or None.

    Every tenant's MAC is computed and compared in constant time, with no early exit, whether the
    answer is well-formed or not: the work done does not depend on which tenant (if any) matches.
    """
    got = _answer_bytes(answer)
    probe = got if got is not None else bytes(64)
    found: T | None = None
    for tenant in tenants:
        ok = hmac.compare_digest(mac(tenant.token, nonce).encode(), probe)
        found = tenant if ok and found is None else found
    return found if got is not None else None


def token_file() -> Path:
    return config.home() / "remote-token"


def check_token(token: str) -> str:
    if not isinstance(token, str) or len(token) < MIN_TOKEN:
        raise ValueError(f"a remote token must be a string of at least {MIN_TOKEN} characters")
    return token


def server_token(explicit: str | None = None) -> tuple[str, Path | None]:
    """The token a server accepts: explicit, ``GPU_TRACE_REMOTE_TOKEN``, or a new one saved to
    :func:`token_file` (returned with its path)."""
    token = explicit or config.remote_token()
    if token:
        return check_token(token), None
    path = token_file()
    token = secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def client_token(explicit: str | None = None) -> str:
    """The token a client presents: explicit, ``GPU_TRACE_REMOTE_TOKEN``, or the token file."""
    token = explicit or config.remote_token()
    if token:
        return check_token(token)
    path = token_file()
    try:
        token = path.read_text().strip()
    except OSError:
        raise ValueError(
            "no remote token: give the server's (--token on the command line, token= in Python)"
            " or set GPU_TRACE_REMOTE_TOKEN; a server started here without --token or --tenants"
            f" writes its own to {path}, a --tenants server's are in its tenants file"
        ) from None
    return check_token(token)


def client_handshake(
    sock: socket.socket, address: str, token: str, client: dict[str, str], mode: str = ""
) -> tuple[FrameReader, dict[str, Any]]:
    """A client's side of CHALLENGE/HELLO/WELCOME on a connected ``sock``: the reader (now
    allowing full frames) and the WELCOME message. ``mode="admin"`` opens no session.

    Raises :class:`~gpu_trace.runtime.protocol.errors.ProtocolMismatch` if the peer is not a
    gpu-trace server of this protocol or refuses the token, and lets wire and socket errors through.
    """
    from gpu_trace.runtime.protocol.errors import ProtocolMismatch
    from gpu_trace.runtime.protocol.wire import (
        MAX_FRAME,
        MAX_HANDSHAKE_FRAME,
        PROTOCOL_VERSION,
        FrameReader,
        FrameWriter,
        MsgType,
        decode_json,
        json_frame,
    )

    reader = FrameReader(sock, MAX_HANDSHAKE_FRAME)
    mtype, body = reader.read()
    if mtype != MsgType.CHALLENGE:
        raise ProtocolMismatch(f"{address} is not a gpu-trace server")
    challenge = decode_json(body)
    if challenge.get("v") != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"server protocol version {challenge.get('v')}, client {PROTOCOL_VERSION}"
        )
    nonce = bytes.fromhex(str(challenge.get("nonce", "")))
    hello: dict[str, Any] = {"v": PROTOCOL_VERSION, "mac": mac(token, nonce), "client": client}
    if mode:
        hello["mode"] = mode
    else:
        hello["binary"] = True  # we read DONE_OK (:mod:`gpu_trace.runtime.protocol.wire`)
    FrameWriter(sock).send(json_frame(MsgType.HELLO, hello))
    reader.max_frame = MAX_FRAME
    mtype, body = reader.read()
    msg = decode_json(body)
    if mtype == MsgType.ERROR:
        raise ProtocolMismatch(f"{address} refused the session: {msg.get('message')}")
    if mtype != MsgType.WELCOME:
        raise ProtocolMismatch(f"unexpected {MsgType(mtype).name} from {address}")
    return reader, msg
