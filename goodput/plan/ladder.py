"""The ladder: add parallelism in order of pain, one rung at a time, until a layout fits.

Rungs, each tried only when every layout before it was rejected (world = nodes x devices per
node, g = devices per node):
1. DP: every rank a whole replica (dp_replicate = world; goodput replicates through FSDP with
   dp_shard = 1, which fp32-master needs for its bf16 compute).
2. FSDP: shard within a node (HSDP: dp_shard = g, a replica per node), then over 2, 4, ...
   nodes (dp_shard = g x m for m dividing nodes) up to the whole world: the smallest shard
   degree that fits. For a mixture of experts whose routed experts hold most parameters, each
   shard degree is also tried with EP within a node (ep dividing g, the experts and dp_shard):
   the experts' state shards the same, but FSDP gathers only the rank's own experts.
3. TP within a node: tp dividing g, ascending (each must divide the heads, kv heads, ffn dim,
   vocabulary and seq_len), FSDP over the rest, smallest shard first.
4. PP across nodes: pp dividing nodes (at most num_layers), with the largest valid tp within a
   node, FSDP over the rest.
5. CP: cp dividing the data-parallel ranks of the smallest layout so far without pp (goodput
   refuses cp inside pipeline stages today); its FSDP group keeps the same ranks (dp_shard x
   cp), for sequences that still do not fit.
Mixtures of experts skip TP, PP and CP: goodput's trainer refuses them with MoE today.

Every candidate must also split the global batch (``batch.batch_problem``). With more than one
micro-batch a step, FSDP holds unsharded gradients through the accumulation unless
``sync_every_micro_batch`` is set; when only that keeps a layout from fitting, the planner sets
it (one reduce-scatter per micro-batch is cheaper than another rung) and says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from goodput.plan.batch import batch_problem, critical_batch_warning
from goodput.plan.layout import Layout, problems, tp_across_hosts
from goodput.plan.memory import GIB, Breakdown, Parameters, Workload, estimate
from goodput.train.flops import model_size
from goodput.train.model_config import ModelConfig

RUNGS = ("DP", "FSDP", "EP", "TP", "PP", "CP")
EXPERTS_DOMINATE = 0.5  # the routed experts' share of the parameters above which EP is tried


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device_bytes(self) -> float:
        return self.gpu_mem_gib * GIB


@dataclass(frozen=True, slots=True)
class Attempt:
    """One rung's candidate: its layout (None: the rung was skipped), its memory (None: the
    trainer would refuse the layout), and why it was rejected (None: it fits)."""

    rung: str
    layout: Layout | None
    breakdown: Breakdown | None
    reason: str | None
    sync_every_micro_batch: bool = False  # set by the planner to make it fit

    @property
    def fits(self) -> bool:
        return self.reason is None


@dataclass(frozen=True, slots=True)
class Plan:
    machine: Machine
    work: Workload
    attempts: tuple[Attempt, ...]  # in ladder order; the last one fits when chosen is set
    chosen: Attempt | None
    warnings: tuple[str, ...]

    @property
    def rejected(self) -> tuple[Attempt, ...]:
        return tuple(a for a in self.attempts if a is not self.chosen)

    def failure(self) -> tuple[str, str]:
        """(what, fix) when nothing fits: the smallest estimate found and what to change."""
        estimated = [a for a in self.attempts if a.breakdown is not None]
        if not estimated:
            return "no layout goodput accepts for this model", "see the rejected rungs"
        best = min(estimated, key=lambda a: a.breakdown.total if a.breakdown else 0.0)
        assert best.breakdown is not None and best.layout is not None
        memory = f"{best.breakdown.total / GIB:.1f} GiB per device"
        if best.breakdown.total <= self.machine.device_bytes:
            return (
                f"no layout splits the global batch of {self.work.global_batch_samples} samples: "
                f"the smallest estimate, {memory} ({best.rung} {best.layout.describe()}), fits "
                "but its data-parallel ranks do not divide the batch",
                "choose --gbs-tokens so that global samples divide by micro-batch x data-parallel "
                "ranks, or use fewer nodes",
            )
        return (
            f"no layout fits: the smallest estimate is {memory} ({best.rung} "
            f"{best.layout.describe()}) against {self.machine.gpu_mem_gib:.1f} GiB",
            "use more nodes, turn on activation checkpointing (--activation-checkpointing), or "
            "lower the micro-batch (--micro-batch-size)",
        )


def plan_layout(
    model: ModelConfig, machine: Machine, work: Workload, given: Layout | None = None
) -> Plan:
    """Climb the ladder until a layout fits. ``given``: the config's own [parallel] layout,
    checked for warnings only."""
    ladder = _Ladder(model, machine, work)
    chosen = ladder.climb()
    warnings = [critical_batch_warning(model, work.global_batch_samples * work.seq_len)]
    if given is not None and (
        across := tp_across_hosts(given, machine.nodes, machine.gpus_per_node)
    ):
        warnings.append(f"the config's [parallel]: {across}")
    if chosen is not None and chosen.layout is not None:
        warnings.append(tp_across_hosts(chosen.layout, machine.nodes, machine.gpus_per_node))
    return Plan(machine, work, tuple(ladder.attempts), chosen, tuple(w for w in warnings if w))


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


class _Ladder:
    def __init__(self, model: ModelConfig, machine: Machine, work: Workload):
        self.model, self.machine, self.work = model, machine, work
        self.attempts: list[Attempt] = []

    def climb(self) -> Attempt | None:
        for rung in (self._dp, self._fsdp, self._tp, self._pp, self._cp):
            for name, candidate in rung():
                attempt = (
                    Attempt(name, None, None, f"skipped: {candidate}")
                    if isinstance(candidate, str)
                    else self._try(name, candidate)
                )
                self.attempts.append(attempt)
                if attempt.fits:
                    return attempt
        return None

    def _try(self, rung: str, layout: Layout) -> Attempt:
        refused = problems(self.model, layout, self.work.seq_len)
        if refused:
            return Attempt(rung, layout, None, "; ".join(refused))
        device = self.machine.device_bytes
        breakdown = estimate(self.model, layout, self.work, device)
        synced = False
        if breakdown.total > device and breakdown.held_gradients > 0:
            reducing = replace(self.work, sync_every_micro_batch=True)
            breakdown, synced = estimate(self.model, layout, reducing, device), True
        reasons = []
        memory = f"{breakdown.total / GIB:.1f} GiB per device"
        if breakdown.total > device:
            every = " (reducing gradients every micro-batch)" if synced else ""
            reasons.append(f"{memory}{every} > {self.machine.gpu_mem_gib:.1f} GiB")
        batch = batch_problem(
            self.model, self.work.global_batch_samples, self.work.micro_batch_size, layout
        )
        if batch:
            reasons.append(batch if reasons else f"fits in {memory}, but {batch}")
        return Attempt(rung, layout, breakdown, "; ".join(reasons) or None, synced)

    def _dp(self) -> Iterator[tuple[str, Layout | str]]:
        yield "DP", Layout(dp_replicate=self.machine.world)

    def _fsdp(self) -> Iterator[tuple[str, Layout | str]]:
        nodes, g = self.machine.nodes, self.machine.gpus_per_node
        if self.machine.world == 1:
            yield "FSDP", "one device: nothing to shard over"
            return
        moe = self.model.moe
        experts = self._experts_share()
        for m in divisors(nodes):
            if g * m == 1:
                continue  # the DP layout again
            base = Layout(dp_replicate=nodes // m, dp_shard=g * m)
            yield "FSDP", base
            if moe is not None and experts >= EXPERTS_DOMINATE:
                for ep in divisors(g):
                    if ep > 1 and moe.num_experts % ep == 0 and base.dp_shard % ep == 0:
                        yield "EP", replace(base, ep=ep)
        if moe is not None and experts < EXPERTS_DOMINATE:
            yield (
                "EP",
                (
                    f"the routed experts are {experts:.0%} of the parameters (EP is tried from "
                    f"{EXPERTS_DOMINATE:.0%}): splitting them saves little"
                ),
            )

    def _tp(self) -> Iterator[tuple[str, Layout | str]]:
        nodes, g = self.machine.nodes, self.machine.gpus_per_node
        if self.model.moe is not None:
            yield "TP", "goodput refuses tp > 1 with a mixture-of-experts model today"
            return
        sizes = [tp for tp in divisors(g) if tp > 1]
        if not sizes:
            yield "TP", "one device per node: TP stays within a node"
        for tp in sizes:
            if problems(self.model, Layout(tp=tp), self.work.seq_len):
                yield "TP", Layout(tp=tp, dp_replicate=nodes, dp_shard=g // tp)  # says why
                continue
            for m in divisors(nodes):
                yield "TP", Layout(tp=tp, dp_replicate=nodes // m, dp_shard=g // tp * m)

    def _pp(self) -> Iterator[tuple[str, Layout | str]]:
        nodes, g = self.machine.nodes, self.machine.gpus_per_node
        if self.model.moe is not None:
            yield "PP", "goodput refuses pp > 1 with a mixture-of-experts model today"
            return
        if nodes == 1:
            yield "PP", "one node: pipeline stages go across nodes"
            return
        valid = [
            t for t in divisors(g) if not problems(self.model, Layout(tp=t), self.work.seq_len)
        ]
        tp = max(valid, default=1)
        for pp in divisors(nodes)[1:]:
            per_stage = nodes // pp
            if pp > self.model.num_layers:
                yield "PP", Layout(pp=pp, tp=tp, dp_replicate=per_stage, dp_shard=g // tp)
                return  # says why; a larger pp has even more stages
            for m in divisors(per_stage):
                yield "PP", Layout(pp=pp, tp=tp, dp_replicate=per_stage // m, dp_shard=g // tp * m)

    def _cp(self) -> Iterator[tuple[str, Layout | str]]:
        if self.model.moe is not None:
            yield "CP", "goodput refuses cp > 1 with a mixture-of-experts model today"
            return
        estimated = [
            a for a in self.attempts if a.breakdown is not None and a.layout and a.layout.pp == 1
        ]
        if not estimated:
            yield "CP", "no layout without pp so far to add cp to (goodput refuses cp with pp)"
            return
        best = min(estimated, key=lambda a: a.breakdown.total if a.breakdown else 0.0)
        assert best.layout is not None
        base = best.layout
        for cp in divisors(base.dp)[1:]:
            if base.dp_shard % cp == 0:
                yield "CP", replace(base, dp_shard=base.dp_shard // cp, cp=cp)
            elif base.dp_replicate % cp == 0:
                yield "CP", replace(base, dp_replicate=base.dp_replicate // cp, cp=cp)

    def _experts_share(self) -> float:
        """The routed experts' share of all parameters (0 for a dense model)."""
        experts = self.model.num_layers * Parameters.of(self.model).block_experts
        return experts / model_size(self.model).total
