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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_trace import config
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


#: ``attrs`` saying how a run was recorded (:func:`recording_attrs`), in the order ``show`` lists
#: them. A run from before they were written has none of them: ``ls`` and ``show`` print ``-``.
RECORDING_ATTRS = (
    "started_by",
    "torch",
    "torch_shapes",
    "tf",
    "nvtx",
    "nvml",
    "nvml_hz",
    "host_hz",
    "remote",
)


def recording_attrs(
    started_by: str,
    *,
    environ: Mapping[str, str] | None = None,
    torch: str | None = None,
    tf: str | None = None,
    shapes: bool | None = None,
    nvtx: str | None = None,
    samplers: Mapping[str, str] | None = None,
    remote: str | None = None,
) -> dict[str, str]:
    """How a run is recorded, for its ``RunInfo.attrs``: every entry point writes these keys.

    ``started_by`` names the entry point (``record`` for `gpu-trace record`, ``start`` for
    ``gpu_trace.start()``, ...). Each setting is the explicit value if given, else the one in
    ``environ`` (default ``os.environ``; `gpu-trace record` passes the program's environment, which
    holds the levels it chose), else the default, so the attrs say what the program ran with.
    ``samplers`` is what the run's samplers wrote (``nvml``, ``nvml_hz``, ``host_hz``, ``gpus``);
    without them both samplers were off. The values were checked when the run started
    (:func:`gpu_trace.config.check_environment`); one that is not valid is written as given.
    """
    env = os.environ if environ is None else environ

    def setting(name: str, explicit: object, default: str) -> str:
        value = explicit if explicit is not None else env.get(name) or default
        return str(value).strip().lower()

    shapes_on = shapes
    if shapes_on is None:
        text = env.get("GPU_TRACE_TORCH_SHAPES") or "0"
        try:
            shapes_on = bool(config.parse("GPU_TRACE_TORCH_SHAPES", text))
        except ValueError:
            shapes_on = False
    sampled = dict(samplers or {})
    attrs = {
        "started_by": started_by,
        "torch": setting("GPU_TRACE_TORCH", torch, "module"),
        "torch_shapes": "on" if shapes_on else "off",
        "tf": setting("GPU_TRACE_TF", tf, "layer"),
        "nvtx": setting("GPU_TRACE_NVTX", nvtx, "native"),
        "nvml": sampled.get("nvml") or "off",
        "nvml_hz": sampled.get("nvml_hz") or "0",
        "host_hz": sampled.get("host_hz") or "0",
    }
    if attrs["nvml"] == "off":
        attrs["nvml_hz"] = "0"
    if sampled.get("gpus"):
        attrs["gpus"] = sampled["gpus"]
    address = remote if remote is not None else env.get("GPU_TRACE_REMOTE")
    if address:
        attrs["remote"] = address
    return attrs


def describe_recording(attrs: Mapping[str, str], *, compact: bool = False) -> str:
    """How a run was recorded, from its attrs: ``torch=op tf=off nvml=10Hz host=2Hz`` (compact,
    for a column) or every setting (for ``show``); ``-`` for a run from before they were kept."""
    if "started_by" not in attrs:
        return "-" + _gpu_activity(attrs)

    def rate(key: str) -> str:
        hz = attrs.get(key, "0")
        return "off" if hz in ("", "0") else f"{hz}Hz"

    nvml = "off" if attrs.get("nvml", "off") == "off" else rate("nvml_hz")
    remote = attrs.get("remote") or ""
    if compact:
        parts = [
            f"torch={attrs.get('torch', '-')}",
            f"tf={attrs.get('tf', '-')}",
            f"nvml={nvml}",
            f"host={rate('host_hz')}",
        ]
        if remote:
            parts.append(f"remote={remote}")
        return " ".join(parts)
    source = attrs.get("nvml", "off")
    nvml_full = "off" if source == "off" else f"{source} at {rate('nvml_hz')}"
    return (
        f"started by {attrs['started_by']}; torch={attrs.get('torch', '-')}"
        f" (shapes {attrs.get('torch_shapes', 'off')}), tf={attrs.get('tf', '-')},"
        f" nvtx={attrs.get('nvtx', '-')}, nvml={nvml_full}, host={rate('host_hz')},"
        f" remote={remote or _fallback(attrs)}{_gpu_activity(attrs)}"
    )


def _fallback(attrs: Mapping[str, str]) -> str:
    """``off``, or why a `record --remote --fallback-local` run ran locally."""
    fallback = attrs.get("remote_fallback")
    return f"off (ran locally: cannot reach the server at {fallback})" if fallback else "off"


def _gpu_activity(attrs: Mapping[str, str]) -> str:
    """GPU activity records, and those CUPTI dropped or that found no API call
    (collectors/gpu_activity writes these attrs; a drop must never go unseen)."""
    if "gpu_activity_records" not in attrs:
        return ""
    text = (
        f", gpu activity={attrs['gpu_activity_records']} records"
        f" ({attrs.get('gpu_activity_dropped', '0')} dropped,"
        f" {attrs.get('gpu_activity_unmatched', '0')} without an API call)"
    )
    note = attrs.get("gpu_activity_note")
    return f"{text}; {note}" if note else text


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
