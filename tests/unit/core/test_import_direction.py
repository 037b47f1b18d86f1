"""Import direction, checked twice: in fresh interpreters (what importing one part loads, not
what this test process happens to have imported already) and in the source (every import,
inside functions too), which also finds any circle between parts or between modules."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import goodput
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
    forbidden = ("goodput.chaos", "goodput.diagnose", "goodput.report")
    assert not [m for m in found["goodput"] if m.startswith(forbidden)]


def test_report_imports_neither_torch_nor_diagnose():
    # `goodput report` runs on login nodes; its figures come from goodput.figures.
    found = _import_all("goodput.report")
    assert {"goodput.report.accounting", "goodput.report.plots"} <= set(found["modules"])
    assert found["torch"] == []
    assert not [m for m in found["goodput"] if m.startswith(("goodput.diagnose", "goodput.train"))]


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


# The same directions, read from the source: every import of every module of goodput/, at module
# level, inside functions and methods, and under `if TYPE_CHECKING:`, relative ones resolved. An
# import inside a function runs only when the function does, so the fresh interpreters above
# never see it; here it counts as much as one at the top.

PACKAGE = Path(goodput.__file__).resolve().parent
TRAIN_WINGS = ("config", "optim", "monitor", "parallel", "convert")
# The root modules that may import goodput's subpackages: the command line, the demo.
# Every other module at the root is a leaf that the parts share, the launcher's among them: it
# imports no goodput part and no torch.
ROOT_FACES = ("goodput.__main__", "goodput.cli", "goodput.demo")

# part -> what none of its modules imports. torch here means at run time: a name imported under
# `if TYPE_CHECKING:` is never loaded, but a goodput module that loads torch when imported is.
NEVER = {
    "goodput.data": ("goodput.train", "goodput.launch"),
    # Login nodes and watchdogs. launch/health.py runs goodput.train.device_check as a child
    # process by its name (a string), which is not an import.
    "goodput.launch": ("goodput.train", "goodput.checkpoint", "torch"),
    "goodput.checkpoint": ("goodput.train", "goodput.launch", "goodput.chaos"),
    "goodput.report": ("goodput.diagnose", "goodput.train", "torch"),
    "goodput.plan": ("torch",),
    "goodput.train": ("goodput.chaos", "goodput.diagnose", "goodput.report"),
}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # goodput.launch.run
    imported: str  # the module: goodput.train.step, torch.distributed
    line: int
    in_function: bool
    typing_only: bool  # under `if TYPE_CHECKING:`: never loaded

    def __str__(self) -> str:
        where = "in a function" if self.in_function else "at module level"
        return f"{self.importer}:{self.line} imports {self.imported} ({where})"


@dataclass(frozen=True, slots=True)
class Deliberate:
    """An import that breaks a direction on purpose, and never when its module is imported: it
    sits inside a function (it runs when called) or names a type for annotations only."""

    importer: str
    imported: str  # this module or any below it
    why: str

    def excuses(self, found: Import) -> bool:
        return (
            found.importer == self.importer
            and (found.in_function or found.typing_only)
            and _within(found.imported, self.imported)
        )


DELIBERATE = (
    Deliberate(
        "goodput",
        "goodput.train.setup",
        "goodput.setup_torch, the public start of a training script (docs/training.md): "
        "imported when called, so that `import goodput` stays torch-free",
    ),
    Deliberate(
        "goodput.plan.verify",
        "torch",
        "--verify builds the layout in spawned children (run_in_child); torch is imported "
        "there only",
    ),
    Deliberate(
        "goodput.launch.inprocess",
        "torch",
        "goodput launch --in-process hosts the recovery store, torch's TCPStore, which must "
        "outlive every rank: imported when that option is given, so any other launch (and a "
        "login node without torch) stays torch-free",
    ),
    Deliberate(
        "goodput.plan.verify",
        "goodput.train",
        "the children build the trainer's own model, mesh and optimizers, never a copy",
    ),
)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[Import] = []
        self.functions = 0
        self.typing = 0

    def _add(self, node: ast.stmt, imported: str) -> None:
        self.found.append(
            Import(self.module, imported, node.lineno, self.functions > 0, self.typing > 0)
        )

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        for alias in node.names:
            submodule = f"{source}.{alias.name}"  # `from goodput import rundir`
            self._add(node, submodule if submodule in MODULES else source)

    def _in_function(self, node: ast.AST) -> None:
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _in_function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        typing = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        self.typing += typing
        for child in node.body:
            self.visit(child)
        self.typing -= typing
        for child in node.orelse:
            self.visit(child)


def _read_imports() -> list[Import]:
    found = []
    for module, path in MODULES.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found += visitor.found
    return found


IMPORTS = _read_imports()


def _goodput_module(imported: str) -> str | None:
    """The goodput module an import loads (``from goodput.x import name`` loads goodput.x)."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


