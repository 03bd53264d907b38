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

import json
import os
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
