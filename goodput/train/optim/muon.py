"""Muon: orthogonalised momentum for the hidden matrices, AdamW for every other parameter, with
the Newton–Schulz work split over the ranks that hold the same matrices.

Groups: each parameter group says ``"matrix": True`` (the Muon rule) or ``False``
(``adamw_rule``). A matrix group may say ``"transposed": True``: its tensors are stacks of
matrices stored [..., in, out] (grouped MoE experts) rather than ``nn.Linear``'s [out, in]; any
tensor of 3 or more dims is a stack of independent matrices over its leading dims.

Rule per matrix (Jordan et al. 2024; Moonlight's scaling): B ← μB + g; U = g + μB with Nesterov,
else B; O = NS(U), five quintic Newton–Schulz iterations in bfloat16; θ ← θ(1 − lr·wd);
θ ← θ − lr·s·O with s = 0.2·√max(out, in) ("match_rms_adamw": update RMS ≈ AdamW's, so its lr
and decay carry over) or √max(1, out/in) ("spectral": lr in spectral-norm units).

Distribution. Newton–Schulz needs whole matrices and costs O(m²n) each, so no rank runs it for
every matrix: the matrices that the same ranks hold are numbered in parameter order (a stack
counts one per matrix) and matrix j is computed by rank j mod (number of those ranks); the
results are summed in a zero-filled bfloat16 buffer (one owner per element, so the sum is exact).
Per step and per set of ranks that means:

- plain tensors replicated over ``replica_group`` (DDP, a pipeline stage's data-parallel
  replicas): no gather; all-reduce of the updates, the size of the matrices, in bf16.
- DTensors whose shards cut the matrices (FSDP2 ``Shard(0)``, tensor parallel ``Shard(0/1)``,
  HSDP's ``Replicate`` × ``Shard``, any mesh): each matrix's U is gathered whole
  (``full_tensor``), then all-reduce of the updates over each dim of the mesh, and every rank
  keeps its own shard (a ``redistribute``, which follows FSDP's uneven shards). The exchange goes
  in rounds of at least one matrix per rank and ``ROUND_MIN_ELEMENTS`` elements, so a round of
  small matrices is one collective while a sharded model is never held whole at once.
- DTensors sharded only over a stack dim (expert parallelism, FSDP over experts): every rank
  holds whole matrices already and orthogonalises its own; no communication.

A matrix gets the same computation on whatever number of ranks, so results are bit-identical to
one process and resume is bit-exact. ``distribute=False`` makes every rank orthogonalise every
matrix itself (the baseline; the same numbers). State: ``momentum_buffer`` (like the parameter,
a DTensor where it is one) and a CPU ``step``; the AdamW parameters keep ``adamw_rule``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from goodput.beacon import current
from goodput.train.dtensors import aligned_grad, local_tensor
from goodput.train.optim.adamw_rule import MatrixOptimizer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
LR_RULES = ("match_rms_adamw", "spectral")
ROUND_MIN_ELEMENTS = 1 << 24  # 32 MiB of bf16 updates: enough to amortise a collective's latency


def newton_schulz(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton–Schulz approximation of ``matrix``'s polar factor (singular values
    land in about [0.5, 1.5], by design), in bfloat16, for one 2-D matrix."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the small Gram matrix
        x = x.T
    x = x / (x.norm() + NS_EPS)  # Frobenius ≥ spectral norm: every singular value ≤ 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def update_scale(shape: torch.Size, transposed: bool, lr_rule: str) -> float:
    """The factor on lr for a matrix of the last two dims of ``shape``."""
    rows, cols = shape[-2], shape[-1]
    fan_out, fan_in = (cols, rows) if transposed else (rows, cols)
    if lr_rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return math.sqrt(max(1.0, fan_out / fan_in))


@dataclass(frozen=True)
class _Ranks:
    """The ranks that split one set of matrices: how many, this one's index among them, and the
    groups whose all-reduces, one after another, sum over all of them."""

    size: int
    index: int
    groups: tuple[dist.ProcessGroup, ...]


_ALONE = _Ranks(1, 0, ())


@dataclass
class _Matrices:
    """One parameter's pending update: its (possibly sharded) U and how to apply the result."""

    param: torch.Tensor
    update: torch.Tensor
    lr: float
    weight_decay: float
    scale: float
    ns_steps: int
    gather: bool  # U is sharded across matrix dims: gather it whole, keep this rank's shard
    ranks: _Ranks

    @property
    def num_matrices(self) -> int:
        return math.prod(self.param.shape[:-2])

    def whole_update(self) -> torch.Tensor:
        if self.gather:
            assert isinstance(self.update, DTensor)
            return self.update.full_tensor()
        return local_tensor(self.update)

    def apply(self, orthogonal: torch.Tensor) -> None:
        """θ ← θ(1 − lr·wd) − lr·s·O, given O whole (gathered) or as this rank's part."""
        if self.gather:
            assert isinstance(self.param, DTensor)
            mesh, placements = self.param.device_mesh, self.param.placements
            replicated = DTensor.from_local(
                orthogonal.reshape(self.param.shape),
                mesh,
                [Replicate()] * mesh.ndim,
                run_check=False,
            )
            orthogonal = replicated.redistribute(mesh, placements).to_local()
        param = local_tensor(self.param)
        param.mul_(1 - self.lr * self.weight_decay)
        param.add_(orthogonal.reshape(param.shape), alpha=-self.lr * self.scale)


