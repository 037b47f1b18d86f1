"""``python -m goodput.launch.health --device``: the vendor tools' checks against fake
``nvidia-smi``, ``rocm-smi``, ``amd-smi``, ``xpu-smi`` and ``journalctl`` scripts on a temporary
PATH (healthy, ECC error, missing device, tool absent, tool hanging), their parsers in-process,
and the CPU device path through the real CLI, as docs/launch.md shows it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from goodput.launch import device_tools, health
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.train.device_check import compare

NVIDIA_L = "".join(
    f"GPU {i}: NVIDIA A100-SXM4-40GB (UUID: GPU-6f2c5a0e-1b8e-5d3c-9a6e-0d2f8c1e4b7{i})\n"
    for i in range(4)
)
ECC = "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
REMAP = "--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure"
BUSES = ["00000000:07:00.0", "00000000:46:00.0", "00000000:85:00.0", "00000000:C7:00.0"]
NVIDIA_OK = {
    "-L": NVIDIA_L,
    f"{ECC} --format=csv,noheader,nounits": "".join(
        f"{i}, {bus}, 0, No\n" for i, bus in enumerate(BUSES)
    ),
    f"{REMAP} --format=csv,noheader": "".join(f"{bus}, 0, 0\n" for bus in BUSES),
}
ROCM_IDS = json.dumps({f"card{i}": {"GPU ID": "0x740c"} for i in range(8)})
AMD_ECC = [
    {"gpu": i, "ecc": {"total_correctable_count": 1, "total_uncorrectable_count": 0}}
    for i in range(8)
]
XPU_IDS = json.dumps({"device_list": [{"device_id": i} for i in range(6)]})
XPU_HEALTH = {
    "device_list": [
        {"device_id": i, "memory": {"status": "OK"}, "power": {"status": "Unknown"}}
        for i in range(6)
    ]
}
RAS = "XPUM_STATS_RAS_ERROR_CAT_CACHE_ERRORS_UNCORRECTABLE"


def xpu_stats(uncorrectable: int) -> str:
    levels = [{"metrics_type": RAS, "value": uncorrectable}]
    return json.dumps({"device_id": 0, "device_level": levels})


INTEL_OK = {
    "discovery -j": XPU_IDS,
    "health -l -j": json.dumps(XPU_HEALTH),
    **{f"stats -d {i} -r -j": xpu_stats(0) for i in range(6)},
}


def fake_tool(folder: Path, name: str, outputs: dict[str, str], *, hang: bool = False) -> None:
    """An executable ``name`` that prints ``outputs[its arguments]``, or exits 2 on others."""
    script = folder / name
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"if {hang!r}:\n    time.sleep(60)\n"
        f"outputs = {outputs!r}\n"
        "key = ' '.join(sys.argv[1:])\n"
        "if key not in outputs:\n    sys.exit('unknown arguments: ' + key)\n"
        "print(outputs[key], end='')\n"
    )
    script.chmod(0o755)


@pytest.fixture
def tools(tmp_path, monkeypatch) -> Path:
    """A folder that is the whole PATH: no real vendor tool or journalctl can answer."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


def test_healthy_nvidia_with_an_unreadable_kernel_log(tools):
    fake_tool(tools, "nvidia-smi", NVIDIA_OK)
    assert health.check_vendor("nvidia", 4) == ([], ["xid: not queryable", "4 devices"])


def test_a_critical_xid_in_the_kernel_log_is_unhealthy(tools):
    fake_tool(tools, "nvidia-smi", NVIDIA_OK)
    log = "NVRM: Xid (PCI:0000:46:00): 79, pid=1234, GPU has fallen off the bus.\n"
    log += "NVRM: Xid (PCI:0000:07:00): 13, pid=99, Graphics Exception\n"  # not critical
    fake_tool(tools, "journalctl", {"-k -b -q --no-pager -o cat -g NVRM: Xid": log})
    problems, _ = health.check_vendor("auto", 4)
    assert problems == ["GPU 0000:46:00: XID 79 (1x in the kernel log)"]


