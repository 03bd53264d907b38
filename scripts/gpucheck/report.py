"""The GPU check's report: one dict, written as JSON and rendered as Markdown from that same dict,
so the two always say the same thing (``scripts/gpu_check.py``; docs/gpu-check.md).

Standard library only: the check runs in whatever Python the GPU machine has, and imports
torch only in its children.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path
from typing import Any

from gpucheck import figures as gpu_figures

SCHEMA = "gpu-check/1"
#: What a part's status may be (docs/gpu-check.md says what each means).
STATUSES = (
    "ok",  # ran; its checks passed and its figures met their targets (or have none)
    "missed",  # ran; a figure missed its target
    "failed",  # ran; a step failed (a test, a bench's exit status, unreadable output)
    "timed out",  # a step reached its deadline: its process group was killed
    "cut short",  # the check itself was stopped (SIGTERM, Ctrl-C) while this part ran
    "skipped",  # not started: its expected time exceeded what was left of the budget
    "not present",  # what it runs is not in this checkout
    "not run",  # not started: no GPU here, or not chosen with --only
    "running",  # started, no result yet (a report read while the check runs, or cut off)
    "pending",  # not reached yet
)
#: Lines of each log kept in the report; bytes of each log kept in the tarball.
TAIL_LINES = 15
LOG_BYTES = 512 * 1024


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a text file (its last 64 KiB read), [] if it is missing."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [x.rstrip()[:400] for x in text.splitlines() if x.strip()][-lines:]


def write(report: dict[str, Any], out: Path, work: Path | None = None) -> None:
    """``report.json`` and ``report.md`` in ``out`` (each replaced whole), and ``logs.tar.gz``
    with each file under ``work`` (logs, the benches' JSON) cut to its last :data:`LOG_BYTES`."""
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / "report.json", json.dumps(report, indent=1) + "\n")
    _replace(out / "report.md", markdown(report))
    if work is not None and work.is_dir():
        tmp = out / ".logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(p for p in work.rglob("*") if p.is_file()):
                _add_tail(tar, path, path.relative_to(work).as_posix())
        os.replace(tmp, out / "logs.tar.gz")


def _add_tail(tar: tarfile.TarFile, path: Path, name: str) -> None:
    import io

    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - LOG_BYTES))
        data = f.read()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(path.stat().st_mtime)
    tar.addfile(info, io.BytesIO(data))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- Markdown ----------------------------------------------------------------------------------


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _seconds(value: object) -> str:
    return f"{value:.0f} s" if isinstance(value, (int, float)) else ""


