"""The node-local copy: a run's newest complete checkpoint copied to node-local disk before the
relaunch that resumes from it: ``goodput broadcast --checkpoint RUN_DIR --dest DEST``.

The checkpoint is the newest ``step-N`` folder with ``.complete`` under ``RUN_DIR/checkpoints``
(or under RUN_DIR itself when it holds the ``step-N`` folders, as a ``[checkpoint] folder``
does); each newer, incomplete one is named and skipped, as ``--resume auto`` does. It goes to
DEST/step-N on every host by ``broadcast``'s greedy tree, under its own name, so that a trainer
with ``[checkpoint] local_dir = DEST`` finds it. A copy appears only whole (the transport renames
a finished temp copy into place); only after that, and only on that host, are the older
``step-N`` folders at DEST removed, so a host whose copy failed keeps what it had. Only folders
that carry the transport's marker (node-local copies made by goodput) are ever removed, and DEST
may not be the run's checkpoint folder, lie within it or hold it: a run's own checkpoints are
never touched. A checkpoint saved without ``checksums.json`` is not copied: the trainer could not
verify the copy, so would not read it. Copying does not verify: the trainer checks each copy
where and when it reads it. Nothing here imports torch.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from goodput.errors import GoodputError
from goodput.launch.broadcast import DEFAULT_FANOUT, ORIGIN, BroadcastResult, broadcast
from goodput.launch.transports import MARKER, LocalTransport, RemoteTransport, Transport
from goodput.rundir import CHECKSUMS, STEP_DIR, checkpoints_dir, list_checkpoints

REMOVE_THREADS = 64  # hosts cleaned up at once (one ssh each for the remote transports)
REMOVE_TIMEOUT_S = 300.0


@dataclass(slots=True)
class CheckpointCopy:
    checkpoint: Path | None  # the saved checkpoint that was sent; None: nothing was
    why_not: str = ""  # why nothing was
    destination: str = ""  # DEST/step-N, as given ({host} not replaced)
    result: BroadcastResult = field(default_factory=BroadcastResult)
    removed: dict[str, list[str]] = field(default_factory=dict)  # host -> older steps removed


def copy_checkpoint(
    run_dir: Path,
    hosts: Sequence[str],
    dest: str,
    transport_for: Callable[[str], Transport],
    *,
    fanout: int = DEFAULT_FANOUT,
    retries: int = 2,
    min_success: int | None = None,
    progress: Callable[[str], None] = print,
) -> CheckpointCopy:
    """Send the newest complete checkpoint of ``run_dir`` to ``dest``/step-N on every host by
    ``broadcast`` (the options are its own); ``transport_for`` makes the transport for a
    destination pattern. Raises ``GoodputError`` where ``broadcast`` does."""
    root = _checkpoint_root(run_dir)
    newest = None
    for checkpoint in reversed(list_checkpoints(root)):
        if checkpoint.complete:
            newest = checkpoint
            break
        progress(f"broadcast: skipping {checkpoint.path}: incomplete (no .complete marker)")
    if newest is None:
        return CheckpointCopy(None, f"{run_dir} has no complete checkpoint")
    if not (newest.path / CHECKSUMS).is_file():
        return CheckpointCopy(
            None,
            f"{newest.path} has no {CHECKSUMS} (saved before goodput wrote checksums), so the "
            "trainer could not verify a copy; it reads this checkpoint where it is",
        )
    destination = posixpath.join(dest, newest.path.name)
    transport = transport_for(destination)
    _check_apart(root, {posixpath.dirname(transport.path(host)) for host in hosts})
    result = broadcast(
        newest.path,
        hosts,
        transport=transport,
        fanout=fanout,
        retries=retries,
        min_success=min_success,
        progress=progress,
    )
    removed: dict[str, list[str]] = {}

    def remove(host: str) -> None:
        try:
            removed[host] = remove_older(transport, host, newest.step)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            progress(f"broadcast: {host}: older node-local copies left in place ({exc})")

    with ThreadPoolExecutor(max_workers=max(1, min(len(result.succeeded), REMOVE_THREADS))) as pool:
        list(pool.map(remove, result.succeeded))
    return CheckpointCopy(newest.path, "", destination, result, removed)


def _checkpoint_root(run_dir: Path) -> Path:
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        return root
    if run_dir.is_dir() and any(STEP_DIR.fullmatch(path.name) for path in run_dir.iterdir()):
        return run_dir  # a [checkpoint] folder outside the run directory
    raise GoodputError.usage(
        run_dir,
        "holds no checkpoints/ folder and no step-N checkpoints",
        "pass the run directory (train.run_dir) or its checkpoint folder",
    )


def _check_apart(root: Path, folders: set[str]) -> None:
    """Refuse copying into the run's checkpoint folder ``root``, within it or above it: the
    node-local copies and their clean-up must never meet the checkpoints they are copies of."""
    real_root = Path(os.path.realpath(root))
    for folder in sorted(folders):
        real = Path(os.path.realpath(folder))
        if real.is_relative_to(real_root) or real_root.is_relative_to(real):
            raise GoodputError.usage(
                "--dest",
                f"{folder} is the run's checkpoint folder {real_root}, or within or above it",
                "copy to a node-local folder outside the run, e.g. /local/scratch/ckpt",
            )


def remove_older(transport: Transport, host: str, step: int) -> list[str]:
    """Remove the node-local copies (``step-N`` folders) with N < ``step`` beside ``host``'s
    copy (only those that carry the transport's marker: goodput's own copies); their names."""
    parent = posixpath.dirname(transport.path(host))
    if isinstance(transport, LocalTransport):
        older = [
            c.path
            for c in list_checkpoints(Path(parent))
            if c.step < step and _is_node_local_copy(c.path)
        ]
        for path in older:
            shutil.rmtree(path)
        return [path.name for path in older]
    # The remote transports' own ssh (with --ssh-config when given). Fixed-width names: `test`
    # reads "00000004" as decimal. Run by sh, whatever the login shell is; no "!", which
    # csh-family login shells expand.
    assert isinstance(transport, RemoteTransport)
    script = (
        f"cd {shlex.quote(parent)} 2>/dev/null || exit 0; for d in step-{'[0-9]' * 8}; do "
        f'if [ -L "$d" ] || [ -L "$d/{MARKER}" ]; then continue; fi; '
        f'if [ -d "$d" ] && [ -f "$d/{MARKER}" ] && [ "${{d#step-}}" -lt {step} ]; then '
        'rm -rf -- "$d" && echo "$d"; fi; '
        "done"
    )
    finished = subprocess.run(
        transport.on(host, "sh", "-c", script),
        capture_output=True,
        text=True,
        timeout=REMOVE_TIMEOUT_S,
    )
    if finished.returncode != 0:
        message = " ".join(finished.stderr.split())[-300:]
        raise RuntimeError(f"ssh exited {finished.returncode}: {message}")
    return finished.stdout.split()


def _is_node_local_copy(path: Path) -> bool:
    marker = path / MARKER
    return not path.is_symlink() and not marker.is_symlink() and marker.is_file()


def describe(copied: CheckpointCopy, num_hosts: int) -> str:
    """What was copied where, in a line or two."""
    if copied.checkpoint is None:
        return f"broadcast: nothing copied to node-local disk: {copied.why_not}"
    result = copied.result
    by_origin = sum(copy.source == ORIGIN for copy in result.copies)
    line = (
        f"broadcast: copied {copied.checkpoint} to node-local disk as {copied.destination} on "
        f"{len(result.succeeded)} of {num_hosts} hosts in {result.makespan_s:.1f} s "
        f"({by_origin} copies from the origin)"
        + (f"; failed: {', '.join(result.failed)}" if result.failed else "")
    )
    names = sorted({name for removed in copied.removed.values() for name in removed})
    if names:
        cleaned = sum(bool(removed) for removed in copied.removed.values())
        line += f"\nbroadcast: removed older {', '.join(names)} on {cleaned} host(s)"
    return line