@pytest.mark.parametrize(
    ("key", "text", "problem"),
    [
        (f"{ECC} --format=csv,noheader,nounits", "0, 00000000:07:00.0, 2, No\n", "2 uncorrected"),
        (f"{ECC} --format=csv,noheader,nounits", "0, 00000000:07:00.0, 0, Yes\n", "retired"),
        (f"{REMAP} --format=csv,noheader", "00000000:07:00.0, 1, 0\n", "remapping pending"),
        (f"{REMAP} --format=csv,noheader", "00000000:07:00.0, 0, 1\n", "remapping failed"),
        ("-L", NVIDIA_L.split("\n", 1)[1], "3 devices found, 4 expected"),
        ("-L", "No devices were found\n", "0 devices found, 4 expected"),
    ],
)
def test_nvidia_ecc_errors_and_missing_devices_are_unhealthy(tools, key, text, problem):
    fake_tool(tools, "nvidia-smi", {**NVIDIA_OK, key: text})
    problems, _ = health.check_vendor("nvidia", 4)
    assert len(problems) == 1 and problem in problems[0]


def test_amd_through_amd_smi_and_through_rocm_smi_alone(tools):
    fake_tool(tools, "rocm-smi", {"--showid --json": ROCM_IDS})
    fake_tool(tools, "amd-smi", {"metric --ecc --json": json.dumps(AMD_ECC)})
    assert health.check_vendor("amd", 8) == ([], ["8 devices"])
    (tools / "amd-smi").unlink()  # older ROCm: the RAS counts come from rocm-smi
    ras = {"card3": {"UMC": {"correctable_count": "0", "uncorrectable_count": "5"}}}
    fake_tool(tools, "rocm-smi", {"--showid --json": ROCM_IDS, "--showrasinfo all --json": ""})
    assert health.check_vendor("amd", 8)[0] == ["rocm-smi: output is not JSON: ''"]
    outputs = {"--showid --json": ROCM_IDS, "--showrasinfo all --json": json.dumps(ras)}
    fake_tool(tools, "rocm-smi", outputs)
    assert health.check_vendor("amd", 7)[0] == [
        "GPU ?: uncorrectable_count = 5",
        "8 devices found, 7 expected",
    ]


def test_intel_health_and_ras_counts(tools):
    fake_tool(tools, "xpu-smi", INTEL_OK)
    assert health.check_vendor("intel", 6) == ([], ["6 devices"])
    sick = dict(XPU_HEALTH, device_list=[{"device_id": 2, "memory": {"status": "Critical"}}])
    outputs = {**INTEL_OK, "health -l -j": json.dumps(sick), "stats -d 4 -r -j": xpu_stats(1)}
    fake_tool(tools, "xpu-smi", outputs)
    assert health.check_vendor("intel", 6)[0] == [
        "XPU 2: memory Critical",
        f"XPU 4: {RAS} = 1",
    ]


def test_an_absent_tool_fails_a_named_vendor_and_skips_auto(tools):
    assert health.check_vendor("nvidia", 4)[0] == ["nvidia-smi: not found on PATH"]
    assert health.check_vendor("intel", None)[0] == ["xpu-smi: not found on PATH"]
    assert health.check_vendor("auto", None) == (
        [],
        ["no vendor tool found: vendor checks skipped"],
    )
    # Devices expected but nothing to count them: unhealthy.
    assert health.check_vendor("auto", 4)[0] == ["no vendor tool counted the devices, 4 expected"]


def test_a_hanging_tool_times_out(tools):
    fake_tool(tools, "nvidia-smi", NVIDIA_OK, hang=True)
    assert health.check_vendor("nvidia", 4, timeout_s=0.5)[0] == [
        "nvidia-smi: no answer within 0.5 s"
    ]


