"""A process's place in a distributed job from its launcher's environment (tracer/ranks.py), and
collective kinds from c10d and backend names (framework_patches/torch/collectives.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpu_trace.tracer import ranks


def test_torchrun_sets_rank_local_rank_world_node_and_job() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "job-7",
    }
    assert ranks.from_env(env) == {
        "rank": "5",
        "world_size": "8",
        "local_rank": "1",
        "local_world_size": "4",
        "node": "1",
        "job": "job-7",
        "host": socket.gethostname(),
        "launcher": "torchrun",
        "source": "env",
    }


def test_mpirun_and_srun() -> None:
    mpi = ranks.from_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        }
    )
    assert (mpi["rank"], mpi["world_size"], mpi["local_rank"], mpi["launcher"]) == (
        "3",
        "4",
        "1",
        "mpirun",
    )
    slurm = ranks.from_env(
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "16", "SLURM_NODEID": "0", "SLURM_JOB_ID": "991"}
    )
    assert (slurm["rank"], slurm["world_size"], slurm["node"], slurm["job"]) == (
        "2",
        "16",
        "0",
        "991",
    )
    assert slurm["launcher"] == "srun"


def test_torchrun_under_srun_is_torchrun_with_slurms_job() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    env |= {"SLURM_JOB_ID": "55", "GROUP_RANK": "0"}
    got = ranks.from_env(env)
    assert (got["rank"], got["launcher"], got["job"]) == ("1", "torchrun", "55")


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"RANK": "0"},  # no world size
        {"RANK": "x", "WORLD_SIZE": "2"},
        {"RANK": "2", "WORLD_SIZE": "2"},  # outside the world
        {"RANK": "-1", "WORLD_SIZE": "2"},
    ],
)
def test_no_rank_or_a_malformed_one_is_not_a_rank(env: dict[str, str]) -> None:
    assert ranks.from_env(env) == {}


def test_rank_and_world_size_by_hand_say_env() -> None:
    assert ranks.from_env({"RANK": "0", "WORLD_SIZE": "1"})["launcher"] == "env"


def test_facts_round_trip_through_the_run_directory(tmp_path: Path) -> None:
    assert ranks.write(tmp_path, {"rank": "1", "world_size": "2", "other": "x"}, pid=42)
    assert not ranks.write(tmp_path, {}, pid=43)
    (tmp_path / ranks.RANKS_DIR / "44.json").write_text("{not json")
    assert ranks.read(tmp_path) == {42: {"rank": "1", "world_size": "2"}}
    assert ranks.read(tmp_path / "none") == {}


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("c10d::allreduce_", "all_reduce"),
        ("c10d::allreduce_coalesced_", "all_reduce"),
        ("c10d::_allgather_base_", "all_gather"),
        ("c10d::allgather_into_tensor_coalesced_", "all_gather"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"),
        ("c10d::broadcast_", "broadcast"),
        ("c10d::barrier", "barrier"),
        ("c10d::alltoall_base_", "all_to_all"),
        ("c10d::send", "send"),
        ("c10d::recv_", "recv"),
        ("c10d::recv_any_source_", "recv"),
        ("gloo:all_reduce", "all_reduce"),
        ("gloo:all_gather", "all_gather"),
        ("nccl:_all_gather_base", "all_gather"),
        ("nccl:send 0->1", "send"),
    ],
)
def test_collective_kinds(name: str, kind: str) -> None:
    collectives = pytest.importorskip("gpu_trace.framework_patches.torch.collectives")
    assert collectives.kind_of(name) == kind
