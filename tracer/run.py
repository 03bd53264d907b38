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
from typing import Any

from gpu_trace.tracer.files import replace_text

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
        # Replaced whole, or in place on a full disk (files.py); no temporary is left behind.
        replace_text(run_dir / RUN_FILE, json.dumps(asdict(self), indent=2, sort_keys=True))

    @classmethod
    def load(cls, run_dir: Path) -> RunInfo:
        data = json.loads((Path(run_dir) / RUN_FILE).read_text())
        data["attrs"] = {str(k): str(v) for k, v in data.get("attrs", {}).items()}
        return cls(**data)

    @classmethod
    def exists(cls, run_dir: Path) -> bool:
        return (Path(run_dir) / RUN_FILE).is_file()


#: ``attrs`` naming the process that opened the run and will close it (`gpu-trace record`'s
#: parent): its pid, host and start time, so that a run it left ``running`` can be told from one
#: still being recorded (:func:`recorder_died`).
RECORDER_ATTRS = ("recorder_pid", "recorder_host", "recorder_start")


def recorder_attrs() -> dict[str, str]:
    """This process as the run's recorder, for ``RunInfo.attrs``."""
    return {
        "recorder_pid": str(os.getpid()),
        "recorder_host": socket.gethostname(),
        "recorder_start": _process_start(os.getpid()) or "",
    }


def recorder_died(info: RunInfo) -> str | None:
    """Why a run left ``running`` will never be closed, or None if it may still be.

    A run is closed (``finished``, ``failed``, ``killed``) by the process that opened it. When that
    process is gone (its pid is not running on this host, or runs another program since), the run
    died with it. A run from another host, or one that does not name its recorder, stays as it is.
    """
    if info.status != "running":
        return None
    pid_text = info.attrs.get("recorder_pid", "")
    if not pid_text.isdigit() or info.attrs.get("recorder_host") != socket.gethostname():
        return None
    pid = int(pid_text)
    died = f"recorder exited before closing the run (pid {pid})"
    started = _process_start(pid)
    if started is not None:  # a process with this pid runs: the recorder, unless pid reused
        recorded = info.attrs.get("recorder_start", "")
        return None if not recorded or started == recorded else died
    if Path("/proc").is_dir():
        return died
    try:  # no /proc: ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return died
    except OSError:
        pass
    return None


def _process_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (Linux ``/proc``), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


STATS_DIR = "stats"


def read_stats(run_dir: Path) -> list[dict[str, Any]]:
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
