"""The environment broadcast over real ssh: star against tree against tree + ``--compress``.

Hosts: aliases of the loopback sshd that ``.ci/start-sshd`` runs (its ``ssh_config`` included,
with more aliases of the same server added, so a host-to-host copy really runs both ssh hops).
Source: ``shared/``, standing in for the shared filesystem: a copy of the site-packages of the
venv running this (the project's: torch included, about 2 GB) and a venv layered on it by a
``.pth`` line. Every "host" is this machine, so each needs its own ``--dest`` (``{host}`` in
it), which a venv refuses (it is pointed at one path): the variants send ``shared/`` as a
folder, the same bytes a staged venv is; the layered venv itself is then sent once, to one
host, and checked there. Variants, all ``--transport tar``: star (only the origin serves), tree
(finished hosts serve too), tree + compress (one archive, host to host). ``REPEATS`` repeats,
order rotated; figures are medians.

Bytes read, counted by the readers, never estimated: the archive's single pass over the source
as its reader counts it (``ArchiveStats.source_bytes_read``), and every ``tar -c`` or ``cat
ARCHIVE`` the origin starts, through
a ``tar`` and a ``cat`` first on ``PATH`` that run the real one and log its ``rchar`` (read
before the child is reaped, ``waitid(WNOWAIT)``) with its arguments. Source bytes: what was read
from the source folder and its layer; origin bytes: all the origin read (the source, then its
staged copy or archive once per first-hop copy). After the last repeat one copy is checked to
import torch from its own ``goodput-layers/``, with the layer's source path hidden.

``python -m benchmarks broadcast``; ``GOODPUT_BENCH_QUICK=1``: a small folder for the layer and
2 hosts, one repeat (what the test runs, so this file is tested).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.launch.broadcast import ORIGIN, broadcast, simulate
from goodput.launch.transports import make_transport
from goodput.testing.sshd import SSH_CONFIG

QUICK = os.environ.get("GOODPUT_BENCH_QUICK") == "1"
REPEATS = 1 if QUICK else 2
NUM_HOSTS = 2 if QUICK else 4
FANOUT = 1  # one copy at a time per source: 4 hosts take 4 rounds as a star, 3 as a tree
VARIANTS = {"star": (False, False), "tree": (True, False), "tree+compress": (True, True)}
WRAPPER = """#!{python}
import json, os, subprocess, sys
proc = subprocess.Popen([{real!r}] + sys.argv[1:])
os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: /proc still there
with open(f"/proc/{{proc.pid}}/io") as io:
    rchar = int(next(line for line in io if line.startswith("rchar:")).split()[1])
with open({log!r}, "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "rchar": rchar}}) + "\\n")
sys.exit(proc.wait())
"""


def _ssh_config(folder: Path) -> tuple[Path, list[str]]:
    hosts = [f"bench{i}" for i in range(1, NUM_HOSTS + 1)]
    config = folder / "ssh_config"
    server = SSH_CONFIG.read_text().split("Host node1 node2 node3 node4", 1)[1]
    config.write_text(f"Include {SSH_CONFIG}\nHost {' '.join(hosts)}{server}")
    return config, hosts


@dataclass(frozen=True, slots=True)
class Setup:
    venv: Path
    layer: Path
    hosts: list[str]
    config: Path
    log: Path  # the wrapped tar and cat, one JSON line each
    nodes: Path


def _layered_venv(folder: Path) -> tuple[Path, Path]:
    """A venv whose .pth adds the layer: a copy of the running venv's site-packages (quick: a
    small package)."""
    layer = folder / "shared" / "site-packages"
    if QUICK:
        (layer / "quick_pkg").mkdir(parents=True)
        (layer / "quick_pkg" / "__init__.py").write_text("VALUE = 1\n" * 10_000)
    else:
        shutil.copytree(sysconfig.get_paths()["purelib"], layer, symlinks=True)
    venv = folder / "shared" / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "layer.pth").write_text(f"{layer}\n")
    return venv, layer


def _wrappers(folder: Path) -> Path:
    """``tar`` and ``cat`` first on PATH, each logging its arguments and ``rchar``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    log = folder / "reads.jsonl"
    for name in ("tar", "cat"):
        real = shutil.which(name)
        assert real is not None, name
        script = WRAPPER.format(python=sys.executable, real=real, log=str(log))
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    os.environ["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    return log


def _one(setup: Setup, name: str) -> dict[str, Any]:
    """One broadcast of ``name``; its time and bytes read, the copies removed after."""
    relay, compress = VARIANTS[name]
    dest = str(setup.nodes / "{host}" / "shared")
    transport = make_transport("tar", dest, setup.config, compress=compress)
    setup.log.write_text("")
    began = time.perf_counter()
    result = broadcast(setup.venv.parent, setup.hosts, transport=transport, fanout=FANOUT,
                       relay=relay, progress=lambda line: None)  # fmt: skip
    seconds = time.perf_counter() - began
    in_process = result.archive.source_bytes_read if result.archive is not None else 0
    reads = [json.loads(line) for line in setup.log.read_text().splitlines()]
    from_source = sum(r["rchar"] for r in reads if _packs(r["argv"], setup.venv.parent))
    shutil.rmtree(setup.nodes)
    return {
        "seconds": seconds,
        "source_bytes_read": in_process + from_source,
        "origin_bytes_read": in_process + sum(r["rchar"] for r in reads),
        "copies_from_origin": sum(copy.source == ORIGIN for copy in result.copies),
        "archive_bytes": result.archive.archive_bytes if result.archive is not None else None,
        # The origin's staging (the archive) ends before the first copy starts.
        "staging_seconds": min(copy.start_s for copy in result.copies),
        "copy_seconds": statistics.median(copy.seconds for copy in result.copies),
    }


def _packs(argv: list[str], source: Path) -> bool:
    """Whether a logged ``tar -C DIR -c`` packed ``source`` (not a host's copy, not a scratch
    copy of it)."""
    return "-C" in argv and Path(argv[argv.index("-C") + 1]) == source


def _check_import(setup: Setup) -> str:
    """Send the layered venv (compressed) to one host, hide the layer's source, import from the
    copy there."""
    host = setup.hosts[0]
    transport = make_transport("tar", str(setup.nodes / host / "venv"), setup.config,
                               compress=True)  # fmt: skip
    broadcast(setup.venv, [host], transport=transport, progress=lambda line: None)
    module = "quick_pkg" if QUICK else "torch"
    hidden = setup.layer.with_name(setup.layer.name + ".hidden")
    setup.layer.rename(hidden)
    try:
        code = f"import {module}; print({module}.__file__)"
        python = setup.nodes / host / "venv" / "bin" / "python"
        ssh = ["ssh", "-F", str(setup.config), host, f"{python} -c '{code}'"]
        found = subprocess.run(ssh, capture_output=True, text=True, timeout=300, check=True)
    finally:
        hidden.rename(setup.layer)
        shutil.rmtree(setup.nodes)
    return found.stdout.strip()


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="goodput-bench-broadcast-") as tmp:
        folder = Path(tmp)
        config, hosts = _ssh_config(folder)
        venv, layer = _layered_venv(folder)
        old_path = os.environ["PATH"]
        setup = Setup(venv, layer, hosts, config, _wrappers(folder), folder / "nodes")
        try:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
            names = list(VARIANTS)
            for repeat in range(REPEATS):
                for name in names[repeat % 3 :] + names[: repeat % 3]:
                    runs[name].append(_one(setup, name))
            imported_from = _check_import(setup)
        finally:
            os.environ["PATH"] = old_path
        return _figures(runs, hosts, imported_from, _size(layer))


