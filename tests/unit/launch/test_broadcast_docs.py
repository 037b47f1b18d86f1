"""docs/launch.md's layered-venv example, run as written over the test sshd: ``python`` on PATH is
a base interpreter in its own prefix (``goodput.testing.venvs``) whose site-packages holds
``base_pkg``, ``~/.ssh/cluster_config`` includes the sshd's config and ``$PBS_NODEFILE`` names
``node1``. The copy's ``sys.path`` must lie under its ``--dest`` and import ``base_pkg`` from its
``goodput-layers/``, the base's site-packages renamed away first."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.sshd import SSH_CONFIG, sshd_answers
from goodput.testing.venvs import SITE_DIRS, make_base, package, run

pytestmark = pytest.mark.skipif(
    not sshd_answers(),
    reason="needs the test sshd (apt: openssh-server openssh-client rsync zstd; .ci/start-sshd)",
)


def _example() -> list[str]:
    page = (REPO / "docs" / "launch.md").read_text()
    section = re.search(r"\*\*Layered venvs\.\*\*.*?```sh\n.*?```", page, re.S)
    assert section is not None
    return command_lines(section.group(0))


@pytest.mark.timeout(300)
def test_the_layered_venv_example_runs_as_written(tmp_path: Path) -> None:
    python = make_base(tmp_path / "base")
    (python.parent / "python").symlink_to(python.name)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "cluster_config").write_text(f"Include {SSH_CONFIG}\n")
    (tmp_path / "nodefile").write_text("node1\n")
    user = f"goodput-doc-{os.getpid()}"
    path = f"{python.parent}:{Path(sys.executable).parent}:{os.defpath}"
    env = outside_any_job(PATH=path, HOME=str(home), USER=user)
    env["PBS_NODEFILE"] = str(tmp_path / "nodefile")
    work = tmp_path / "work"
    work.mkdir()
    dest = Path("/tmp") / user / "layered"
    try:
        outputs = []
        for number, line in enumerate(_example()):
            if number == 1:  # the venv exists: give its base a package to import
                site = json.loads(run(work / "layered" / "bin" / "python", "-I", "-S", "-c",
                                      SITE_DIRS))[0]  # fmt: skip
                package(Path(site), "base_pkg")
                base_site = Path(site)
            done = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True,
                                  text=True, timeout=240)  # fmt: skip
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            outputs.append(done.stdout)
        assert outputs[1].startswith("broadcast: 1 of 1 hosts in ")
        sys_path = outputs[2].split("sys.path = [", 1)[1].split("]", 1)[0]
        site_paths = [p for p in re.findall(r"'(/[^']+)'", sys_path) if "-packages" in p]
        assert site_paths and all(p.startswith(f"{dest}/") for p in site_paths), outputs[2]
        base_site.rename(base_site.with_name("moved-away"))
        found = run(dest / "bin" / "python", "-c", "import base_pkg; print(base_pkg.__file__)")
        assert found.startswith(f"{dest}/goodput-layers/")
    finally:
        shutil.rmtree(dest.parent, ignore_errors=True)
