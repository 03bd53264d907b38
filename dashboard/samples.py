"""The sample runs in ``sample_traces/runs``: recorded run directories the demo and tests load.

Each is a run directory exactly as ``gpu-trace record`` leaves it (``run.json``, ``spool/*.arrow``,
``stats/``); loading one is an ordinary, idempotent ingest into whatever store is given.
``sample_traces/README.md`` says how they were recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_trace.tracer.ingest import IngestReport
    from gpu_trace.tracer.store import Store

#: The sample runs, by run id: a local PyTorch training run, a two-tenant forwarded run, and a
#: real GPU run (an H100 training a GPT-style model, ``--torch module``, real NVML counters).
SAMPLES = ("local-training", "forwarded-two-tenants", "20261124-174647-9ad8eb")


def samples_dir() -> Path:
    """``sample_traces/runs`` of the source tree this package runs from."""
    return Path(__file__).resolve().parents[1] / "sample_traces" / "runs"


def sample_runs() -> list[Path]:
    """The sample run directories that exist (none in an installed wheel)."""
    base = samples_dir()
    return [base / name for name in SAMPLES if (base / name / "run.json").is_file()]


def load_samples(store: Store) -> list[IngestReport]:
    """Ingest every sample run into ``store`` (idempotent: a second load adds nothing)."""
    from gpu_trace.tracer.ingest import ingest

    return [ingest(store, path) for path in sample_runs()]