def machine_rows(machine: dict[str, Any]) -> list[list[object]]:
    """The machine section's rows: what ran where, in words."""
    if not machine:
        return [["probe", "no answer (see the machine part's log)"]]
    torch = machine.get("torch") or {}
    nvml = machine.get("nvml") or {}
    cupti = machine.get("cupti") or {}
    host = machine.get("host") or {}
    tools = machine.get("tools") or {}
    pkgs = machine.get("packages") or {}
    devices = torch.get("devices") or []
    gpu = (
        "; ".join(f"{d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)" for d in devices)
        or f"none seen by torch ({torch.get('error', 'no CUDA device')})"
    )
    rows: list[list[object]] = [["GPU", gpu]]
    if "error" in nvml:
        rows.append(["driver (NVML)", f"NVML: {nvml['error']}"])
    else:
        rows.append(
            [
                "driver (NVML)",
                f"driver {nvml.get('driver')}, NVML {nvml.get('nvml')},"
                f" CUDA driver API {nvml.get('cuda_driver')}",
            ]
        )
    rows.append(
        [
            "torch",
            f"{torch.get('version', torch.get('error'))}, CUDA {torch.get('cuda')},"
            f" cuDNN {torch.get('cudnn')}",
        ]
    )
    rows.append(
        [
            "CUPTI",
            f"{cupti.get('library') or 'libcupti not found'}"
            + (f", API version {cupti['api_version']}" if "api_version" in cupti else "")
            + (", headers found" if cupti.get("headers") else ", headers not found"),
        ]
    )
    rows.append(
        [
            "host",
            f"Python {host.get('python')}, {host.get('cpus')} CPUs, "
            f"{host.get('memory_gib')} GiB, {host.get('platform')}",
        ]
    )
    rows.append(["tools", ", ".join(f"{k}: {v if v else 'absent'}" for k, v in tools.items())])
    if isinstance(pkgs, dict):
        rows.append(
            ["packages", ", ".join(f"{k} {v}" if v else f"{k} absent" for k, v in pkgs.items())]
        )
    for name, state in (machine.get("c_parts") or {}).items():
        rows.append([name, state])
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: verdict, machine, parts (each with its status), figures against
    their targets, then each part's details and log tail."""
    lines = [f"# GPU check: {report.get('title', '')}", "", report.get("verdict", ""), ""]
    lines.append(
        f"Commit `{report.get('commit')}`, mode `{report.get('mode')}`, started"
        f" {report.get('started_utc')}, {_seconds(report.get('elapsed_s'))} of a"
        f" {_seconds(report.get('budget_s'))} budget"
        + (
            ""
            if report.get("finished")
            else " (not finished: the report of a run in progress or cut off)"
        )
        + f". Command: `{report.get('command')}`."
    )
    lines += ["", "## Machine", ""]
    lines += _table(["", ""], machine_rows(report.get("machine") or {}))
    lines += ["", "## Parts", "", "In the order they ran; each bounded by its time limit.", ""]
    lines += _table(
        ["part", "status", "time", "limit", "summary"],
        [
            [
                p["name"],
                p["status"],
                _seconds(p.get("seconds")),
                _seconds(p.get("limit_s")),
                p.get("summary", ""),
            ]
            for p in report.get("parts", [])
        ],
    )
    figures = [(p["name"], f) for p in report.get("parts", []) for f in p.get("figures", [])]
    lines += ["", "## Figures", ""]
    if figures:
        lines += _table(
            ["figure", "value", "spread", "target", "result", "part", "note"],
            [
                [
                    f["name"],
                    f["value"],
                    f.get("spread", ""),
                    f.get("target", ""),
                    gpu_figures.result(f),
                    part,
                    f.get("note", ""),
                ]
                for part, f in figures
            ],
        )
    else:
        lines.append("None measured.")
    lines += ["", "## Details", ""]
    for p in report.get("parts", []):
        lines += _details(p)
    return "\n".join(lines).rstrip() + "\n"


def _details(part: dict[str, Any]) -> list[str]:
    lines = [f"### {part['name']}: {part['title']}", "", f"Status: {part['status']}."]
    if part.get("summary"):
        lines[-1] += f" {part['summary']}"
    lines.append("")
    files = (part.get("details") or {}).get("files")
    if files:
        lines += _table(
            ["file", "result", "time"],
            [[f["file"], f["result"], _seconds(f.get("seconds"))] for f in files],
        )
        lines.append("")
        for f in files:
            for failure in f.get("failures", []):
                lines += [f"{failure['test']}: {failure['message']}", "", "```text"]
                lines += failure.get("tail", []) + ["```", ""]
    for step in part.get("steps", []):
        bad = step.get("timed_out") or step.get("rc") != 0
        state = (
            "timed out, its process group killed"
            if step.get("timed_out")
            else f"exit status {step.get('rc')}"
        )
        shown = step.get("tail", []) if bad else step.get("tail", [])[-5:]
        lines.append(
            f"`{step['name']}`: {state}, {_seconds(step.get('seconds'))}; log"
            f" `{step.get('log')}` (in logs.tar.gz), its last lines:"
        )
        lines += ["", "```text", *shown, "```", ""]
    return lines
