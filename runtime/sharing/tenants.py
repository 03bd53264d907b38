"""Tenants of a shared server: who may connect, with what memory quota, weight and priority.

``gpu-trace serve --tenants tenants.toml`` reads them (:func:`load_tenants`); without a file the
server has one tenant, ``default``, with the server's token and no quota (:func:`single_tenant`).
A tenant's memory quota is a fraction of the device's memory or a number of bytes; it is
resolved against the device's capacity when the server starts (:meth:`Tenant.limit_bytes`).

The file is TOML, one ``[[tenant]]`` table per tenant (docs/sharing.md, "Tenants file")::

    [[tenant]]
    name = "alice"
    token_env = "ALICE_TOKEN"     # or token = "..." (at least 16 characters)
    memory = 0.5                  # a fraction of the device, or bytes: 8589934592, "8GiB"
    weight = 2.0
    priority = 0
    on_quota = "wait"             # or "fail"
    wait_s = 60
    idle_s = 30
    max_sessions = 4              # most sessions at once (default: all but one per other tenant)
    batch_s = 30                  # a batch running longer ends its session (--isolation process)
    admin = false

A malformed file is refused whole, with the line and the field named
(``tenants.toml:7: tenant "bob": memory must be ...``); unknown keys are errors, so a typo never
silently drops a quota.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_trace.runtime.protocol.auth import MIN_TOKEN

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: What a tenant's op does when it would go over the tenant's memory quota.
ON_QUOTA = ("fail", "wait")


@dataclass(frozen=True)
class Tenant:
    """One tenant: a name, the token its clients authenticate with, and its share of the GPU.

    ``memory_fraction`` (0 < f <= 1, of device memory) and ``memory_bytes`` are exclusive;
    neither means no quota. ``weight`` is the compute share for weighted policies (> 0);
    ``priority`` is a strict class, higher first. ``on_quota`` is ``fail`` or ``wait``;
    ``wait_s`` bounds a wait. ``idle_s`` is how long a session may sit idle before its tensors
    are paged out to host memory (None: the server's default). ``admin`` tenants may list and
    evict every tenant's sessions.
    """

    name: str
    token: str
    memory_fraction: float | None = None
    memory_bytes: int | None = None
    weight: float = 1.0
    priority: int = 0
    on_quota: str = "fail"
    wait_s: float = 60.0
    idle_s: float | None = None
    max_sessions: int | None = None
    batch_s: float | None = None
    admin: bool = False

    def limit_bytes(self, capacity: int) -> int | None:
        """The quota in bytes on a device with ``capacity`` bytes; None: no quota."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        if self.memory_fraction is not None:
            return int(self.memory_fraction * capacity)
        return None


def single_tenant(token: str) -> list[Tenant]:
    """The tenants of a server started without a tenants file: everyone is ``default``."""
    return [Tenant(name="default", token=token, admin=True)]


# ---- the tenants file ----------------------------------------------------------------------------

#: Keys a ``[[tenant]]`` table may have.
KEYS = (
    "name",
    "token",
    "token_env",
    "memory",
    "weight",
    "priority",
    "on_quota",
    "wait_s",
    "idle_s",
    "max_sessions",
    "batch_s",
    "admin",
)
#: The smallest byte quota (an integer below it is almost surely a mistaken fraction).
MIN_MEMORY_BYTES = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)b?$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


class TenantsError(ValueError):
    """A malformed tenants file; the message names the file, the line and the field."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(message)
        self.line = line


def parse_size(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"16GB"``, ``"1073741824"``: ``Ki``/``Mi``/``Gi``/
    ``Ti`` are powers of 1024, ``K``/``M``/``G``/``T`` powers of 1000 (as Kubernetes reads
    them), a trailing ``B`` optional. ``ValueError`` for anything else."""
    m = _SIZE.match(str(text).strip())
    if m is None:
        raise ValueError(f"not a byte size: {str(text)[:40]!r} (write e.g. 8GiB, 512MiB, 16GB)")
    number, prefix, binary = m.groups()
    if binary and not prefix:
        raise ValueError(f"not a byte size: {text!r}")
    base = 1024 if binary else 1000
    return int(float(number) * base ** _POWERS[prefix.lower()])


