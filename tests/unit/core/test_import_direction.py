"""Import direction, checked in fresh interpreters: what one part imports, not what this test
process happens to have imported already."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from goodput.testing.jobs import outside_any_job

# Every module of a package, imported; then the torch modules that came with them, as JSON.
IMPORT_ALL = """
    import importlib, json, pkgutil, sys
    package = importlib.import_module({package!r})
    found = pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    # "_name": a C library loaded with ctypes (data/_interleave), not a Python module.
    names = [m.name for m in found if not m.name.rsplit(".", 1)[-1].startswith("_")]
    for name in names:
        importlib.import_module(name)
    torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    goodput = sorted(m for m in sys.modules if m.startswith("goodput."))
    print(json.dumps({{"modules": names, "torch": torch, "goodput": goodput}}))
"""


def _import_all(package: str) -> dict[str, list[str]]:
    code = textwrap.dedent(IMPORT_ALL.format(package=package))
    result = subprocess.run(
        [sys.executable, "-c", code], env=outside_any_job(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_no_module_of_launch_imports_torch():
    # It runs on login nodes and in watchdogs, where importing torch takes seconds or fails.
    found = _import_all("goodput.launch")
    assert {"goodput.launch.run", "goodput.launch.history", "goodput.launch.health"} <= set(
        found["modules"]
    )
    assert found["torch"] == []
    assert not [
        m for m in found["goodput"] if m.startswith(("goodput.train", "goodput.checkpoint"))
    ]


def test_checkpoint_imports_neither_train_nor_launch():
    # It knows no model code (conversions live in train/) and no scheduler; its fault hooks are
    # goodput.faults, not the campaign that plans them.
    found = _import_all("goodput.checkpoint")
    assert "goodput.checkpoint.metadata" in found["modules"]
    forbidden = ("goodput.train", "goodput.launch", "goodput.chaos")
    assert not [m for m in found["goodput"] if m.startswith(forbidden)]
    assert "goodput.faults" in found["goodput"]


def test_train_imports_the_fault_hooks_not_the_campaign():
    found = _import_all("goodput.train")
    assert "goodput.faults" in found["goodput"]
    forbidden = ("goodput.chaos", "goodput.diagnostics", "goodput.report")
    assert not [m for m in found["goodput"] if m.startswith(forbidden)]


def test_report_imports_neither_torch_nor_diagnostics():
    # `goodput report` runs on login nodes; its figures come from goodput.figures.
    found = _import_all("goodput.report")
    assert {"goodput.report.accounting", "goodput.report.plots"} <= set(found["modules"])
    assert found["torch"] == []
    assert not [
        m for m in found["goodput"] if m.startswith(("goodput.diagnostics", "goodput.train"))
    ]


def test_data_imports_neither_train_nor_launch():
    found = _import_all("goodput.data")
    assert not [m for m in found["goodput"] if m.startswith(("goodput.train", "goodput.launch"))]


def test_plan_imports_no_torch():
    # `goodput plan` estimates on login nodes: its modules are arithmetic on a config, and the
    # trainer's layout rules it asks are torch-free too.
    found = _import_all("goodput.plan")
    assert {"goodput.plan.memory", "goodput.plan.ladder", "goodput.plan.report"} <= set(
        found["modules"]
    )
    assert found["torch"] == []
    assert {m for m in found["goodput"] if m.startswith("goodput.train.")} == {
        "goodput.train.flops",
        "goodput.train.config",
        "goodput.train.config.model",
        "goodput.train.config.parallel",
        "goodput.train.config.precision",
    }


def test_the_run_config_imports_no_torch():
    # What reads a config without training (goodput plan, goodput model info) stays quick.
    code = "import sys, goodput.train.config.run, goodput.train.info; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=outside_any_job(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
