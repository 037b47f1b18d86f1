"""A whole machine's layout checked on one CPU (``goodput plan layout ... --verify``).

The trainer's own pieces build the layout under torch's fake process group of the whole world
(N x G ranks, collectives that return at once, no devices): ``build_mesh``, then
``build.build_model`` — the model on the meta device, ``parallelize``, pipeline stages — and the
optimizer's parameter groups (``optim.Optimizers``). What each rank holds is then read off its
parameters' local shards, without allocating them:

- parameters: the local shard's elements in the dtype the precision policy left them in;
- gradients: the same (FSDP's sharded gradients have their parameter's shape and dtype);
- optimizer: ``moment_buffers`` tensors shaped like each parameter (``torch.zeros_like``, so in
  the parameter's dtype).

Which ranks. The survey builds the first rank of every pipeline rank (and ``--rank``). Within
one pipeline stage that rank holds the most: FSDP and DTensor split a dimension as
``torch.chunk`` does, the larger pieces first, so coordinate 0 of every other dimension never
holds less than any other coordinate (a test surveys every rank of a small world to hold this
to it). The most any rank holds is compared with the planner's estimate of the most
(``memory.state_bytes_per_device``): within ``AGREEMENT`` they agree.

Then one rank (``--rank R``, default the one with the most state) is built for real on this CPU
as the trainer builds it (``build_model(..., empty=False)``: its shards allocated and
initialised). Reported: its bytes (parameters and buffers, the storages it allocated), the
build's seconds, and its peak memory: the child's peak resident set over the build
(``device.process_peak_bytes``, reset just before it) less its resident set just before.

Each of the two steps runs in a child process (spawn), so that the fake process group never
reaches the caller and the peak is the build's own; a child that dies or runs past its time is
one error line. torch is imported in the children only: ``goodput.plan`` stays torch-free.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from goodput.errors import GoodputError, from_exception
from goodput.plan.memory import GIB
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import ParallelConfig, check_tp_within_hosts, resolve_degrees

if TYPE_CHECKING:
    from torch import nn

    from goodput.train.config.run import RunConfig

AGREEMENT = 0.02  # built and estimated state may differ by this share of the estimate
# Per child. The largest rank tried, 3.2B parameters (the 405B at TP 8 x PP 16, no FSDP), took
# 4 minutes on a loaded 2-core machine.
DEFAULT_TIMEOUT_S = 3600.0
PLACEHOLDER_TRAIN = {"steps": 1, "run_dir": "<not written by --verify>"}
PLACEHOLDER_FILE_LIST = "<not read by --verify>"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankState:
    """What one rank holds for training, in bytes, read off its built (meta) parameters."""

    rank: int
    pp_rank: int
    parameters: int  # elements of the local shards
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Materialized:
    """One rank built for real on this CPU."""

    rank: int
    num_bytes: int  # the storages of its parameters and buffers
    seconds: float  # build_model: meta build, parallelize, allocate, initialise
    peak_rss_bytes: int  # the child's peak resident set above its resident set before


@dataclass(frozen=True, slots=True, kw_only=True)
class Verified:
    world: int
    surveyed: tuple[RankState, ...]  # the first rank of each pipeline rank, and --rank
    estimated_state_bytes: float
    materialized: Materialized

    @property
    def most(self) -> RankState:
        return most_state(self.surveyed)

    @property
    def difference(self) -> float:
        """Built over estimated state, less 1 (0.01: the build holds 1 % more)."""
        return self.most.state_bytes / self.estimated_state_bytes - 1

    @property
    def agrees(self) -> bool:
        return abs(self.difference) <= AGREEMENT

    def to_json(self) -> dict[str, Any]:
        return {
            "state_gib_per_device_built": self.most.state_bytes / GIB,
            "state_gib_per_device_estimated": self.estimated_state_bytes / GIB,
            "rank": self.materialized.rank,
            "materialized_gib": self.materialized.num_bytes / GIB,
            "init_seconds": self.materialized.seconds,
            "peak_rss_gib": self.materialized.peak_rss_bytes / GIB,
        }

    def format_text(self) -> str:
        most, done = self.most, self.materialized
        verdict = "agree" if self.agrees else f"DISAGREE (by more than {AGREEMENT:.0%})"
        return "\n".join(
            [
                f"verified on this CPU under a fake process group of {self.world} ranks:",
                f"  state per device: built {_gib(most.state_bytes)} on rank {most.rank} (the "
                f"most of any rank; {most.parameters:,} parameters: weights "
                f"{_gib(most.parameter_bytes)}, gradients {_gib(most.gradient_bytes)}, "
                f"optimizer {_gib(most.optimizer_bytes)}), estimated "
                f"{_gib(self.estimated_state_bytes)}: {self.difference:+.2%}, {verdict}",
                f"  rank {done.rank} materialised and initialised: {_gib(done.num_bytes)} in "
                f"{done.seconds:.1f} s, peak memory {_gib(done.peak_rss_bytes)} above its start",
            ]
        )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.3g} GiB"


def most_state(states: Sequence[RankState]) -> RankState:
    """The rank holding the most state (the lowest such rank)."""
    return max(states, key=lambda state: (state.state_bytes, -state.rank))


def verify_layout(
    config_path: Path,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    nhosts: int,
    ppn: int,
    seq_len: int,
    micro_batch_size: int,
    global_batch_size: int,
    rank: int | None,
    estimated_state_gib: float,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Verified:
    """Build ``parallel`` for ``model`` on ``nhosts`` x ``ppn`` fake ranks, compare the most
    state a device holds with the planner's ``estimated_state_gib``
    (``memory.state_bytes_per_device``) and materialise ``rank`` (None: the rank with the most
    state). ``global_batch_size`` is in samples."""
    world = nhosts * ppn
    from goodput.train.config.run import plan_batches

    where = f"{config_path} on {nhosts} x {ppn} ranks"
    try:  # what the config and the world size alone refuse, before a child is started
        cfg = run_config(
            config_path,
            model,
            parallel,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
        )
        degrees = resolve_degrees(cfg.parallel, world)
        check_tp_within_hosts(degrees.tp, world, ppn)
        plan_batches(cfg.train, dp_size=degrees.dp)
    except GoodputError as error:
        raise _naming(where, error) from None
    if rank is not None and not 0 <= rank < world:
        raise GoodputError.usage(
            "--rank", f"rank {rank} is not in the world of {world} ranks", f"give 0..{world - 1}"
        )
    per_pipeline_rank = world // degrees.pp
    leads = [pp_rank * per_pipeline_rank for pp_rank in range(degrees.pp)]
    ranks = sorted({*leads, *([rank] if rank is not None else [])})
    surveyed = tuple(run_in_child(survey, (cfg, world, ppn, ranks), where, timeout_s))
    chosen = rank if rank is not None else most_state(surveyed).rank
    materialized = run_in_child(materialize, (cfg, world, ppn, chosen), where, timeout_s)
    return Verified(
        world=world,
        surveyed=surveyed,
        estimated_state_bytes=estimated_state_gib * GIB,
        materialized=materialized,
    )


def run_config(
    config_path: Path,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    seq_len: int,
    micro_batch_size: int,
    global_batch_size: int,
) -> RunConfig:
    """The run config the trainer would build from ``config_path``, with the plan's model,
    layout and batch in it. A config of only ``[model]`` gets placeholders for what a build
    never reads (``train.steps``, ``train.run_dir``, ``data.file_list``); a config's data-mix
    stages are replaced by the placeholder file list, and a decay tied to one is left out."""
    from goodput.config import from_table, read_toml
    from goodput.train.config.run import DEPRECATED_TRAIN_KEYS, RunConfig

    raw = read_toml(config_path)
    for section in ("train", "data"):
        if not isinstance(raw.get(section, {}), dict):
            raise GoodputError.usage(
                config_path, f"'{section}' is not a table", f"write it as [{section}]"
            )
    train = dict(raw.get("train", {}))
    for key in DEPRECATED_TRAIN_KEYS:  # ``parallel`` holds what the planner made of them
        train.pop(key, None)
    placeholders = dict(PLACEHOLDER_TRAIN)
    if "output" in train:  # the deprecated spelling of run_dir
        placeholders.pop("run_dir")
    train = placeholders | train
    train |= {
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "tokens_per_step": global_batch_size * seq_len,
    }
    # What the data is, a file list or stages, a build never reads: the placeholder stands for
    # either (a stage's start_tokens need not divide the plan's batch), and a decay tied to a
    # stage's start goes with the stages.
    data = {key: value for key, value in raw.get("data", {}).items() if key != "stages"}
    data = {"file_list": PLACEHOLDER_FILE_LIST} | data
    schedule = raw.get("schedule", {})
    if isinstance(schedule, dict):
        schedule = {key: value for key, value in schedule.items() if key != "decay_start"}
    # The config's own [parallel] may not suit the plan's seq_len: the plan's layout replaces it.
    raw = raw | {"train": train, "data": data, "schedule": schedule, "parallel": {}}
    cfg = from_table(RunConfig, raw, str(config_path))
    return replace(cfg, model=model, parallel=parallel)


def moment_buffers(group: dict[str, Any]) -> int:
    """Tensors shaped like each parameter of an optimizer's ``group`` that it keeps: two
    (AdamW's and LAMB's moments, SophiaG's momentum and Hessian estimate), but one momentum on
    the matrices of Muon's and Mano's matrix groups (``optim.matrix_groups``). A test holds it
    to each optimizer's real state after a step."""
    return 1 if group.get("matrix") else 2


def fake_store() -> Any:
    """torch's store for the fake process group. It lives in an internal module of torch's
    tests (``torch.testing._internal``): this is the one place that imports it."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        import torch

        raise GoodputError(
            "torch.testing._internal.distributed.fake_pg",
            f"torch {torch.__version__} has no FakeStore there ({exc})",
            "install the torch version pyproject.toml pins, or update goodput.plan.verify",
        ) from None
    return FakeStore()


@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as ``rank`` of a fake process group of ``world`` ranks, for the block."""
    import torch.distributed as dist

    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def survey(cfg: RunConfig, world: int, ranks_per_host: int, ranks: list[int]) -> list[RankState]:
    """In a child: what each of ``ranks`` holds, each built on the meta device."""
    import torch

    from goodput.train.build import build_model
    from goodput.train.config.run import plan_batches
    from goodput.train.parallel.mesh import build_mesh
    from goodput.train.parallel.pipeline import model_parts

    meta = torch.device("meta")
    states = []
    for rank in ranks:
        with fake_world(rank, world):
            mesh = build_mesh(cfg.parallel, torch.device("cpu"), ranks_per_host)
            plan = plan_batches(cfg.train, dp_size=mesh.dp_size)
            parts = model_parts(build_model(cfg, meta, mesh, plan, empty=True))
            states.append(rank_state(parts, cfg, rank, mesh.pp_rank))
    return states


def rank_state(parts: list[nn.Module], cfg: RunConfig, rank: int, pp_rank: int) -> RankState:
    """The state of a rank holding ``parts``, by its optimizer's parameter groups."""
    from goodput.train.dtensors import local_tensor
    from goodput.train.optim.optimizers import Optimizers

    elements = weights = moments = 0
    for group in Optimizers(parts, cfg.optim, cfg.schedule.lr).param_groups:
        for parameter in group["params"]:
            local = local_tensor(parameter)
            elements += local.numel()
            weights += local.numel() * local.element_size()
            moments += moment_buffers(group) * local.numel() * local.element_size()
    return RankState(
        rank=rank,
        pp_rank=pp_rank,
        parameters=elements,
        parameter_bytes=weights,
        gradient_bytes=weights,
        optimizer_bytes=moments,
    )


def materialize(cfg: RunConfig, world: int, ranks_per_host: int, rank: int) -> Materialized:
    """In a child: build ``rank`` as the trainer does, on this CPU, and measure it."""
    import torch

    from goodput.train.build import build_model
    from goodput.train.config.run import plan_batches
    from goodput.train.device import process_peak_bytes, reset_process_peak
    from goodput.train.parallel.mesh import build_mesh
    from goodput.train.parallel.pipeline import model_parts

    cpu = torch.device("cpu")
    with fake_world(rank, world):
        mesh = build_mesh(cfg.parallel, cpu, ranks_per_host)
        plan = plan_batches(cfg.train, dp_size=mesh.dp_size)
        reset_process_peak()  # the peak is now the resident set: what the build adds shows
        before = process_peak_bytes()
        start = time.perf_counter()
        parts = model_parts(build_model(cfg, cpu, mesh, plan, empty=False))
        seconds = time.perf_counter() - start
        peak = process_peak_bytes() - before
        return Materialized(
            rank=rank, num_bytes=allocated_bytes(parts), seconds=seconds, peak_rss_bytes=peak
        )


def allocated_bytes(parts: list[nn.Module]) -> int:
    """Bytes of the distinct storages under ``parts``' parameters and buffers (FSDP's padded
    shards whole, a tied weight once)."""
    from goodput.train.dtensors import local_tensor

    storages = {}
    for part in parts:
        for tensor in [*part.parameters(), *part.buffers()]:
            storage = local_tensor(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_in_child(
    target: Callable[..., Any], args: tuple[Any, ...], where: str, timeout_s: float
) -> Any:
    """``target(*args)`` in a spawned child: its result, its GoodputError raised here, or one
    error line when it dies or runs past ``timeout_s``."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, target, args), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise GoodputError(
                where,
                f"the --verify child ({getattr(target, '__name__', target)}) ran past "
                f"{timeout_s:g} s",
                "verify a smaller layout, or give it more time",
            )
        try:
            failed, value = receive.recv()
        except EOFError:
            child.join()
            what = f"the --verify child {_death(child.exitcode)}"
            raise GoodputError(where, what, _DIED_FIX) from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    if failed:
        raise _naming(where, value)
    return value


def _naming(where: str, error: GoodputError) -> GoodputError:
    """``error`` with ``where`` (the config and the world) in front of its own ``where``,
    unless that names the config already (the config loader's errors do)."""
    config = where.partition(" on ")[0]
    if error.where.startswith(config):
        return error
    return GoodputError(f"{where}: {error.where}", error.what, error.fix, code=error.code)


_DIED_FIX = "check this machine's free memory (one rank's shard must fit), or pass --rank R"


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory?)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {exitcode} without a result"


def _child(send: Any, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        result: tuple[bool, Any] = (False, target(*args))
    except BaseException as exc:  # everything reaches the parent as one line
        result = (True, from_exception(exc))
    send.send(result)
    send.close()
