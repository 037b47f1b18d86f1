"""The ladder: every layout goodput's trainer could run, in order of pain; of those that fit in
memory and split the global batch, the cheapest step by ``cost.step_cost`` wins, and the order
of pain breaks ties (costs within ``TIE`` of the cheapest).

Rungs, in order of pain (world = hosts x devices per host, g = devices per host):
1. DP: every rank a whole replica (dp_replicate = world; goodput replicates through FSDP with
   dp_shard = 1, which fp32-master needs for its bf16 compute).
2. FSDP: shard within a host (HSDP: dp_shard = g, a replica per host), then over 2, 4, ...
   hosts (dp_shard = g x m for m dividing the hosts) up to the whole world.
3. EP (a mixture of experts whose routed experts hold most parameters): each shard degree again
   with ep within a host (ep dividing g, the experts and dp_shard).
4. AC: activation checkpointing on any of the above: the per-op policy ("op": recomputes the
   elementwise ops, keeps the matmuls' and attention's outputs), whole blocks ("full"), and a
   memory budget ("budget", under compile only), as ``Options`` allows.
5. TP within a host: tp dividing g (each must divide the heads, kv heads, ffn dim, vocabulary
   and seq_len), FSDP over the rest; with and without AC.
6. PP across hosts: pp dividing the hosts (at most num_layers), each valid tp within a host,
   FSDP over the rest; layers that do not divide are split by ``balanced_layer_split``.
7. CP: cp dividing dp_shard of each layout, up to ``MAX_CP`` and the first cp that cuts a
   sequence into more chunks than it has tokens; its FSDP group keeps the same ranks (dp_shard x
   cp). Inside pipeline stages only from ``CP_IN_STAGES_FROM`` tokens a sequence, and on layouts
   whose stages shard over all their ranks (dp_replicate 1: a bound on the count).
Mixtures of experts climb every rung as dense models do. A candidate's rung is the most painful
one it uses (tp 2 + AC is TP). Beside the rungs, each layout is weighed with every fp8 scaling
and compile setting ``Options`` allows (fp8 only on a device with FP8 matmuls, ``Rates.fp8``;
what the trainer refuses, e.g. compile with a zero-bubble schedule, is refused with its
reason): they change the cost, not the pain.

With more than one micro-batch a step, FSDP holds unsharded gradients through the accumulation
unless ``sync_every_micro_batch`` is set; when only that keeps a layout from fitting, the
planner sets it (one reduce-scatter per micro-batch, which its cost counts) and says so.

When nothing splits the global batch, or what does costs more than ``BATCH_GAIN`` above the
cheapest layout that fits in memory, ``nearest_batches`` are the closest global batches, below
and above, that a layout fitting in memory splits (each checked by planning it; with a layout
chosen, only those cheaper per sample): the error's fix, or a warning.

The work is bounded: at most ``MAX_CANDIDATES`` layouts are weighed (a machine whose counts list
more is refused as they are listed, before any is weighed), cp stops at ``MAX_CP``, and what
layouts of one shape share (the trainer's model check, a cp rank's tokens, the stages' split and
parameters) is computed once (``layout.CACHED``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from goodput.errors import GoodputError
from goodput.plan.batch import batch_problem, critical_batch_warning
from goodput.plan.cost import Cost, Rates, step_cost
from goodput.plan.layout import Layout, balanced_layer_split, problems, tp_across_hosts
from goodput.plan.memory import GIB, Breakdown, Parameters, Workload, estimate
from goodput.plan.schedule import PLANNED
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import default_stages_per_rank
from goodput.train.flops import model_size

RUNGS = ("DP", "FSDP", "EP", "AC", "TP", "PP", "CP")
EXPERTS_DOMINATE = 0.5  # the routed experts' share of the parameters above which EP is tried
TIE = 0.01  # costs this close to the cheapest are a tie: the least painful of them wins
BATCH_GAIN = 0.1  # a batch forcing a layout this much costlier makes the planner look nearby
NEAREST_TRIES = 4  # batches planned on each side, nearest first
NEAREST_RANGE = 0.25  # how far from a batch that some layout runs the planner looks
# The longest context-parallel ring the planner tries: 64 times Llama 3's (cp 16 at 131,072
# tokens), and a bound on its work (the trainer's check of a cp walks its 2 cp chunks).
MAX_CP = 1024
# The shortest sequence for which cp is weighed inside pipeline stages. The step cost prices
# cp's ring (its K/V passes) but not what short chunks lose in kernel efficiency, so at 8,192
# tokens it would trade the 405B's recompute for cp 8 inside 32 stages — where every published
# run uses none (Llama 3 turned cp on for its long-context stage only; torchtitan's 4D table,
# FSDP x TP x PP x CP, starts at 32,768). Until a cp measurement calibrates that loss.
CP_IN_STAGES_FROM = 32_768
# The most layouts one plan weighs (each has its memory and cost estimated, and again at up to
# 2 x NEAREST_TRIES nearby batches): a power-of-two machine at the command's maxima, 131,072
# hosts x 1,024 devices, lists about 10,400 with the three checkpointing modes weighed by
# default; counts with many divisors list far more. 20,000 when two modes were weighed: the same
# machines fit under it with three (with fp8 and compile too, fewer do: the refusal says so).
MAX_CANDIDATES = 30_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """How the blocks may compute, beside the degrees: the checkpointing modes the ladder
    weighs (``layout.AC_MODES``; "budget" at ``memory_budget``, with compile only), a
    pipeline's schedules (each a layout of its own: its stages split the layers), the fp8
    scalings (None: bf16) and compile settings."""

    checkpointing: tuple[str, ...] = ("none", "full", "op")
    schedules: tuple[str, ...] = PLANNED  # a pipeline's ([parallel] pp_schedule values)
    memory_budget: float = 0.5
    fp8: tuple[str | None, ...] = (None,)
    compile: tuple[bool, ...] = (False,)

    def variants(self, base: Layout, rates: Rates) -> list[Layout]:
        """``base`` with each combination allowed (fp8 only where ``rates`` has it)."""
        return [
            replace(
                base,
                activation_checkpointing=mode,
                activation_memory_budget=self.memory_budget,
                fp8=recipe,
                compile=compiled,
            )
            for mode in self.checkpointing
            for recipe in self.fp8
            if recipe is None or rates.fp8(recipe) is not None
            for compiled in self.compile
            if compiled or mode != "budget"
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    nhosts: int
    ppn: int  # devices (ranks) per host
    gpu_mem_gib: float

    @property
    def world(self) -> int:
        return self.nhosts * self.ppn

    @property
    def device_bytes(self) -> float:
        return self.gpu_mem_gib * GIB


@dataclass(frozen=True, slots=True)
class Candidate:
    """One layout tried: its rung, its layout (None: the rung was skipped), its memory (None:
    the trainer would refuse the layout) and step cost, and why it was rejected (None: it fits
    and splits the batch)."""

    rung: str
    layout: Layout | None
    breakdown: Breakdown | None
    cost: Cost | None
    reason: str | None
    sync_every_micro_batch: bool = False  # set by the planner to make it fit
    fits_memory: bool = False

    @property
    def fits(self) -> bool:
        return self.reason is None


@dataclass(frozen=True, slots=True)
class Nearest:
    """A global batch close to the asked one that a layout splits."""

    samples: int
    layout: Layout
    total_s: float


@dataclass(frozen=True, slots=True)
class Plan:
    machine: Machine
    work: Workload
    rates: Rates
    candidates: tuple[Candidate, ...]  # in order of pain
    chosen: Candidate | None
    warnings: tuple[str, ...]
    nearest: tuple[Nearest, ...] = ()  # when no layout splits the batch: below, above

    @property
    def fitting(self) -> list[Candidate]:
        """The candidates that fit, cheapest first."""
        fit = [c for c in self.candidates if c.fits and c.cost is not None]
        return sorted(fit, key=_ranking)

    def failure(self) -> tuple[str, str]:
        """(what, fix) when nothing fits: the nearest batches, or the smallest estimate."""
        estimated = [c for c in self.candidates if c.breakdown is not None]
        if not estimated:
            refused = next((c.reason for c in self.candidates if c.reason), "none tried")
            return (
                f"no layout goodput accepts for this model (e.g. {refused})",
                "change the machine or the model's shape",
            )
        best = min(estimated, key=lambda c: c.breakdown.total if c.breakdown else 0.0)
        assert best.breakdown is not None and best.layout is not None
        memory = f"{best.breakdown.total / GIB:.1f} GiB per device"
        samples = self.work.global_batch_samples
        if any(c.fits_memory for c in self.candidates):
            what = (
                f"no layout splits the global batch of {samples} samples: layouts fit in "
                "memory, but their data-parallel ranks x the micro-batch do not divide it"
            )
            if not self.nearest:
                return what, "choose another --gbs-tokens, or use fewer hosts"
            options = [
                f"{n.samples} samples (--gbs-tokens {n.samples * self.work.seq_len}: "
                f"{n.layout.describe()}, {n.total_s:.3g} s a step)"
                for n in self.nearest
            ]
            return f"{what}; the nearest that do: " + " or ".join(options), (
                "pass one of those --gbs-tokens, or use fewer hosts"
            )
        return (
            f"no layout fits: the smallest estimate is {memory} ({best.rung} "
            f"{best.layout.describe()}) against {self.machine.gpu_mem_gib:.1f} GiB",
            "use more hosts or lower the micro-batch (--micro-batch-size)"
            + (
                ""
                if any(c.layout and c.layout.activation_checkpointing != "none" for c in estimated)
                else ", or allow activation checkpointing (--activation-checkpointing any)"
            ),
        )


def plan_layout(
    model: ModelConfig,
    machine: Machine,
    work: Workload,
    rates: Rates,
    *,
    options: Options = Options(),
    given: Layout | None = None,
) -> Plan:
    """Try every layout and choose the cheapest that fits. ``options``: the checkpointing
    modes, fp8 scalings and compile settings the planner may choose. ``given``: the config's
    own [parallel] layout, checked for warnings only."""
    ladder = _Ladder(model, machine, work, rates, options)
    candidates = sorted(ladder.candidates(), key=lambda c: RUNGS.index(c.rung))
    chosen = cheapest(candidates)
    warnings = [critical_batch_warning(model, work.global_batch_samples * work.seq_len)]
    if given is not None and (across := tp_across_hosts(given, machine.nhosts, machine.ppn)):
        warnings.append(f"the config's [parallel]: {across}")
    nearest: tuple[Nearest, ...] = ()
    if _batch_costs_too_much(candidates, chosen):
        nearest = nearest_batches(model, machine, work, rates, candidates, chosen)
        if chosen is not None and nearest:
            warnings.append(_cheaper_batches(work, chosen, nearest))
    return Plan(
        machine,
        work,
        rates,
        tuple(candidates),
        chosen,
        tuple(w for w in warnings if w),
        nearest,
    )


def cheapest(candidates: list[Candidate]) -> Candidate | None:
    """The cheapest candidate that fits of the least painful rung that has one within ``TIE``
    of the cheapest of all."""
    fit = [c for c in candidates if c.fits and c.cost is not None]
    if not fit:
        return None
    best = min(_total(c) for c in fit)
    rung = min(RUNGS.index(c.rung) for c in fit if _total(c) <= best * (1 + TIE))
    return min((c for c in fit if RUNGS.index(c.rung) == rung), key=_ranking)


def _total(candidate: Candidate) -> float:
    assert candidate.cost is not None
    return candidate.cost.total


def _ranking(candidate: Candidate) -> tuple[float, float, float]:
    """Cost, then (between equal costs) the traffic the compute hides, then memory."""
    assert candidate.cost is not None and candidate.breakdown is not None
    cost = candidate.cost
    return round(cost.total, 6), round(cost.fsdp, 6), candidate.breakdown.total


def evaluate(
    model: ModelConfig, machine: Machine, work: Workload, rates: Rates, layout: Layout, rung: str
) -> Candidate:
    """One layout's memory, cost and fit (setting ``sync_every_micro_batch`` when only that
    makes it fit)."""
    refused = problems(model, layout, work.seq_len)
    if refused:
        return Candidate(rung, layout, None, None, "; ".join(refused))
    device = machine.device_bytes
    breakdown = estimate(model, layout, work, device)
    synced = False
    reducible = layout.pp == 1 and not work.sync_every_micro_batch  # pp holds them anyway
    if breakdown.total > device and breakdown.held_gradients > 0 and reducible:
        work = replace(work, sync_every_micro_batch=True)
        breakdown, synced = estimate(model, layout, work, device), True
    cost = step_cost(model, layout, work, rates)
    reasons = []
    memory = f"{breakdown.total / GIB:.1f} GiB per device"
    fits_memory = breakdown.total <= device
    if not fits_memory:
        every = " (reducing gradients every micro-batch)" if synced else ""
        reasons.append(f"{memory}{every} > {machine.gpu_mem_gib:.1f} GiB")
    batch = batch_problem(model, work.global_batch_samples, work.micro_batch_size, layout)
    if batch:
        reasons.append(batch if reasons else f"fits in {memory}, but {batch}")
    reason = "; ".join(reasons) or None
    return Candidate(rung, layout, breakdown, cost, reason, synced, fits_memory)


def rung_of(layout: Layout) -> str:
    """The most painful rung ``layout`` uses."""
    for rung, used in (
        ("CP", layout.cp > 1),
        ("PP", layout.pp > 1),
        ("TP", layout.tp > 1),
        ("AC", layout.activation_checkpointing != "none"),
        ("EP", layout.ep > 1),
        ("FSDP", layout.shard > 1),
    ):
        if used:
            return rung
    return "DP"


def _batch_costs_too_much(candidates: list[Candidate], chosen: Candidate | None) -> bool:
    """Whether the global batch rules out every layout that fits in memory, or forces one
    costing more than ``BATCH_GAIN`` above the cheapest of them."""
    best = _cheapest_in_memory(candidates)
    if best is None:
        return False
    return chosen is None or _total(chosen) > (1 + BATCH_GAIN) * best


def _cheapest_in_memory(candidates: list[Candidate]) -> float | None:
    """The cheapest step of the layouts that fit in memory, whether or not they split the
    batch."""
    costs = [_total(c) for c in candidates if c.fits_memory and c.cost is not None]
    return min(costs, default=None)


def nearest_batches(
    model: ModelConfig,
    machine: Machine,
    work: Workload,
    rates: Rates,
    candidates: list[Candidate],
    chosen: Candidate | None,
) -> tuple[Nearest, ...]:
    """The global batches nearest to ``work``'s, below and above, that a layout fitting in
    memory splits (multiples of micro-batch x its data-parallel ranks), each planned again;
    of the ``NEAREST_TRIES`` nearest on each side, the nearest whose cost per sample is within
    ``BATCH_GAIN`` of theirs. With ``chosen`` set, only within ``NEAREST_RANGE`` of the batch
    and ``BATCH_GAIN`` cheaper per sample than ``chosen``."""
    samples = work.global_batch_samples
    fit = [c.layout for c in candidates if c.fits_memory and c.layout is not None]
    rounds = sorted({work.micro_batch_size * layout.dp for layout in fit})
    below = sorted({samples // r * r for r in rounds if 0 < samples // r * r < samples})
    above = sorted({-(-samples // r) * r for r in rounds if samples % r})
    per_sample = _total(chosen) / samples / (1 + BATCH_GAIN) if chosen else math.inf
    if chosen is not None:  # a layout runs this batch: look only close to it
        below = [b for b in below if b >= samples * (1 - NEAREST_RANGE)]
        above = [b for b in above if b <= samples * (1 + NEAREST_RANGE)]
    # Only the layouts the trainer takes whose data-parallel ranks divide a batch can split it:
    # those are evaluated again at that batch (memory and cost depend on the accumulation).
    valid = [c for c in candidates if c.breakdown is not None and c.layout is not None]
    found = []
    for options in (below[::-1][:NEAREST_TRIES], above[:NEAREST_TRIES]):
        planned = []
        for batch in options:
            again = replace(work, global_batch_samples=batch)
            best = cheapest(
                [
                    evaluate(model, machine, again, rates, c.layout, c.rung)
                    for c in valid
                    if c.layout is not None and batch % (work.micro_batch_size * c.layout.dp) == 0
                ]
            )
            if best is not None and best.layout is not None and best.cost is not None:
                planned.append(Nearest(batch, best.layout, best.cost.total))
        if not planned:
            continue
        lowest = min(n.total_s / n.samples for n in planned)
        good = [
            n
            for n in planned  # nearest first
            if n.total_s / n.samples <= min(per_sample, (1 + BATCH_GAIN) * lowest)
        ]
        found += good[:1]
    return tuple(found)


def _cheaper_batches(work: Workload, chosen: Candidate, nearest: tuple[Nearest, ...]) -> str:
    assert chosen.layout is not None
    options = " or ".join(
        f"{n.samples} samples (--gbs-tokens {n.samples * work.seq_len}: {n.layout.describe()}, "
        f"{n.total_s:.3g} s a step)"
        for n in nearest
    )
    return (
        f"the global batch of {work.global_batch_samples} samples leaves only costlier layouts "
        f"({chosen.layout.describe()}, {_total(chosen):.3g} s a step); cheaper per sample: "
        f"{options}"
    )


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


class _Ladder:
    def __init__(
        self,
        model: ModelConfig,
        machine: Machine,
        work: Workload,
        rates: Rates,
        options: Options,
    ):
        self.model, self.machine, self.work, self.rates = model, machine, work, rates
        self.variants = len(options.variants(Layout(), rates))  # per layout
        self.options = options

    def candidates(self) -> Iterator[Candidate]:
        bases: list[Layout] = []
        for rung in (self._dp, self._fsdp, self._tp, self._pp):
            for name, layout in rung():
                if isinstance(layout, str):
                    yield Candidate(name, None, None, None, f"skipped: {layout}")
                    continue
                self._add(bases, layout)
        for widen in (self._cp, self._ep):
            for name, layout in widen(list(bases)):
                if isinstance(layout, str):
                    yield Candidate(name, None, None, None, f"skipped: {layout}")
                    continue
                self._add(bases, layout)
        for base in bases:
            if problems(self.model, base, self.work.seq_len):  # once, with the trainer's reason
                yield evaluate(self.model, self.machine, self.work, self.rates, base, rung_of(base))
                continue
            for layout in self.options.variants(base, self.rates):
                yield self._scheduled(layout)

    def _scheduled(self, layout: Layout) -> Candidate:
        """``layout`` evaluated; a pipeline's under each schedule ``Options`` allows (its
        stages splitting the layers as ``balanced_layer_split`` does), the cheapest that fits
        kept (else its first, 1F1B's): one candidate, whatever the schedules, so that they
        add work but no layouts to the bound."""
        model, work = self.model, self.work
        if layout.pp == 1:
            return evaluate(model, self.machine, work, self.rates, layout, rung_of(layout))
        tried = []
        for schedule in self.options.schedules:
            stages = layout.pp * default_stages_per_rank(schedule)
            if stages > model.num_layers:
                continue  # more stages than layers
            split = balanced_layer_split(model.num_layers, stages)
            scheduled = replace(layout, pp_schedule=schedule, pp_layers_per_stage=split)
            if problems(model, scheduled, work.seq_len):
                continue  # a schedule the trainer refuses here (compile with zero bubble)
            tried.append(evaluate(model, self.machine, work, self.rates, scheduled, "PP"))
        if not tried:
            return evaluate(model, self.machine, work, self.rates, layout, rung_of(layout))
        best = cheapest(tried) or tried[0]
        return replace(best, rung=rung_of(layout))

    def _add(self, bases: list[Layout], layout: Layout) -> None:
        """``layout`` to weigh, unless the ladder has grown past ``MAX_CANDIDATES`` (counted
        as the layouts are listed, before any is weighed, so the refusal takes a moment)."""
        bases.append(layout)
        if len(bases) * self.variants <= MAX_CANDIDATES:
            return
        machine = self.machine
        fewer = 1 << (machine.nhosts.bit_length() - 1)
        raise GoodputError.usage(
            "--nhosts/--ppn",
            f"{machine.nhosts} hosts x {machine.ppn} devices give more than "
            f"{MAX_CANDIDATES:,} layouts to weigh: the divisors of both counts multiply the "
            f"FSDP, tensor, pipeline and context-parallel splits, each weighed in "
            f"{self.variants} setting(s) of checkpointing, fp8 and compile",
            f"plan for a count of hosts with fewer divisors (the job leaves the rest spare), "
            f"e.g. --nhosts {fewer}"
            + (
                ", or allow fewer settings (--activation-checkpointing, --fp8, --no-compile)"
                if self.variants > 1
                else ""
            ),
        )

    def _dp(self) -> Iterator[tuple[str, Layout | str]]:
        yield "DP", Layout(dp_replicate=self.machine.world)

    def _fsdp(self) -> Iterator[tuple[str, Layout | str]]:
        nodes, g = self.machine.nhosts, self.machine.ppn
        if self.machine.world == 1:
            yield "FSDP", "one device: nothing to shard over"
            return
        for m in divisors(nodes):
            if g * m == 1:
                continue  # the DP layout again
            yield "FSDP", Layout(dp_replicate=nodes // m, dp_shard=g * m)

    def _tp(self) -> Iterator[tuple[str, Layout | str]]:
        nodes, g = self.machine.nhosts, self.machine.ppn
        sizes = [tp for tp in divisors(g) if tp > 1]
        if not sizes:
            yield "TP", "one device per host: TP stays within a host"
        for tp in sizes:
            if problems(self.model, Layout(tp=tp), self.work.seq_len):
                yield "TP", Layout(tp=tp, dp_replicate=nodes, dp_shard=g // tp)  # says why
                continue
            for m in divisors(nodes):
                yield "TP", Layout(tp=tp, dp_replicate=nodes // m, dp_shard=g // tp * m)

    def _pp(self) -> Iterator[tuple[str, Layout | str]]:
        nodes, g = self.machine.nhosts, self.machine.ppn
        if nodes == 1:
            yield "PP", "one host: pipeline stages go across hosts"
            return
        sizes = [
            t for t in divisors(g) if not problems(self.model, Layout(tp=t), self.work.seq_len)
        ]
        layers = self.model.num_layers
        for pp in divisors(nodes)[1:]:
            per_stage = nodes // pp
            if pp > layers:
                yield "PP", Layout(pp=pp, dp_replicate=per_stage, dp_shard=g)  # says why
                return  # a larger pp has even more stages
            split = balanced_layer_split(layers, pp)
            for tp in sizes:
                for m in divisors(per_stage):
                    yield (
                        "PP",
                        Layout(
                            pp=pp,
                            tp=tp,
                            dp_replicate=per_stage // m,
                            dp_shard=g // tp * m,
                            pp_layers_per_stage=split,
                        ),
                    )

    def _cp(self, bases: list[Layout]) -> Iterator[tuple[str, Layout | str]]:
        seq_len = self.work.seq_len
        for base in bases:
            if base.dp_shard == 1 or problems(self.model, base, seq_len):
                continue
            if base.pp > 1 and (base.dp_replicate > 1 or seq_len < CP_IN_STAGES_FROM):
                continue  # the module docstring
            for cp in divisors(base.dp_shard)[1:]:
                if cp > MAX_CP:
                    break
                yield "CP", replace(base, dp_shard=base.dp_shard // cp, cp=cp)
                if 2 * cp > seq_len:
                    break  # says why; a larger cp has even shorter chunks

    def _ep(self, bases: list[Layout]) -> Iterator[tuple[str, Layout | str]]:
        """Each layout again with the routed experts split over ep of its dp_shard ranks (ep
        dividing the experts), for a mixture whose experts hold most of the parameters."""
        moe = self.model.moe
        if moe is None:
            return
        experts = self._experts_share()
        if experts < EXPERTS_DOMINATE:
            yield (
                "EP",
                (
                    f"the routed experts are {experts:.0%} of the parameters (EP is tried from "
                    f"{EXPERTS_DOMINATE:.0%}): splitting them saves little"
                ),
            )
            return
        for base in bases:
            if problems(self.model, base, self.work.seq_len):
                continue
            for ep in divisors(math.gcd(base.dp_shard, moe.num_experts))[1:]:
                yield "EP", replace(base, ep=ep)

    def _experts_share(self) -> float:
        """The routed experts' share of all parameters (0 for a dense model)."""
        experts = self.model.num_layers * Parameters.of(self.model).block_experts
        return experts / model_size(self.model).total
