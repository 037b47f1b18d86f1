"""A chaos campaign: a run config trained twice under ``goodput.launch.run`` — straight, and with
faults injected and recovery on — then the faulted run's accounting and its final state
compared bit for bit with the straight run's. Each run is read as ``goodput report`` reads it
(``report.run_files``) and accounted for by its ``account``: the campaign's goodput and badput are
the report's, and the faults' outcomes are built on its timeline (``outcomes``).

The campaign folder (``--output``; default ``chaos-<config stem>``)::

    OUT/
      campaign.json        what was asked and drawn; written first, it marks the folder as ours
                           (written again once the slow faults are timed)
      plan.json            the faulted run's fault plan (GOODPUT_FAULTS; goodput.faults),
                           written after the straight run
      reference-plan.json  the straight run's: the same ``nan`` faults, when there are any
      fired/ reference-fired/   the faults' fired records
      reference/ faulted/  the two run directories (train.run_dir and launch --run-dir), each
                           with launch.log: every rank's output
      report.json          the report (``report``), written last

Before anything is written or started, each run's whole ``goodput train`` command line (config,
overrides, the checkpoint interval the campaign sets, its run directory, ``perturb``) is loaded
as ``goodput train`` loads it and checked for the launch (``train.preflight``): a config the
trainer would refuse is refused here, in one line. A folder that exists must be empty or hold
``campaign.json``; in the latter the entries above
are replaced, anything else in it is left alone. Both runs get the same config and overrides;
the faulted one also gets ``perturb`` (a control: a difference the comparison must catch).
Recovery is ``--auto-retry`` plus the user's launch options. The fault plan needs checkpoints:
when the config saves too rarely for it, ``checkpoint.interval_steps`` is set for both runs, and
the report says so. ``bad-node`` and ``host-loss`` need a spare host per fault (``--nhosts N`` of
a larger job): without one they are left out of the default kinds and refused when asked for.
``snapshot-kill`` and ``host-loss`` need in-memory checkpoints (``checkpoint.memory_interval_steps``
k > 0, read from the config and overrides, the same for both runs), ``host-loss`` also a second host
to hold the partner copies: without them they are left out of the default kinds and refused when
asked for. ``slow`` and ``stall`` (asked for only) need a peer for the launcher to name their rank
against: refused on one rank, and ``slow`` on two under a straggler ratio of 2 or more
(``_check_named``). With k > 0 the report also asks that each fault that ends an attempt
lose at most k steps, and that each host-loss restart load its partner's copy. A hang is caught
by the idle watchdog: without the user's ``--timeout``, the faulted run gets
``IDLE_TIMEOUT_FACTOR`` times the straight run's longest quiet stretch it can see (its start-up
or its slowest step, that step slowed by a ``slow`` fault's sleep), at least
``MIN_IDLE_TIMEOUT_S``; a ``stall`` is caught the same way, and sits out ``--grace`` too (its
peers wait in a collective and never see SIGTERM's flag). A ``slow`` fault sleeps
``max(MIN_SLOW_S, SLOW_FACTOR x the straight run's median step time)`` on each step of its
window, a window ``watch.straggler_steps + 5`` steps long (``plan.slow_window``): a straggler
the watch must name, and no hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from goodput import faults, rundir
from goodput.chaos import outcomes, plan, records
from goodput.chaos.report import Report, write_report
from goodput.config import load_config
from goodput.errors import ExitCode, GoodputError
from goodput.io import write_json
from goodput.launch import LaunchOptions, launchers
from goodput.launch import run as launch_run
from goodput.launch.env import current_placement
from goodput.launch.run import DEFAULT_IDLE_TIMEOUT_S, load_profile
from goodput.outputs import check_output_dir, folder_holding
from goodput.ranks import FAULTS_VAR
from goodput.report.accounting import Accounting, account
from goodput.report.run_files import RunFiles, read_run
from goodput.train.config.run import RunConfig

if TYPE_CHECKING:  # torch's: imported where used, so a usage error comes without it
    from goodput.chaos import compare

MARKER = "campaign.json"
PLAN, REFERENCE_PLAN = "plan.json", "reference-plan.json"
FIRED, REFERENCE_FIRED = "fired", "reference-fired"
REFERENCE, FAULTED = "reference", "faulted"
REPORT = "report.json"
LOG = "launch.log"
CAMPAIGN_DIR = folder_holding(MARKER)
OURS = (PLAN, REFERENCE_PLAN, FIRED, REFERENCE_FIRED, REFERENCE, FAULTED, REPORT)
IDLE_TIMEOUT_FACTOR = 2.0
MIN_IDLE_TIMEOUT_S = 10.0
SLOW_FACTOR = 3.0  # a slow rank's sleep, in the straight run's median step times
MIN_SLOW_S = 0.05
# Kinds that test the launcher's naming of a rank, with windows sized by [watch]: only on --kinds.
ASKED_ONLY = ("slow", "stall")
# Why host-loss needs two hosts or more.
ONE_HOST = "on one host, no partner on another host holds a copy of the lost host's snapshots"


@dataclass(frozen=True, slots=True, kw_only=True)
class CampaignOptions:
    """What ``goodput chaos`` takes, as its options name it."""

    config: Path
    overrides: tuple[str, ...] = ()  # section.key=value, for both runs
    perturb: tuple[str, ...] = ()  # overrides for the faulted run only
    num_faults: int = 8
    seed: int = 0
    # None: every kind this launch can recover from, but those in ASKED_ONLY
    kinds: tuple[str, ...] | None = None
    output: Path | None = None  # None: chaos-<config stem>
    # goodput launch's options for both runs (its command is the campaign's): nhosts, ppn,
    # nproc, profile, timeout, retries, backoff, grace, prefix.
    launch: LaunchOptions = dataclasses.field(default_factory=lambda: LaunchOptions(command=()))


def run_campaign(options: CampaignOptions) -> Report:
    """Run the campaign; its report, also written to OUT/report.json. Everything that can be
    refused is refused before anything is written."""
    setup = _prepare(options)
    _claim(setup.output)
    write_json(setup.output / MARKER, _campaign_record(options, setup))
    nans = [fault for fault in setup.faults if fault.kind == "nan"]
    if nans:
        plan.write_plan(setup.output / REFERENCE_PLAN, nans, setup.output / REFERENCE_FIRED)
    reference = _run_straight(options, setup, bool(nans))
    setup = _time_slow_faults(setup, reference.accounting)
    write_json(setup.output / MARKER, _campaign_record(options, setup))
    plan.write_plan(setup.output / PLAN, setup.faults, setup.output / FIRED)
    derived_idle_s, derived_startup_s = _quiet_bounds(reference.accounting, setup.slow_s)
    idle_timeout_s = _or(options.launch.idle_timeout_s, derived_idle_s)
    startup_timeout_s = options.launch.startup_timeout_s
    if startup_timeout_s is None and options.launch.idle_timeout_s is None:
        # --timeout alone keeps its meaning: the one bound, start-up included.
        startup_timeout_s = derived_startup_s
    if options.launch.idle_timeout_s is None:
        setup.notes.append(
            f"idle timeout {idle_timeout_s:.1f} s for the faulted run: {IDLE_TIMEOUT_FACTOR:g} x "
            "the straight run's slowest step, plus a slow fault's sleep (goodput launch "
            "--timeout sets it)"
        )
    if options.launch.startup_timeout_s is None and options.launch.idle_timeout_s is None:
        setup.notes.append(
            f"start-up timeout {derived_startup_s:.1f} s for the faulted run: "
            f"{IDLE_TIMEOUT_FACTOR:g} x the straight run's start-up (goodput launch "
            "--startup-timeout sets it)"
        )
    faulted = dataclasses.replace(
        options.launch,
        nproc=setup.num_ranks,
        auto_retry=True,
        idle_timeout_s=idle_timeout_s,
        startup_timeout_s=startup_timeout_s,
    )
    _say(f"faulted run: {len(setup.faults)} fault(s), output in {setup.output / FAULTED / LOG}")
    perturbed = dataclasses.replace(
        setup.train, overrides=(*setup.train.overrides, *options.perturb)
    )
    code = _launch(faulted, perturbed, setup.output / FAULTED, setup.output / PLAN)
    report = _report(options, setup, reference, code, idle_timeout_s)
    write_report(setup.output / REPORT, report)
    return report


@dataclass(frozen=True, slots=True)
class _Setup:
    """What a campaign decided before it ran anything."""

    output: Path
    num_steps: int
    num_ranks: int
    ranks_per_host: int
    kinds: tuple[str, ...]
    faults: list[faults.Fault]  # a slow fault's seconds: None until _time_slow_faults
    notes: list[str]  # what the campaign changed or left out; the report shows them
    train: _TrainCommand
    memory_interval_steps: int  # checkpoint.memory_interval_steps of both runs; 0: off
    slow_s: float = 0.0  # what a slow fault sleeps a step; 0 until timed, or without one


def _prepare(options: CampaignOptions) -> _Setup:
    """Check the config and the launch, and draw the plan: the interval it needs, its faults."""
    output = (options.output or Path(f"chaos-{options.config.stem}")).absolute()
    cfg = load_config(RunConfig, options.config, options.overrides)
    _check_config(cfg)
    launch_plan = launchers.plan_launch(
        current_placement(),
        load_profile(options.launch),
        run_dir=output / FAULTED,
        nhosts=options.launch.nhosts,
        ppn=options.launch.ppn,
        nproc=options.launch.nproc,
    )
    snapshot_interval = cfg.checkpoint.memory_interval_steps
    kinds, notes = _kinds(
        options.kinds,
        num_spares=len(launch_plan.spares),
        num_hosts=len(launch_plan.hosts),
        snapshots=bool(snapshot_interval),
    )
    dealt = plan.deal_kinds(options.num_faults, kinds, options.seed)
    _check_kinds(dealt, launch_plan, snapshot_interval)
    _check_named(dealt, launch_plan.nproc, cfg.watch.straggler_ratio)
    notes += _memory_notes(snapshot_interval)
    overrides = list(options.overrides)
    interval = plan.interval_needed(
        cfg.train.steps, sum(k in faults.IN_SAVE for k in dealt), cfg.checkpoint.interval_steps
    )
    if interval is not None:
        overrides.append(f"checkpoint.interval_steps={interval}")
        notes.append(
            f"checkpoint.interval_steps={interval} for both runs: the config's "
            f"{cfg.checkpoint.interval_steps} leaves too few saves for a final checkpoint and "
            "the checkpoint faults"
        )
    drawn = plan.draw_faults(
        dealt,
        num_steps=cfg.train.steps,
        interval_steps=interval or cfg.checkpoint.interval_steps,
        num_ranks=launch_plan.nproc,
        seed=options.seed,
        straggler_steps=cfg.watch.straggler_steps,
        snapshot_interval_steps=snapshot_interval,
    )
    train = _TrainCommand(options.config, tuple(overrides), bool(cfg.checkpoint.folder))
    # Each run's whole command line, loaded as goodput train loads it (a mistyped --perturb
    # control too), then checked as its ranks will check it: a config the trainer refuses
    # fails now, before the campaign writes its folder or starts the straight run.
    runs = ((output / REFERENCE, ()), (output / FAULTED, options.perturb))
    configs = [
        load_config(RunConfig, options.config, train.overrides_for(run_dir, extra))
        for run_dir, extra in runs
    ]
    from goodput.train.preflight import check_launchable

    for run_cfg in configs:
        check_launchable(run_cfg, launch_plan.nproc, launch_plan.ppn)
    return _Setup(
        output,
        cfg.train.steps,
        launch_plan.nproc,
        launch_plan.ppn,
        kinds,
        drawn,
        notes,
        train,
        snapshot_interval,
    )


def _memory_notes(snapshot_interval: int) -> list[str]:
    """The bound a campaign with in-memory checkpoints every ``snapshot_interval`` steps holds."""
    if not snapshot_interval:
        return []
    return [
        f"memory snapshots every {snapshot_interval} step(s) in both runs: each fault that ends "
        f"an attempt must lose at most {snapshot_interval} step(s), and a host-loss restart "
        "must load the lost host's state from its partner's copy"
    ]


def _time_slow_faults(setup: _Setup, straight: Accounting) -> _Setup:
    """``setup`` with its slow faults' sleep set from the straight run's median step time."""
    if not any(fault.kind == "slow" for fault in setup.faults):
        return setup
    times = [step.step_time_s for span in straight.timeline for step in span.steps]
    median_s = statistics.median(times) if times else 0.0
    slow_s = round(max(MIN_SLOW_S, SLOW_FACTOR * median_s), 3)
    note = (
        f"slow faults sleep {slow_s:.3f} s a step: {SLOW_FACTOR:g} x the straight run's median "
        f"step time ({median_s:.3f} s), at least {MIN_SLOW_S:g} s"
    )
    return dataclasses.replace(
        setup,
        faults=plan.timed(setup.faults, slow_s),
        notes=[*setup.notes, note],
        slow_s=slow_s,
    )


def _run_straight(options: CampaignOptions, setup: _Setup, with_nans: bool) -> AccountedRun:
    """The straight run: one attempt, no retry; it must succeed, or there is nothing to compare."""
    straight = dataclasses.replace(
        options.launch,
        nproc=setup.num_ranks,
        auto_retry=False,
        retries=0,
        idle_timeout_s=_or(options.launch.idle_timeout_s, DEFAULT_IDLE_TIMEOUT_S),
    )
    run_dir = setup.output / REFERENCE
    _say(f"straight run: {setup.num_ranks} rank(s), output in {run_dir / LOG}")
    fault_plan = setup.output / REFERENCE_PLAN if with_nans else None
    code = _launch(straight, setup.train, run_dir, fault_plan)
    if code != ExitCode.OK:
        raise GoodputError(
            run_dir / LOG,
            f"the straight run failed (goodput launch exited {code}) before any fault",
            "fix what its log says: the campaign needs a config that trains",
        )
    return account_run(run_dir)


def _report(
    options: CampaignOptions,
    setup: _Setup,
    reference: AccountedRun,
    code: int,
    idle_timeout_s: float,
) -> Report:
    """The faulted run read back, accounted for and compared (when it finished)."""
    run = account_run(setup.output / FAULTED)
    fired = records.read_fired(setup.output / FIRED)
    unfinished, comparison = None, None
    if code != ExitCode.OK:
        reason = run.files.attempts[-1].reason if run.files.attempts else None
        unfinished = f"the faulted run did not finish: goodput launch exited {code}" + (
            f" ({reason})" if reason else ""
        )
    else:
        comparison = _compare(setup.output, setup.num_steps, reference, run)
    return Report(
        config=str(options.config),
        output=str(setup.output / REPORT),
        seed=options.seed,
        num_ranks=setup.num_ranks,
        kinds=setup.kinds,
        notes=tuple(setup.notes),
        idle_timeout_s=idle_timeout_s,
        memory_interval_steps=setup.memory_interval_steps,
        faults=tuple(
            outcomes.fault_outcomes(
                setup.faults, fired, run.accounting.timeline, ranks_per_host=setup.ranks_per_host
            )
        ),
        attempts=tuple(run.files.attempts),
        faulted=run.accounting,
        reference=reference.accounting,
        unfinished=unfinished,
        comparison=comparison,
    )


def _check_config(cfg: RunConfig) -> None:
    if cfg.checkpoint.resume != "auto":
        raise GoodputError.usage(
            "checkpoint.resume",
            f"is {cfg.checkpoint.resume!r}: the faulted run must resume from its own saves",
            "set checkpoint.resume=auto (the default)",
        )
    if cfg.checkpoint.local_dir:
        raise GoodputError.usage(
            "checkpoint.local_dir",
            "is set: a campaign's runs resume from their own saves, not a node-local copy",
            "remove local_dir from the config's [checkpoint] table for the campaign",
        )


def _kinds(
    asked: tuple[str, ...] | None, *, num_spares: int, num_hosts: int, snapshots: bool
) -> tuple[tuple[str, ...], list[str]]:
    """The kinds asked for, or the default: every kind this launch and config can recover from
    but those in ASKED_ONLY (and the notes saying which were left out, and why)."""
    if asked is not None:
        return asked, []
    kinds = [
        kind
        for kind in faults.KINDS
        if kind not in ASKED_ONLY and (snapshots or kind not in faults.NEEDS_SNAPSHOTS)
    ]
    if not num_spares:
        out = [kind for kind in kinds if kind in faults.DEVICE_LOST]
        note = f"{' and '.join(out)} left out: this launch has no spare host to replace a bad one"
        return tuple(kind for kind in kinds if kind not in out), [note]
    if num_hosts < 2 and "host-loss" in kinds:
        kinds.remove("host-loss")
        return tuple(kinds), [f"host-loss left out: {ONE_HOST}"]
    return tuple(kinds), []


def _check_kinds(
    dealt: list[str], launch_plan: launchers.LaunchPlan, snapshot_interval: int
) -> None:
    """Refuse the dealt kinds this launch or config cannot recover from."""
    needs_snapshots = [kind for kind in faults.NEEDS_SNAPSHOTS if kind in dealt]
    if needs_snapshots and not snapshot_interval:
        raise GoodputError.usage(
            "--kinds",
            f"{' and '.join(needs_snapshots)} fault(s) need memory snapshots; the config "
            "takes none (checkpoint.memory_interval_steps is 0)",
            "add the override checkpoint.memory_interval_steps=K, or leave snapshot-kill and "
            "host-loss out of --kinds",
        )
    lost = [kind for kind in faults.DEVICE_LOST if kind in dealt]
    num_lost, num_spares = sum(kind in lost for kind in dealt), len(launch_plan.spares)
    if num_lost > num_spares:
        raise GoodputError.usage(
            "--kinds",
            f"{num_lost} {' and '.join(lost)} fault(s) need as many spare hosts; this launch "
            f"has {num_spares}",
            "run inside a job with spare hosts (-- --nhosts N of a larger allocation), or "
            f"leave {' and '.join(lost)} out of --kinds",
        )
    if "host-loss" in dealt and len(launch_plan.hosts) < 2:
        raise GoodputError.usage(
            "--kinds",
            f"host-loss needs two hosts or more: {ONE_HOST}",
            "launch on two hosts or more (-- --nhosts 2 of a job with a spare), or leave "
            "host-loss out of --kinds",
        )


def _check_named(dealt: list[str], nproc: int, straggler_ratio: float) -> None:
    """Refuse the dealt slow and stall faults (``outcomes.NAMED``) whose rank the launcher
    could not name, whatever the runs do: it names a rank against its peers."""
    named = [kind for kind in outcomes.NAMED if kind in dealt]
    if named and nproc < 2:
        raise GoodputError.usage(
            "--nproc",
            f"{' and '.join(sorted(named))} fault(s) need two ranks or more: the launcher "
            f"names a slow or stalled rank against its peers, and {nproc} rank has none",
            f"give --nproc 2 or more, or leave {' and '.join(sorted(named))} out of --kinds",
        )
    if "slow" in dealt and nproc == 2 and straggler_ratio >= 2:
        # Of two ranks the median is their mean, so a rank is never 2x the median.
        raise GoodputError.usage(
            "watch.straggler_ratio",
            f"is {straggler_ratio:g}: of 2 ranks no rank is 2x the median (their mean), so "
            "the straggler watch could never name a slow fault's rank",
            "lower watch.straggler_ratio below 2, give --nproc 3 or more, or leave slow out "
            "of --kinds",
        )


def _claim(output: Path) -> None:
    """Make ``output`` ours: new, empty, or a campaign folder whose previous entries go."""
    check_output_dir(output, CAMPAIGN_DIR, "--output")
    for name in OURS:
        path = output / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    output.mkdir(parents=True, exist_ok=True)


def _campaign_record(options: CampaignOptions, setup: _Setup) -> dict[str, object]:
    return {
        "config": str(options.config),
        "overrides": list(options.overrides),
        "perturb": list(options.perturb),
        "seed": options.seed,
        "faults": [fault.keys() for fault in setup.faults],
        "notes": list(setup.notes),
        "output": str(setup.output),
    }


@dataclass(frozen=True, slots=True)
class _TrainCommand:
    """``python -m goodput train CONFIG OVERRIDES... train.run_dir=RUN`` for one run."""

    config: Path
    overrides: tuple[str, ...]
    own_checkpoint_folder: bool  # the config names checkpoint.folder: each run gets its own

    def argv(self, run_dir: Path) -> tuple[str, ...]:
        goodput = (sys.executable, "-m", "goodput", "train")
        return (*goodput, str(self.config.absolute()), *self.overrides_for(run_dir))

    def overrides_for(self, run_dir: Path, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The overrides of the run in ``run_dir`` (``extra``: the faulted run's --perturb)."""
        placed = [f"train.run_dir={json.dumps(str(run_dir))}"]
        if self.own_checkpoint_folder:
            folder = rundir.checkpoints_dir(run_dir)
            placed.append(f"checkpoint.folder={json.dumps(str(folder))}")
        return (*self.overrides, *extra, *placed)


