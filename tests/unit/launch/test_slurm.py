"""``goodput launch`` inside a real Slurm allocation, on the single-node Slurm of this machine.

CI starts it with ``.ci/start-slurm``; elsewhere these tests skip unless ``srun`` and ``sinfo``
are installed and a node answers. ``salloc`` runs its command on this host with the
allocation's ``SLURM_*`` variables set, so ``goodput launch`` reads its placement from a real
environment and starts real ``srun`` steps. The allocation a ``goodput submit`` chain asks for is
put to Slurm's own check (``sbatch --test-only``); the chains themselves run in test_submit.py and
tests/chaos/test_job_chain.py.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.launch.history import read_attempts
from goodput.testing.jobs import outside_any_job, slurm_node

TIMEOUT_S = 60


pytestmark = pytest.mark.skipif(
    slurm_node() is None,
    reason="needs a running Slurm with a usable node (apt: slurm-wlm munge; .ci/start-slurm)",
)


def _salloc(ntasks: int, launch_args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``goodput launch LAUNCH_ARGS`` run by ``salloc`` in a fresh one-node allocation."""
    # --overcommit: two tasks fit a one-core node too (salloc passes it on to srun).
    salloc = ["salloc", "--nodes", "1", "--ntasks", str(ntasks), "--overcommit"]
    salloc += ["--time", "2", "--job-name", "goodput-test"]
    return subprocess.run(
        [*salloc, sys.executable, "-m", "goodput", "launch", *launch_args],
        cwd=cwd,
        env=outside_any_job(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_ranks_really_run_under_srun(tmp_path):
    # Each rank names every rank's host from the launcher's host file, srun's --nodelist too.
    code = (
        "import os; from goodput.ranks import every_rank_host; "
        "print('rank', os.environ['SLURM_PROCID'], 'of', os.environ['SLURM_NTASKS'], "
        "'on', *every_rank_host(2, os.environ))"
    )
    run_dir = tmp_path / "run"
    result = _salloc(
        2,
        ["--ppn", "2", "--timeout", "50", "--run-dir", str(run_dir)]
        + ["--", sys.executable, "-c", code],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    node = slurm_node()
    assert sorted(result.stdout.splitlines()) == [
        f"[srun] rank {rank} of 2 on {node} {node}" for rank in (0, 1)
    ]
    assert "launch: slurm: 1 host(s) x 2 = 2 rank(s)" in result.stderr
    (record,) = read_attempts(run_dir / "attempts.jsonl")
    assert record.exit_code == 0


def test_dry_run_names_this_host_from_the_allocation(tmp_path):
    result = _salloc(1, ["--dry-run", "--", "true"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.splitlines()
    argv = shlex.split(line)
    srun = argv[argv.index("srun") :]
    node = slurm_node()
    assert node == socket.gethostname().split(".")[0]
    assert f" rank(s) on {node}; " in result.stderr  # the plan's line
    # The hosts go in the attempt's host file (a '/': srun reads the names from it), named in
    # the job's launch folder; a real launch writes it, a dry run nothing.
    hostfile = Path(srun[srun.index("--nodelist") + 1])
    assert hostfile.parent.name.startswith("launch-") and hostfile.is_absolute()
    assert srun[-1] == "true" and "--kill-on-bad-exit=1" in srun
    assert f"MASTER_ADDR={node}" in argv[: argv.index("srun")]
    assert f"GOODPUT_HOSTFILE={hostfile}" in argv[: argv.index("srun")]
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_a_rank_killed_under_srun_is_probed_and_the_healthy_node_kept(tmp_path):
    # Rank 1 dies by SIGKILL once, as under the OOM killer: srun says "srun: error: HOST: task 1:
    # Killed". That makes the only node a suspect, not a bad node: its probe (a real srun step)
    # passes, so the next attempt runs on it again, although no spare exists.
    marker = tmp_path / "killed-once"
    code = "import os, signal, pathlib; print('step=1', flush=True); "
    code += f"m = pathlib.Path({str(marker)!r}); "
    code += "os.environ['SLURM_PROCID'] == '1' and not m.exists() and "
    code += "(m.touch(), os.kill(os.getpid(), signal.SIGKILL))"
    run_dir = tmp_path / "run"
    launch = ["--auto-retry", "--ppn", "2", "--run-dir", str(run_dir), "--backoff", "0.1"]
    result = _salloc(2, [*launch, "--", sys.executable, "-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    first, second = [r.to_json() for r in read_attempts(run_dir / "attempts.jsonl")]
    node = slurm_node()
    assert first["class"] == "error" and first["hosts"] == [node] == second["hosts"]
    assert first["evidence"] == [] and first["replaced"] == {} and first["decision"] == "retry"
    assert f"srun: error: {node}: task 1: Killed" in result.stderr
    assert "health probe passed: kept" in result.stderr
    assert second["class"] == "success"


def test_auto_retry_probes_the_node_through_srun_and_stops_a_config_bug(tmp_path):
    run_dir = tmp_path / "run"
    launch = ["--auto-retry", "--ppn", "2", "--run-dir", str(run_dir), "--backoff", "0.1"]
    result = _salloc(2, [*launch, "--", sys.executable, "-c", "raise SystemExit(5)"], tmp_path)
    # 5 is no code goodput names (3 would be the eval gate's, which stops at once).
    assert result.returncode == 1  # goodput launch's own code for an exit it has no name for
    records = [r.to_json() for r in read_attempts(run_dir / "attempts.jsonl")]
    assert [r["exit_code"] for r in records] == [5, 5]
    assert [r["class"] for r in records] == ["stuck-pre-training"] * 2
    assert all(r["evidence"] == [] and r["replaced"] == {} for r in records)
    # The default probe ran on the node, through a real srun step, and found it healthy.
    assert "probing 1 host(s)" in result.stderr
    assert "2 attempts in a row made no step" in result.stderr


# Two ranks that write real beacons (goodput.beacon, standard library) and go silent, the first
# two times they run: rank 0 waits in a collective, rank 1 stays in its data phase, so the hang
# forensics (through ``srun --overlap``) names rank 1 both times. The third run finishes.
SUSPECT_TWICE = """
import os, pathlib, socket, sys, time
from goodput import beacon
rank = int(os.environ["SLURM_PROCID"])
runs = pathlib.Path(sys.argv[1]) / f"runs-{rank}"
run = len(runs.read_text()) if runs.exists() else 0
runs.write_text("x" * (run + 1))
print(f"step={run + 1}", flush=True)
if run < 2:
    me = beacon.open_beacon(os.environ, rank=rank, world_size=2, local_rank=rank,
                            host=socket.gethostname())
    me.step(run + 1)
    me.phase("data" if rank == 1 else "forward")
    if rank == 1:
        time.sleep(600)
    with me.collective("step.tokens"):
        time.sleep(600)
"""


def test_a_node_named_the_hang_suspect_twice_with_no_spare_is_kept(tmp_path):
    # The one node cannot be replaced (no second node here): the launcher says so and goes on.
    (tmp_path / "worker.py").write_text(SUSPECT_TWICE)
    run_dir = tmp_path / "run"
    launch = ["--auto-retry", "--ppn", "2", "--run-dir", str(run_dir), "--backoff", "0.1"]
    launch += ["--timeout", "3", "--grace", "1"]
    worker = [sys.executable, str(tmp_path / "worker.py"), str(tmp_path)]
    result = _salloc(2, [*launch, "--", *worker], tmp_path)
    assert result.returncode == 0, result.stderr
    first, second, third = read_attempts(run_dir / "attempts.jsonl")
    node = slurm_node()
    for record in (first, second):
        assert record.class_ == "hang" and record.replaced == {} and record.decision == "retry"
        suspect = record.evidence[0]
        assert (suspect.source, suspect.host, suspect.rank) == ("hang-suspect", node, 1)
        assert suspect.said.startswith(f"hang suspect: rank 1 on {node} ")
    assert third.class_ == "success" and third.hosts == (node,)
    kept = f"{node}: named the hang suspect twice in a row; probe passed; no spare: kept"
    assert result.stderr.count(kept) == 1


def _node_cpus() -> int:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", slurm_node() or "", "-o", "%c"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    return int(out.split()[0])


def _chain_script(tmp_path: Path, launch: list[str]) -> str:
    """The script ``goodput submit`` writes for a one-node chain of ``goodput launch LAUNCH``."""
    argv = [sys.executable, "-m", "goodput", "submit", "--nhosts", "1", "--time", "00:01:00"]
    argv += ["--run-dir", str(tmp_path / "run"), "--job-name", "goodput-test"]
    written = subprocess.run(
        [*argv, "--", "goodput", "launch", *launch, "--", "true"],
        cwd=tmp_path,
        env=outside_any_job(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert written.returncode == 0, written.stderr
    return written.stdout.strip()


@pytest.mark.parametrize(
    ("profile", "extra_ranks", "granted"),
    [([], 0, True), (["--profile", "perlmutter"], 0, True), ([], 1, False)],
)
def test_the_allocation_a_chain_asks_for_holds_its_ranks(tmp_path, profile, extra_ranks, granted):
    # As many ranks as the node has CPUs: one CPU a rank, or the whole node (--exclusive); one
    # more, and Slurm's own check finds no node for the job: the allocation carries the count
    # (a job asking for nodes only would be granted, and its srun step refused).
    cpus = _node_cpus()
    script = _chain_script(tmp_path, [*profile, "--nproc", str(cpus + extra_ranks)])
    text = Path(script).read_text()
    assert f"#SBATCH --ntasks-per-node={cpus + extra_ranks}\n" in text
    assert ("#SBATCH --exclusive\n" in text) == bool(profile)
    test_only = subprocess.run(
        ["sbatch", "--test-only", script], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if granted:
        assert test_only.returncode == 0 and f"using {cpus} processors" in test_only.stderr
    else:
        assert test_only.returncode == 1
        assert "Requested node configuration is not available" in test_only.stderr
