"""Vendor device tools, run and read for ``python -m goodput.launch.health --device``.

Each tool runs as an argv list (never a shell) under a timeout, with its output cut at
``MAX_OUTPUT_CHARS``: a node whose driver hangs must fail the probe, not hang it. Each parser
takes any text and returns what it found, or raises ``Refusal`` with one line: a tool that
prints something unexpected is a sick node or a version we do not know, and either way the
probe must not pass on it. Formats follow the vendors' documentation (nvidia-smi's
``--help-query-gpu``, amd-smi's and rocm-smi's ``--json``, xpu-smi's ``-j``).
Standard library only (launch/ never imports torch).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from goodput.errors import one_line

# Four nvidia-smi calls and journalctl must fit in the probe's default health_timeout_s (60 s).
TOOL_TIMEOUT_S = 10.0
MAX_OUTPUT_CHARS = 1 << 20
MAX_LINE_CHARS = 200
MAX_JSON_NODES = 100_000
# XIDs that mean the GPU or its memory needs a reset or a repair (NVIDIA's XID catalogue):
# 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 94/95 contained /
# uncontained ECC, 119/120 GSP errors.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 94, 95, 119, 120})
VENDORS = ("nvidia", "amd", "intel")
MAX_DEVICES = 1024  # the most devices one host may be expected to have (--expect-devices)
COUNT = re.compile(r"[0-9]{1,18}")  # ASCII only: str.isdigit takes "²", which int() refuses


class Refusal(ValueError):
    """A tool's output that cannot be trusted, or a tool that did not answer: one line."""

    def __init__(self, what: str) -> None:
        super().__init__(one_line(what, MAX_LINE_CHARS))


class ToolAbsent(Refusal):
    pass


@dataclass
class Report:
    """What one vendor's tools said: devices counted, problems (unhealthy), notes (kept)."""

    devices: int | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_tool(argv: Sequence[str], timeout_s: float = TOOL_TIMEOUT_S) -> tuple[int, str]:
    """Exit status and standard output (bounded) of ``argv``; Refusal when it cannot run or
    outlives ``timeout_s``."""
    if shutil.which(argv[0]) is None:
        raise ToolAbsent(f"{argv[0]}: not found on PATH")
    try:
        result = subprocess.run(
            list(argv),
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise Refusal(f"{argv[0]}: no answer within {timeout_s:g} s") from None
    except OSError as error:
        raise Refusal(f"{argv[0]}: {error.strerror or error}") from None
    out = result.stdout[:MAX_OUTPUT_CHARS].decode("utf-8", "replace")
    err = result.stderr[:MAX_LINE_CHARS].decode("utf-8", "replace")
    return result.returncode, out + ("\n" + err if result.returncode else "")


def _checked(argv: Sequence[str], timeout_s: float) -> str:
    code, out = run_tool(argv, timeout_s)
    if code != 0:
        raise Refusal(f"{argv[0]} {argv[1]}: exit {code}: {out.strip()[-MAX_LINE_CHARS:]}")
    return out


def _json(text: str, tool: str) -> object:
    try:
        return json.loads(text)
    # RecursionError: deeply nested arrays; ValueError: not JSON (JSONDecodeError included).
    except (ValueError, RecursionError):
        raise Refusal(f"{tool}: output is not JSON: {text.strip()[:80]!r}") from None


def _walk(data: object, tool: str) -> list[tuple[str, object, dict[str, object]]]:
    """Every (key, value, parent) of the JSON tree, bounded in size: key names are matched
    rather than paths, since the layout differs across tool versions."""
    found: list[tuple[str, object, dict[str, object]]] = []
    stack = [data]
    while stack:
        node = stack.pop()
        if len(found) > MAX_JSON_NODES:
            raise Refusal(f"{tool}: output larger than {MAX_JSON_NODES} values")
        if isinstance(node, dict):
            for key, value in node.items():
                found.append((str(key), value, node))
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _count(value: object, tool: str, key: str) -> int:
    if isinstance(value, bool):
        raise Refusal(f"{tool}: {key} is {value!r}, not a count")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and COUNT.fullmatch(value.strip()):
        return int(value.strip())
    if isinstance(value, str) and value.strip().upper() in ("N/A", "[N/A]", "NOT SUPPORTED"):
        return 0  # the device does not report it: nothing counted against it
    raise Refusal(f"{tool}: {key} is {str(value)[:40]!r}, not a count")


# --- nvidia ------------------------------------------------------------------------------------

NVIDIA_GPU_LINE = re.compile(r"GPU (\d+): .*\(UUID: [\w-]+\)")
NVIDIA_DRIVER_DOWN = ("couldn't communicate with the nvidia driver", "failed to initialize nvml")


def parse_nvidia_list(text: str) -> int:
    """The GPU count of ``nvidia-smi -L``."""
    lowered = text.lower()
    if any(phrase in lowered for phrase in NVIDIA_DRIVER_DOWN):
        raise Refusal("nvidia-smi: the NVIDIA driver does not answer")
    if "no devices were found" in lowered:
        return 0
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # MIG devices are listed indented under their GPU; the GPUs are what ranks are placed on.
    gpus = [line for line in lines if not line.startswith("MIG ")]
    for line in gpus:
        if not NVIDIA_GPU_LINE.fullmatch(line):
            raise Refusal(f"nvidia-smi -L: unexpected line {line[:80]!r}")
    return len(gpus)


def _csv_rows(text: str, tool: str, width: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != width:
            raise Refusal(f"{tool}: {len(cells)} fields, want {width}: {line[:80]!r}")
        rows.append(cells)
    return rows


def _flag(value: str, tool: str) -> bool:
    if value in ("Yes", "1"):
        return True
    if value in ("No", "0", "[N/A]", "N/A", "[Not Supported]"):
        return False
    raise Refusal(f"{tool}: {value[:40]!r} is not Yes or No")


def parse_nvidia_ecc(text: str) -> list[str]:
    """Problems in ``--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,
    retired_pages.pending --format=csv,noheader,nounits``."""
    tool = "nvidia-smi --query-gpu"
    problems = []
    for index, bus, uncorrected, pending in _csv_rows(text, tool, 4):
        count = _count(uncorrected, tool, "ecc.errors.uncorrected.volatile.total")
        if count > 0:
            problems.append(f"GPU {index[:8]} ({bus[:20]}): {count} uncorrected ECC errors")
        if _flag(pending, tool):
            problems.append(f"GPU {index[:8]} ({bus[:20]}): retired pages pending a reset")
    return problems


def parse_nvidia_remap(text: str) -> list[str]:
    """Problems in ``--query-remapped-rows=gpu_bus_id,remapped_rows.pending,
    remapped_rows.failure --format=csv,noheader``."""
    tool = "nvidia-smi --query-remapped-rows"
    problems = []
    for bus, pending, failure in _csv_rows(text, tool, 3):
        if _flag(pending, tool):
            problems.append(f"GPU {bus[:20]}: row remapping pending a reset")
        if _flag(failure, tool):
            problems.append(f"GPU {bus[:20]}: row remapping failed")
    return problems


XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]{1,20})\): (\d{1,4})\b")


