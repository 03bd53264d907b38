"""Ranks of a distributed job: who each process is, as its launcher said.

Recording side: a process learns its place in the job from the environment its launcher set
(:func:`from_env`: torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``,
``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``; Open MPI's ``OMPI_COMM_WORLD_*``; MPICH's
``PMI_RANK``/``PMI_SIZE``; Slurm's ``SLURM_PROCID``/``SLURM_NTASKS``/...), or from
``torch.distributed`` once a process group exists (``framework_patches/torch/collectives.py``),
and writes it to ``<run_dir>/ranks/<pid>.json`` (:func:`write`). Ingest puts it in the
``threads`` table's ``process_attrs`` (docs/schema.md).

The reading side (rank summaries, per-step analysis) is :mod:`gpu_trace.query.distributed`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path

#: Where each process's facts go in a run directory: ``ranks/<pid>.json``.
RANKS_DIR = "ranks"
#: The lane of collective calls (framework_patches/torch/collectives.py); backend work has its own.
COLLECTIVE_LANE = "torch/collectives"
#: Keys a process's facts may have (all strings), in the order `show` reads them.
KEYS = (
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node",
    "host",
    "job",
    "launcher",
    "backend",
    "source",
)

# (launcher, rank, world size, local rank, local world size, node, job): the first launcher whose
# rank variable is set wins; torchrun's (also set by any launcher that follows its convention)
# first, since torchrun under srun or mpirun sets its own on top.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
     "TORCHELASTIC_RUN_ID"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK", ""),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "", ""),
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
     "SLURM_NODEID", "SLURM_JOB_ID"),
)  # fmt: skip


def _int(text: str | None) -> str | None:
    """``text`` as a canonical non-negative integer string, None if it is not one."""
    if text is None:
        return None
    text = text.strip()
    return str(int(text)) if text.isdigit() else None


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's place in a job from the launcher's environment: the :data:`KEYS` found
    (``rank`` and ``world_size`` at least, else ``{}``: not a rank), plus ``host``,
    ``launcher`` and ``source=env``. A malformed value is left out, never raised."""
    env = os.environ if environ is None else environ
    for launcher, rank, world, local, local_world, node, job in _LAUNCHERS:
        r, w = _int(env.get(rank)), _int(env.get(world))
        if r is None or w is None or int(r) >= int(w):
            continue
        out = {"rank": r, "world_size": w}
        for key, var in (("local_rank", local), ("local_world_size", local_world), ("node", node)):
            value = _int(env.get(var)) if var else None
            if value is not None:
                out[key] = value
        if launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in env and "GROUP_RANK" not in env:
            launcher = "env"  # RANK/WORLD_SIZE set by hand or by another launcher
        job_id = (env.get(job) or "").strip() if job else ""
        if not job_id:
            job_id = (env.get("SLURM_JOB_ID") or "").strip()
        if job_id:
            out["job"] = job_id[:200]
        out.update(host=socket.gethostname(), launcher=launcher, source="env")
        return out
    return {}


def write(
    run_dir: str | os.PathLike[str], facts: Mapping[str, str], pid: int | None = None
) -> bool:
    """Write a process's facts to ``<run_dir>/ranks/<pid>.json`` (replaced whole); False if it
    could not be written (never raises: the traced program goes on)."""
    if not facts:
        return False
    d = Path(run_dir) / RANKS_DIR
    path = d / f"{os.getpid() if pid is None else pid}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        d.mkdir(exist_ok=True)
        tmp.write_text(json.dumps({k: str(v) for k, v in facts.items()}))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def read(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, str]]:
    """Every process's facts in a run directory, by pid; unreadable files are left out."""
    out: dict[int, dict[str, str]] = {}
    d = Path(run_dir) / RANKS_DIR
    if not d.is_dir():
        return out
    for path in sorted(d.glob("*.json")):
        if path.name.startswith(".") or not path.stem.isdigit():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out[int(path.stem)] = {str(k): str(v) for k, v in data.items() if k in KEYS}
    return out


# ---- one run per job ---------------------------------------------------------------------------

#: ``run.json`` attrs of a run that is one part of a job (``gpu-trace record --job``).
JOB_ATTR = "job"
#: Characters a job id keeps in its run id (others become ``-``).
_JOB_ID = re.compile(r"[^A-Za-z0-9._-]+")


def job_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The job this `record` is one part of, when no ``--job`` was given: ``GPU_TRACE_JOB``, else
    the launcher's own job id where the launcher started several of these records (Slurm's
    ``SLURM_JOB_ID`` with ``SLURM_NTASKS`` > 1, Open MPI's ``PMIX_NAMESPACE`` with
    ``OMPI_COMM_WORLD_SIZE`` > 1, torchrun's ``TORCHELASTIC_RUN_ID`` unless it is ``none``, with
    ``WORLD_SIZE`` > 1); None otherwise. A record alone in an allocation is not a job part."""
    env = os.environ if environ is None else environ
    explicit = (env.get("GPU_TRACE_JOB") or "").strip()
    if explicit:
        return explicit
    for job, size in (
        ("SLURM_JOB_ID", "SLURM_NTASKS"),
        ("PMIX_NAMESPACE", "OMPI_COMM_WORLD_SIZE"),
        ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"),
    ):
        value = (env.get(job) or "").strip()
        n = _int(env.get(size))
        if value and value != "none" and n is not None and int(n) > 1:
            return value
    return None


def job_run_id(job: str) -> str:
    """The run id every part of ``job`` records into: ``job-`` and the id's safe characters (at
    most 64), with a short hash of the whole id when characters were replaced or cut, so two
    jobs never share a run."""
    safe = _JOB_ID.sub("-", job.strip()).strip("-.") or "job"
    if safe != job.strip() or len(safe) > 64:
        safe = f"{safe[:55]}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"
    return f"job-{safe}"


def job_trace_id(job: str) -> str:
    """The W3C trace id every part of ``job`` shares (32 hex digits from the job id)."""
    digest = hashlib.sha256(b"gpu-trace job " + job.encode()).hexdigest()[:32]
    return digest if int(digest, 16) else "1".rjust(32, "0")
