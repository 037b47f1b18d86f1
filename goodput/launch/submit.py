"""Job chains, the JOB scope of recovery: a Slurm or PBS batch script that reruns one
``goodput launch`` line, allocation after allocation, until the run is done.

Each job asks for the hosts and the ranks per host its launch line runs (``fit_launch``: the
line's ``--nhosts``/``--ppn``/``--nproc``, else the profile's ``ppn``; whole nodes when the
profile says ``whole_nodes``), so the line always fits the allocation. Each job, in order:
  1. stops at once if ``RUN_DIR/done`` exists. The trainer writes that marker on rank 0, last,
     once every step has run; nothing else counts as done;
  2. stops, exit 1, if the two jobs before it gained no step (the guard, below);
  3. unless it is job ``max_jobs``, queues its successor with an after-any dependency *before*
     training, so that a walltime kill, a crash or a lost node still leaves the next job queued;
  4. runs the launch line and waits for it (no ``exec``: the script has work left after it; a
     walltime SIGTERM is trapped so that bash waits too, rather than dying before the launch);
  5. if the marker now exists, cancels the queued successor and exits 0; if the eval gate stopped
     the run (exit 3), cancels it and exits 3; if neither this job nor
     the one before it gained a step, cancels it and exits 1; otherwise exits with the launch's
     code and the successor carries the run on.
The guard is ``python -m goodput.launch.submit``: it reads what each job gained from the
``job`` and ``steps_gained`` of the launch's ``attempts.jsonl`` (a job that left no record
gained nothing) and prints why it ends the chain. The chain position reaches each job in
``GOODPUT_CHAIN_JOB`` (the first job gets 1) and the ids of the jobs before it in
``GOODPUT_CHAIN_PREVIOUS`` (two at most, the latest last; the first job gets none), so that
rerunning ``goodput submit`` starts a fresh chain of up to ``max_jobs`` that no job of an older
chain can end, and nothing is written for it.

Invariants: every value in the script body is ``shlex.quote``d; values in ``#SBATCH``/``#PBS``
lines must instead match strict patterns, because sbatch and qsub parse those lines themselves,
not with a shell; the script is written atomically and a different existing one is never
replaced; schedulers are run with argv lists. The jobs run in the environment of the shell that
submits them (Slurm's default; ``-V`` on PBS). Slurm writes each job's log into the run dir;
PBS keeps its default, the folder the job was submitted from. Not done here: watching the jobs,
or judging why an attempt failed (``goodput launch`` does that inside each job). Standard library
and ``goodput.launch`` only.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from goodput import rundir
from goodput.errors import ExitCode, GoodputError, from_exception
from goodput.io import read_text, write_text
from goodput.launch.env import JOB_ID, MAX_HOSTS
from goodput.launch.history import read_attempts
from goodput.launch.launchers import MAX_PPN, ProfileConfig, rank_counts
from goodput.launch.run import default_run_dir

if TYPE_CHECKING:
    from goodput.launch.run import LaunchOptions

CHAIN_JOB_VAR = "GOODPUT_CHAIN_JOB"
CHAIN_PREVIOUS_VAR = "GOODPUT_CHAIN_PREVIOUS"
# Jobs in a row without a step that end a chain: as many as end the attempts of one launch.
MAX_STEPLESS_JOBS = 2
GUARD_MODULE = "goodput.launch.submit"  # each job runs python -m GUARD_MODULE (main, below)
CLIENTS = {"slurm": "sbatch", "pbs": "qsub"}

# What may go into a #SBATCH/#PBS line. Nothing there is quoted: sbatch and qsub parse those
# lines themselves, each its own way, so only values that need no quoting are allowed.
JOB_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # accounts, partitions, queues
FILESYSTEMS = re.compile(r"[A-Za-z0-9_]+(:[A-Za-z0-9_]+)*")
PATH = re.compile(r"[A-Za-z0-9._/+-]+")
WALLTIME = re.compile(r"[0-9]{1,4}:[0-5][0-9]:[0-5][0-9]")
MAX_JOBS = 10_000  # a chain that long has stopped making progress long before

# The script a job runs after its headers. Values appear once, each shell-quoted and assigned to
# a variable, and are filled in one pass, so a value holding "@...@" is never filled again.
BODY = """\
# Written by `goodput submit`: one job of a chain that reruns the launch line below until the
# done marker exists or max_jobs jobs have run. Its position comes in GOODPUT_CHAIN_JOB, the ids
# of the jobs before it in this chain (two at most, the latest last) in GOODPUT_CHAIN_PREVIOUS.
set -euo pipefail
cd @WORKDIR@
script=@SCRIPT@
done_marker=@DONE@
job=${GOODPUT_CHAIN_JOB:-1}
max_jobs=@MAX_JOBS@
this_job=@THIS_JOB@
previous=${GOODPUT_CHAIN_PREVIOUS:-}
# The job before this one and this one: the successor's GOODPUT_CHAIN_PREVIOUS.
recent=${previous:+${previous##*,},}$this_job
# The walltime's SIGTERM reaches every process of the job. Untrapped, it would end bash at once;
# trapped, bash waits for the launch (which stops its ranks, saves and logs) and settles the chain.
trap 'echo "goodput chain: job $job: SIGTERM (the walltime?); settling the chain" >&2' TERM
# Checked before (( )) reads it: bash arithmetic would evaluate any expression, $(...) included.
if [[ ! $job =~ ^[1-9][0-9]{0,8}$ ]]; then
  echo "goodput chain: GOODPUT_CHAIN_JOB=$job is not a job number; unset it" >&2
  exit 2
fi
if [[ -e $done_marker ]]; then
  echo "goodput chain: job $job: $done_marker exists, the run is complete; nothing to do"
  exit 0
fi
# Before anything is queued: a chain whose last two jobs made no step queues no more. The
# guard says why; it reads the ids as data and judges them itself.
if ! @GUARD@ -- "$previous"; then
  echo "goodput chain: job $job: the chain ends here, before its launch" >&2
  exit 1
fi
next=
if ((job < max_jobs)); then
  # Queued before the launch: a walltime kill or a crash still leaves the next job waiting.
  if next=$(GOODPUT_CHAIN_JOB=$((job + 1)) GOODPUT_CHAIN_PREVIOUS=$recent @QUEUE_NEXT@); then
    next=${next%%;*}
    echo "goodput chain: job $job of at most $max_jobs; job $next is queued to go on"
  else
    echo "goodput chain: job $job: could not queue a successor; the chain ends here" >&2
    next=
  fi
else
  echo "goodput chain: job $job of $max_jobs (--max-jobs): the last one"
fi
status=0
@LAUNCH@ || status=$?
if [[ -e $done_marker ]]; then
  # The successor would stop at the marker by itself; cancelling frees its place in the queue.
  if [[ -n $next ]]; then @CANCEL@ "$next" || true; fi
  echo "goodput chain: job $job: $done_marker written, the run is complete"
  exit 0
fi
if ((status == @NOT_LEARNING@)); then
  if [[ -n $next ]]; then @CANCEL@ "$next" || true; fi
  echo "goodput chain: job $job: the eval gate stopped the run (exit $status); the chain" \
    "ends here" >&2
  exit "$status"
fi
if ! @GUARD@ -- "$recent"; then
  if [[ -n $next ]]; then
    @CANCEL@ "$next" || true
    echo "goodput chain: job $job: job $next cancelled" >&2
  fi
  echo "goodput chain: job $job: the launch exited $status; the chain ends here" >&2
  exit 1
fi
if [[ -n $next ]]; then
  echo "goodput chain: job $job: the launch exited $status; job $next goes on"
else
  echo "goodput chain: job $job: the launch exited $status and the chain ends without" \\
    "$done_marker; submit $script again to go on" >&2
fi
exit "$status"
"""

# How sbatch/qsub are called, by this module and by each job for its successor: the chain
# position goes in the client's environment, which both pass on to the job they queue.
SUBMIT_FLAGS = {
    "slurm": ("--parsable", f"--export=ALL,{CHAIN_JOB_VAR}"),  # --parsable: print the id only
    "pbs": ("-v", CHAIN_JOB_VAR),
}
# The job's own id, as the scheduler sets it (and goodput launch records it in attempts.jsonl).
THIS_JOB = {
    "slurm": "${SLURM_JOB_ID:?is not set: submit this script with sbatch}",
    "pbs": "${PBS_JOBID:?is not set: submit this script with qsub}",
}
AFTER_THIS_JOB = {
    "slurm": '--dependency=afterany:"$this_job"',
    "pbs": '-W depend=afterany:"$this_job"',
}
CANCEL = {"slurm": "scancel", "pbs": "qdel"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    """One chain's settings; validated on creation, so every instance renders safely."""

    scheduler: str  # "slurm" | "pbs"
    run_dir: Path  # absolute: the script, Slurm's job logs and the done marker live here
    workdir: Path  # absolute: every job starts here, so relative paths mean what they meant
    launch_line: tuple[str, ...]  # goodput launch ... -- CMD ...
    nhosts: int
    ppn: int  # ranks per host that the launch line runs (fit_launch)
    whole_nodes: bool = False  # every CPU of each host, not one per rank (the profile's)
    # Where the launch line writes attempts.jsonl (its --run-dir, else its --log's folder);
    # None: goodput launch's default, launch-JOBID in the working folder, one per job.
    launch_run_dir: Path | None = None
    python: str = sys.executable  # runs the guard: an interpreter that imports this goodput
    walltime: str  # HH:MM:SS
    job_name: str
    account: str | None = None
    queue: str | None = None  # a Slurm partition or a PBS queue
    filesystems: str | None = None  # PBS only
    max_jobs: int = 10

    def __post_init__(self) -> None:
        assert self.scheduler in CLIENTS, self.scheduler
        assert self.run_dir.is_absolute() and self.workdir.is_absolute()
        assert self.launch_run_dir is None or self.launch_run_dir.is_absolute()
        if not WALLTIME.fullmatch(self.walltime) or not self.walltime.strip("0:"):
            raise GoodputError.usage(
                "submit --time",
                f"{self.walltime!r} is not HH:MM:SS above zero",
                "e.g. --time 06:00:00",
            )
        for option, count, most in (
            ("--nhosts", self.nhosts, MAX_HOSTS),
            ("--max-jobs", self.max_jobs, MAX_JOBS),
            ("-- goodput launch --ppn", self.ppn, MAX_PPN),
        ):
            if not 1 <= count <= most:
                raise GoodputError.usage(f"submit {option}", f"is {count}", f"give 1 to {most}")
        if self.filesystems is not None and self.scheduler != "pbs":
            raise GoodputError.usage(
                "submit --filesystems", "is a PBS resource", "drop it for Slurm"
            )
        names = "up to 64 letters, digits and ._-"
        checks = [
            ("--job-name", self.job_name, JOB_NAME, f"{names}, first a letter"),
            ("--account", self.account, NAME, names),
            ("--partition/--queue", self.queue, NAME, names),
            ("--filesystems", self.filesystems, FILESYSTEMS, "names and ':', e.g. home:flare"),
        ]
        if self.scheduler == "slurm":  # the run dir is in the #SBATCH --output line
            checks.append(("--run-dir", str(self.run_dir), PATH, "letters, digits and ._/+-"))
        for option, value, pattern, allowed in checks:
            if value is not None and not pattern.fullmatch(value):
                raise GoodputError.usage(
                    f"submit {option}",
                    f"{value!r} cannot go into a #SBATCH/#PBS line",
                    f"use {allowed}",
                )

    @property
    def script(self) -> Path:
        return self.run_dir / rundir.CHAIN_SCRIPTS[self.scheduler]

    @property
    def done_marker(self) -> Path:
        return self.run_dir / rundir.DONE


def check_launch_line(argv: list[str]) -> None:
    """Refuse anything but a ``goodput launch ...`` line (its options are the CLI's to parse)."""
    if len(argv) < 2 or Path(argv[0]).name != "goodput" or argv[1] != "launch":
        raise GoodputError.usage(
            "submit --",
            f"is followed by {shlex.join(argv[:2]) or 'nothing'}, not a goodput launch line",
            "end with the line each job runs, e.g. -- goodput launch --timeout 1800 -- "
            "goodput train run.toml",
        )


def fit_launch(options: LaunchOptions, profile: ProfileConfig, nhosts: int) -> int:
    """The ranks per host a job of ``nhosts`` hosts must hold for the launch line ``options`` to
    run in it, by the rule ``goodput launch`` plans with; a line that cannot run in such a job
    is a usage error naming the option at fault."""
    if options.nhosts is not None and options.nhosts > nhosts:
        raise GoodputError.usage(
            "submit -- goodput launch --nhosts",
            f"{options.nhosts} hosts do not fit a job of --nhosts {nhosts}",
            f"submit with --nhosts {options.nhosts} or more (the extra hosts are spares), or "
            f"launch on {nhosts} or fewer",
        )
    num_hosts = nhosts if options.nhosts is None else options.nhosts
    try:
        ppn, _ = rank_counts(profile, num_hosts, ppn=options.ppn, nproc=options.nproc)
    except GoodputError as error:
        raise GoodputError.usage(
            f"submit -- goodput launch {error.where}", error.what, error.fix
        ) from None
    return ppn


def detect_scheduler() -> str:
    found = [name for name, client in CLIENTS.items() if shutil.which(client)]
    if len(found) != 1:
        what = "both sbatch and qsub are" if found else "neither sbatch nor qsub is"
        raise GoodputError.usage(
            "submit --scheduler", f"not given, and {what} on PATH", "pass --scheduler slurm|pbs"
        )
    return found[0]


def default_job_name(run_dir: Path) -> str:
    return run_dir.name if JOB_NAME.fullmatch(run_dir.name) else "goodput"


def render(chain: Chain) -> str:
    """The batch script: scheduler headers, then ``BODY`` with every value quoted."""
    scheduler = chain.scheduler
    headers = _slurm_headers(chain) if scheduler == "slurm" else _pbs_headers(chain)
    flags = " ".join(SUBMIT_FLAGS[scheduler])
    guard = [chain.python, "-m", GUARD_MODULE]
    if chain.launch_run_dir is not None:
        guard += ["--launch-run-dir", str(chain.launch_run_dir)]
    fields = {
        "WORKDIR": shlex.quote(str(chain.workdir)),
        "SCRIPT": shlex.quote(str(chain.script)),
        "DONE": shlex.quote(str(chain.done_marker)),
        "MAX_JOBS": str(chain.max_jobs),
        "THIS_JOB": THIS_JOB[scheduler],
        "GUARD": shlex.join(guard),
        "QUEUE_NEXT": f'{CLIENTS[scheduler]} {AFTER_THIS_JOB[scheduler]} {flags} "$script"',
        "LAUNCH": shlex.join(chain.launch_line),
        "CANCEL": CANCEL[scheduler],
        "NOT_LEARNING": str(int(ExitCode.NOT_LEARNING)),
    }
    body = re.sub(r"@([A-Z_]+)@", lambda match: fields[match[1]], BODY)
    return "#!/bin/bash\n" + "".join(line + "\n" for line in headers) + body


def _slurm_headers(chain: Chain) -> list[str]:
    lines = [
        f"--job-name={chain.job_name}",
        f"--nodes={chain.nhosts}",
        f"--ntasks-per-node={chain.ppn}",  # without it, a job holds one CPU: srun refuses 2 ranks
        *(["--exclusive"] if chain.whole_nodes else []),
        f"--time={chain.walltime}",
        f"--output={chain.run_dir}/%x-%j.out",  # one log per job, beside the run
    ]
    lines += [f"--account={chain.account}"] if chain.account else []
    lines += [f"--partition={chain.queue}"] if chain.queue else []
    return [f"#SBATCH {line}" for line in lines]


def _pbs_headers(chain: Chain) -> list[str]:
    # mpiprocs: each host's count in PBS_NODEFILE; ncpus: one CPU a rank unless whole nodes.
    chunk = f"mpiprocs={chain.ppn}"
    if not chain.whole_nodes:
        chunk = f"ncpus={chain.ppn}:{chunk}"
    lines = [
        f"-N {chain.job_name}",
        f"-l select={chain.nhosts}:{chunk}",
        # One chunk per node, not N chunks packed onto one; excl: no other job on it.
        f"-l place=scatter{':excl' if chain.whole_nodes else ''}",
        f"-l walltime={chain.walltime}",
    ]
    lines += [f"-l filesystems={chain.filesystems}"] if chain.filesystems else []
    lines += [f"-A {chain.account}"] if chain.account else []
    lines += [f"-q {chain.queue}"] if chain.queue else []
    lines += ["-j oe", "-V"]  # -V: the submitting shell's environment, as Slurm does by default
    return [f"#PBS {line}" for line in lines]


def write_script(chain: Chain) -> Path:
    """Write ``chain.script`` atomically; the same script again is fine, a different one is not."""
    text, path = render(chain), chain.script
    if chain.run_dir.exists() and not chain.run_dir.is_dir():
        raise GoodputError.usage("submit --run-dir", f"{chain.run_dir} is a file", "give a folder")
    if not path.exists():
        try:
            write_text(path, text)
        except OSError as exc:
            error = from_exception(exc)
            raise GoodputError.usage(
                f"submit --run-dir {error.where}", error.what, error.fix
            ) from None
    elif read_text(path) != text:
        raise GoodputError.usage(
            path,
            "exists and differs from the script these options give",
            "remove it to write the new one, or submit it as it is: "
            f"{CLIENTS[chain.scheduler]} {shlex.quote(str(path))}",
        )
    return path


def submit(chain: Chain) -> str:
    """Queue the chain's first job; return its id."""
    if chain.done_marker.exists():
        raise GoodputError.usage(
            chain.done_marker,
            "exists: this run is complete",
            "remove it to train on (after raising train.steps), or pick another --run-dir",
        )
    argv = [CLIENTS[chain.scheduler], *SUBMIT_FLAGS[chain.scheduler], str(chain.script)]
    if shutil.which(argv[0]) is None:
        raise GoodputError.usage(
            argv[0],
            "is not on PATH",
            "submit from a login node of the cluster, or drop --submit to only write the script",
        )
    # Set and cleared, not inherited: goodput submit may itself run inside a job of another chain,
    # whose jobs must not count in this one.
    env = {**os.environ, CHAIN_JOB_VAR: "1"}
    env.pop(CHAIN_PREVIOUS_VAR, None)
    try:
        result = subprocess.run(
            argv, cwd=chain.workdir, env=env, capture_output=True, text=True, errors="replace"
        )
    except OSError as exc:
        raise from_exception(exc) from None
    if result.returncode != 0:
        said = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise GoodputError(
            argv[0],
            f"exited {result.returncode}: {said}",
            f"fix what it says (the script is {chain.script}) and submit again",
        )
    return result.stdout.strip().split(";")[0]  # sbatch --parsable prints ID or ID;CLUSTER


# --- the guard, run by each job ----------------------------------------------------------------


def parse_jobs(text: str) -> list[str]:
    """``GOODPUT_CHAIN_PREVIOUS``'s value: up to ``MAX_STEPLESS_JOBS`` job ids, comma-separated,
    the latest last; empty in a chain's first job."""
    jobs = text.split(",") if text else []
    if len(jobs) > MAX_STEPLESS_JOBS or not all(JOB_ID.fullmatch(job) for job in jobs):
        raise GoodputError.usage(
            CHAIN_PREVIOUS_VAR,
            f"{text[:200]!r} is not up to {MAX_STEPLESS_JOBS} job ids separated by commas",
            "unset it: each job of a goodput submit chain sets it for the next",
        )
    return jobs


def check_progress(jobs: Sequence[str], launch_run_dir: Path | None) -> None:
    """Raise, saying what each did, when ``jobs`` are the last ``MAX_STEPLESS_JOBS`` of a chain
    and none of them gained a step; fewer jobs never end a chain. A job's attempts log is
    ``launch_run_dir``'s, else ``launch-JOB`` here, as ``goodput launch`` picks it."""
    if len(jobs) < MAX_STEPLESS_JOBS:
        return
    accounts = [_account(job, launch_run_dir or default_run_dir(job)) for job in jobs]
    if any(gained for gained, _ in accounts):
        return
    raise GoodputError(
        f"jobs {' and '.join(jobs)}",
        f"{len(jobs)} jobs in a row gained no step ({'; '.join(said for _, said in accounts)})",
        "the chain ends here; fix what their logs show, then start a new chain with goodput "
        "submit --submit",
    )


def _account(job: str, launch_run_dir: Path) -> tuple[int, str]:
    """Steps ``job`` gained by its attempt records, and one phrase of what its last one said."""
    attempts = launch_run_dir / rundir.ATTEMPTS
    records = [r for r in (read_attempts(attempts) if attempts.exists() else []) if r.job == job]
    if not records:
        return 0, f"{job}: no launch attempt in {attempts}, so its launch line failed first"
    last = records[-1]
    why = f"{last.class_}, {last.reason}" if last.reason else last.class_
    said = f"{job}: {len(records)} attempt(s), the last exited {last.exit_code} ({why})"
    return sum(r.steps_gained for r in records), said


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m goodput.launch.submit [--launch-run-dir DIR] -- JOBS``: the guard the job
    script runs. Exit 0 when the chain may go on; else one line on stderr and non-zero."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {GUARD_MODULE}",
        description="Exit non-zero, saying why, when the job chain's last jobs JOBS (comma-"
        "separated, the latest last) all gained no step.",
    )
    parser.add_argument("--launch-run-dir", type=Path, help="where the launch line logs")
    parser.add_argument("jobs", metavar="JOBS")
    args = parser.parse_args(argv)
    try:
        check_progress(parse_jobs(args.jobs), args.launch_run_dir)
    except Exception as exc:  # the job's log gets one line, whatever went wrong
        error = from_exception(exc)
        print(f"goodput chain: {error.render()}", file=sys.stderr, flush=True)
        return int(error.code)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