def parse_xid(text: str) -> list[str]:
    """Problems in the kernel log's ``NVRM: Xid`` lines: the critical XIDs, once per GPU."""
    seen: dict[tuple[str, int], int] = {}
    for bus, xid in XID_LINE.findall(text):
        if int(xid) in CRITICAL_XIDS:
            seen[bus, int(xid)] = seen.get((bus, int(xid)), 0) + 1
    return [f"GPU {bus}: XID {xid} ({n}x in the kernel log)" for (bus, xid), n in seen.items()]


def check_nvidia(timeout_s: float) -> Report:
    report = Report(devices=parse_nvidia_list(_checked(["nvidia-smi", "-L"], timeout_s)))
    ecc = "index,pci.bus_id,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
    query = ["nvidia-smi", f"--query-gpu={ecc}", "--format=csv,noheader,nounits"]
    report.problems += parse_nvidia_ecc(_checked(query, timeout_s))
    rows = "gpu_bus_id,remapped_rows.pending,remapped_rows.failure"
    query = ["nvidia-smi", f"--query-remapped-rows={rows}", "--format=csv,noheader"]
    report.problems += parse_nvidia_remap(_checked(query, timeout_s))
    # The kernel log is often root-only; without it XIDs go unchecked, and the line says so.
    journal = ["journalctl", "-k", "-b", "-q", "--no-pager", "-o", "cat", "-g", "NVRM: Xid"]
    try:
        code, out = run_tool(journal, timeout_s)
    except Refusal:
        code, out = -1, ""
    if code == 0:
        report.problems += parse_xid(out)
    elif code == 1 and not out.strip():  # journalctl -g with no match
        pass
    else:
        report.notes.append("xid: not queryable")
    return report


# --- amd ---------------------------------------------------------------------------------------