def load_tenants(path: str | Path, environ: Mapping[str, str] | None = None) -> list[Tenant]:
    """The tenants of a TOML tenants file; :class:`TenantsError` naming the line and field of
    the first problem. ``environ`` is where ``token_env`` names are looked up (``os.environ``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsError(f"{path}: cannot read the tenants file: {exc}") from None
    return parse_tenants(text, str(path), os.environ if environ is None else environ)


def parse_tenants(text: str, where: str, environ: Mapping[str, str]) -> list[Tenant]:
    """:func:`load_tenants` on the file's text (``where`` names it in errors)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None) or _line_of_decode_error(str(exc))
        msg = getattr(exc, "msg", None) or re.sub(r"\s*\(at line \d+.*\)$", "", str(exc))
        raise TenantsError(f"{where}:{line}: {msg}", line) from None
    lines = _KeyLines(text)

    def fail(message: str, line: int) -> None:
        raise TenantsError(f"{where}:{line}: {message}", line)

    for key in doc:
        if key != "tenant":
            fail(f"unknown key {key!r} (the file holds [[tenant]] tables)", lines.top(key))
    tables = doc.get("tenant")
    if tables is None:
        fail("no tenants: add a [[tenant]] table with a name and a token", 1)
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        fail("tenant must be an array of tables ([[tenant]])", lines.top("tenant"))
    if not tables:
        fail("no tenants: add a [[tenant]] table with a name and a token", lines.top("tenant"))
    tenants: list[Tenant] = []
    names: dict[str, int] = {}
    tokens: dict[str, str] = {}
    for index, table in enumerate(tables):
        tenant = _tenant(table, index, lines, environ, fail)
        if tenant.name in names:
            first = names[tenant.name] + 1
            fail(
                f"tenant {json.dumps(tenant.name)}: name is already used by tenant #{first}",
                lines.key(index, "name"),
            )
        if tenant.token in tokens:
            key = "token" if "token" in table else "token_env"
            fail(
                f"tenant {json.dumps(tenant.name)}: {key} gives the same token as tenant "
                f"{json.dumps(tokens[tenant.token])} (a token names its tenant)",
                lines.key(index, key),
            )
        names[tenant.name] = index
        tokens[tenant.token] = tenant.name
        tenants.append(tenant)
    return tenants


def _tenant(
    table: dict[str, Any], index: int, lines: _KeyLines, environ: Mapping[str, str], fail: Any
) -> Tenant:
    def bad(key: str | None, message: str) -> None:
        who = f"tenant {json.dumps(name)}" if name else f"tenant #{index + 1}"
        fail(f"{who}: {message}", lines.key(index, key) if key else lines.header(index))

    name = table.get("name") if type(table.get("name")) is str else None
    for key in table:
        if key not in KEYS:
            bad(key, f"unknown key {key!r} (known: {', '.join(KEYS)})")
    if "name" not in table:
        bad(None, "name is required")
    if name is None or not _NAME.match(name):
        shown = json.dumps(table["name"]) if name is not None else repr(table["name"])
        name = None
        bad("name", f'name must be 1-64 letters, digits, ".", "_" or "-", got {shown[:70]}')
    assert name is not None

    if ("token" in table) == ("token_env" in table):
        bad(None if "token" not in table else "token", "give exactly one of token and token_env")
    if "token" in table:
        token = table["token"]
        if type(token) is not str or len(token) < MIN_TOKEN:
            bad("token", f"token must be a string of at least {MIN_TOKEN} characters")
    else:
        var = table["token_env"]
        if type(var) is not str or not var:
            bad("token_env", "token_env must name an environment variable")
        token = environ.get(var, "")
        if not token:
            bad("token_env", f"token_env names {var}, which is not set")
        if len(token) < MIN_TOKEN:
            bad("token_env", f"the token in {var} is shorter than {MIN_TOKEN} characters")

    fields: dict[str, Any] = {}
    if "memory" in table:
        try:
            fields.update(_memory(table["memory"]))
        except ValueError as exc:
            bad("memory", str(exc))
    if "weight" in table:
        w = table["weight"]
        if type(w) not in (int, float) or not math.isfinite(w) or w <= 0:
            bad("weight", f"weight must be a number > 0, got {_show(w)}")
        fields["weight"] = float(w)
    if "priority" in table:
        p = table["priority"]
        if type(p) is not int or not -1000 <= p <= 1000:
            bad("priority", f"priority must be an integer in [-1000, 1000], got {_show(p)}")
        fields["priority"] = p
    if "on_quota" in table:
        q = table["on_quota"]
        if q not in ON_QUOTA:
            bad("on_quota", f"on_quota must be one of {', '.join(ON_QUOTA)}, got {_show(q)}")
        fields["on_quota"] = q
    for key, lo in (("wait_s", 0.0), ("idle_s", None), ("batch_s", None)):
        if key in table:
            v = table[key]
            ok = type(v) in (int, float) and math.isfinite(v) and (v > 0 if lo is None else v >= lo)
            if not ok:
                bound = "> 0" if lo is None else ">= 0"
                bad(key, f"{key} must be a number of seconds {bound}, got {_show(v)}")
            fields[key] = float(v)
    if "max_sessions" in table:
        m = table["max_sessions"]
        if type(m) is not int or not 1 <= m <= 1 << 16:
            bad("max_sessions", f"max_sessions must be an integer >= 1, got {_show(m)}")
        fields["max_sessions"] = m
    if "admin" in table:
        if type(table["admin"]) is not bool:
            bad("admin", f"admin must be true or false, got {_show(table['admin'])}")
        fields["admin"] = table["admin"]
    return Tenant(name=name, token=token, **fields)


