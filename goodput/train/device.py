"""Device and backend: the one module that names device types.

CUDA and ROCm (which PyTorch also reports as ``cuda``) use NCCL/RCCL, Intel XPU uses XCCL, Apple
MPS and CPU use gloo. ``GOODPUT_DEVICE`` overrides the probe (e.g. ``cpu`` on a GPU node for a
smoke test). torch is imported inside the functions, so asking for a device type stays cheap.
"""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path
from typing import Any

from goodput.errors import GoodputError
from goodput.ranks import DEVICE_VAR

BACKENDS = {"cuda": "nccl", "xpu": "xccl", "mps": "gloo", "cpu": "gloo"}


def detect_device_type(env: dict[str, str] | None = None) -> str:
    """``cuda`` | ``xpu`` | ``mps`` | ``cpu``: the override if set, else the first present."""
    import torch

    override = (env if env is not None else os.environ).get(DEVICE_VAR)
    if override:
        if override not in BACKENDS:
            raise GoodputError.usage(
                DEVICE_VAR,
                f"unknown device type {override!r}",
                f"use one of {', '.join(BACKENDS)}",
            )
        return override
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def backend_for(device_type: str) -> str:
    return BACKENDS[device_type]


def local_device(device_type: str, local_rank: int) -> Any:
    """This rank's ``torch.device``, made current where the device type has a notion of it."""
    import torch

    if device_type in ("cuda", "xpu"):
        module = getattr(torch, device_type)
        index = local_rank % module.device_count()
        module.set_device(index)
        return torch.device(device_type, index)
    return torch.device(device_type)


def device_name(device: Any) -> str:
    """The product name (``NVIDIA H100 80GB HBM3``, ...), or the CPU model for ``cpu``/``mps``."""
    import torch

    if device.type in ("cuda", "xpu"):
        return str(getattr(torch, device.type).get_device_name(device))
    return _cpu_model()


def fp8_matmuls_missing(device_type: str) -> str | None:
    """None when this rank's current ``device_type`` device multiplies in FP8 (torch's
    ``_scaled_mm``, which torchao's float8 training calls): NVIDIA from compute capability 8.9
    (Ada, Hopper, Blackwell), AMD from MI300 (gfx942). Otherwise the device, named, and why not,
    to end a sentence ("... which <this>")."""
    import torch

    if device_type != "cuda":
        name = device_name(torch.device(device_type))
        return f"{device_type} ({name}) lacks: torchao's float8 training runs on CUDA and ROCm only"
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
        if arch in ("gfx942", "gfx950"):
            return None
        return f"the ROCm device {name} ({arch}) lacks: they need MI300 (gfx942) or later"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) >= (8, 9):
        return None
    return (
        f"the CUDA device {name} (compute capability {major}.{minor}) lacks: they need 8.9 "
        "(Ada, Hopper) or later"
    )


def peak_memory_bytes(device: Any) -> int:
    """The device's peak allocated memory; on CPU (and MPS, sharing host memory), the process's
    peak resident set, which includes the interpreter and libraries."""
    import torch

    if device.type in ("cuda", "xpu"):
        return int(getattr(torch, device.type).max_memory_allocated(device))
    return process_peak_bytes()


def process_peak_bytes() -> int:
    """This process's peak resident set since it started (or since ``reset_process_peak``).
    On Linux /proc's ``VmHWM``: ``ru_maxrss`` keeps, across exec, the peak of the process that
    started this one (a spawned rank or child would report its parent's); ``ru_maxrss`` only
    where there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024  # elsewhere it is in KiB


def reset_process_peak() -> None:
    """Start ``process_peak_bytes`` again from the resident set now (Linux: writing 5 to
    /proc/self/clear_refs), so a peak measures what came after; a no-op without /proc."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