def _launch(
    options: LaunchOptions, train: _TrainCommand, run_dir: Path, fault_plan: Path | None
) -> int:
    """One run through ``goodput.launch.run``, its ranks' output to RUN/launch.log only; its
    exit code."""
    launch = dataclasses.replace(
        options, command=train.argv(run_dir), run_dir=run_dir, log=run_dir / LOG
    )
    with (
        _fault_plan(fault_plan),
        open(os.devnull, "w") as quiet,
        contextlib.redirect_stdout(quiet),
    ):
        code = int(launch_run(launch))
    if code == ExitCode.INTERRUPTED:  # Ctrl-C: the campaign stops too, as goodput launch does
        raise KeyboardInterrupt
    return code


@contextlib.contextmanager
def _fault_plan(path: Path | None) -> Iterator[None]:
    """``GOODPUT_FAULTS`` set to ``path`` (unset: None) for the ranks to inherit; restored after."""
    before = os.environ.pop(FAULTS_VAR, None)
    if path is not None:
        os.environ[FAULTS_VAR] = str(path)
    try:
        yield
    finally:
        os.environ.pop(FAULTS_VAR, None)
        if before is not None:
            os.environ[FAULTS_VAR] = before


@dataclass(frozen=True, slots=True)
class AccountedRun:
    files: RunFiles
    accounting: Accounting


