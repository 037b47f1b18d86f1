"""The training loop's evaluation: the blend's held-out samples per corpus and multiple-choice
tasks, scored through the training step's own loss in whatever layout the run trains in.

Owns ``LoopEval`` (built once at start: the rows to score; ``evaluate`` every
``[eval] interval_steps``) and ``score_rows`` (rows -> each row's summed token loss, on every
rank).

Rows. Everything scored is a row of ``seq_len + 1`` tokens, as a training sample is, with labels
masked (``IGNORE_INDEX``) where nothing is scored: a held-out sample scores every position; a
multiple-choice request (``harness.choice_requests``, with ``max_len = seq_len``) is right-padded
and scores its continuation only, so its summed loss is minus its log-likelihood and the metrics
are ``harness.summarize``'s. Rows go through in batches shaped exactly as the step's global
batch (the pipeline's schedule fixed its shapes at the first step; the last batch is padded with
rows that score nothing): data-parallel rank ``r`` takes rows ``[r·L, (r+1)·L)`` of each, cut
into micro-batches as the step cuts them (``step.micro_batches_of``: under context
parallelism each rank its chunks of every row). Each rank's per-row sums are completed over the
context-parallel group (each holds part of every row), then gathered over the data-parallel
group, so every rank ends with every row's sum; tensor-parallel ranks compute the same sums
from vocabulary shards (``loss.row_loss_sums``) and pipeline stages get them from the last
(``Pipeline.row_loss_sums``). No gradient is taken, no optimizer or RNG state moves: a run with
evals trains exactly as one without.

Results. Per corpus: the held-out loss (token-weighted mean) and perplexity; overall: the same
over every corpus's tokens; per task: ``ChoiceScores``. ``records`` turns them into
``evals.jsonl`` lines, ``metrics`` into the step record's keys (``heldout_loss``,
``heldout_loss/<corpus>``, ``acc/<task>``...).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from goodput.beacon import current
from goodput.data.loader import BlendedSamples
from goodput.errors import GoodputError
from goodput.eval.choice_tasks import ChoiceItem, read_choice_task
from goodput.eval.config import EvalConfig
from goodput.eval.harness import ChoiceScores, choice_requests, summarize
from goodput.eval.records import EvalRecord
from goodput.train.config.run import BatchPlan
from goodput.train.convert.hf_tokenizer import blend_tokenizer
from goodput.train.loss import IGNORE_INDEX, row_loss_sums
from goodput.train.parallel.mesh import ParallelMesh
from goodput.train.parallel.pipeline import Pipeline, model_parts
from goodput.train.parallel.ring_attention import ContextLayout
from goodput.train.step import micro_batches_of

HELDOUT = "heldout"  # evals.jsonl's task name prefix: heldout/<corpus>


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows to score: ``input_ids`` and ``labels`` ``[n, seq_len]`` (int64, on the CPU)."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True, slots=True)
class ChoiceTask:
    name: str
    items: list[ChoiceItem]
    rows: Rows  # one per (item, choice), item by item


@dataclass(frozen=True, slots=True)
class EvalResult:
    heldout: dict[str, tuple[float, int]]  # corpus -> (summed loss, tokens)
    tasks: dict[str, ChoiceScores]

    def heldout_loss(self, corpus: str | None = None) -> float:
        """One corpus's held-out loss, or (None) all corpora's together, token-weighted."""
        chosen = [self.heldout[corpus]] if corpus is not None else self.heldout.values()
        loss_sum = sum(loss for loss, _ in chosen)
        tokens = sum(count for _, count in chosen)
        return loss_sum / tokens if tokens else math.nan

    def records(self) -> list[EvalRecord]:
        lines = []
        for corpus in self.heldout:
            loss = self.heldout_loss(corpus)
            lines.append(EvalRecord(f"{HELDOUT}/{corpus}", "loss", loss))
            lines.append(EvalRecord(f"{HELDOUT}/{corpus}", "perplexity", _perplexity(loss)))
        for name, scores in self.tasks.items():
            lines.append(EvalRecord(name, "acc", scores.acc, scores.acc_stderr))
            lines.append(EvalRecord(name, "acc_norm", scores.acc_norm, scores.acc_norm_stderr))
            lines.append(EvalRecord(name, "chance", scores.chance))
        return lines

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        if self.heldout:
            values["heldout_loss"] = self.heldout_loss()
            values["heldout_ppl"] = _perplexity(values["heldout_loss"])
            for corpus in self.heldout:
                values[f"heldout_loss/{corpus}"] = self.heldout_loss(corpus)
        for name, scores in self.tasks.items():
            values[f"acc/{name}"] = scores.acc
            values[f"acc_norm/{name}"] = scores.acc_norm
        return values

    def describe(self, step: int) -> str:
        parts = []
        if self.heldout:
            per_corpus = ", ".join(f"{c} {self.heldout_loss(c):.4f}" for c in self.heldout)
            parts.append(f"held-out loss {self.heldout_loss():.4f} ({per_corpus})")
        for name, scores in self.tasks.items():
            parts.append(
                f"{name} acc {scores.acc:.3f} ± {scores.acc_stderr:.3f} "
                f"(acc_norm {scores.acc_norm:.3f}, chance {scores.chance:.3f})"
            )
        return f"eval: step {step}: " + "; ".join(parts)


class LoopEval:
    """What the loop evaluates (see the module docstring), read and tokenized once at start."""

    def __init__(
        self,
        cfg: EvalConfig,
        samples: BlendedSamples,
        *,
        seq_len: int,
        vocab_size: int,
    ):
        self.interval = cfg.interval_steps
        self.corpora = samples.corpus_names if cfg.holdout_samples else []
        self.heldout_rows = _heldout_rows(samples) if cfg.holdout_samples else None
        self.tasks = _choice_tasks(cfg, samples, seq_len, vocab_size)

    def describe(self) -> str:
        if not self.interval:
            return "train: eval: none ([eval] interval_steps = 0)"
        held = (
            f"{len(self.heldout_rows):,} held-out samples of {len(self.corpora)} corpus(es)"
            if self.heldout_rows is not None
            else "no held-out samples"
        )
        tasks = "".join(f", {t.name} ({len(t.items)} items)" for t in self.tasks)
        return f"train: eval every {self.interval} steps: {held}{tasks}"

    def evaluate(
        self,
        model: nn.Module | Pipeline,
        *,
        mesh: ParallelMesh,
        plan: BatchPlan,
        context: ContextLayout | None,
        positions_t: torch.Tensor | None,
        device: torch.device,
    ) -> EvalResult:
        """Every rank: score the held-out samples and the tasks with ``model`` as it is now."""

        def score(rows: Rows) -> torch.Tensor:
            return score_rows(
                model, rows, mesh=mesh, plan=plan, context=context,
                positions_t=positions_t, device=device,
            )  # fmt: skip

        heldout: dict[str, tuple[float, int]] = {}
        if self.heldout_rows is not None:
            sums = score(self.heldout_rows).double()
            per_corpus = len(self.heldout_rows) // len(self.corpora)
            tokens = int(self.heldout_rows.labels.shape[1]) * per_corpus
            for c, corpus in enumerate(self.corpora):
                heldout[corpus] = (float(sums[c * per_corpus : (c + 1) * per_corpus].sum()), tokens)
        tasks = {}
        for task in self.tasks:
            loglikelihoods = (-score(task.rows).double()).tolist()
            per_item, offset = [], 0
            for item in task.items:
                per_item.append(loglikelihoods[offset : offset + len(item.choices)])
                offset += len(item.choices)
            tasks[task.name] = summarize(task.items, per_item)
        return EvalResult(heldout, tasks)


def score_rows(
    model: nn.Module | Pipeline,
    rows: Rows,
    *,
    mesh: ParallelMesh,
    plan: BatchPlan,
    context: ContextLayout | None,
    positions_t: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Each row's summed token loss (``[n]`` fp32, on the CPU), the same on every rank (see the
    module docstring)."""
    global_rows, local_rows = plan.global_batch_size, plan.local_batch_size
    first = mesh.dp_rank * local_rows
    dp_group = mesh.dp_mesh.get_group() if mesh.dp_size > 1 else None
    cp_group = mesh.cp_group if mesh.degrees.cp > 1 else None
    parts = model_parts(model)
    was_training = [part.training for part in parts]
    for part in parts:
        part.eval()
    sums = []
    try:
        for start in range(0, len(rows), global_rows):
            input_ids, labels = (
                _padded(t[start : start + global_rows], global_rows)[first : first + local_rows]
                for t in (rows.input_ids, rows.labels)
            )
            labels[input_ids < 0] = IGNORE_INDEX
            input_ids = input_ids.clamp(min=0)
            micro = micro_batches_of((input_ids, labels), context, mesh.cp_rank, plan, device)
            mine = _local_row_sums(model, micro, positions_t)
            if cp_group is not None:
                with current().collective("eval.sums"):
                    dist.all_reduce(mine, group=cp_group)
            if dp_group is not None:
                everyone = torch.empty(global_rows, dtype=mine.dtype, device=mine.device)
                with current().collective("eval.sums"):
                    dist.all_gather_into_tensor(everyone, mine, group=dp_group)
                mine = everyone
            sums.append(mine.cpu())
    finally:
        for part, training in zip(parts, was_training, strict=True):
            part.train(training)
    return torch.cat(sums)[: len(rows)]


