"""Recording a replay file on a GPU machine with NVIDIA's ``cupti-python`` (``record-replay``).

Replay files are how the conversion is tested without a GPU (``tests/data/cupti-*.jsonl.gz``).
This runs a Python program in this process with CUPTI's Activity API enabled through
``cupti-python`` and writes every record as one JSON object per line: every public scalar
attribute, ``kind`` as its number, as the H100 file in ``tests/data`` was made. It is a tool for
making test data, not the collector (that is ``injection.c``: no Python in the loop).

    pip install cupti-python
    python -m gpu_trace.collectors.gpu_activity record-replay out.jsonl.gz -- train.py --steps 3
"""

from __future__ import annotations

import enum
import gzip
import importlib
import json
import runpy
import sys
from pathlib import Path

KINDS = (
    "CONCURRENT_KERNEL",
    "MEMCPY",
    "MEMSET",
    "RUNTIME",
    "DRIVER",
    "SYNCHRONIZATION",
)
BUFFER_BYTES = 8 * 1024 * 1024


def _scalars(record: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for name in dir(record):
        if name.startswith("_"):
            continue
        try:
            value = getattr(record, name)
        except Exception:  # an attribute this record version does not have
            continue
        if isinstance(value, enum.Enum):
            value = int(value.value)
        if isinstance(value, (int, float, str)) and not callable(value):
            out[name] = value
    return out


def record(out: Path, program: list[str]) -> int:
    """Run ``program`` (a Python script and its arguments) and write its CUPTI records to ``out``."""
    try:
        cupti = importlib.import_module("cupti.cupti")
    except ImportError:
        print("error: record-replay needs cupti-python: pip install cupti-python", file=sys.stderr)
        return 2
    opener = gzip.open if out.suffix == ".gz" else open
    count = 0
    with opener(out, "wt", encoding="utf-8") as f:

        def requested() -> tuple[int, int]:
            return BUFFER_BYTES, 0

        def completed(activities: list[object]) -> None:
            nonlocal count
            for activity in activities:
                f.write(json.dumps(_scalars(activity), sort_keys=True) + "\n")
                count += 1

        cupti.activity_register_callbacks(requested, completed)
        for kind in KINDS:
            cupti.activity_enable(getattr(cupti.ActivityKind, kind))
        sys.argv = list(program)
        try:
            runpy.run_path(program[0], run_name="__main__")
        finally:
            cupti.activity_flush_all(1)
            for kind in KINDS:
                cupti.activity_disable(getattr(cupti.ActivityKind, kind))
    print(f"{count} CUPTI records written to {out}")
    return 0
