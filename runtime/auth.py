"""Client authentication: a shared token proven by HMAC over a fresh server nonce.

The token never crosses the wire: the server sends a random 32-byte nonce in its CHALLENGE, the
client answers with ``HMAC-SHA256(token, "gpu-trace/1" + nonce)``, and the server compares in
constant time. A server started without a token makes one and keeps it in
``GPU_TRACE_HOME/remote-token`` (mode 0600), where clients on the same machine find it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from gpu_trace import config

DOMAIN = b"gpu-trace/1"
NONCE_BYTES = 32
MIN_TOKEN = 16


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(token: str, nonce: bytes) -> str:
    """The client's answer to a challenge, as hex."""
    return hmac.new(token.encode(), DOMAIN + nonce, hashlib.sha256).hexdigest()


def verify(token: str, nonce: bytes, answer: object) -> bool:
    if not isinstance(answer, str) or len(answer) != 64:
        return False
    return hmac.compare_digest(mac(token, nonce), answer)


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
            f"no remote token: pass token=..., set GPU_TRACE_REMOTE_TOKEN, or run the server on "
            f"this machine (it writes {path})"
        ) from None
    return check_token(token)
