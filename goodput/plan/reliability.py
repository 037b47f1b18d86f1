"""The failure budget of a job (``goodput plan reliability``): how often it fails, how often to
checkpoint, what goodput to expect, and how many spare nodes keep it alive to the end.

The model (independent node failures at a constant rate, exponential times between them):
- The job fails when any node does: cluster MTBF M = node MTBF / nodes (the seed: 16,000 nodes
  at one failure a node-year is about 44 failures a day).
- Each checkpoint stalls training for δ seconds (the save's blocking part; an async save's
  flush does not count). The optimal compute between checkpoints is Young's (1974) first-order
  √(2δM), refined by Daly (2006, "A higher order estimate of the optimum checkpoint interval
  for restart dumps", FGCS 22): τ = √(2δM)·[1 + ⅓√(δ/2M) + ⅑(δ/2M)] − δ for δ < 2M, else M.
  With s = √(δ/2M) that is τ = 2Ms(1 − s/3)², computed so: no cancellation, and > 0.
- Expected goodput at interval τ with restart time R (Daly's exponential model, in which a
  failure may strike during a save or a restart too): useful time / wall time =
  τ / (M · e^(R/M) · (e^((τ+δ)/M) − 1)).
- In-memory checkpoints (``--memory-interval-steps K``): every τm = K steps each rank's state goes
  to host memory, stalling δm, and a copy to a partner on the next host. A failed node's state
  comes back from its partner's copy unless the partner fails too before the state is copied
  again, p = e^(−(R+τm)/node MTBF) (p = 0 with one node: nothing outlives the node); else from
  the disk checkpoint of interval τd (the configured one, else Daly's). Lost work per failure
  p·τm/2 + (1−p)·τd/2 against τd/2; goodput Daly's at (τm, δm) times e^(−(1−p)(τd−τm)/2M)
  for the failures that reach disk, times τd/(τd+δd) for the disk saves that go on. It counts
  node failures only: a process that dies on a node that lives restores from its own copy, so
  the gain it shows is a floor.
- Spares: failures during a walltime W are Poisson with mean λ = nodes · W / node MTBF; each
  takes one spare (no node comes back within the job), so the pool is the smallest k with
  P(failures ≤ k) at least the stated probability.

Every figure is finite on every input the options admit, and the probabilities (expected
goodput, the pool's survival) lie in [0, 1], clamped where rounding crosses a bound. An input for
which the model has no finite answer (a cluster MTBF of a fraction of a second, a save stall
below a microsecond, a step so short that the interval is no count of steps) is a usage
``GoodputError`` naming its option. Torch-free and pure arithmetic; ``goodput.commands.plan``
reads the options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from goodput.argtypes import MAX_COUNT
from goodput.errors import GoodputError

DAY_S = 86400.0
# More expected failures in one walltime, or a day, than this is a typo in the MTBF, not a
# machine; it also bounds the Poisson sum below.
MAX_EXPECTED_FAILURES = 1e6
MIN_SAVE_STALL_S = 1e-6  # no save holds training for less; far below, δ/2M underflows to 0
MAX_EXPONENT = 700.0  # e^700 is near float's limit; the goodput there is 0 to any print


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    nodes: int
    node_mtbf_s: float
    save_stall_s: float  # δ: training held per checkpoint
    restart_s: float  # R: failure to training again
    walltime_s: float
    survival: float  # the probability that the spare pool lasts the walltime
    step_s: float | None = None
    interval_steps: int | None = None  # the configured checkpoint interval, with step_s
    memory_interval_steps: int | None = None  # in-memory checkpoints every K steps, with step_s
    memory_stall_s: float | None = None  # δm: training held per snapshot (None: save_stall_s)


def cluster_mtbf_s(nodes: int, node_mtbf_s: float) -> float:
    return node_mtbf_s / nodes


def young_interval_s(save_stall_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_stall_s * mtbf_s)


def daly_interval_s(save_stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints."""
    if save_stall_s >= 2 * mtbf_s:
        return mtbf_s
    root = math.sqrt(save_stall_s / (2 * mtbf_s))
    return 2 * mtbf_s * root * (1 - root / 3) ** 2


