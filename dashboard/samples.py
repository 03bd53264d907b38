"""The sample runs in ``sample_traces/runs``: recorded run directories the demo and tests load.

Each is a run directory exactly as ``gpu-trace record`` leaves it (``run.json``, ``spool/*.arrow``,
``stats/``); loading one is an ordinary, idempotent ingest into whatever store is given.
``sample_traces/README.md`` says how they were recorded. A large one is kept as a ``.tar.gz`` of
its directory (the H100 op-level run: 17 MB of spool, 2.4 MB packed) and unpacked into
``GPU_TRACE_HOME/samples`` the first time the demo loads it, so the checkout stays small and its
files are never touched.

Beside them the demo imports a real PyTorch profiler (Kineto) trace of the same H100 program,
``tests/data/kineto-h100-lm.json.gz``: the only sample with GPU kernels, memcpys and the CUDA
calls that launched them, so the dashboard's GPU lanes and ``gpu-trace show``'s kernel table.
It stays where the import tests read it (a copy would be the same 7.6 MB twice in a checkout);
neither folder is in the wheel, whose demo has no samples. An import is idempotent:
``import_trace`` finds a file imported before by its SHA-256 and names that run.
"""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_trace import config

if TYPE_CHECKING:
    from gpu_trace.store.client import Store
    from gpu_trace.store.importer import ImportReport, Progress
    from gpu_trace.store.ingest import IngestReport

log = logging.getLogger(__name__)

#: The sample runs, by run id: a local PyTorch training run, a two-tenant forwarded run, and a
#: real GPU run (an H100 training a GPT-style model, ``--torch module``, real NVML counters).
SAMPLES = ("local-training", "forwarded-two-tenants", "20261124-174647-9ad8eb")
#: Packed sample runs (``<id>.tar.gz`` of the run directory), loaded by the demo only: the same
#: H100 program at ``--torch op`` (268,596 events: every ATen op under its module).
PACKED_SAMPLES = ("20261124-174702-6a22f9",)
#: Trace files the demo imports, relative to the source tree: the H100 program's PyTorch
#: profiler trace (60 steps, 391,584 events, GPU kernels on their streams).
TRACE_SAMPLES = ("tests/data/kineto-h100-lm.json.gz",)


def samples_dir() -> Path:
    """``sample_traces/runs`` of the source tree this package runs from."""
    return Path(__file__).resolve().parents[1] / "sample_traces" / "runs"


def trace_samples() -> list[Path]:
    """The sample trace files that exist (none in an installed wheel)."""
    root = Path(__file__).resolve().parents[1]
    return [root / name for name in TRACE_SAMPLES if (root / name).is_file()]


def sample_runs() -> list[Path]:
    """The sample run directories that exist (none in an installed wheel)."""
    base = samples_dir()
    return [base / name for name in SAMPLES if (base / name / "run.json").is_file()]


def packed_runs() -> list[Path]:
    """The packed sample runs, unpacked under ``GPU_TRACE_HOME/samples`` (once; none in an
    installed wheel)."""
    out = []
    target = config.home() / "samples"
    for name in PACKED_SAMPLES:
        archive = samples_dir() / f"{name}.tar.gz"
        if not (target / name / "run.json").is_file() and archive.is_file():
            if not hasattr(tarfile, "data_filter"):  # Python before 3.10.12 / 3.11.4
                log.warning("sample run %s not unpacked: this Python's tarfile is too old", name)
                continue
            try:
                target.mkdir(parents=True, exist_ok=True)
                with tarfile.open(archive) as tar:
                    # The "data" filter refuses absolute paths, links out of the target, devices.
                    tar.extractall(target, filter="data")
            except (tarfile.TarError, OSError, EOFError) as exc:
                log.warning("sample run %s not unpacked from %s: %s", name, archive, exc)
                continue
        if (target / name / "run.json").is_file():
            out.append(target / name)
    return out


def load_samples(store: Store, *, packed: bool = False) -> list[IngestReport]:
    """Ingest every sample run into ``store`` (idempotent: a second load adds nothing), and the
    packed ones too when ``packed`` (the demo: they take seconds, tests need the small ones)."""
    from gpu_trace.store.ingest import ingest

    paths = sample_runs() + (packed_runs() if packed else [])
    return [ingest(store, path) for path in paths]


def import_samples(store: Store, progress: Progress | None = None) -> list[ImportReport]:
    """Import every sample trace file into ``store``; a file imported before is not imported
    again (its report has ``existing`` set and names that run). TraceImportError, StoreError as
    ``import_trace`` raises them."""
    from gpu_trace.store.importer import import_trace

    return [import_trace(store, path, progress=progress) for path in trace_samples()]