# module -> what importing it runs: its imports at module level, but the typing-only ones.
AT_IMPORT: dict[str, set[str]] = {}
for _found in IMPORTS:
    if not (_found.in_function or _found.typing_only):
        AT_IMPORT.setdefault(_found.importer, set()).add(_found.imported)


def _loaded_with(module: str) -> set[str]:
    """Every module importing ``module`` loads: its packages' ``__init__`` and their module-level
    imports, transitively (what runs at import time, never what a function imports)."""
    loaded: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in loaded:
            continue
        loaded.add(name)
        ours = _goodput_module(name)
        if ours is None:
            continue
        parts = ours.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += AT_IMPORT.get(ours, ())
    return loaded


@functools.cache
def _loads_torch(imported: str) -> bool:
    return any(_within(name, "torch") for name in _loaded_with(imported))


def _breaks(found: Import, forbidden: str) -> bool:
    if forbidden == "torch":
        return not found.typing_only and _loads_torch(found.imported)
    return _within(found.imported, forbidden)


def _is_root(module: str) -> bool:
    """A module at the package's root, ``goodput`` itself included."""
    return module == "goodput" or (
        module.count(".") == 1 and not (PACKAGE / module.split(".")[1]).is_dir()
    )


def _is_root_leaf(module: str) -> bool:
    return _is_root(module) and module not in ROOT_FACES


def _broken_directions(imports: list[Import]) -> list[str]:
    broken = []
    for found in imports:
        if any(rule.excuses(found) for rule in DELIBERATE):
            continue
        part = ".".join(found.importer.split(".")[:2])
        broken += [
            f"{found}: {part} never imports {forbidden}"
            for forbidden in NEVER.get(part, ())
            if _breaks(found, forbidden)
        ]
        if _within(found.imported, "goodput.testing") and not _within(
            found.importer, "goodput.testing"
        ):
            broken.append(f"{found}: only tests and benchmarks import goodput.testing")
        if not _is_root_leaf(found.importer):
            continue
        imported = _goodput_module(found.imported)
        if imported and not _is_root(imported):
            broken.append(f"{found}: a root module imports no goodput part")
        if _breaks(found, "torch"):
            broken.append(f"{found}: a root module imports no torch")
    return broken


def _part(module: str) -> str:
    """The part a module belongs to (train with its wings); a root module is one of its own."""
    return module if _is_root(module) else ".".join(module.split(".")[:2])


def _wing(module: str) -> str:
    """Inside train/: the wing a module belongs to, or the module itself at train/'s top."""
    parts = module.split(".")
    in_a_wing = parts[1:2] == ["train"] and len(parts) > 2 and parts[2] in TRAIN_WINGS
    return ".".join(parts[:3]) if in_a_wing else module


