"""Server addresses as users write them: ``HOST:PORT``, ``:PORT`` or ``[v6]:PORT``.

Both sides parse them (a client to connect, ``gpu-trace serve`` to listen, the metrics endpoint,
``gpu-trace record --remote`` to check its argument early), so the parser lives with the
protocol rather than in the server a client must never import.
"""

from __future__ import annotations


def parse_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``, ``[v6]:PORT``) as ``(host, port)``; ``ValueError`` if bad."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    host = host.strip("[]") or default_host
    return host, int(port)