def _local_row_sums(
    model: nn.Module | Pipeline,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    positions_t: torch.Tensor | None,
) -> torch.Tensor:
    if isinstance(model, Pipeline):
        input_ids = torch.cat([ids for ids, _ in micro_batches])
        labels = torch.cat([labels for _, labels in micro_batches])
        return model.row_loss_sums(input_ids, labels).float()
    sums = []
    with torch.no_grad():
        for ids, labels in micro_batches:
            logits = model(ids, positions_t)
            vocab_sharded = isinstance(logits, DTensor)  # the step's loss_parallel, as there
            with loss_parallel() if vocab_sharded else contextlib.nullcontext():
                sums.append(row_loss_sums(logits, labels))
    return torch.cat(sums).float()


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` with rows of -1 (nothing to score) appended up to ``count``."""
    pad = torch.full((count - len(rows), rows.shape[1]), -1, dtype=rows.dtype)
    return torch.cat([rows, pad]).clone()


def _heldout_rows(samples: BlendedSamples) -> Rows:
    """Every corpus's held-out samples, corpus by corpus, as rows."""
    tokens = np.stack(
        [
            samples.heldout(c, k)
            for c in range(len(samples.corpus_names))
            for k in range(len(samples.heldout_numbers[c]))
        ]
    )
    as_tensor = torch.from_numpy(tokens)
    return Rows(as_tensor[:, :-1].contiguous(), as_tensor[:, 1:].contiguous())


def _choice_tasks(
    cfg: EvalConfig, samples: BlendedSamples, seq_len: int, vocab_size: int
) -> list[ChoiceTask]:
    specs = cfg.task_specs()
    if not specs:
        return []
    blend_file = samples.directory / "blend.json"
    tokenizer = blend_tokenizer(
        blend_file,
        samples.manifest,
        "multiple-choice tasks need the tokenizer of the data: tokenize the corpora with "
        "`goodput data tokenize`, or drop [eval] tasks",
    )
    if isinstance(tokenizer, GoodputError):
        raise tokenizer
    tasks = []
    for spec in specs:
        items = read_choice_task(Path(spec.path), spec.layout, cfg.task_items)
        requests = choice_requests(tokenizer, items, range(len(items)), seq_len, vocab_size)
        input_ids = torch.full((len(requests), seq_len), tokenizer.eod_id, dtype=torch.long)
        labels = torch.full((len(requests), seq_len), IGNORE_INDEX, dtype=torch.long)
        for row, request in enumerate(requests):
            ids, count = request.ids, request.num_continuation
            input_ids[row, : len(ids) - 1] = torch.tensor(ids[:-1])
            # Position j predicts token j + 1: the last ``count`` ids are scored.
            labels[row, len(ids) - count - 1 : len(ids) - 1] = torch.tensor(ids[-count:])
        tasks.append(ChoiceTask(spec.name, items, Rows(input_ids, labels)))
    return tasks


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