def test_a_failing_tool_is_unhealthy(tools):
    fake_tool(tools, "xpu-smi", {})  # exits 2 with its complaint
    (problem,) = health.check_vendor("intel", None)[0]
    assert problem.startswith("xpu-smi discovery: exit 1: unknown arguments: discovery -j")


def test_parsers_refuse_what_they_do_not_know():
    refusals = [
        (device_tools.parse_nvidia_list, "Failed to initialize NVML: Driver/library mismatch"),
        (device_tools.parse_nvidia_list, "GPU 0: something else\n"),
        (device_tools.parse_nvidia_ecc, "0, bus, 0\n"),
        (device_tools.parse_nvidia_ecc, "0, bus, many, No\n"),
        (device_tools.parse_nvidia_remap, "bus, maybe, 0\n"),
        (device_tools.parse_amd_ecc, "[" * 100_000),
        (device_tools.parse_amd_ecc, json.dumps({"total_uncorrectable_count": True})),
        (device_tools.parse_rocm_ids, "[]"),
        (device_tools.parse_xpu_discovery, json.dumps({"device_list": [{"device_id": "x"}]})),
        (device_tools.parse_xpu_health, json.dumps({"devices": []})),
    ]
    for parse, text in refusals:
        with pytest.raises(device_tools.Refusal) as refusal:
            parse(text)
        assert "\n" not in str(refusal.value)
    mig = NVIDIA_L + "  MIG 3g.20gb     Device  0: (UUID: MIG-5c3b)\n"
    assert device_tools.parse_nvidia_list(mig) == 4
    assert device_tools.parse_nvidia_ecc("0, 00000000:07:00.0, [N/A], [N/A]\n") == []


def test_compare_finds_a_one_bit_difference():
    for dtype in (torch.float32, torch.bfloat16):
        want = torch.arange(-8, 8, dtype=dtype).reshape(4, 4)
        got = want.clone()
        assert compare(got, want) is None
        got.view(torch.int32 if dtype == torch.float32 else torch.int16)[2, 1] ^= 1
        assert str(compare(got, want)).startswith("1 elements differ, first at (2, 1)")
        # Equal as values, not as bits: a device that drops the sign of zero is caught.
        assert compare(torch.zeros(2, dtype=dtype), -torch.zeros(2, dtype=dtype)) is not None


def _cli(line: str, path: str) -> subprocess.CompletedProcess[str]:
    env = outside_any_job(PATH=path)
    return subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, cwd=REPO)


def test_the_documented_commands_run_as_written(tools):
    """docs/launch.md's Device health block, with a healthy fake nvidia-smi of 4 GPUs first on
    PATH and the venv's python: the real CPU device path runs in each."""
    fake_tool(tools, "nvidia-smi", NVIDIA_OK)
    page = (REPO / "docs" / "launch.md").read_text()
    section = re.search(r"\*\*Device health\.\*\*.*?```sh\n.*?```", page, re.S)
    assert section is not None
    lines = command_lines(section.group(0))
    assert len(lines) == 2
    path = f"{tools}:{Path(sys.executable).parent}:{os.defpath}"
    for line in lines:
        result = _cli(line, path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert re.fullmatch(
            r"health: \S+: healthy \(.*4 devices; device cpu: ok\)\n", result.stdout
        )


def test_a_matmul_past_its_bound_is_unhealthy_and_bad_options_are_usage_errors(tools):
    path = f"{Path(sys.executable).parent}:{os.defpath}"
    result = _cli("python -m goodput.launch.health --device --bound-s 1e-6", path)
    assert result.returncode == 1
    assert "unhealthy: device cpu: float32 matmul took" in result.stdout
    assert "bound 1e-06 s" in result.stdout
    for argv in (["--vendor", "amd"], ["--device", "--bound-s", "nan"], ["--device", "-x"]):
        assert health.main(argv) == 2
