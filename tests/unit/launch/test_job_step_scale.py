"""The attempt's own step on Aurora's size, 10,624 hosts of 12 ranks (127,488 ranks), started
for real: ``build_processes``'s srun and mpiexec (both dialects) exec'd through the stand-in
scheduler (``goodput.testing.jobs``), whose step runs the command as its first task would. No
argument and no variable is near Linux's limit on one of them (``MAX_ARG_STRLEN``): the hosts
travel in the attempt's host file, which srun, mpiexec and the ranks read. Before, the names
went comma-joined on srun's ``--nodelist`` and in every rank's environment (148,736 bytes
here), and exec failed with E2BIG: the job never started."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from goodput.launch.env import expand_nodelist, read_placement
from goodput.launch.launchers import build_processes, load_profile, plan_launch, write_hostfile
from goodput.testing.jobs import stand_in_scheduler

MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")  # Linux: one argument, or one NAME=VALUE
NODELIST = "x[1000-1165]c[0-7]s[0-7]b0n0"  # Aurora's names: 10,624 of 13 characters
HOSTS = expand_nodelist(NODELIST)
RANKS = 12 * len(HOSTS)
# The step's first task, as a rank: the attempt's hosts and every rank's host, from the file.
TASK = f"""
import os
from goodput.ranks import every_rank_host, launch_hosts, rank_host
hosts, every = launch_hosts(os.environ), every_rank_host({RANKS}, os.environ)
print(len(hosts), len(every), rank_host({RANKS - 1}, os.environ), len(set(map(id, every))))
"""
ALLOCATIONS = {
    "slurm": ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": NODELIST}, None, "generic"),
    "hydra": ({"PBS_JOBID": "1.pbs"}, "".join(f"{host}\n" for host in HOSTS), "generic"),
    "pals": ({"PBS_JOBID": "1.pbs"}, "".join(f"{host}\n" for host in HOSTS), "aurora"),
}


def test_the_names_joined_are_past_what_one_argument_may_hold():
    # The limit is real here: the command line goodput built before fails to start.
    joined = ",".join(HOSTS)
    assert len(HOSTS) == 10_624 and len(joined) == 148_735 > MAX_ARG_STRLEN
    with pytest.raises(OSError) as failed:
        subprocess.Popen(["srun", "--nodelist", joined, "true"])
    assert failed.value.errno == errno.E2BIG


@pytest.mark.parametrize("kind", ALLOCATIONS)
def test_the_jobs_own_step_on_10624_hosts_starts_and_its_ranks_read_every_host(tmp_path, kind):
    env, hostfile, profile = ALLOCATIONS[kind]
    plan = plan_launch(
        read_placement(env, hostfile), load_profile(profile), run_dir=tmp_path, ppn=12
    )
    launcher_env = {**os.environ, **stand_in_scheduler(tmp_path / "bin", {}, tmp_path / "log")}
    (spec,) = build_processes(plan, [sys.executable, "-c", TASK], launcher_env)
    assert spec.argv[0] == ("srun" if kind == "slurm" else "mpiexec")
    assert max(len(arg.encode()) for arg in spec.argv) < 4096
    assert max(len(f"{k}={v}".encode()) for k, v in spec.env.items()) < MAX_ARG_STRLEN
    write_hostfile(plan)
    step = subprocess.Popen(spec.argv, env=spec.env, stdout=subprocess.PIPE, text=True)
    out, _ = step.communicate(timeout=120)
    assert step.returncode == 0
    # 10,624 hosts, 127,488 ranks; the last rank on the last host; one string a host.
    assert out.split() == ["10624", "127488", "x1165c7s7b0n0", "10624"]