def account_run(run_dir: Path) -> AccountedRun:
    """One of the campaign's runs, read and accounted for as ``goodput report RUN`` does."""
    files = read_run(run_dir)
    return AccountedRun(files, account(files))


def _compare(
    output: Path, num_steps: int, reference: AccountedRun, faulted: AccountedRun
) -> compare.Comparison:
    from goodput.chaos import compare

    parts = compare.compare_checkpoints(
        compare.final_checkpoint(output / REFERENCE, num_steps),
        compare.final_checkpoint(output / FAULTED, num_steps),
    )
    return compare.Comparison(
        losses=compare.compare_losses(reference.files.steps, faulted.files.steps, num_steps),
        **parts,
    )


def _quiet_bounds(straight: Accounting, slow_s: float) -> tuple[float, float]:
    """The faulted run's watchdog (idle, start-up) from the straight run's quiet stretches: its
    slowest step and its start-up; ``slow_s``: what a slow fault adds to a step."""
    span = straight.timeline[0]  # the straight run: one attempt
    startup_s = span.steps[0].time - span.start if span.steps else span.end - span.start
    slowest_s = max((step.step_time_s for step in span.steps), default=0.0) + slow_s
    return _bound(slowest_s), _bound(startup_s)


def _bound(quiet_s: float) -> float:
    derived = max(MIN_IDLE_TIMEOUT_S, IDLE_TIMEOUT_FACTOR * quiet_s)
    return math.ceil(derived * 10) / 10  # to 0.1 s up, as the launcher and the report print it


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _say(text: str) -> None:
    print(f"chaos: {text}", file=sys.stderr, flush=True)
