"""``goodput model info``: what a model config costs, before anything is allocated."""

from __future__ import annotations

from goodput.train.config.model import ModelConfig
from goodput.train.config.precision import PRECISIONS
from goodput.train.flops import flops_per_token, model_size


def describe(cfg: ModelConfig, seq_len: int) -> dict[str, object]:
    size = model_size(cfg)
    return {
        "parameters_total": size.total,
        "parameters_active": size.active,
        "flops_per_token": flops_per_token(cfg, seq_len),
        "seq_len": seq_len,
        "training_bytes": {
            name: size.total * policy.bytes_per_parameter for name, policy in PRECISIONS.items()
        },
    }


def format_description(name: str, info: dict) -> str:
    lines = [
        f"{name}",
        f"  parameters   {_count(info['parameters_total'])} total, "
        f"{_count(info['parameters_active'])} active per token",
        f"  FLOPs/token  {info['flops_per_token'] / 1e9:10.3f} GFLOP at seq_len {info['seq_len']} "
        "(6N + 12·layers·dim·seq_len)",
        "  training memory for weights, gradients and AdamW moments (activations excluded):",
    ]
    for policy, total in info["training_bytes"].items():
        per = PRECISIONS[policy].bytes_per_parameter
        lines.append(f"    {policy:<12} {per:2d} bytes/parameter = {total / 2**30:12,.1f} GiB")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