def _memory(value: Any) -> dict[str, Any]:
    """``memory_fraction`` or ``memory_bytes`` from a tenant's ``memory`` value."""
    problem = f"memory must be a fraction in (0, 1] or a byte size, got {_show(value)}"
    if type(value) is float:
        if not 0.0 < value <= 1.0:
            raise ValueError(problem)
        return {"memory_fraction": value}
    if type(value) is str and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(problem) from None
        if not 0.0 < percent <= 100.0:
            raise ValueError(problem)
        return {"memory_fraction": percent / 100.0}
    if type(value) is str:
        try:
            value = parse_size(value)
        except ValueError:
            raise ValueError(problem) from None
    if type(value) is not int or value <= 0:
        raise ValueError(problem)
    if value < MIN_MEMORY_BYTES:
        raise ValueError(
            f"memory {value} is a number of bytes, less than 1 MiB: write a fraction as a "
            'float (1.0, 0.5) or a size ("8GiB")'
        )
    return {"memory_bytes": value}


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)[:60]
    if isinstance(value, (int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def _line_of_decode_error(message: str) -> int:
    m = re.search(r"line (\d+)", message)
    return int(m.group(1)) if m else 1


_HEADER = re.compile(r"^\s*\[\[\s*tenant\s*\]\]")
_TABLE = re.compile(r"^\s*\[")
_KEY = re.compile(r"""^\s*(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*[.=]""")


class _KeyLines:
    """Where keys are in the text: tomllib keeps no positions, so errors about a value find the
    line of its key (inside the right ``[[tenant]]`` table) here."""

    def __init__(self, text: str) -> None:
        self._top: dict[str, int] = {}
        self._tables: list[tuple[int, dict[str, int]]] = []
        current: dict[str, int] | None = self._top
        for number, line in enumerate(text.splitlines(), 1):
            if _HEADER.match(line):
                current = {}
                self._tables.append((number, current))
            elif _TABLE.match(line):
                name = line.strip().strip("[]").split(".")[0].strip().strip("\"'")
                self._top.setdefault(name, number)
                current = None
            elif current is not None:
                m = _KEY.match(line)
                if m:
                    current.setdefault(next(g for g in m.groups() if g is not None), number)

    def top(self, key: str) -> int:
        return self._top.get(key, 1)

    def header(self, index: int) -> int:
        if index < len(self._tables):
            return self._tables[index][0]
        return self.top("tenant")

    def key(self, index: int, key: str) -> int:
        if index < len(self._tables):
            return self._tables[index][1].get(key, self._tables[index][0])
        return self.top("tenant")


def check_tenants(tenants: Sequence[Tenant]) -> list[Tenant]:
    """``ValueError`` unless there is a tenant and names and tokens are unique and long enough."""
    tenants = list(tenants)
    if not tenants:
        raise ValueError("a server needs at least one tenant")
    if len({t.name for t in tenants}) != len(tenants):
        raise ValueError("tenant names must be unique")
    if len({t.token for t in tenants}) != len(tenants):
        raise ValueError("tenant tokens must be unique (a token names its tenant)")
    for t in tenants:
        if not isinstance(t.token, str) or len(t.token) < MIN_TOKEN:
            raise ValueError(f"tenant {t.name!r}: a token needs at least {MIN_TOKEN} characters")
    return tenants
