"""The default per-host health probe: ``python -m goodput.launch.health``.

``goodput launch --auto-retry`` runs it on each active host (one process per host, through the
job's own srun or mpiexec) when an attempt failed and no log line named a culprit, so that a
host is evicted on evidence, never by a blind pick. It checks what a training rank needs first
and what silently breaks on a sick node: that Python starts at all (the probe running is the
check), that node-local temporary space and ``/dev/shm`` take a write that reads back, and that
the temporary space has room. Exit 0 and one ``healthy`` line, or exit 1 and one line naming
the failed check.

``--device`` checks the accelerators too, as the GPU site profiles' ``health_check`` asks: the
vendor's tool (``--vendor``; ``auto`` takes the first found on PATH) for uncorrected ECC errors,
pending retirements or remaps, critical XIDs and the device count (``--expect-devices``), see
``device_tools``; then ``python -m goodput.train.device_check`` as a child process (a module
name, not an import: launch/ never imports torch), which must compute a matmul bit for bit
within ``--bound-s`` and copy to and from every local device (the CPU on a CPU node).
Exit 0 healthy, 1 unhealthy, 2 a bad option, each with one line.
Standard library only: it must start fast on a node that may be half broken.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from goodput.errors import ExitCode, GoodputError, one_line
from goodput.launch import device_tools
from goodput.ranks import PROBE_HOST_VAR

PROBE_BYTES = 1 << 20
MIN_FREE_BYTES = 1 << 30
MAX_EXPECT_DEVICES = device_tools.MAX_DEVICES
MAX_BOUND_S = 3600.0  # device_check's --bound-s too
DEFAULT_BOUND_S = 5.0
# The device check's child starts Python and torch (and CUDA's context) before any matmul.
CHILD_STARTUP_S = 120.0
MAX_LINE_CHARS = 1000


def _write_reads_back(folder: Path) -> None:
    payload = os.urandom(PROBE_BYTES)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".goodput-health-") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
        handle.seek(0)
        if handle.read() != payload:
            raise OSError(f"{folder}: data read back differs from data written")


def check() -> str | None:
    """None when healthy, else what failed."""
    folders = [Path(tempfile.gettempdir())]
    if Path("/dev/shm").is_dir():
        folders.append(Path("/dev/shm"))
    try:
        for folder in folders:
            _write_reads_back(folder)
        free = shutil.disk_usage(folders[0]).free
    except OSError as error:
        return f"{error.filename or ''} {error.strerror or error}".strip()
    if free < MIN_FREE_BYTES:
        return f"{folders[0]}: {free / 2**20:.0f} MiB free, want at least 1 GiB"
    return None


def check_vendor(
    vendor: str, expect_devices: int | None, timeout_s: float = device_tools.TOOL_TIMEOUT_S
) -> tuple[list[str], list[str]]:
    """(problems, notes) of the vendor's tool, its device count against ``expect_devices``."""
    report = device_tools.check_vendor(vendor, timeout_s)
    problems, notes = list(report.problems), list(report.notes)
    if report.devices is not None:
        notes.append(f"{report.devices} devices")
    if expect_devices is not None and report.devices is None and not report.problems:
        problems.append(f"no vendor tool counted the devices, {expect_devices} expected")
    elif expect_devices is not None and report.devices not in (None, expect_devices):
        problems.append(f"{report.devices} devices found, {expect_devices} expected")
    return problems, notes


def check_local_devices(bound_s: float) -> tuple[list[str], list[str]]:
    """(problems, notes) of ``python -m goodput.train.device_check``, one line per device."""
    argv = [sys.executable, "-m", "goodput.train.device_check", "--bound-s", repr(bound_s)]
    timeout_s = CHILD_STARTUP_S + 2 * bound_s
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return [f"device check: no answer within {timeout_s:g} s"], []
    # A crash prints no device line: its traceback's last line says why.
    lines = result.stdout.strip().splitlines() or result.stderr.strip().splitlines()[-1:]
    lines = lines or [f"device check: exit {result.returncode}"]
    return (lines, []) if result.returncode else ([], lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise GoodputError.usage(self.prog, message, "see --help")


def _positive(limit: float, kind: type[float] | type[int]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not (math.isfinite(value) and 0 < value <= limit):
            raise argparse.ArgumentTypeError(f"want above 0, at most {limit:g}")
        return value

    parse.__name__ = kind.__name__
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python -m goodput.launch.health", description=__doc__.split("\n")[0])
    parser.add_argument("--device", action="store_true", help="check the accelerators too")
    parser.add_argument("--vendor", choices=("auto", *device_tools.VENDORS))
    parser.add_argument("--expect-devices", type=_positive(MAX_EXPECT_DEVICES, int))
    parser.add_argument("--bound-s", type=_positive(MAX_BOUND_S, float))
    args = parser.parse_args(argv)
    given = [name for name in ("vendor", "expect_devices", "bound_s") if getattr(args, name)]
    if given and not args.device:
        option = "--" + given[0].replace("_", "-")
        raise GoodputError.usage(parser.prog, f"{option} needs --device", "add --device")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except GoodputError as error:
        print(f"health: {error.render()}", file=sys.stderr)
        return int(error.code)
    host = os.environ.get(PROBE_HOST_VAR) or socket.gethostname()
    problem = check()
    problems = [] if problem is None else [problem]
    notes: list[str] = []
    if args.device:
        for found, noted in (
            check_vendor(args.vendor or "auto", args.expect_devices),
            check_local_devices(args.bound_s or DEFAULT_BOUND_S),
        ):
            problems += found
            notes += noted
    if problems:
        line = "unhealthy: " + "; ".join(problems)
    else:
        line = "healthy" + (f" ({'; '.join(notes)})" if notes else "")
    print(f"health: {host}: {one_line(line, MAX_LINE_CHARS)}")
    return int(ExitCode.OK if not problems else ExitCode.ERROR)


if __name__ == "__main__":
    sys.exit(main())
