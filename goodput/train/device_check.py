"""``python -m goodput.train.device_check [--bound-s S]``: does every local device compute and
copy right? The device half of ``python -m goodput.launch.health --device``, run by it as a
child so that launch/ never imports torch.

On each local device (every CUDA or XPU device, else the CPU): a matmul of seeded integer
matrices in [-2, 2], in fp32 (TF32 off) and in bf16. Every product and partial sum is an
integer of at most 2048 in magnitude, exact in fp32 accumulation, so the fp32 result must equal
a float64 reference bit for bit and the bf16 result must equal that reference rounded once to
bf16. Each matmul must finish within ``--bound-s``; a 64 MiB host -> device -> host copy must
read back equal. One line per device; exit 0 when all pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

from goodput.launch.health import DEFAULT_BOUND_S, MAX_BOUND_S  # its caller's bounds

SIZE = 512
COPY_BYTES = 64 << 20
SEED = 20250527
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def compare(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` equals ``want`` bit for bit (same dtype), else where it first differs.
    Bits, not values: -0.0 == 0.0 and NaN != NaN would hide a fault or invent one."""
    got_bits, want_bits = got.view(BITS[got.dtype]), want.view(BITS[want.dtype])
    differ = (got_bits != want_bits).nonzero()
    if len(differ) == 0:
        return None
    first = tuple(int(i) for i in differ[0])
    values = f"{got[first].item()} != {want[first].item()}"
    return f"{len(differ)} elements differ, first at {first}: {values}"


def _synchronize(device: torch.device) -> None:
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).synchronize(device)


def check_device(device: torch.device, bound_s: float) -> list[str]:
    problems = []
    generator = torch.Generator().manual_seed(SEED)
    a = torch.randint(-2, 3, (SIZE, SIZE), generator=generator, dtype=torch.float64)
    b = torch.randint(-2, 3, (SIZE, SIZE), generator=generator, dtype=torch.float64)
    reference = a @ b
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(device, dtype), b.to(device, dtype)
        _synchronize(device)
        start = time.perf_counter()
        product = x @ y
        _synchronize(device)
        took = time.perf_counter() - start
        name = str(dtype).removeprefix("torch.")
        if took > bound_s:
            problems.append(f"{name} matmul took {took:.3g} s, bound {bound_s:g} s")
        mismatch = compare(product.cpu(), reference.to(dtype))
        if mismatch is not None:
            problems.append(f"{name} matmul differs from the float64 reference: {mismatch}")
    payload = torch.randint(0, 256, (COPY_BYTES,), generator=generator, dtype=torch.uint8)
    back = payload.to(device, copy=True).to("cpu", copy=True)
    if not torch.equal(back, payload):
        problems.append(f"{COPY_BYTES >> 20} MiB host -> device -> host copy read back different")
    return problems


def local_devices() -> list[torch.device]:
    for kind in ("cuda", "xpu"):
        module: Any = getattr(torch, kind, None)
        if module is not None and module.is_available():
            return [torch.device(kind, i) for i in range(module.device_count())]
    return [torch.device("cpu")]


def _bound(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= MAX_BOUND_S):
        raise argparse.ArgumentTypeError(f"want seconds above 0, at most {MAX_BOUND_S:g}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m goodput.train.device_check")
    parser.add_argument("--bound-s", type=_bound, default=DEFAULT_BOUND_S)
    args = parser.parse_args(argv)
    # Exactness needs full fp32 products and one rounding of an fp32 sum to bf16: no TF32, no
    # reduced-precision split-K reductions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.set_float32_matmul_precision("highest")
    healthy = True
    for device in local_devices():
        problems = check_device(device, args.bound_s)
        healthy = healthy and not problems
        print(f"device {device}: {'ok' if not problems else '; '.join(problems)}", flush=True)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