def _circles(edges: set[tuple[str, str]]) -> list[set[str]]:
    """The groups of nodes that reach each other (a circle's members), each of two or more."""
    after: dict[str, set[str]] = {}
    for start, end in edges:
        after.setdefault(start, set()).add(end)
    reach = {}
    for node in after:
        seen: set[str] = set()
        todo = list(after[node])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += after.get(name, ())
        reach[node] = seen
    circles: list[set[str]] = []
    for node, seen in sorted(reach.items()):
        group = {node} | {other for other in seen if node in reach.get(other, ())}
        if len(group) > 1 and group not in circles:
            circles.append(group)
    return circles


def _edges(imports: list[Import], node: Callable[[str], str]) -> set[tuple[str, str]]:
    """Who imports whom, as ``node`` groups modules. A name imported for annotations only
    (`if TYPE_CHECKING:`) is no edge: it is never loaded and orders nothing; a deliberate
    exception is none either (it is named above, with its reason)."""
    edges = set()
    for found in imports:
        imported = _goodput_module(found.imported)
        if imported is None or found.typing_only:
            continue
        if any(rule.excuses(found) for rule in DELIBERATE):
            continue
        start, end = node(found.importer), node(imported)
        if start != end:
            edges.add((start, end))
    return edges


def test_every_import_keeps_the_directions():
    assert _broken_directions(IMPORTS) == []


def test_every_deliberate_exception_is_still_taken():
    # An exception nothing needs any more is a hole left open for the next import.
    unused = [rule for rule in DELIBERATE if not any(rule.excuses(found) for found in IMPORTS)]
    assert unused == []


def test_the_only_circle_between_parts_is_train_and_eval():
    # The loop builds and runs the in-loop eval (eval/heldout.py, gate.py); eval/inference.py
    # builds the trainer's model for a checkpoint. Every other part sits on one side of every
    # other (never in a circle between files: below).
    assert _circles(_edges(IMPORTS, _part)) == [{"goodput.train", "goodput.eval"}]


def _train_edges() -> set[tuple[str, str]]:
    inside = [
        found
        for found in IMPORTS
        if _within(found.importer, "goodput.train") and _within(found.imported, "goodput.train")
    ]
    return _edges(inside, _wing)


def test_no_circle_between_the_wings_of_train_and_its_top():
    # config/ optim/ monitor/ parallel/ convert/ and the loop's modules at train/'s top.
    # The model's own pieces that layouts touch (ring attention, the DTensor helpers) sit
    # beside the model, not in parallel/, which imports the model.
    assert _circles(_train_edges()) == []


def test_no_circle_between_modules():
    assert _circles(_edges(IMPORTS, lambda module: module)) == []


PLANTED = """
from __future__ import annotations

from typing import TYPE_CHECKING

from goodput import rundir

if TYPE_CHECKING:
    from torch import nn


def restart():
    from ..train import step

    import torch.distributed
"""


def test_a_planted_import_inside_a_function_is_caught():
    # The checks above are only as good as the walk: imports inside a function, relative ones
    # and `from goodput import module` are found; a typing-only torch is not a torch import.
    visitor = _Imports("goodput.launch.planted", is_package=False)
    visitor.visit(ast.parse(textwrap.dedent(PLANTED)))
    assert {(found.imported, found.in_function, found.typing_only) for found in visitor.found} >= {
        ("goodput.rundir", False, False),
        ("torch", False, True),
        ("goodput.train.step", True, False),
        ("torch.distributed", True, False),
    }
    assert _broken_directions(visitor.found) == [
        "goodput.launch.planted:13 imports goodput.train.step (in a function): goodput.launch "
        "never imports goodput.train",
        "goodput.launch.planted:13 imports goodput.train.step (in a function): goodput.launch "
        "never imports torch",
        "goodput.launch.planted:15 imports torch.distributed (in a function): goodput.launch "
        "never imports torch",
    ]
    circle = {("goodput.train", "goodput.launch"), ("goodput.launch", "goodput.train")}
    assert _circles(circle) == [{"goodput.train", "goodput.launch"}]