def _size(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _figures(
    runs: dict[str, list[dict[str, Any]]], hosts: list[str], imported_from: str, layer_bytes: int
) -> dict[str, Any]:
    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    figures: dict[str, Any] = {"hosts": len(hosts), "fanout": FANOUT, "repeats": REPEATS}
    figures["layer_bytes"] = layer_bytes
    for name in VARIANTS:
        figures[name] = {
            key: median(name, key)
            for key in (
                "seconds",
                "source_bytes_read",
                "origin_bytes_read",
                "copies_from_origin",
                "staging_seconds",
                "copy_seconds",
            )
        }
        figures[name]["all_seconds"] = [run["seconds"] for run in runs[name]]
    compressed = runs["tree+compress"][0]
    figures["archive_bytes"] = compressed["archive_bytes"]
    tree_rounds, star_rounds = simulate(len(hosts), 1.0, FANOUT)
    figures["model_rounds"] = {"tree": tree_rounds, "star": star_rounds}
    figures["imported_from"] = imported_from
    figures["crossover"] = crossover(figures)
    gib = 1 << 30
    print(
        f"broadcast ({len(hosts)} hosts, fanout {FANOUT}, {layer_bytes / gib:.2f} GiB layer): "
        + "; ".join(
            f"{name} {figures[name]['seconds']:.1f} s, source read "
            f"{figures[name]['source_bytes_read'] / gib:.2f} GiB, origin read "
            f"{figures[name]['origin_bytes_read'] / gib:.2f} GiB"
            for name in VARIANTS
        )
        + f"; archive {compressed['archive_bytes'] / gib:.2f} GiB; import from {imported_from}"
    )
    return figures


def crossover(figures: dict[str, Any], fanout: int = 8) -> dict[str, Any]:
    """Where, by the greedy tree's rounds (``simulate``) at ``fanout``, the measured costs make
    compressing pay: the archive's one-off ``A`` (the compressed run's staging) against what it
    saves each round, ``t_copy - t_zstd`` (the median copy of the tree and of the compressed
    tree). Rounds of N hosts: ceil(log_{fanout+1}(N+1)); the first N with r rounds is
    (fanout+1)**(r-1)."""
    t_copy = figures["tree"]["copy_seconds"]
    t_zstd = figures["tree+compress"]["copy_seconds"]
    archive_s = figures["tree+compress"]["staging_seconds"]
    found: dict[str, Any] = {"fanout": fanout, "t_copy_s": t_copy, "t_zstd_s": t_zstd}
    found["archive_s"] = archive_s
    found["compress_wins_from_hosts"] = None
    if t_zstd < t_copy:
        for rounds in range(1, 16):
            hosts = (fanout + 1) ** (rounds - 1)
            tree_s = simulate(hosts, t_copy, fanout)[0]
            if archive_s + simulate(hosts, t_zstd, fanout)[0] < tree_s:
                found["compress_wins_from_hosts"] = hosts
                break
    return found
