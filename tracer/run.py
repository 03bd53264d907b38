"""A run: its identity and the ``run.json`` file at the top of its directory.

One run is one `gpu-trace record` invocation (or one server session). Its ``trace_id`` is shared
by every process of the run and by the server side of forwarded calls.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RUN_FILE = "run.json"


def new_run_id() -> str:
    """Sortable and unique: UTC time plus 6 random hex digits (``20261121-124501-ab12cd``)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def new_trace_id() -> str:
    """A W3C trace id: 32 lowercase hex digits, not all zero."""
    while True:
        value = secrets.token_hex(16)
        if int(value, 16):
            return value


@dataclass
class RunInfo:
    run_id: str
    trace_id: str
    started_ns: int
    ended_ns: int = 0
    command: str = ""
    hosts: list[str] = field(default_factory=lambda: [socket.gethostname()])
    status: str = "running"
    attrs: dict[str, str] = field(default_factory=dict)

    def save(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        os.replace(tmp, run_dir / RUN_FILE)

    @classmethod
    def load(cls, run_dir: Path) -> RunInfo:
        data = json.loads((Path(run_dir) / RUN_FILE).read_text())
        data["attrs"] = {str(k): str(v) for k, v in data.get("attrs", {}).items()}
        return cls(**data)

    @classmethod
    def exists(cls, run_dir: Path) -> bool:
        return (Path(run_dir) / RUN_FILE).is_file()


STATS_DIR = "stats"


def read_stats(run_dir: Path) -> list[dict]:
    """Per-process totals the recorders wrote (``stats/<pid>.json``); unreadable files are skipped."""
    d = Path(run_dir) / STATS_DIR
    out = []
    if d.is_dir():
        for p in sorted(d.glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
    return out
