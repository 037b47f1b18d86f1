"""The step-cost model held against published measurements: the rows (``MEASUREMENTS``, each
with its source), the devices' constants (``DEVICES``: ``goodput plan layout --device NAME``)
and the fit that gave them (``fit``), on the rows marked ``fitted`` (at most half); the others
are the check (``tests/unit/plan/test_calibration.py``: every row within ``TOLERANCE`` of its
measurement, and the rows of one machine ranked as measured).

A row is a run as goodput would be told it: a model, a machine (hosts x devices), a layout
(``Layout``: degrees, checkpointing, fp8, compile), the sequence, micro-batch and global batch,
and the tokens/s per device measured. ``estimate`` prices it as ``goodput plan layout
--layout-from-config`` does (``cost.step_cost``): tokens a step / seconds a step / devices.

What the rows ran that goodput's cost model does not know, and so prices as goodput runs it:
torchtitan's per-op checkpointing recomputes every second matmul (``_save_list`` in
torchtitan's ``parallelize_llama.py``), where goodput's "op" keeps them all; Megatron-LM
overlaps its tensor-parallel collectives with the matmuls (``--tp-comm-overlap``), which
goodput's TP does not; AsyncTP (torchtitan's 405B rows); GPT's GELU MLP and LayerNorm (priced
as SwiGLU of the same FLOPs). Interleaved pipeline schedules are left out of the rows.

Does not: measure anything, or fit the bandwidths (datasheet figures, each with its source).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from goodput.plan.cost import Rates, step_cost
from goodput.plan.layout import Layout
from goodput.plan.memory import Workload
from goodput.train.config.model import ModelConfig

TOLERANCE = 0.25  # an estimate within 25% of its measurement
# Matmuls reach a share dim / (dim + GEMM_HALF_DIM) of a device's rate: Megatron-LM's README
# measures 41% MFU at dim 2048 and 47-48% at dims of 16384 and more ("larger GEMMs have higher
# arithmetic intensity"): 41 / 47.5 = 2048 / (2048 + 325). Not fitted (the rows' other
# constants absorb any value along a ridge); without it the 1.7B row is 28% fast.
GEMM_HALF_DIM = 325.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One device's constants for the step cost (``cost.Rates``) and where each comes from."""

    name: str
    memory_gib: float  # the device's memory (its default --gpu-mem-gb)
    peak_tflops: float  # dense bf16, the vendor's datasheet
    tflops: float  # achieved, eager bf16, by large matmuls (fitted where rows measure it)
    intra_gbps: float  # per device and direction, within a host
    inter_gbps: float  # per device and direction, between hosts
    fp8_rowwise: float | None  # the linear layers' speed-up in fp8 (None: no FP8 matmuls)
    fp8_tensorwise: float | None
    compile: float  # the step's speed-up under torch.compile
    source: str
    gemm_half_dim: float = GEMM_HALF_DIM

    def rates(self, ppn: int) -> Rates:
        return Rates(
            flops=self.tflops * 1e12,
            intra_bytes=self.intra_gbps * 1e9,
            inter_bytes=self.inter_gbps * 1e9,
            ppn=ppn,
            fp8_rowwise=self.fp8_rowwise,
            fp8_tensorwise=self.fp8_tensorwise,
            compile=self.compile,
            gemm_half_dim=self.gemm_half_dim,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One published run: what ran, where, and the tokens/s per device it measured."""

    name: str
    source: str  # the file or paper and its table
    machine: str  # the cluster: rows of one machine must rank as measured
    device: str  # a name of DEVICES
    model: ModelConfig
    nhosts: int
    ppn: int
    layout: Layout
    seq_len: int
    micro_batch_size: int
    global_batch: int  # sequences a step
    tokens_per_s: float  # per device, measured
    fitted: bool  # in the half the constants are fitted on

    @property
    def workload(self) -> Workload:
        return Workload(
            seq_len=self.seq_len,
            micro_batch_size=self.micro_batch_size,
            global_batch_samples=self.global_batch,
            precision="fp32-master",  # torchtitan's and Megatron-LM's: bf16 compute, fp32 master
        )


def estimate(row: Measurement, device: Device) -> float:
    """The tokens/s per device the step cost gives ``row`` on ``device``."""
    work = row.workload
    seconds = step_cost(row.model, row.layout, work, device.rates(row.ppn)).total
    return work.global_batch_samples * work.seq_len / seconds / (row.nhosts * row.ppn)


def error(row: Measurement, device: Device) -> float:
    """The estimate's relative error against the measurement (+: the estimate is faster)."""
    return estimate(row, device) / row.tokens_per_s - 1


# --- the models the rows ran ---------------------------------------------------------------

# Llama 3.1 (Meta, "The Llama 3 Herd of Models", 2024, Table 3; configs/llama-*.toml).
LLAMA_8B = ModelConfig(
    vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
LLAMA_70B = ModelConfig(
    vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
LLAMA_405B = ModelConfig(
    vocab_size=128256, dim=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_dim=53248,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip


def gpt(dim: int, heads: int, layers: int) -> ModelConfig:
    """Megatron-LM's benchmark GPT (README: vocabulary 131,072, sequence 4,096; multi-head
    attention, a 4 x dim GELU MLP, tied embeddings): its MLP as a SwiGLU of the same FLOPs
    (3 x ffn = 8 x dim, rounded to a multiple of 8 so that tp 8 divides it)."""
    ffn = 8 * round(8 * dim / 3 / 8)
    return ModelConfig(
        vocab_size=131072, dim=dim, num_layers=layers, num_heads=heads, ffn_dim=ffn,
        max_seq_len=4096, tie_embeddings=True,
    )  # fmt: skip


# --- the devices ---------------------------------------------------------------------------

NVLINK_H100 = "NVLink 4, 900 GB/s a GPU = 450 GB/s a direction (NVIDIA H100 datasheet)"
SHARED = (
    "compile and fp8 speed-ups fitted on torchtitan's H100 rows (Grand Teton) and shared by "
    "every device with FP8 matmuls (compile by every device: no other vendor's rows)"
)
DEVICES: dict[str, Device] = {
    device.name: device
    for device in (
        Device(
            name="h100",
            memory_gib=80.0,
            peak_tflops=989.0,
            tflops=562.9,
            intra_gbps=450.0,
            inter_gbps=50.0,
            fp8_rowwise=1.023,
            fp8_tensorwise=1.434,
            compile=1.153,
            source=f"H100 SXM5 at 700 W: 989 dense bf16 TFLOP/s; {NVLINK_H100}; 400 Gb/s "
            "InfiniBand a GPU; tflops fitted on Megatron-LM's H100 rows; " + SHARED,
        ),
        Device(
            name="h100-500w",
            memory_gib=96.0,
            peak_tflops=989.0,
            tflops=372.5,
            intra_gbps=450.0,
            inter_gbps=50.0,
            fp8_rowwise=1.023,
            fp8_tensorwise=1.434,
            compile=1.153,
            source="H100 96 GB HBM2e at its 500 W limit (Meta's Grand Teton, torchtitan's "
            "benchmarks: a peak 'between SXM and NVL'); " + NVLINK_H100 + "; 400 Gb/s RDMA a "
            "GPU; tflops fitted on torchtitan's rows; " + SHARED,
        ),
        Device(
            name="h200",
            memory_gib=141.0,
            peak_tflops=989.0,
            tflops=477.8,
            intra_gbps=450.0,
            inter_gbps=50.0,
            fp8_rowwise=1.023,
            fp8_tensorwise=1.434,
            compile=1.153,
            source="H200 SXM: 989 dense bf16 TFLOP/s, 141 GB HBM3e (NVIDIA H200 datasheet); "
            + NVLINK_H100
            + "; 400 Gb/s RDMA a GPU (WhiteFiber, torchtitan's H200 rows); "
            "tflops fitted on the 4-host H200 row; " + SHARED,
        ),
        Device(
            name="mi250x",
            memory_gib=64.0,
            peak_tflops=191.5,
            tflops=67.0,
            intra_gbps=50.0,
            inter_gbps=12.5,
            fp8_rowwise=None,
            fp8_tensorwise=None,
            compile=1.153,
            source="one GCD of an MI250X (Frontier's device): 383 dense bf16 TFLOP/s an MI250X "
            "over its 2 GCDs (AMD Instinct MI250X datasheet), no FP8 matmuls; tflops = 35% "
            "of that (Dash et al. 2023, 'Optimizing Distributed Training on Frontier for Large "
            "Language Models': 31.96 to 38.38% of peak from 22B to 1T); Infinity Fabric 50 "
            "GB/s a direction between GCDs (the slowest of its links); 4 x 200 Gb/s Slingshot "
            "a node over 8 GCDs; not fitted: no row measures it; " + SHARED,
        ),
        Device(
            name="max1550",
            memory_gib=64.0,
            peak_tflops=419.0,
            tflops=105.0,
            intra_gbps=100.0,
            inter_gbps=16.7,
            fp8_rowwise=None,
            fp8_tensorwise=None,
            compile=1.153,
            source="one tile of an Intel Data Center GPU Max 1550 (Aurora's device: 12 tiles a "
            "node): 838.9 dense bf16 TFLOP/s a GPU over its 2 tiles (Intel's product "
            "specifications), no FP8 matmuls; tflops = 25%, an assumption below the H100's "
            "fitted MFU; Xe Link ~100 GB/s a direction between tiles; 8 x 200 Gb/s Slingshot "
            "a node over 12 tiles; not fitted: no row measures it; " + SHARED,
        ),
    )
}


# --- the rows ------------------------------------------------------------------------------

TT_2412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TT_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TT_H200 = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
AO_README = "pytorch/ao torchao/float8/README.md, training benchmarks (torchao 0.10)"
MEGATRON = "NVIDIA/Megatron-LM README.md, images/model_table.png (Megatron-Core r0.8.0)"
GRAND_TETON = "Meta Grand Teton, H100 96 GB at 500 W (torchtitan)"
EOS = "NVIDIA H100 SXM cluster (Megatron-LM)"


def _titan(
    name: str,
    source: str,
    model: ModelConfig,
    hosts: int,
    layout: Layout,
    lbs: int,
    tps: float,
    *,
    fitted: bool = False,
    machine: str = GRAND_TETON,
    device: str = "h100-500w",
    ppn: int = 8,
    mbs: int | None = None,
) -> Measurement:
    """A torchtitan row: seq 8192 (its llama3 configs), local batch ``lbs`` on each
    data-parallel rank (one micro-batch unless ``mbs`` says)."""
    return Measurement(
        name=name,
        source=source,
        machine=machine,
        device=device,
        model=model,
        nhosts=hosts,
        ppn=ppn,
        layout=layout,
        seq_len=8192,
        micro_batch_size=mbs or lbs,
        global_batch=lbs * layout.dp,
        tokens_per_s=tps,
        fitted=fitted,
    )


def _megatron(
    size: str,
    dim: int,
    heads: int,
    layers: int,
    tp: int,
    pp: int,
    batch: int,
    tflops: float,
    *,
    fitted: bool = False,
) -> Measurement:
    """A row of Megatron-LM's weak-scaling table: 48 data-parallel ranks (its distributed
    optimizer: replicated weights, gradients reduce-scattered and weights gathered once a step,
    the traffic of goodput's all-reduce over dp_replicate), micro-batch 1 (not stated),
    its per-GPU TFLOP/s turned to tokens/s by its FLOPs a token (the same count as
    ``flops.flops_per_token`` for this shape: 6 N + 12 layers dim seq)."""
    from goodput.train.flops import flops_per_token

    model = gpt(dim, heads, layers)
    layout = Layout(tp=tp, pp=pp, dp_replicate=48)
    world = tp * pp * 48
    return Measurement(
        name=f"Megatron-LM GPT {size} on {world}",
        source=MEGATRON,
        machine=EOS,
        device="h100",
        model=model,
        nhosts=world // 8,
        ppn=8,
        layout=layout,
        seq_len=4096,
        micro_batch_size=1,
        global_batch=batch,
        tokens_per_s=tflops * 1e12 / flops_per_token(model, 4096),
        fitted=fitted,
    )


FSDP8, FSDP128 = Layout(dp_shard=8), Layout(dp_shard=128)
# How the rows' blocks compute, as keyword arguments of ``Layout``.
OP: dict[str, Any] = {"activation_checkpointing": "op"}
FULL: dict[str, Any] = {"activation_checkpointing": "full"}
COMPILED: dict[str, Any] = {"compile": True}
TENSORWISE: dict[str, Any] = {"fp8": "tensorwise", "compile": True}
ROWWISE: dict[str, Any] = {"fp8": "rowwise", "compile": True}
TT_70B = Layout(dp_shard=32, tp=8, **FULL)

MEASUREMENTS: tuple[Measurement, ...] = (
    # torchtitan, Dec 2024, Table 1: 8B, 8 GPUs, local batch 2, selective (op) checkpointing.
    _titan("8B x 8 FSDP", f"{TT_2412} Table 1", LLAMA_8B, 1, replace(FSDP8, **OP), 2, 5762,
           fitted=True),
    _titan("8B x 8 FSDP + compile", f"{TT_2412} Table 1", LLAMA_8B, 1,
           replace(FSDP8, **OP, **COMPILED), 2, 6667, fitted=True),
    _titan("8B x 8 FSDP + compile + fp8", f"{TT_2412} Table 1", LLAMA_8B, 1,
           replace(FSDP8, **OP, **TENSORWISE), 2, 8532, fitted=True),
    # Table 3: the same on 128 GPUs (16 hosts).
    _titan("8B x 128 FSDP", f"{TT_2412} Table 3", LLAMA_8B, 16, replace(FSDP128, **OP), 2, 5605),
    _titan("8B x 128 FSDP + compile", f"{TT_2412} Table 3", LLAMA_8B, 16,
           replace(FSDP128, **OP, **COMPILED), 2, 6514),
    _titan("8B x 128 FSDP + compile + fp8", f"{TT_2412} Table 3", LLAMA_8B, 16,
           replace(FSDP128, **OP, **TENSORWISE), 2, 8380),
    # Table 4: 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full checkpointing, compile, fp8.
    _titan("70B x 256 FSDP 32 x TP 8 + compile + fp8", f"{TT_2412} Table 4 (2D)", LLAMA_70B,
           32, replace(TT_70B, **TENSORWISE), 16, 829),
    # Table 5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 in micro-batches of 4 (8
    # per pipeline: torchtitan's default, one per stage), 1F1B, full checkpointing, compile,
    # fp8 (and AsyncTP, which goodput prices as plain TP).
    _titan("405B x 512 FSDP 8 x TP 8 x PP 8 + compile + fp8", f"{TT_2412} Table 5 (1F1B)",
           LLAMA_405B, 64,
           Layout(dp_shard=8, tp=8, pp=8, pp_layers_per_stage=(15, 16, 16, 16, 16, 16, 16, 15),
                  **FULL, **TENSORWISE),
           32, 100, mbs=4),
    # torchtitan, Jun 2025, async TP benchmarks, vanilla TP column: 70B as Table 4 above.
    _titan("70B x 256 FSDP 32 x TP 8 + compile", f"{TT_ASYNC} (70B, None, vanilla TP)",
           LLAMA_70B, 32, replace(TT_70B, **COMPILED), 16, 597.3),
    _titan("70B x 256 FSDP 32 x TP 8 + compile + fp8 tensorwise",
           f"{TT_ASYNC} (70B, float8 tensorwise, vanilla TP)", LLAMA_70B, 32,
           replace(TT_70B, **TENSORWISE), 16, 809.8),
    _titan("70B x 256 FSDP 32 x TP 8 + compile + fp8 rowwise",
           f"{TT_ASYNC} (70B, float8 rowwise, vanilla TP)", LLAMA_70B, 32,
           replace(TT_70B, **ROWWISE), 16, 599.6),
    # torchao's float8 README: 8B on one host of 8 H100s, local batch 1, op checkpointing,
    # compile, FSDP.
    _titan("8B x 8 FSDP + compile (torchao)", f"{AO_README} (bfloat16)", LLAMA_8B, 1,
           replace(FSDP8, **OP, **COMPILED), 1, 6150, machine="torchao's 8 x H100"),
    _titan("8B x 8 FSDP + compile + fp8 tensorwise (torchao)", f"{AO_README} (tensorwise)",
           LLAMA_8B, 1, replace(FSDP8, **OP, **TENSORWISE), 1, 7689.5,
           machine="torchao's 8 x H100"),
    _titan("8B x 8 FSDP + compile + fp8 rowwise (torchao)", f"{AO_README} (rowwise)",
           LLAMA_8B, 1, replace(FSDP8, **OP, **ROWWISE), 1, 6768, fitted=True,
           machine="torchao's 8 x H100"),
    # Trainy on WhiteFiber, Jun 2025: 8B on 4 and 8 hosts of 8 H200s, local batch 2, op
    # checkpointing, compile, fp8 tensorwise with float8 all-gather.
    _titan("8B x 32 H200 FSDP + compile + fp8", TT_H200, LLAMA_8B, 4,
           replace(Layout(dp_shard=32), **OP, **TENSORWISE), 2, 10938, fitted=True,
           machine="WhiteFiber H200", device="h200"),
    _titan("8B x 64 H200 FSDP + compile + fp8", TT_H200, LLAMA_8B, 8,
           replace(Layout(dp_shard=64), **OP, **TENSORWISE), 2, 10753,
           machine="WhiteFiber H200", device="h200"),
    # Megatron-LM's weak scaling on H100 (48 data-parallel ranks each).
    _megatron("1.7B", 2048, 16, 24, 1, 1, 192, 408.8, fitted=True),
    _megatron("7.1B", 4096, 32, 30, 2, 1, 192, 465.9),
    _megatron("16B", 6144, 48, 32, 4, 1, 192, 489.1, fitted=True),
    _megatron("32B", 7168, 56, 48, 8, 1, 192, 459.6),
    _megatron("70B", 8192, 64, 84, 8, 2, 384, 419.7, fitted=True),
    _megatron("119B", 10240, 80, 92, 8, 4, 768, 420.5),
    _megatron("177B", 12288, 96, 96, 8, 6, 1152, 432.8),
    _megatron("314B", 16384, 128, 96, 8, 8, 1536, 474.4, fitted=True),
    _megatron("462B", 18432, 144, 112, 8, 16, 3072, 459.9),
)  # fmt: skip


# --- the fit -------------------------------------------------------------------------------

SHARED_GAINS = ("compile", "fp8_tensorwise", "fp8_rowwise")
FIT_ROUNDS = 6  # coordinate-descent sweeps: the fitted values move < 0.1% after 3
GOLDEN_STEPS = 40  # golden-section steps per coordinate: brackets 2^-27 of their range wide
BOUNDS = {"tflops": (10.0, 2000.0), "gain": (1.0, 3.0)}


def fit(rows: tuple[Measurement, ...] = MEASUREMENTS) -> dict[str, Device]:
    """``DEVICES`` with their constants fitted on ``rows``' fitted half: the rate of each
    device a fitted row ran on, and the compile and fp8 speed-ups shared by all; the least
    sum of squared log errors, by coordinate descent with a golden-section search on each
    (deterministic: no randomness, a fixed number of steps)."""
    fitting = [row for row in rows if row.fitted]
    names = sorted({row.device for row in fitting})
    keys = [*(f"{name}.tflops" for name in names), *SHARED_GAINS]
    values = {key: _start(key) for key in keys}

    def loss(trial: dict[str, float]) -> float:
        devices = _with(trial)
        return sum(math.log(estimate(r, devices[r.device]) / r.tokens_per_s) ** 2 for r in fitting)

    for _ in range(FIT_ROUNDS):
        for key in keys:
            low, high = BOUNDS["tflops" if key.endswith(".tflops") else "gain"]
            values[key] = _golden(functools.partial(_trial, loss, values, key), low, high)
    return _with(values)


def _trial(
    loss: Callable[[dict[str, float]], float], values: dict[str, float], key: str, value: float
) -> float:
    """``loss`` at ``values`` with ``key`` set to ``value``."""
    return loss({**values, key: value})


def _start(key: str) -> float:
    if key.endswith(".tflops"):
        return DEVICES[key.removesuffix(".tflops")].tflops
    return float(getattr(DEVICES["h100"], key))


def _with(values: dict[str, float]) -> dict[str, Device]:
    """``DEVICES`` with ``values`` set (``NAME.tflops``; the shared gains on every device
    that has them)."""
    devices = {}
    for name, device in DEVICES.items():
        changes: dict[str, Any] = {}
        if f"{name}.tflops" in values:
            changes["tflops"] = values[f"{name}.tflops"]
        for gain in SHARED_GAINS:
            if gain in values and getattr(device, gain) is not None:
                changes[gain] = values[gain]
        devices[name] = replace(device, **changes)
    return devices


def _golden(f: Callable[[float], float], low: float, high: float) -> float:
    """The minimum of ``f`` on [low, high] (log-spaced), by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = math.log(low), math.log(high)
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(GOLDEN_STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2)
