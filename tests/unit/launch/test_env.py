"""Placement from faked scheduler and launcher environments: no cluster needed."""

import pytest

from goodput.errors import GoodputError
from goodput.launch.env import expand_nodelist, read_placement


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        (
            "x[1000-1003,1010]c0s1b0n0",
            ["x1000c0s1b0n0", "x1001c0s1b0n0", "x1002c0s1b0n0", "x1003c0s1b0n0", "x1010c0s1b0n0"],
        ),
        ("nid[008-010],login1", ["nid008", "nid009", "nid010", "login1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("single", ["single"]),
    ],
)
def test_slurm_nodelists_expand(spec, hosts):
    assert expand_nodelist(spec) == hosts


def test_slurm_job_step():
    env = {
        "SLURM_JOB_ID": "812",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
    }
    placement = read_placement(env)
    assert (placement.scheduler, placement.job_id, placement.hosts) == (
        "slurm",
        "812",
        ("gpu01", "gpu02"),
    )
    assert (
        placement.source,
        placement.rank,
        placement.world_size,
        placement.local_rank,
        placement.local_world_size,
    ) == ("slurm", 5, 8, 1, 4)
    assert placement.master_addr == "gpu01"
    assert placement.master_port == read_placement({**env, "SLURM_PROCID": "0"}).master_port
    assert placement.master_port != read_placement({**env, "SLURM_JOB_ID": "813"}).master_port


def test_pbs_with_mpich_hydra_ranks():
    env = {
        "PBS_JOBID": "42.pbs",
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
    }
    placement = read_placement(env, "x1\nx1\nx2\nx2\n")
    assert placement.hosts == ("x1", "x2") and placement.scheduler == "pbs"
    assert (placement.source, placement.rank, placement.local_rank, placement.local_world_size) == (
        "pmi",
        3,
        1,
        2,
    )


def test_cray_pals_and_open_mpi_and_torchrun():
    pals = read_placement(
        {"PALS_RANKID": "7", "PMI_SIZE": "12", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "6"}
    )
    assert (pals.source, pals.rank, pals.local_rank, pals.local_world_size) == ("pals", 7, 1, 6)
    ompi = read_placement(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        }
    )
    assert (ompi.source, ompi.rank, ompi.world_size, ompi.local_rank) == ("ompi", 2, 4, 0)
    # torchrun's variables win over the job step's that srun also set.
    torchrun = read_placement(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "1234",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
        }
    )
    assert (torchrun.source, torchrun.rank, torchrun.master_addr, torchrun.master_port) == (
        "torchrun",
        1,
        "node7",
        1234,
    )


def test_single_process():
    placement = read_placement({})
    assert (placement.scheduler, placement.source, placement.rank, placement.world_size) == (
        "local",
        "single",
        0,
        1,
    )
    assert placement.master_addr == "127.0.0.1"


@pytest.mark.parametrize(
    ("env", "hostfile", "message"),
    [
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-x]"}, None, "cannot expand"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1;rm -rf /"}, None, "not a valid host"),
        ({"PBS_JOBID": "1"}, "good\n$(reboot)\n", "not a valid host"),
        ({"PBS_JOBID": "1"}, None, "PBS host file could not be read"),
        ({"PMI_RANK": "4", "PMI_SIZE": "4"}, None, "outside a world of 4"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, None, "is not a count"),
    ],
)
def test_bad_environments_are_named(env, hostfile, message):
    with pytest.raises(GoodputError, match=message):
        read_placement(env, hostfile)