def expected_goodput(
    interval_s: float, save_stall_s: float, restart_s: float, mtbf_s: float
) -> float:
    """Useful compute over wall time, checkpointing every ``interval_s`` of compute."""
    exponent = (interval_s + save_stall_s) / mtbf_s
    if exponent + restart_s / mtbf_s > MAX_EXPONENT:  # a job that almost never gets through
        return 0.0
    # τ/M over e^((τ+δ)/M) − 1 is at most 1 (e^x − 1 >= x), so no factor can overflow.
    goodput = interval_s / mtbf_s / math.expm1(exponent) * math.exp(-restart_s / mtbf_s)
    return _probability(goodput)


def _probability(value: float) -> float:
    """``value`` within [0, 1]: a probability that rounding carried past a bound."""
    return min(max(value, 0.0), 1.0)


def spares_needed(expected_failures: float, survival: float) -> tuple[int, float]:
    """(the smallest k with P(Poisson(expected_failures) <= k) >= survival, that probability)."""
    if expected_failures == 0:
        return 0, 1.0
    # In log space, with a running log-sum-exp: e^-λ underflows long before λ is large. The
    # tail past λ + 50√λ + 100 holds nothing a float can see, so the loop stops there at worst.
    log_term = log_cdf = -expected_failures  # log P(X = 0)
    log_rate = math.log(expected_failures)
    last = expected_failures + 50 * math.sqrt(expected_failures) + 100
    k = 0
    while math.exp(log_cdf) < survival and k < last:
        k += 1
        log_term += log_rate - math.log(k)
        log_cdf = _log_add(log_cdf, log_term)
    return k, _probability(math.exp(log_cdf))


def _log_add(a: float, b: float) -> float:
    high, low = max(a, b), min(a, b)
    return high + math.log1p(math.exp(low - high))


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """In-memory checkpoints every ``interval_s`` of compute against disk checkpoints alone."""

    interval_s: float  # τm
    stall_s: float  # δm
    partner_survives: float  # p: a failure's state comes back from memory
    lost_s: float  # expected work lost per failure, with snapshots
    disk_interval_s: float  # τd: the configured interval, else the optimum
    disk_lost_s: float  # ... with disk checkpoints alone
    goodput: float
    disk_goodput: float  # at τd, disk checkpoints alone

    def as_dict(self) -> dict[str, float]:
        return {
            "interval_s": self.interval_s,
            "stall_s": self.stall_s,
            "partner_survives": self.partner_survives,
            "lost_per_failure_s": self.lost_s,
            "disk_interval_s": self.disk_interval_s,
            "disk_lost_per_failure_s": self.disk_lost_s,
            "expected_goodput": self.goodput,
            "disk_expected_goodput": self.disk_goodput,
        }


def plan_memory(budget: Budget, mtbf_s: float, disk_interval_s: float) -> MemoryPlan:
    """In-memory checkpoints every ``budget.memory_interval_steps`` steps, disk checkpoints every
    ``disk_interval_s`` of compute (see the module docstring); a usage ``GoodputError`` when
    snapshots would be no newer than the disk checkpoint."""
    assert budget.memory_interval_steps is not None and budget.step_s is not None
    interval = budget.memory_interval_steps * budget.step_s
    stall = budget.save_stall_s if budget.memory_stall_s is None else budget.memory_stall_s
    if interval > disk_interval_s:
        raise GoodputError.usage(
            "--memory-interval-steps",
            f"{budget.memory_interval_steps:,} steps of {budget.step_s:g} s = {interval:,.0f} s "
            f"is longer than the disk checkpoint interval of {disk_interval_s:,.0f} s",
            "give fewer steps: a snapshot is taken at every disk checkpoint anyway",
        )
    if stall < MIN_SAVE_STALL_S:
        raise GoodputError.usage(
            "--memory-stall-s",
            f"{stall:g} s is below {MIN_SAVE_STALL_S:g} s, shorter than any snapshot",
            "give the seconds a snapshot holds training (e.g. 2)",
        )
    survives = (
        0.0 if budget.nodes == 1 else math.exp(-(budget.restart_s + interval) / budget.node_mtbf_s)
    )
    to_disk = 1 - survives
    disk_saves = disk_interval_s / (disk_interval_s + budget.save_stall_s)
    goodput = (
        expected_goodput(interval, stall, budget.restart_s, mtbf_s)
        * math.exp(-to_disk * (disk_interval_s - interval) / (2 * mtbf_s))
        * disk_saves
    )
    return MemoryPlan(
        interval_s=interval,
        stall_s=stall,
        partner_survives=survives,
        lost_s=survives * interval / 2 + to_disk * disk_interval_s / 2,
        disk_interval_s=disk_interval_s,
        disk_lost_s=disk_interval_s / 2,
        goodput=_probability(goodput),
        disk_goodput=expected_goodput(
            disk_interval_s, budget.save_stall_s, budget.restart_s, mtbf_s
        ),
    )


