"""The environment for a child process that must not think it runs inside a job, the node of
this machine's Slurm that the Slurm tests run on, the pids of the ranks a launcher runs, and a
stand-in scheduler (``srun`` and ``mpiexec`` answering for thousands of hosts at once)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import goodput
from goodput.launch import fanout
from goodput.launch.env import expand_nodelist, read_hostfile
from goodput.launch.run import PROFILE_VAR
from goodput.launch.submit import CHAIN_JOB_VAR

REPO = Path(goodput.__file__).resolve().parents[1]
# Variables that would make a child read a placement, a profile or a chain position of the job
# the tests themselves may run in.
JOB_PREFIXES = ("SLURM_", "SBATCH_", "PBS_")
JOB_VARS = (PROFILE_VAR, CHAIN_JOB_VAR)


def outside_any_job(**extra: str) -> dict[str, str]:
    """This process's environment without any scheduler's or goodput's job variables, with this
    checkout first on PYTHONPATH; ``extra`` is set on top."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(JOB_PREFIXES) and k not in JOB_VARS
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}


def run_goodput(
    *argv: object,
    cwd: Path | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m goodput ARGV`` in a child, as a user runs it outside any job (``env`` on
    top), with its output captured as text; ``timeout`` fails a test that would block."""
    return subprocess.run(
        [sys.executable, "-m", "goodput", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=outside_any_job(**(env or {})),
        preexec_fn=preexec_fn,
    )


def slurm_node() -> str | None:
    """A node this machine's Slurm can run on now, or None (no Slurm, or no node answers)."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return None
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-t", "idle,mix,alloc", "-o", "%N"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        return None
    nodes = result.stdout.split() if result.returncode == 0 else []
    return nodes[0] if nodes else None


def launched_rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of each child of ``launcher_pid`` that runs a rank now (its ``RANK``)."""
    found = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # it just ended
                continue
            ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0])] = int(pid)
    return found


# --- a stand-in scheduler -----------------------------------------------------------------------

STAND_IN_ANSWERS_VAR = "GOODPUT_STAND_IN_ANSWERS"
STAND_IN_LOG_VAR = "GOODPUT_STAND_IN_LOG"
# Its start and end are logged around all of it, Python's imports too: the run is alive between.
STAND_IN = """#!{python}
import os, sys
def log(event):
    fd = os.open(os.environ[{log_var!r}], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, f"{{event}} {{os.getpid()}}\\n".encode())  # one append: lines never mix
    os.close(fd)
log("start")
try:
    from goodput.testing.jobs import stand_in_main
    code = stand_in_main({name!r}, sys.argv[1:])
finally:
    log("end")
sys.exit(code)
"""
# What each says when a host of the step is down, as the real ones do.
STAND_IN_REFUSALS = {
    "srun": "srun: error: Unable to create step for job 1: Requested node configuration is not "
    "available ({host} is down)",
    "mpiexec": "ssh: connect to host {host} port 22: No route to host",
}
# The options of srun and of both mpiexec dialects that goodput passes, with how many values
# each takes: the command is what follows them.
STAND_IN_OPTIONS = {
    "srun": {"--nodes": 1, "--ntasks": 1, "--ntasks-per-node": 1, "--nodelist": 1, "--mem": 1},
    "mpiexec": {
        **dict.fromkeys(("-n", "-ppn", "-hosts", "-hostfile", "-launcher", "-bind-to"), 1),
        **dict.fromkeys(("--np", "--ppn", "--hosts", "--hostfile", "--cpu-bind", "--env"), 1),
        **dict.fromkeys(("-genvlist", "--envlist"), 1),
        "-genv": 2,
    },
}


def stand_in_scheduler(bin_dir: Path, answers: dict[str, Any], log: Path) -> dict[str, str]:
    """Stand-in ``srun`` and ``mpiexec`` in ``bin_dir``: the environment that puts them first
        on PATH. Each answers for every host it is given (``--nodelist``, ``-hosts``, a host file)
        as the real one running goodput's fan-out task there (``python -m goodput.launch.fanout``)
        does, with the task's variable set as the real one sets it, at once, from ``answers``:
        ``{"default": ANSWER, "hosts": {HOST: ANSWER}, "refuse": [HOST, ...]}``, where ANSWER is
        ``{"code": 0, "output": "text with {host}"}`` and the hostile ways a host may answer:
        ``"output_hex"`` (bytes, any), ``"repeat": N`` (the output N times), ``"silent": true``
        (no answer), ``"claims": OTHER`` (its task tagged as OTHER's: its name, or its place in the
    step, one past the last when OTHER is not in it), ``"raw_hex": [LINE]``
        (lines printed as they are), ``"timeout": true`` (its command ran out of time),
        ``"hang": true`` (the step never ends). A step naming a host of ``refuse`` is refused as
        Slurm refuses one naming a down node. A job step (a command that is no fan-out task)
        runs its command once, here, as its first task would, with mpiexec's ``-genv``/``--env``
        variables. Each run appends ``start PID`` and ``end PID`` to
        ``log`` (``peak_children`` reads it)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in STAND_IN_OPTIONS:
        script = bin_dir / name
        script.write_text(
            STAND_IN.format(python=sys.executable, name=name, log_var=STAND_IN_LOG_VAR)
        )
        script.chmod(0o755)
    (bin_dir / "answers.json").write_text(json.dumps(answers))
    return {
        "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        STAND_IN_ANSWERS_VAR: str(bin_dir / "answers.json"),
        STAND_IN_LOG_VAR: str(log),
    }


def peak_children(log: Path) -> int:
    """The most stand-in runs alive at once, by the order of their start and end lines."""
    alive = peak = 0
    for line in log.read_text().splitlines():
        alive += 1 if line.startswith("start ") else -1
        peak = max(peak, alive)
    return peak


def _stand_in_hosts(options: dict[str, list[str]]) -> list[str]:
    for name in ("--nodelist", "-hosts", "--hosts"):
        if name in options:
            value = options[name][0]
            return read_hostfile(value) if "/" in value else expand_nodelist(value, name)
    (named,) = (
        values[0] for name, values in options.items() if name in ("-hostfile", "--hostfile")
    )
    return read_hostfile(named)


def _stand_in_answer(host: str, spec: dict[str, Any], task: argparse.Namespace) -> fanout.Answer:
    """``spec``'s answer as the task's ``run_bounded`` would have made it."""
    output = bytes.fromhex(spec["output_hex"]) if "output_hex" in spec else None
    if output is None:
        output = spec.get("output", "").replace("{host}", host).encode()
    output *= spec.get("repeat", 1)
    code = None if spec.get("timeout") else spec.get("code", 0)
    if len(output) <= task.bytes:
        return fanout.Answer(code, output)
    if task.tail:
        return fanout.Answer(code, output[-task.bytes :], cut=True)
    return fanout.Answer(-signal.SIGKILL, output[: task.bytes], cut=True)


def stand_in_main(name: str, argv: list[str]) -> int:
    """One run of the stand-in ``name`` (``stand_in_scheduler``)."""
    options: dict[str, list[str]] = {}
    step_env: dict[str, str] = {}  # what mpiexec is told to set for its tasks
    while argv and argv[0].startswith("-"):
        option, *_ = argv[0].split("=", 1)
        takes = 0 if "=" in argv[0] else STAND_IN_OPTIONS[name].get(option, 0)
        options[option] = argv[1 : 1 + takes]
        if option == "-genv":
            step_env[argv[1]] = argv[2]
        elif option == "--env" and takes:
            variable, _, value = argv[1].partition("=")
            step_env[variable] = value
        argv = argv[1 + takes :]
    hosts = _stand_in_hosts(options)
    answers = json.loads(Path(os.environ[STAND_IN_ANSWERS_VAR]).read_text())
    refused = sorted(set(hosts) & set(answers.get("refuse", ())))
    if refused:
        print(STAND_IN_REFUSALS[name].format(host=refused[0]), file=sys.stderr)
        return 1
    if argv[1:3] != ["-m", fanout.__name__]:
        # A job step (an attempt's own): its command once, here, as its first task runs it.
        return subprocess.run(argv, env={**os.environ, **step_env}, check=False).returncode
    task = fanout.task_parser().parse_args(argv[3:])
    hang = False
    out = sys.stdout.buffer
    for host in hosts:
        spec = {**answers.get("default", {}), **answers.get("hosts", {}).get(host, {})}
        hang = hang or spec.get("hang", False)
        for line in spec.get("raw_hex", ()):
            out.write(bytes.fromhex(line) + b"\n")
        if spec.get("silent") or spec.get("hang"):
            continue
        claimed = spec.get("claims", host)
        tag = claimed
        if task.rank_var:
            tag = str(hosts.index(claimed) if claimed in hosts else len(hosts))
        out.writelines(fanout.frame_lines(tag, _stand_in_answer(host, spec, task)))
    out.flush()
    if hang:
        time.sleep(3600)
    return 0
