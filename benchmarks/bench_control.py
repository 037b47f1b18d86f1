"""The control plane at the seed's scale: what goodput adds around the model's own work, one
section a function (``SECTIONS``).

Launcher fan-out (``launcher_fanout``). The health probe of every host (``failover.probe_hosts``)
and the hang forensics' collection (``suspects.collect_hosts``) of 2,048 and 10,624 hosts (Aurora
has 10,624 nodes), under the stand-in scheduler of the tests (``goodput.testing.jobs``: ``srun``
and ``mpiexec`` first on PATH, answering for every host they are given at once, as the real ones
running goodput's fan-out task do). Each run is a fresh launcher process, so that its figures are
its own: wall time, the most stand-in children alive at once (from their start and end lines),
the launcher's peak resident memory (``VmHWM``) and the most file descriptors it held (sampled
every millisecond), against the profile's ``health_timeout_s``. Three cases at each size: every
host healthy; one host down (every step naming it is refused, as Slurm refuses a down node's, so
the fan-out splits round it); forensics with a report of 12 ranks from every host (Aurora's 12
tiles a node). Slurm under the generic profile, PBS with Cray PALS under Aurora's.

The step's vote (``step_vote``). What each rank sends a step and a straggler window, counted
on rank 0 of the fake process group at W = 2 ... 127,488 running the real vote and straggler
watch (``train.step_vote``, ``train.monitor.stragglers``) with every ``all_reduce`` counted;
the time of one vote measured on real gloo ranks at W = 2, 4, 8 (median of 300, this machine's
2 cores: past 2 ranks they are shared, so the growth is an upper bound), beside the vote it
replaced (one SUM of W + 3 float64); and the control time a step modelled at 1,488, 8,192 and
127,488 ranks (12 a node, as Aurora): NCCL's own latency model of a small all-reduce on its
tree with the LL protocol (NVIDIA/nccl, ``src/graph/tuning.cc``: base 4.4 µs + 2 x ((ranks a
node - 1) x 0.52 µs x 1.8 + floor(log2 nodes) x 5.0 µs)), the window's reductions spread over
``straggler_steps`` (20) steps; and the replaced vote as a ring of 2(W-1) hops (gloo's, and
NCCL's ring for a small message) at the per-hop latency measured here at 2 ranks.

goodput's own process groups (``groups``). Measured on real gloo ranks at W = 2, 4, 8, 16
(``testing.sockets.group_sockets``: the real checkpointer and snapshot store, a synchronous save
and one snapshot; hosts of 2 ranks): a rank's TCP sockets with the default group alone, once
goodput's groups are made, and once each was used. "Before" is as goodput made them until
issue 41 — three whole-world groups (the checkpointer's, the snapshot store's, the step vote's),
every pair connected when made; "after" is the two of ``checkpoint.groups.lazy_gloo_group``,
each pair connected on first use (the step vote runs on the default group). Rank 0 (DCP's
coordinator) and the most any other rank holds, each against the model below. Then, under
torch's fake process group at 1,488 / 8,192 / 127,488 ranks on one CPU: the training mesh's
groups (``build_mesh`` with the llama-80b recipe's tp and pp at 1,488 and at all of Aurora's
127,488 ranks, 12 a host; llama-405b's at 8,192, 8 a host; data parallelism fills the rest) —
the ``new_group`` calls every rank makes, the groups rank 0 is a member of and their sizes — and
goodput's two lazy gloo groups really made at that size (time, sockets, memory). The fake
process group's store is a ``HashStore``: gloo writes this rank's entry there when a group is
made, which the fake store does not implement. Last, the model of the sockets a rank holds for
goodput's own groups at those sizes (``modelled_sockets``).

Every rank's host at start (``rank_hosts_at_start``), at W = 8, 1,488, 8,192 and 127,488 ranks,
12 a host (Aurora's names, ``x1000c0s0b0n0``, 13 characters). Before: the launcher passed the
names comma-joined (srun's ``--nodelist``, every rank's ``GOODPUT_LAUNCH_HOSTS``), measured here
by exec'ing a command with that argument (E2BIG past 128 KiB), and every rank gathered every
rank's name (``all_gather_object``: W pickles, padded to the largest, to each of W ranks;
modelled from the measured pickle). After: one host file, its path in ``GOODPUT_HOSTFILE``; each
rank opens and reads it once (bytes measured) and expands it with no collective: the first
``every_rank_host`` of a fresh process timed, and what it keeps (the expanded tuple and the
host file's names and short names, shared) measured with ``sys.getsizeof``.

The report at scale (``report_at_scale``). ``goodput report RUN``, ``--json`` and ``--html`` on a
synthetic run of 10,624 hosts of 12 ranks and 100,000 steps with a straggler-watch window every
20 steps (``goodput.testing.scale_runs``: metrics.jsonl with the per-step busy keys, 5,000
busy.jsonl lines, ten attempts each naming every host), each a fresh process: wall and CPU
seconds and peak resident memory, against the issue's bound (10 s and 2 GiB each).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from goodput.checkpoint.groups import lazy_gloo_group
from goodput.checkpoint.snapshot.pairing import Pairing
from goodput.config import read_toml
from goodput.launch.forensics import HostReport, RankReport
from goodput.launch.launchers import write_hosts
from goodput.plan.verify import fake_store, run_in_child
from goodput.ranks import HOSTFILE_VAR
from goodput.testing.dist import run_distributed
from goodput.testing.jobs import peak_children, stand_in_scheduler
from goodput.testing.proc import status_kib
from goodput.testing.scale_runs import ScaleRun, measure_goodput, write_scale_run
from goodput.testing.sockets import GroupSockets, group_sockets, hosts_of, open_sockets
from goodput.train.config.parallel import ParallelConfig
from goodput.train.parallel.mesh import build_mesh

HOST_COUNTS = (2048, 10_624)
RANKS_PER_HOST = 12
LAUNCHERS = {"slurm": "generic", "pbs": "aurora"}  # launcher -> the profile it runs under

# The launcher under measure, in a process of its own: the case's fan-out, then its figures as
# one line of JSON.
DRIVER = """
import json, os, sys, threading, time
from pathlib import Path
from goodput.launch import failover, suspects
from goodput.launch.env import read_placement
from goodput.launch.launchers import load_profile, plan_launch