@dataclass(frozen=True, slots=True)
class Report:
    budget: Budget
    cluster_mtbf_s: float
    failures_per_day: float
    young_interval_s: float
    optimal_interval_s: float
    expected_goodput: float  # at the optimal interval
    configured_interval_s: float | None
    configured_goodput: float | None
    expected_failures: float  # in one walltime
    spares: int
    spares_survival: float  # P(the pool lasts) with that many spares
    memory: MemoryPlan | None = None  # with --memory-interval-steps

    @property
    def optimal_interval_steps(self) -> float | None:
        """The optimal interval in steps of ``step_s``; None without a step time."""
        step_s = self.budget.step_s
        return None if step_s is None else self.optimal_interval_s / step_s

    def as_dict(self) -> dict[str, object]:
        budget = self.budget
        return {
            "nodes": budget.nodes,
            "node_mtbf_s": budget.node_mtbf_s,
            "save_stall_s": budget.save_stall_s,
            "restart_s": budget.restart_s,
            "cluster_mtbf_s": self.cluster_mtbf_s,
            "failures_per_day": self.failures_per_day,
            "young_interval_s": self.young_interval_s,
            "optimal_interval_s": self.optimal_interval_s,
            "optimal_interval_steps": self.optimal_interval_steps,
            "expected_goodput": self.expected_goodput,
            "configured_interval_s": self.configured_interval_s,
            "configured_goodput": self.configured_goodput,
            "walltime_s": budget.walltime_s,
            "expected_failures_in_walltime": self.expected_failures,
            "survival": budget.survival,
            "spare_nodes": self.spares,
            "spare_nodes_survival": self.spares_survival,
        } | ({} if self.memory is None else {"memory_snapshots": self.memory.as_dict()})


def plan_reliability(budget: Budget) -> Report:
    """The report of ``budget``; a usage ``GoodputError`` naming the option whose value puts
    the model out of its domain."""
    mtbf = cluster_mtbf_s(budget.nodes, budget.node_mtbf_s)
    expected_failures = budget.nodes * budget.walltime_s / budget.node_mtbf_s
    _check_domain(budget, mtbf, expected_failures)
    optimal = daly_interval_s(budget.save_stall_s, mtbf)
    configured = None
    if budget.interval_steps is not None and budget.step_s is not None:
        configured = budget.interval_steps * budget.step_s
    spares, survival = spares_needed(expected_failures, budget.survival)
    report = Report(
        budget=budget,
        cluster_mtbf_s=mtbf,
        failures_per_day=DAY_S / mtbf,
        young_interval_s=young_interval_s(budget.save_stall_s, mtbf),
        optimal_interval_s=optimal,
        expected_goodput=expected_goodput(optimal, budget.save_stall_s, budget.restart_s, mtbf),
        configured_interval_s=configured,
        configured_goodput=(
            expected_goodput(configured, budget.save_stall_s, budget.restart_s, mtbf)
            if configured is not None
            else None
        ),
        expected_failures=expected_failures,
        spares=spares,
        spares_survival=survival,
        memory=(
            plan_memory(budget, mtbf, optimal if configured is None else configured)
            if budget.memory_interval_steps is not None
            else None
        ),
    )
    steps = report.optimal_interval_steps
    if steps is not None and steps > MAX_COUNT:
        raise GoodputError.usage(
            "--step-s",
            f"a step of {budget.step_s:g} s makes the optimal interval of {optimal:,.0f} s "
            f"more than {MAX_COUNT:,} steps, beyond any run",
            "give a step's time in seconds (e.g. 10)",
        )
    return report