def parse_amd_ecc(text: str, tool: str = "amd-smi") -> list[str]:
    """Problems in ``amd-smi metric --ecc --json`` or ``rocm-smi --showrasinfo all --json``:
    any uncorrectable count above 0, wherever the version puts it."""
    problems = []
    for key, value, parent in _walk(_json(text, tool), tool):
        if "uncorrect" in key.lower() and not isinstance(value, dict | list):
            count = _count(value, tool, key)
            if count > 0:
                where = parent.get("gpu", parent.get("block", "?"))
                problems.append(f"GPU {str(where)[:20]}: {key[:40]} = {count}")
    return problems


def parse_rocm_ids(text: str) -> int:
    """The GPU count of ``rocm-smi --showid --json`` (one ``cardN`` entry each)."""
    data = _json(text, "rocm-smi")
    if not isinstance(data, dict):
        raise Refusal("rocm-smi --showid: output is not a JSON object")
    return sum(1 for key in data if re.fullmatch(r"card\d+", str(key)))


def check_amd(timeout_s: float) -> Report:
    report = Report(devices=parse_rocm_ids(_checked(["rocm-smi", "--showid", "--json"], timeout_s)))
    try:
        text = _checked(["amd-smi", "metric", "--ecc", "--json"], timeout_s)
        report.problems += parse_amd_ecc(text, "amd-smi")
    except ToolAbsent:  # older ROCm: rocm-smi only
        text = _checked(["rocm-smi", "--showrasinfo", "all", "--json"], timeout_s)
        report.problems += parse_amd_ecc(text, "rocm-smi")
    return report


# --- intel -------------------------------------------------------------------------------------


def _device_list(text: str, tool: str) -> list[dict[str, object]]:
    data = _json(text, tool)
    devices = data.get("device_list") if isinstance(data, dict) else None
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise Refusal(f"{tool}: no device_list in the output")
    return devices


def parse_xpu_discovery(text: str) -> list[int]:
    """The device ids of ``xpu-smi discovery -j``."""
    ids = []
    for device in _device_list(text, "xpu-smi discovery"):
        ids.append(_count(device.get("device_id"), "xpu-smi discovery", "device_id"))
    return ids


def parse_xpu_health(text: str) -> list[str]:
    """Problems in ``xpu-smi health -l -j``: any component whose status is not OK. "Unknown"
    is a component the device does not monitor, which says nothing against it."""
    problems = []
    for device in _device_list(text, "xpu-smi health"):
        for component, value in device.items():
            if isinstance(value, dict) and "status" in value:
                status = str(value["status"])
                if status not in ("OK", "Unknown"):
                    who = str(device.get("device_id", "?"))[:8]
                    problems.append(f"XPU {who}: {component[:40]} {status[:20]}")
    return problems


def parse_xpu_stats(text: str, device: int) -> list[str]:
    """Problems in ``xpu-smi stats -d N -r -j``: any uncorrectable RAS count above 0."""
    tool = "xpu-smi stats"
    problems = []
    for key, value, parent in _walk(_json(text, tool), tool):
        if key == "metrics_type" and "UNCORRECTABLE" in str(value).upper():
            count = _count(parent.get("value", 0), tool, str(value))
            if count > 0:
                problems.append(f"XPU {device}: {str(value)[:60]} = {count}")
    return problems


def check_intel(timeout_s: float) -> Report:
    ids = parse_xpu_discovery(_checked(["xpu-smi", "discovery", "-j"], timeout_s))
    report = Report(devices=len(ids))
    report.problems += parse_xpu_health(_checked(["xpu-smi", "health", "-l", "-j"], timeout_s))
    for device in ids:
        text = _checked(["xpu-smi", "stats", "-d", str(device), "-r", "-j"], timeout_s)
        report.problems += parse_xpu_stats(text, device)
    return report


CHECKS: dict[str, tuple[str, Callable[[float], Report]]] = {
    "nvidia": ("nvidia-smi", check_nvidia),
    "amd": ("rocm-smi", check_amd),
    "intel": ("xpu-smi", check_intel),
}


def check_vendor(vendor: str, timeout_s: float = TOOL_TIMEOUT_S) -> Report:
    """The vendor's report; ``auto`` checks the first vendor whose tool is on PATH, or none.
    A refusal (tool absent, hung, unreadable) is a problem."""
    if vendor == "auto":
        found = [name for name, (tool, _) in CHECKS.items() if shutil.which(tool)]
        if not found:
            return Report(notes=["no vendor tool found: vendor checks skipped"])
        vendor = found[0]
    try:
        return CHECKS[vendor][1](timeout_s)
    except Refusal as refusal:
        return Report(problems=[str(refusal)])
