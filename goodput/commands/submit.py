"""``goodput submit``: write (and queue) the Slurm or PBS job chain of ``goodput.launch.submit``
around a ``goodput launch`` line. The line is parsed into the ``LaunchOptions`` each job will run
and its machine profile loaded now, and the job's allocation is sized to fit it, so a typo or a
line no job could run fails at once (exit 2), not hours later when the first job starts; so does
a ``goodput train`` line whose config no job could start (``train.config.check_world``). Nothing
is run. Never imports torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from goodput import argtypes
from goodput.commands import Subparsers, after_dashes, launch
from goodput.errors import ExitCode, GoodputError

if TYPE_CHECKING:
    from goodput.launch import LaunchOptions
    from goodput.launch.launchers import ProfileConfig


def register(groups: Subparsers) -> None:
    sub = groups.add_parser(
        "submit",
        help="write (and --submit) a Slurm or PBS job chain that reruns a goodput launch line, "
        "one allocation after another, until the run is done",
        description="Write RUN_DIR/chain.sbatch (Slurm) or RUN_DIR/chain.pbs (PBS). Each job "
        "queues its successor (after-any dependency) before it runs the launch line, so a "
        "walltime kill still leaves the next job queued; the chain stops once the trainer has "
        "written RUN_DIR/done, or after --max-jobs jobs. The jobs run in the environment you "
        "submit from.",
        usage="goodput submit --run-dir DIR --nhosts N --time HH:MM:SS [options] "
        "-- goodput launch [launch options] -- CMD ...",
    )
    sub.add_argument(
        "--run-dir",
        type=Path,
        required=True,
        help="the run's output folder (train.run_dir): the script, Slurm's job logs and the done "
        "marker live here",
    )
    argtypes.add_renamed(
        sub,
        "--nhosts",
        "--nodes",  # the old spelling, deprecated
        type=argtypes.positive_int,
        required=True,
        help="hosts (nodes) per job",
    )
    sub.add_argument("--time", required=True, metavar="HH:MM:SS", help="walltime per job")
    sub.add_argument(
        "--scheduler",
        choices=["slurm", "pbs"],
        help="default: the one installed (sbatch: slurm, qsub: pbs)",
    )
    sub.add_argument("--job-name", help="default: the run dir's name")
    sub.add_argument("--account", help="Slurm --account, PBS -A (the project)")
    sub.add_argument("--partition", "--queue", dest="queue", help="Slurm partition, PBS queue")
    sub.add_argument("--filesystems", help="PBS -l filesystems=, e.g. home:flare on Aurora")
    sub.add_argument(
        "--max-jobs",
        type=argtypes.positive_int,
        default=10,
        help="jobs in the chain at most (default 10)",
    )
    sub.add_argument(
        "--submit",
        action="store_true",
        help="queue the first job and print its id (default: print the script's path)",
    )
    sub.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- goodput launch ...")
    sub.set_defaults(handler=_submit)


def _submit(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import submit
    from goodput.launch.run import named_run_dir
    from goodput.outputs import RUN_DIR, check_output_dir

    check_output_dir(args.run_dir, RUN_DIR, "--run-dir")
    launch_line = after_dashes(args.cmd)
    submit.check_launch_line(launch_line)
    options, profile = _check_launch_options(launch_line[2:])
    ppn = submit.fit_launch(options, profile, args.nhosts)
    _check_train_line(options, ppn, options.nhosts or args.nhosts)
    launch_run_dir = named_run_dir(options)
    chain = submit.Chain(
        scheduler=args.scheduler or submit.detect_scheduler(),
        run_dir=args.run_dir.absolute(),
        workdir=Path.cwd(),
        launch_line=tuple(launch_line),
        nhosts=args.nhosts,
        ppn=ppn,
        whole_nodes=profile.whole_nodes,
        launch_run_dir=launch_run_dir.absolute() if launch_run_dir else None,
        walltime=args.time,
        job_name=args.job_name or submit.default_job_name(args.run_dir.absolute()),
        account=args.account,
        queue=args.queue,
        filesystems=args.filesystems,
        max_jobs=args.max_jobs,
    )
    script = submit.write_script(chain)
    if not args.submit:
        print(script)
        return ExitCode.OK
    job_id = submit.submit(chain)
    print(job_id)
    print(
        f"submit: job {job_id} queued from {script}; the chain goes on until {chain.done_marker} "
        f"exists, {chain.max_jobs} jobs at most",
        file=sys.stderr,
    )
    return ExitCode.OK


def _check_launch_options(argv: list[str]) -> tuple[LaunchOptions, ProfileConfig]:
    """Parse ``goodput launch ARGV`` into the ``LaunchOptions`` each job will run and load their
    profile: every check of the line that needs no job, done before anything is written."""
    from goodput.launch.run import load_profile

    args, unknown = launch.parse(argv)
    if unknown or not after_dashes(args.cmd):
        raise GoodputError.usage(
            "submit --",
            f"goodput launch does not know {' '.join(unknown)}"
            if unknown
            else "the goodput launch line names no command",
            "see goodput launch --help; end the line with -- CMD, e.g. -- goodput train run.toml",
        )
    options = launch.options(args)
    # Picked as goodput launch picks it: the jobs run in the environment submitted from (Slurm's
    # default, -V on PBS), so $GOODPUT_PROFILE there is the one here.
    return options, load_profile(options)


def _check_train_line(options: LaunchOptions, ppn: int, nhosts: int) -> None:
    """A chain of ``goodput train CONFIG ...``: the config is loaded as the trainer loads it and
    checked on the ranks each job launches (``train.config.check_world``), so that one no job
    could start (a missing data.file_list, a recipe for another machine, a pipeline with too
    few micro-batches) fails now. Torch-free; the data is checked when the job starts."""
    from goodput.commands import train
    from goodput.train.config.run import check_world

    if list(options.command[:2]) != ["goodput", "train"]:
        return
    args, unknown = train.parse(options.command[2:])
    if unknown:
        raise GoodputError.usage(
            "submit -- goodput launch -- goodput train",
            f"goodput train does not know {' '.join(unknown)}",
            "see goodput train --help",
        )
    cfg = train.load_run_config(args)
    try:
        check_world(cfg, options.nproc or nhosts * ppn, ppn)
    except GoodputError as error:  # it names the section; add the file
        where = f"{args.config} {error.where}"
        raise GoodputError(where, error.what, error.fix, code=error.code) from None
