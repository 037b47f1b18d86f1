"""The global batch against a layout, and the critical batch size it should stay under.

A layout's data-parallel ranks (dp_replicate x dp_shard) each take micro-batches of the global
batch, so global samples (global tokens / seq_len) must divide by micro_batch x dp: data
parallelism runs out before memory does (``train.config.plan_batches`` refuses the rest).

The critical batch is Kaplan et al. 2020, "Scaling Laws for Neural Language Models"
(arXiv:2001.08361): the loss a model of N non-embedding parameters reaches,
L(N) = (N_c / N)^alpha_N with N_c = 8.8e13 and alpha_N = 0.076 (their eq. 1.1/1.5, in nats),
and the critical batch at that loss, B_crit(L) = B* / L^(1/alpha_B) with B* = 2e8 tokens and
alpha_B = 0.21 (their eq. 1.4). It is an order-of-magnitude figure, fitted to their tokenizer
and data (WebText2); a measured gradient noise scale of the run itself is the better number.
For a mixture of experts N counts the active parameters, a rougher guess still.
"""

from __future__ import annotations

from goodput.errors import GoodputError
from goodput.plan.layout import Layout
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import ParallelConfig, pipeline_microbatches
from goodput.train.flops import model_size

KAPLAN_N_C = 8.8e13  # non-embedding parameters
KAPLAN_ALPHA_N = 0.076
KAPLAN_B_STAR = 2e8  # tokens
KAPLAN_ALPHA_B = 0.21


def non_embedding_parameters(model: ModelConfig) -> int:
    """Active parameters less the embedding table and an untied output head."""
    size = model_size(model)
    head = 0 if model.tie_embeddings else model.vocab_size * model.dim
    return size.active - size.embedding - head


def critical_batch_tokens(non_embedding: float) -> float:
    """Kaplan et al.'s B_crit(L(N)), in tokens (see the module docstring)."""
    loss = (KAPLAN_N_C / non_embedding) ** KAPLAN_ALPHA_N
    return KAPLAN_B_STAR / loss ** (1 / KAPLAN_ALPHA_B)


def critical_batch_warning(model: ModelConfig, gbs_tokens: int) -> str | None:
    """A warning when the global batch exceeds the critical batch estimate; None below it."""
    n = non_embedding_parameters(model)
    critical = critical_batch_tokens(n)
    if gbs_tokens <= critical:
        return None
    return (
        f"the global batch of {gbs_tokens:,} tokens exceeds the critical batch estimate of "
        f"~{_tokens(critical)} tokens for {n / 1e9:.3g}B non-embedding parameters (Kaplan et "
        "al. 2020, eq. 1.1 and 1.4: an order-of-magnitude figure for their tokenizer and data); "
        "beyond it more data-parallel ranks buy less than linear speedup and cost sample "
        "efficiency; the gradient noise scale measured on the run itself (issue 15) is the "
        "better number"
    )


def batch_problem(
    model: ModelConfig, global_samples: int, micro_batch: int, layout: Layout
) -> str | None:
    """Why the global batch does not split over ``layout``'s data-parallel ranks, or its
    pipeline's micro-batches do not suit the trainer's schedule; None if they do."""
    per_round = micro_batch * layout.dp
    if global_samples % per_round == 0:
        return pipeline_problem(global_samples // layout.dp, micro_batch, layout)
    critical = critical_batch_tokens(non_embedding_parameters(model))
    return (
        f"the global batch of {global_samples} samples does not split into micro-batches of "
        f"{micro_batch} on {layout.dp} data-parallel ranks: data parallelism runs out before "
        f"memory (a larger batch should stay under the critical batch, ~{_tokens(critical)} "
        "tokens)"
    )


def pipeline_problem(local_samples: int, micro_batch: int, layout: Layout) -> str | None:
    """The trainer's refusal of a pipeline's micro-batches for its schedule
    (``pipeline_microbatches``: 1F1B needs at least ``pp`` of them); None without one."""
    if layout.pp == 1:
        return None
    try:
        schedule = ParallelConfig(
            pp=layout.pp,
            pp_schedule=layout.pp_schedule,  # type: ignore[arg-type]  # the trainer's names
            pp_stages_per_rank=layout.pp_stages_per_rank,
        )
        pipeline_microbatches(schedule, local_samples, local_samples // micro_batch)
    except GoodputError as error:
        return f"{error.what}; {error.fix}"
    return None


def _tokens(count: float) -> str:
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,.0f}"
