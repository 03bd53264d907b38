"""Store DSNs: where ``chdb:///path``, a bare path or ``http(s)://user:password@host:port[/db]``
points (:class:`Target`), parsed by :func:`parse_dsn`. The database name is the only part that
reaches SQL text, so it must be a plain identifier (:data:`IDENTIFIER`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

__all__ = ["DEFAULT_DATABASE", "IDENTIFIER", "Target", "parse_dsn"]

DEFAULT_DATABASE = "gpu_trace"
#: What a database name may be: it is put into SQL text.
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Target:
    """Where a DSN points: an embedded chDB directory or a ClickHouse server."""

    kind: str  # "chdb" or "http"
    path: str = ""  # chdb: the store directory ("" = in memory)
    host: str = ""
    port: int = 0
    username: str = "default"
    password: str = field(default="", repr=False)
    secure: bool = False
    database: str = DEFAULT_DATABASE

    def display(self) -> str:
        """The DSN without its password, for messages and logs."""
        if self.kind == "chdb":
            return f"chdb://{self.path or ':memory:'}"
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{self.username}@{self.host}:{self.port}/{self.database}"


def parse_dsn(dsn: str) -> Target:
    """Parse a store DSN. A bare path means a chDB directory. Raises ValueError when malformed."""
    dsn = dsn.strip()
    if not dsn:
        raise ValueError("empty store DSN")
    if dsn.startswith("chdb:"):
        rest = dsn[len("chdb:") :]
        if rest.startswith("//"):
            rest = rest[2:]
        if rest in ("", "memory", ":memory:"):
            return Target("chdb", path="")
        if not rest.startswith("/"):  # chdb://relative/dir or chdb:~/dir
            rest = os.path.expanduser(rest)
        return Target("chdb", path=os.path.abspath(os.path.expanduser(unquote(rest))))
    if "://" not in dsn:
        if not dsn.startswith(("/", "./", "../", "~")):
            # A bare word is more likely a mistyped option than a store to create here.
            raise ValueError(
                f"not a store DSN: {dsn!r}; give chdb:///path or a path (/dir, ./dir, ~/dir) "
                "for an embedded store, or http(s)://user:password@host:port for a ClickHouse "
                "server"
            )
        return Target("chdb", path=os.path.abspath(os.path.expanduser(dsn)))
    url = urlparse(dsn)
    if url.scheme not in ("http", "https"):
        raise ValueError(f"store DSN must be chdb://, http:// or https://, got {url.scheme}://")
    if not url.hostname:
        raise ValueError(f"store DSN has no host: {dsn.split('@')[-1]}")
    if url.params or url.query or url.fragment:
        raise ValueError("store DSN takes no parameters after the database name")
    secure = url.scheme == "https"
    database = unquote(url.path.strip("/")) or DEFAULT_DATABASE
    if not IDENTIFIER.match(database):
        raise ValueError(f"database name must be a plain identifier, got {database!r}")
    try:
        port = url.port or (8443 if secure else 8123)
    except ValueError:
        raise ValueError("store DSN has an invalid port") from None
    return Target(
        "http",
        host=url.hostname,
        port=port,
        username=unquote(url.username) if url.username else "default",
        password=unquote(url.password) if url.password else "",
        secure=secure,
        database=database,
    )
