"""Pipeline schedules as the planner prices them: which stages each pipeline rank holds, how
many micro-batches' activations a rank keeps at its peak, and the bubble (the seconds a rank
idles in a step).

Names are the trainer's ``[parallel] pp_schedule`` values (where each places a rank's stages:
``train.config.parallel.SCHEDULE_PLACEMENT``, ``rank_stages``), torch's
``torch.distributed.pipelining`` schedules: ``gpipe`` (ScheduleGPipe), ``1f1b``
(Schedule1F1B), ``interleaved_1f1b`` (ScheduleInterleaved1F1B), ``interleaved_zb``
(ScheduleInterleavedZeroBubble, the ZB1P schedule), ``zbv`` (ScheduleZBVZeroBubble) and
``dualpipev`` (ScheduleDualPipeV).

Notation: p pipeline ranks, v stages per rank, m micro-batches per step and pipeline; F, B
and W a rank's forward, backward for the inputs and backward for the weights over one step
(all its stages, all m micro-batches). The planner takes F = B = W = a third of the step's
compute (forward 2N, backward 4N FLOPs a token, half of it for the weights), the recompute of
activation checkpointing added to B (it runs just before the input gradients).

Bubble, from each schedule's paper (the idle time of a rank in one step):
- gpipe, 1f1b: (p - 1) (F + B + W) / m (Huang et al. 2019, "GPipe"; Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section
  2.2.1).
- interleaved_1f1b: (p - 1) (F + B + W) / (v m) (Narayanan et al. 2021, section 2.2.2).
- interleaved_zb: (p - 1) (F + B - W) / (v m): ZB-H1's bubble (Qi et al. 2023, "Zero Bubble
  Pipeline Parallelism", arXiv:2401.10241, section 2.1: a third of 1F1B's when F = B = W;
  DeepSeek-V3's Table 2 writes it (PP - 1)(F + B - 2W) with B the whole backward), divided by
  the stages per rank as interleaving divides 1F1B's.
- zbv: (p - 1) max(0, F + B - 2W) / (2 m): ZB-V (Qi et al. 2023, section 6) with each of a
  rank's two chunks taking half its times; zero when F = B = W (torch's docstring says the
  same), the recompute's share of B otherwise.
- dualpipev: (p - 1) max(0, F + 2B - W) / (2 m): DualPipe's (PP/2 - 1)(F&B + B - 3W)
  (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Table 2) over PP = 2p stages of half a
  rank's times each, the overlapped forward-and-backward chunk F&B taking F + B + W: torch runs
  its two halves one after the other (its OVERLAP_F_B action without a custom function), so
  the all-to-all overlap that is DualPipe's point in DeepSeek's system is not priced.

Activations in flight at a rank's peak, in micro-batches of the whole rank's layers:
- gpipe: m (every forward runs before the first backward);
- 1f1b: p - r on rank r (Narayanan et al. 2021), at most m;
- interleaved_1f1b and interleaved_zb: torch's warm-up count of chunks (``_get_warmup_ops``:
  (v - 1) x micro-batches per round + f (p - 1 - r), f = 2 for interleaved 1F1B and 1 for
  ZB1P) plus the one computing, over v: p + (p - 1) / v on rank 0 for interleaved 1F1B
  (Narayanan et al.'s 1 + (p - 1) / (p v) of 1F1B's), p for ZB1P (Qi et al.: 1F1B's memory);
- zbv: p on every rank (Qi et al., section 6: ZB-V's peak is 1F1B's, balanced over ranks);
- dualpipev: p + 1/2 on every rank (DeepSeek-V3's Table 2: PP + 1 chunks' activations).

Stages: ``v`` stages per rank; looped (stage s on rank s mod p) but for the V schedules, whose
rank r holds stages r and 2p - 1 - r (so rank 0 holds the first and the last).
"""

from __future__ import annotations

from goodput.train.config.parallel import SCHEDULE_PLACEMENT

# The schedules the planner weighs on a pipeline: gpipe is left out, its bubble being 1F1B's
# with every micro-batch in flight.
PLANNED = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
PLANNED_STAGES_PER_RANK = 2  # for the interleaved ones, as Llama 3's 405B run (Dubey et al.)


def in_flight(schedule: str, pp: int, stages_per_rank: int, micro: int, rank: int) -> float:
    """Micro-batches of the whole rank's activations ``rank`` keeps at its peak."""
    if schedule == "gpipe":
        return micro
    if schedule == "1f1b":
        return min(pp - rank, micro)
    if SCHEDULE_PLACEMENT[schedule] == "looped":
        v = stages_per_rank
        rounds = max(1, micro // pp)
        factor = 2 if schedule == "interleaved_1f1b" else 1
        warmup = min((v - 1) * (micro // rounds) + factor * (pp - 1 - rank), micro * v)
        return min(warmup + 1, micro * v) / v
    if schedule == "zbv":
        return min(pp, micro)
    assert schedule == "dualpipev", schedule
    return min(pp + 0.5, micro)


def bubble(
    schedule: str,
    pp: int,
    stages_per_rank: int,
    micro: int,
    *,
    forward: float,
    backward_input: float,
    backward_weight: float,
) -> float:
    """Seconds a rank idles in a step of ``micro`` micro-batches whose forward, input and
    weight backward take the given seconds over the step (the module docstring)."""
    f, b, w = forward, backward_input, backward_weight
    steps = (pp - 1) / micro
    if schedule in ("gpipe", "1f1b"):
        return steps * (f + b + w)
    if schedule == "interleaved_1f1b":
        return steps * (f + b + w) / stages_per_rank
    if schedule == "interleaved_zb":
        return steps * max(0.0, f + b - w) / stages_per_rank
    if schedule == "zbv":
        return steps * max(0.0, f + b - 2 * w) / 2
    assert schedule == "dualpipev", schedule
    return steps * max(0.0, f + 2 * b - w) / 2