def _splits_matrix_dims(param: DTensor) -> bool:
    matrix_dims = (param.ndim - 2, param.ndim - 1)
    return any(getattr(p, "dim", None) in matrix_dims for p in param.placements)


def _mesh_ranks(param: DTensor) -> _Ranks:
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank holds a parameter of a mesh it is not in"
    index = 0
    for position, size in zip(coordinate, mesh.shape, strict=True):
        index = index * size + position
    groups = tuple(mesh.get_group(dim) for dim in range(mesh.ndim))
    return _Ranks(mesh.size(), index, groups)


class Muon(MatrixOptimizer):
    """Muon on the ``"matrix": True`` groups, AdamW on the others (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[dict],
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = False,
        ns_steps: int = 5,
        lr_rule: str = "match_rms_adamw",
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        replica_group: dist.ProcessGroup | None = None,
        distribute: bool = True,
    ) -> None:
        if lr_rule not in LR_RULES:
            raise ValueError(f"Muon lr_rule {lr_rule!r}: expected one of {', '.join(LR_RULES)}")
        self.replica_group = replica_group
        self.distribute = distribute
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "lr_rule": lr_rule,
            "weight_decay": weight_decay,
            "betas": betas,
            "eps": eps,
            "transposed": False,
        }
        super().__init__(list(params), defaults)

    def matrix_steps(self, matrices: Iterable[tuple[torch.Tensor, dict]]) -> None:
        pending = [self._momentum_step(param, group) for param, group in matrices]
        # Grouped by the ranks that split them, in parameter order (the same on every rank, so
        # the collectives line up).
        by_ranks: dict[_Ranks, list[_Matrices]] = {}
        for stepped in pending:
            by_ranks.setdefault(stepped.ranks, []).append(stepped)
        for same_ranks in by_ranks.values():
            _orthogonalise_and_apply(same_ranks)

    def _momentum_step(self, param: torch.Tensor, group: dict) -> _Matrices:
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        grad = aligned_grad(param)
        local_tensor(state["momentum_buffer"]).mul_(group["momentum"]).add_(local_tensor(grad))
        # U as a tensor of the parameter's layout (a DTensor where it is one), to gather whole.
        update = state["momentum_buffer"]
        if group["nesterov"]:
            update = grad + group["momentum"] * update
        gather = isinstance(param, DTensor) and _splits_matrix_dims(param)
        return _Matrices(
            param=param,
            update=update,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            scale=update_scale(param.shape, group["transposed"], group["lr_rule"]),
            ns_steps=group["ns_steps"],
            gather=gather,
            ranks=self._ranks_splitting(param, gather),
        )

    def _ranks_splitting(self, param: torch.Tensor, gather: bool) -> _Ranks:
        """The ranks that hold the same matrices as this one and so split their work."""
        if not self.distribute:
            return _ALONE
        if gather:
            assert isinstance(param, DTensor)
            return _mesh_ranks(param)
        if isinstance(param, DTensor) or self.replica_group is None:
            return _ALONE  # whole matrices of this rank's own (split experts), or no replicas
        group = self.replica_group
        return _Ranks(dist.get_world_size(group), dist.get_rank(group), (group,))


def _orthogonalise_and_apply(matrices: list[_Matrices]) -> None:
    """Newton–Schulz for the matrices that one set of ranks splits, round by round."""
    ranks = matrices[0].ranks
    if ranks.size == 1:
        for one in matrices:
            whole = one.whole_update()
            stack = whole.reshape(-1, *whole.shape[-2:])
            one.apply(torch.stack([newton_schulz(m, one.ns_steps) for m in stack]))
        return
    first_matrix = 0
    for round_ in _rounds(matrices, ranks.size):
        _exchange_round(round_, first_matrix, ranks)
        first_matrix += sum(one.num_matrices for one in round_)


def _rounds(matrices: list[_Matrices], num_ranks: int) -> Iterable[list[_Matrices]]:
    """Consecutive runs of at least one matrix per rank and ``ROUND_MIN_ELEMENTS`` elements."""
    round_: list[_Matrices] = []
    num_matrices = num_elements = 0
    for one in matrices:
        round_.append(one)
        num_matrices += one.num_matrices
        num_elements += one.param.numel()
        if num_matrices >= num_ranks and num_elements >= ROUND_MIN_ELEMENTS:
            yield round_
            round_, num_matrices, num_elements = [], 0, 0
    if round_:
        yield round_


def _exchange_round(round_: list[_Matrices], first_matrix: int, ranks: _Ranks) -> None:
    """Matrix ``first_matrix + j`` of the round is rank ``(first_matrix + j) mod size``'s: the
    owners fill their updates into a zeroed buffer, whose sum every rank then reads."""
    wholes = [one.whole_update() for one in round_]
    buffer = torch.zeros(
        sum(w.numel() for w in wholes), dtype=torch.bfloat16, device=wholes[0].device
    )
    views, offset, matrix_index = [], 0, first_matrix
    for one, whole in zip(round_, wholes, strict=True):
        view = buffer[offset : offset + whole.numel()].view(whole.shape)
        offset += whole.numel()
        views.append(view)
        stack_in = whole.reshape(-1, *whole.shape[-2:])
        stack_out = view.view(-1, *whole.shape[-2:])
        for i in range(len(stack_in)):
            if matrix_index % ranks.size == ranks.index:
                stack_out[i] = newton_schulz(stack_in[i], one.ns_steps)
            matrix_index += 1
    with current().collective("optim.reduce"):
        for group in ranks.groups:
            dist.all_reduce(buffer, group=group)
    for one, view in zip(round_, views, strict=True):
        one.apply(view)