def _check_domain(budget: Budget, mtbf_s: float, expected_failures: float) -> None:
    """Refuse the inputs for which the model has no finite answer, naming the option."""
    fix = "check the node MTBF (days), --nodes and the walltime (hours)"
    if expected_failures > MAX_EXPECTED_FAILURES:
        raise GoodputError.usage(
            "--node-mtbf-days",
            f"{expected_failures:.3g} failures expected in one walltime: more than "
            f"{MAX_EXPECTED_FAILURES:.0e}",
            fix,
        )
    if mtbf_s * MAX_EXPECTED_FAILURES < DAY_S:  # also a cluster MTBF that underflows to 0
        raise GoodputError.usage(
            "--node-mtbf-days",
            f"{budget.node_mtbf_s / DAY_S:g} days over {budget.nodes:,} nodes is a cluster "
            f"MTBF of {mtbf_s:.3g} s: more than {MAX_EXPECTED_FAILURES:.0e} failures a day",
            fix,
        )
    if budget.save_stall_s < MIN_SAVE_STALL_S:
        raise GoodputError.usage(
            "--save-stall-s",
            f"{budget.save_stall_s:g} s is below {MIN_SAVE_STALL_S:g} s, shorter than any save",
            "give the seconds a checkpoint holds training (e.g. 20)",
        )


def format_text(report: Report) -> str:
    """The terminal view: the failure rate, the intervals and their goodput, the spares."""
    budget = report.budget
    in_steps = report.optimal_interval_steps
    steps = f" = {in_steps:,.0f} steps of {budget.step_s:g} s" if in_steps is not None else ""
    lines = [
        f"reliability: {budget.nodes:,} nodes at a node MTBF of {budget.node_mtbf_s / DAY_S:g} "
        f"days: cluster MTBF {report.cluster_mtbf_s:,.0f} s ({report.cluster_mtbf_s / 3600:.2f} "
        f"h), {report.failures_per_day:,.1f} failures a day",
        f"checkpoint: {budget.save_stall_s:g} s of training held per save, "
        f"{budget.restart_s:g} s from a failure to training again",
        f"  optimal interval (Daly): {report.optimal_interval_s:,.0f} s of compute{steps} "
        f"(Young: {report.young_interval_s:,.0f} s): expected goodput "
        f"{100 * report.expected_goodput:.1f}%",
    ]
    if report.configured_interval_s is not None and report.configured_goodput is not None:
        lines.append(
            f"  configured: every {budget.interval_steps:,} steps = "
            f"{report.configured_interval_s:,.0f} s: expected goodput "
            f"{100 * report.configured_goodput:.1f}% "
            f"({100 * (report.expected_goodput - report.configured_goodput):.1f} points below "
            "the optimum)"
        )
    if report.memory is not None:
        lines += _memory_lines(report.memory, budget)
    lines.append(
        f"spares: {report.expected_failures:,.1f} node failures expected in a "
        f"{budget.walltime_s / 3600:g} h walltime; {report.spares:,} spare nodes last it with "
        f"probability {100 * report.spares_survival:.2f}% (asked: {100 * budget.survival:g}%)"
    )
    return "\n".join(lines)


def _memory_lines(memory: MemoryPlan, budget: Budget) -> list[str]:
    partner = (
        "one node: no partner copy, every failure reaches disk"
        if budget.nodes == 1
        else f"a failed node's state comes back from its partner's copy with probability "
        f"{memory.partner_survives:.6f}"
    )
    return [
        f"memory snapshots: every {budget.memory_interval_steps:,} steps = "
        f"{memory.interval_s:,.0f} s, {memory.stall_s:g} s of training held per snapshot; "
        + partner,
        f"  work lost per failure: {memory.lost_s:,.0f} s (disk checkpoints every "
        f"{memory.disk_interval_s:,.0f} s alone: {memory.disk_lost_s:,.0f} s): expected goodput "
        f"{100 * memory.goodput:.1f}% (alone: {100 * memory.disk_goodput:.1f}%)",
    ]