scheduler, profile, count, case, run_dir = sys.argv[1:]
hosts = [f"x{index:05d}" for index in range(int(count))]
if scheduler == "slurm":
    nodelist = f"x[00000-{int(count) - 1:05d}]"
    placement = read_placement({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": nodelist})
else:
    placement = read_placement({"PBS_JOBID": "1.pbs"}, "".join(h + "\\n" for h in hosts))
plan = plan_launch(placement, load_profile(profile), run_dir=Path(run_dir))
most_fds = 0
done = threading.Event()

def sample():
    global most_fds
    while not done.wait(0.001):
        most_fds = max(most_fds, len(os.listdir("/proc/self/fd")))

threading.Thread(target=sample, daemon=True).start()
started = time.monotonic()
if case == "forensics":
    reports = suspects.collect_hosts(plan, Path(run_dir) / "beacons", dict(os.environ))
    wrong = sorted(h for h, r in reports.items() if r is None or len(r.ranks) != 12)
else:
    failed = failover.probe_hosts(plan, plan.hosts, dict(os.environ))
    wrong = sorted(failed)
wall = time.monotonic() - started
done.set()
status = Path("/proc/self/status").read_text()
hwm = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
print(json.dumps({"wall_s": wall, "peak_rss_mib": hwm / 1024, "most_open_files": most_fds,
                  "wrong": wrong[:5], "timeout_s": plan.profile.health_timeout_s}))
"""


def _report(first_rank: int, world: int) -> str:
    ranks = tuple(
        RankReport(
            rank=rank, world_size=world, pid=4000 + rank, schedule_id=0, step=1234,
            phase="forward", last_site="step.tokens", entered=9000, left=8999, flush_site="",
            flush_entered=0, flush_left=0, torn=False, state="running", answered=True,
            stack=("distributed_c10d.py:2501 all_reduce", "loop.py:118 train", "cli.py:40 main"),
        )
        for rank in range(first_rank, first_rank + RANKS_PER_HOST)
    )  # fmt: skip
    return HostReport(ranks=ranks).to_json()


def _answers(count: int, case: str) -> dict[str, Any]:
    hosts = [f"x{index:05d}" for index in range(count)]
    if case == "forensics":
        world = count * RANKS_PER_HOST
        return {
            "hosts": {
                host: {"output": _report(index * RANKS_PER_HOST, world)}
                for index, host in enumerate(hosts)
            }
        }
    answers: dict[str, Any] = {"default": {"output": "health: {host}: healthy\n"}}
    if case == "one host down":
        answers["refuse"] = [hosts[count * 2 // 3]]
    return answers


def _one(tmp: Path, scheduler: str, count: int, case: str) -> dict[str, Any]:
    log = tmp / "stand-ins.log"
    log.unlink(missing_ok=True)
    run_dir = tmp / "run"
    run_dir.mkdir(exist_ok=True)
    env = {**os.environ, **stand_in_scheduler(tmp / "bin", _answers(count, case), log)}
    argv = [sys.executable, "-c", DRIVER, scheduler, LAUNCHERS[scheduler], str(count), case]
    result = subprocess.run(
        [*argv, str(run_dir)], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    figures: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    figures["steps"] = log.read_text().count("start ")
    figures["peak_children"] = peak_children(log)
    return figures


def launcher_fanout() -> dict[str, Any]:
    """Probes and forensics of 2,048 and 10,624 stand-in hosts (the module docstring)."""
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="goodput-bench-control-") as tmp:
        for scheduler in LAUNCHERS:
            for count in HOST_COUNTS:
                for case in ("all healthy", "one host down", "forensics"):
                    one = _one(Path(tmp), scheduler, count, case)
                    figures[f"{scheduler} {count} {case}"] = one
                    print(
                        f"launcher fan-out, {scheduler} ({LAUNCHERS[scheduler]}), {count:,} "
                        f"hosts, {case}: {one['wall_s']:.2f} s of {one['timeout_s']:g} s, "
                        f"{one['steps']} step(s), at most {one['peak_children']} at once, "
                        f"launcher peak RSS {one['peak_rss_mib']:.0f} MiB, at most "
                        f"{one['most_open_files']} open files; hosts failed {one['wrong']}"
                    )
    return figures


VOTE_WORLDS = (2, 4, 16, 1_488, 8_192, 127_488)
TIMED_WORLDS = (2, 4, 8)
MODELLED_WORLDS = (1_488, 8_192, 127_488)
RANKS_PER_NODE = 12
VOTE_REPEATS = 300

# Rank 0 of a fake world of W ranks: the real vote and straggler watch over one window and a
# step, every all_reduce counted (the fake group reduces nothing: rank 0's own values return).
COUNTER = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from goodput.plan.verify import fake_store
from goodput.train.config.run import WatchConfig
from goodput.train.monitor.stragglers import StragglerWatch
from goodput.train.monitor.wire import ProcessWire
from goodput.train.step_vote import Ballot, cast

world, run_dir = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
sent = []
reduce = dist.all_reduce
def counted(tensor, *args, **kwargs):
    sent.append(tensor.numel() * tensor.element_size())
    return reduce(tensor, *args, **kwargs)
dist.all_reduce = counted
cfg = WatchConfig()
wire = ProcessWire(torch.device("cpu"))
watch = StragglerWatch(cfg, ["h"] * world, wire, run_dir=run_dir)
per_step = []
for step in range(cfg.straggler_steps + 2):
    before = len(sent)
    ballot = Ballot(sigterm=False, minutes_due=False, snapshot_ok=True, busy_s=0.1)
    watch.observe(step, 0.1, cast(wire, ballot).busy)
    per_step.append(sent[before:])
window = max(per_step, key=len)
print(json.dumps({"step": [len(per_step[1]), sum(per_step[1])],
                  "window": [len(window), sum(window)]}))
"""


def _vote_time(rank: int, world_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of one vote (``cast``) and of the replaced one, on real gloo ranks."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from goodput.train.monitor.wire import ProcessWire
    from goodput.train.step_vote import Ballot, cast

    wire = ProcessWire(torch.device("cpu"))
    ballot = Ballot(sigterm=False, minutes_due=False, snapshot_ok=True, busy_s=0.1)
    times: dict[str, list[float]] = {"vote": [], "replaced": []}
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        cast(wire, ballot)
        times["vote"].append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(torch.zeros(world_size + 3, dtype=torch.float64))
        times["replaced"].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def nccl_tree_ll_us(ranks: int, ranks_per_node: int = RANKS_PER_NODE) -> float:
    """NCCL's modelled latency of a small all-reduce on its tree, LL protocol (module
    docstring): the constants of ``src/graph/tuning.cc``, NVLink within a node."""
    nodes = max(1, ranks // ranks_per_node)
    within = (min(ranks, ranks_per_node) - 1) * 0.52 * (1.8 if nodes > 1 else 1.0)
    return 4.4 + 2 * (within + (nodes.bit_length() - 1) * 5.0)


def step_vote() -> dict[str, Any]:
    """The vote's traffic counted, timed and modelled (the module docstring)."""
    from goodput.testing.dist import run_distributed
    from goodput.train.config.run import WatchConfig

    figures: dict[str, Any] = {"counted": {}, "measured": {}, "modelled": {}}
    with tempfile.TemporaryDirectory(prefix="goodput-bench-vote-") as tmp:
        for world in VOTE_WORLDS:
            result = subprocess.run(
                [sys.executable, "-c", COUNTER, str(world), tmp],
                capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            counted = json.loads(result.stdout.splitlines()[-1])
            figures["counted"][world] = counted
            print(
                f"step vote, W = {world:,} (fake group, rank 0): a step {counted['step'][0]} "
                f"all-reduce(s) of {counted['step'][1]:,} bytes; a window's step "
                f"{counted['window'][0]} of {counted['window'][1]:,} bytes"
            )
    for world in TIMED_WORLDS:
        timed = run_distributed(_vote_time, world, VOTE_REPEATS, timeout_s=600)[0]
        figures["measured"][world] = timed
        print(
            f"step vote, W = {world} (gloo, this machine): {timed['vote'] * 1e6:.0f} µs a vote; "
            f"the replaced W + 3 float64 all-reduce {timed['replaced'] * 1e6:.0f} µs"
        )
    per_hop_s = figures["measured"][2]["replaced"] / 2  # a 2-rank ring all-reduce: 2 hops
    window_steps = WatchConfig().straggler_steps
    step_calls, window_calls = (
        figures["counted"][VOTE_WORLDS[-1]][k][0] for k in ("step", "window")
    )
    per_step_calls = step_calls + (window_calls - step_calls) / window_steps
    for world in MODELLED_WORLDS:
        tree_us = nccl_tree_ll_us(world)
        modelled = {
            "all_reduces_a_step": per_step_calls,
            "nccl_tree_ll_us": tree_us,
            "control_us_a_step": per_step_calls * tree_us,
            "replaced_gloo_ring_s": 2 * (world - 1) * per_hop_s,
        }
        figures["modelled"][world] = modelled
        print(
            f"step vote, W = {world:,} (modelled, {RANKS_PER_NODE} ranks a node): "
            f"{per_step_calls:.2f} all-reduces a step x {tree_us:.0f} µs (NCCL tree, LL) = "
            f"{modelled['control_us_a_step']:.0f} µs a step; the replaced vote on a gloo ring "
            f"{modelled['replaced_gloo_ring_s']:.2f} s a step"
        )
    return figures


MEASURED_WORLDS = (2, 4, 8, 16)
# world -> (the recipe whose tp and pp it runs, ranks a host)
FAKE_WORLDS = {1_488: ("llama-80b", 12), 8_192: ("llama-405b", 8), 127_488: ("llama-80b", 12)}
RECIPES = Path(__file__).resolve().parent.parent / "configs"


def ceil_log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _tree_peers(rank: int, world: int) -> set[int]:
    """A rank's parent and children in a binomial tree rooted at 0 (gloo's broadcast)."""
    peers = {rank - (1 << (rank.bit_length() - 1))} if rank else set()
    step = 1 << rank.bit_length() if rank else 1
    while rank + step < world:
        peers.add(rank + step)
        step <<= 1
    return peers


def _checkpoint_peers(rank: int, world: int) -> set[int]:
    """The peers a rank of the checkpointer's lazy group connects to in its first save: every
    rank for rank 0 (DCP's coordinator gathers and scatters); else the ring neighbours
    (all-gathers), the dissemination barrier's ranks at 1, 2, 4, ... either way, rank 0, and its
    broadcast tree's."""
    if rank == 0:
        return set(range(1, world))
    distances = [1 << k for k in range(ceil_log2(world))]
    barrier = {(rank + sign * d) % world for d in distances for sign in (1, -1)}
    return (barrier | {0} | _tree_peers(rank, world)) - {rank}


def _snapshot_peers(rank: int, hosts: list[str]) -> set[int]:
    """The peers a rank of the snapshot store's lazy group connects to in its first snapshot:
    its ring neighbours (the store's all-gathers) and its partner holder and source."""
    world = len(hosts)
    pairing = Pairing.from_hosts(hosts, rank)
    partners = {p for p in (pairing.holder, pairing.source) if p is not None}
    return ({(rank + 1) % world, (rank - 1) % world} | partners) - {rank}


def modelled_sockets(world: int, hosts: list[str], ranks: Iterable[int]) -> dict[str, int]:
    """Sockets a rank holds for goodput's own groups (a listening one each, one a connected
    peer): before (three groups, every pair connected: 3 W), after (made: listeners and the
    store's ring neighbours; used: rank 0, and the most of the other ``ranks``)."""

    def used(rank: int) -> int:
        return 2 + len(_checkpoint_peers(rank, world)) + len(_snapshot_peers(rank, hosts))

    return {
        "before": 3 * world,
        "made": 2 + min(2, world - 1),
        "used, rank 0": used(0),
        "used, other ranks (most)": max(used(rank) for rank in ranks if rank != 0),
    }


def _measured(world: int, eager: bool) -> list[GroupSockets]:
    with tempfile.TemporaryDirectory(prefix="goodput-bench-groups-") as tmp:
        return run_distributed(group_sockets, world, tmp, eager, timeout_s=600)


def _fake_start_up(world: int, recipe: str, ranks_per_host: int) -> dict[str, Any]:
    """In a spawned child: rank 0 of a fake world of ``world`` ranks builds the training mesh
    (counted), then goodput's two lazy gloo groups (timed, sockets and memory)."""
    layout = read_toml(RECIPES / f"{recipe}.toml")["parallel"]
    parallel = ParallelConfig(tp=layout.get("tp", 1), pp=layout.get("pp", 1))
    fake_store()  # registers the fake backend
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    calls = 0
    made = dist.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return made(*args, **kwargs)

    started = time.perf_counter()
    with mock.patch("torch.distributed.device_mesh.new_group", counted):
        mesh = build_mesh(parallel, torch.device("cpu"), ranks_per_host)
    mesh_s = time.perf_counter() - started
    groups = {
        group.group_desc: len(ranks)
        for group, ranks in distributed_c10d._world.pg_group_ranks.items()
        if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD
    }
    sockets, resident = open_sockets(), status_kib("VmRSS")
    started = time.perf_counter()
    own = [lazy_gloo_group(), lazy_gloo_group()]  # the checkpointer's, the snapshot store's
    own_s = time.perf_counter() - started
    figures = {
        "layout": f"tp {mesh.degrees.tp} x pp {mesh.degrees.pp} x dp_shard {mesh.degrees.dp}",
        "new_group calls": calls,
        "mesh groups": groups,
        "mesh s": mesh_s,
        "own groups": len(own),
        "own groups s": own_s,
        "own groups sockets": open_sockets() - sockets,
        "own groups MiB": (status_kib("VmRSS") - resident) / 2**10,
    }
    dist.destroy_process_group()
    return figures


def groups(
    measured_worlds: Sequence[int] = MEASURED_WORLDS,
    fake_worlds: Sequence[int] = tuple(FAKE_WORLDS),
) -> dict[str, Any]:
    """goodput's own process groups, measured and counted (the module docstring)."""
    figures: dict[str, Any] = {}
    print("goodput's groups, TCP sockets a rank holds (rank 0 / most of any other; model):")
    print("| W | when | before: measured | after: measured | after: modelled |")
    print("|---|---|---|---|---|")
    for world in measured_worlds:
        before, after = _measured(world, eager=True), _measured(world, eager=False)
        hosts = hosts_of(world)
        model = modelled_sockets(world, hosts, range(world))
        figures[f"measured {world}"] = {
            "before": [dataclasses.asdict(rank) for rank in before],
            "after": [dataclasses.asdict(rank) for rank in after],
            "model": model,
        }
        for when in ("default", "made", "used"):
            cells = []
            for found in (before, after):
                counts = [getattr(rank, when) for rank in found]
                cells.append(f"{counts[0]} / {max(counts[1:])}")
            modelled = {
                "default": f"{world} / {world}",
                "made": f"{world + model['made']} / {world + model['made']}",
                "used": f"{world + model['used, rank 0']} / "
                f"{world + model['used, other ranks (most)']}",
            }[when]
            print(f"| {world} | {when} | {cells[0]} | {cells[1]} | {modelled} |")
        works = all(rank.saved and rank.snapshot_ok for rank in (*before, *after))
        print(f"W = {world}: every save complete and every snapshot exchanged: {works}")
    for world in fake_worlds:
        recipe, per_host = FAKE_WORLDS[world]
        where = f"fake world of {world}"
        one = run_in_child(_fake_start_up, (world, recipe, per_host), where, 600)
        hosts = [f"x{rank // per_host:05d}" for rank in range(world)]
        # The most any rank holds is on a rank with the largest tree and barrier: a sample of
        # ranks (the first and last hosts' and every power of two) stands for all.
        sample = {0, *range(1, per_host * 2), *range(world - per_host, world)}
        sample |= {(1 << k) - 1 for k in range(1, ceil_log2(world) + 1) if (1 << k) - 1 < world}
        one["model"] = modelled_sockets(world, hosts, sorted(sample))
        figures[f"fake {world}"] = one
        sizes = ", ".join(f"{name} {size:,}" for name, size in one["mesh groups"].items())
        print(
            f"fake world {world:,} ({recipe}'s tp and pp, {per_host} a host: {one['layout']}): "
            f"build_mesh {one['mesh s']:.1f} s, {one['new_group calls']:,} new_group calls a "
            f"rank; rank 0's mesh groups: {sizes}. goodput's {one['own groups']} lazy gloo "
            f"groups of {world:,}: {one['own groups s']:.2f} s, {one['own groups sockets']} "
            f"sockets, {one['own groups MiB']:.0f} MiB. Model, goodput's groups a rank: "
            f"{one['model']}"
        )
    return figures


WORLD_SIZES = (8, 1488, 8192, 127_488)
MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")  # Linux: one argument, or one NAME=VALUE
# One rank's start in a process of its own: its first every_rank_host, timed, and what it keeps.
RANK_AT_START = """
import json, os, sys, time
from goodput.ranks import every_rank_host, launch_hosts
world = int(sys.argv[1])
started = time.perf_counter()
every = every_rank_host(world, os.environ)
took = time.perf_counter() - started
names = launch_hosts(os.environ)
kept = {id(s): sys.getsizeof(s) for s in (*names, *every)}
kept_bytes = sys.getsizeof(every) + sys.getsizeof(names) * 2 + sum(kept.values())
print(json.dumps({"read_expand_ms": took * 1e3, "kept_bytes": kept_bytes,
                  "distinct_strings": len({id(s) for s in every})}))
"""


def _aurora_names(count: int) -> list[str]:
    return [f"x{1000 + i // 64}c{i // 8 % 8}s{i % 8}b0n0" for i in range(count)]


def _exec_with(argument: str) -> str:
    try:
        subprocess.run(["true", argument], check=True)
    except OSError as error:
        return errno.errorcode.get(error.errno or 0, str(error))
    return "ok"


def rank_hosts_at_start(world_sizes: tuple[int, ...] = WORLD_SIZES) -> dict[str, Any]:
    """Every rank's host at start, before and after (the module docstring)."""
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="goodput-bench-control-") as tmp:
        for world in world_sizes:
            names = _aurora_names(math.ceil(world / RANKS_PER_HOST))
            joined = f"GOODPUT_LAUNCH_HOSTS={','.join(names)}"
            pickled = max(len(pickle.dumps(name)) for name in names[-1:])
            path = write_hosts(Path(tmp), names)
            env = {**os.environ, HOSTFILE_VAR: str(path), "LOCAL_WORLD_SIZE": str(RANKS_PER_HOST)}
            rank = subprocess.run(
                [sys.executable, "-c", RANK_AT_START, str(world)],
                env=env, capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            after = json.loads(rank.stdout)
            one = {
                "hosts": len(names),
                "before_longest_argument_bytes": len(joined),
                "before_exec": _exec_with(joined),
                "before_gathered_bytes_per_rank": world * pickled,
                "before_gathered_bytes_in_all": world * world * pickled,
                "after_longest_argument_bytes": len(f"{HOSTFILE_VAR}={path}"),
                "after_exec": _exec_with(f"{HOSTFILE_VAR}={path}"),
                "after_files_opened_per_rank": 1,
                "after_bytes_read_per_rank": path.stat().st_size,
                "after_bytes_read_in_all": world * path.stat().st_size,
                **after,
            }
            figures[f"W={world}"] = one
            print(
                f"rank hosts at start, W = {world:,} ({len(names):,} hosts): before: argument "
                f"{len(joined):,} B (exec {one['before_exec']}), gathered "
                f"{one['before_gathered_bytes_per_rank'] / 1e6:.2f} MB a rank, "
                f"{one['before_gathered_bytes_in_all'] / 1e9:.3g} GB in all; after: argument "
                f"{one['after_longest_argument_bytes']} B (exec {one['after_exec']}), 1 file of "
                f"{one['after_bytes_read_per_rank']:,} B a rank "
                f"({one['after_bytes_read_in_all'] / 1e9:.3g} GB in all), read and expanded in "
                f"{after['read_expand_ms']:.1f} ms, {after['kept_bytes'] / 1e6:.2f} MB kept, "
                f"{after['distinct_strings']:,} strings"
            )
    return figures


REPORT_BOUND_S = 10.0  # the bound on each of goodput report's three forms at full size
REPORT_BOUND_MIB = 2048.0


def report_at_scale(shape: ScaleRun | None = None) -> dict[str, Any]:
    """``goodput report`` three ways on the run of ``shape`` (default: the issue's, the module
    docstring)."""
    shape = shape or ScaleRun()
    figures: dict[str, Any] = {"hosts": shape.hosts, "ranks": shape.ranks, "steps": shape.steps,
                               "windows": shape.steps // shape.window}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="goodput-bench-report-") as tmp:
        run_dir = Path(tmp) / "run"
        write_scale_run(run_dir, shape)
        sizes = {path.name: path.stat().st_size for path in run_dir.iterdir() if path.is_file()}
        figures["file_mib"] = {name: size / 2**20 for name, size in sorted(sizes.items())}
        forms = {"text": (), "json": ("--json",), "html": ("--html", Path(tmp) / "report.html")}
        for form, options in forms.items():
            one = measure_goodput("report", run_dir, *options)
            if one.returncode != 0:
                raise RuntimeError(f"goodput report {form}: {one.stderr.strip()[-500:]}")
            within = one.wall_s <= REPORT_BOUND_S and one.peak_rss_mib <= REPORT_BOUND_MIB
            figures[form] = {"wall_s": one.wall_s, "cpu_s": one.cpu_s,
                             "peak_rss_mib": one.peak_rss_mib, "within_bound": within}  # fmt: skip
            print(
                f"report at scale, {shape.hosts:,} hosts x {shape.ranks_per_host} ranks, "
                f"{shape.steps:,} steps, {figures['windows']:,} busy windows: goodput report "
                f"({form}) {one.wall_s:.2f} s wall, {one.cpu_s:.2f} s CPU, peak RSS "
                f"{one.peak_rss_mib:.0f} MiB (bound {REPORT_BOUND_S:g} s, "
                f"{REPORT_BOUND_MIB:,.0f} MiB: {'within' if within else 'PAST IT'})"
            )
    return figures


SECTIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "launcher fan-out": launcher_fanout,
    "step vote": step_vote,
    "groups": groups,
    "rank hosts at start": rank_hosts_at_start,
    "report at scale": report_at_scale,
}


def main() -> dict[str, Any]:
    return {name: section() for name, section in SECTIONS.items()}
