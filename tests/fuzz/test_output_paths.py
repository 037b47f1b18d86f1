"""``goodput.outputs``' guard over generated trees: files, folders, symbolic links and hard links
inside and outside a run directory and its checkpoint. The property: the guard refuses with a
usage error, or the path it approves resolves into no run directory or checkpoint (but what the
run holds of that kind), is no other name of a run's file, and is new, empty or of its kind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import rundir
from goodput.errors import ExitCode, GoodputError
from goodput.outputs import (
    HTML_GENERATOR,
    HTML_REPORT,
    LAUNCH_DIR,
    LAUNCH_LOG,
    NEW_DIR,
    RUN_DIR,
    TORCH_FILE,
    Kind,
    check_output_dir,
    check_output_file,
)

OURS = f"<html><head>{HTML_GENERATOR}</head></html>"
NAMES = ["a.html", "b.log", "metrics.jsonl", "config.toml", "c", "x.out", "d.pt"]
SKELETON_DIRS = ["run", "run/checkpoints", "run/checkpoints/step-00000002", "out", "out/sub"]
FILE_KINDS = [HTML_REPORT, LAUNCH_LOG, TORCH_FILE]
DIR_KINDS = [NEW_DIR, RUN_DIR, LAUNCH_DIR]

entries = st.lists(
    st.tuples(
        st.sampled_from(["", *SKELETON_DIRS]),
        st.sampled_from(NAMES + ["e", "f"]),
        st.sampled_from(["foreign", "ours", "empty", "dir", "symlink", "hardlink"]),
        st.integers(0, 1000),
    ),
    max_size=12,
)


def build(root: Path, extra: list[tuple[str, str, str, int]]) -> None:
    for folder in SKELETON_DIRS:
        (root / folder).mkdir()
    run, step = root / "run", root / "run/checkpoints/step-00000002"
    (run / rundir.RUN_RECORD).write_text("{}")
    (run / rundir.METRICS).write_text('{"step": 1}\n')
    (run / rundir.CONFIG).write_text("[model]\n")
    (run / "launch.log").write_text("launch: ...\n")
    (step / rundir.METADATA).write_bytes(b"\x80")
    (step / rundir.TRAIN_STATE).write_text('{"step": 2}')
    (root / "out/page.html").write_text(OURS)
    for folder, name, what, pick in extra:
        path = root / folder / name
        if os.path.lexists(path):
            continue
        existing = sorted(p for p in root.rglob("*") if p != path)
        other = existing[pick % len(existing)] if existing else root
        if what == "dir":
            path.mkdir()
        elif what == "symlink":
            path.symlink_to(other if pick % 3 else root / "nowhere" / name)
        elif what == "hardlink" and other.is_file() and not other.is_symlink():
            os.link(other, path)
        else:
            path.write_text({"foreign": "someone's data\n", "ours": OURS}.get(what, ""))


def allowed_in_run(real: Path, run: Path, kind: Kind) -> bool:
    if kind.run_itself and real == run:
        return True
    return kind.run_names is not None and real.parent == run and kind.run_names(real.name)


def check_approved(root: Path, path: Path, kind: Kind, is_dir: bool) -> None:
    run = (root / "run").resolve()
    step = (root / "run/checkpoints/step-00000002").resolve()
    real = Path(os.path.realpath(path))
    link = Path(os.path.realpath(path.parent)) / path.name
    for place in {real, link}:
        assert not place.is_relative_to(step), place
        if place.is_relative_to(run):
            assert allowed_in_run(place, run, kind), place
            assert not place.is_relative_to(run / rundir.CHECKPOINTS), place
    if not os.path.exists(real):
        return
    status = os.stat(real)
    run_files = {(s.st_dev, s.st_ino) for s in map(os.lstat, run.rglob("*"))}
    if is_dir:
        assert real.is_dir()
        assert real == run or (status.st_dev, status.st_ino) not in run_files
        return
    assert real.is_file() and status.st_nlink == 1
    if not (real == link and allowed_in_run(real, run, kind)):  # a log beside the run's files
        assert (status.st_dev, status.st_ino) not in run_files
    assert status.st_size == 0 or (kind.is_ours is not None and kind.is_ours(real))


@given(
    extra=entries,
    folder=st.sampled_from(["", "run", "out", "out/sub", "link-to-run", "link-to-step"]),
    name=st.sampled_from([*NAMES, "e", "f", "page.html", "launch.log", "step-00000002"]),
    kind_index=st.integers(0, 5),
)
def test_the_guard_never_approves_a_run_file_or_a_foreign_one(extra, folder, name, kind_index):
    with tempfile.TemporaryDirectory() as temp:
        root = Path(temp)
        build(root, extra)
        if not os.path.lexists(root / "link-to-run"):
            (root / "link-to-run").symlink_to(root / "run")
        if not os.path.lexists(root / "link-to-step"):
            (root / "link-to-step").symlink_to(root / "run/checkpoints/step-00000002")
        path = root / folder / name
        is_dir = kind_index >= len(FILE_KINDS)
        kind = DIR_KINDS[kind_index - 3] if is_dir else FILE_KINDS[kind_index]
        check = check_output_dir if is_dir else check_output_file
        try:
            check(path, kind, "--out")
        except GoodputError as error:
            assert error.code == ExitCode.USAGE and error.render().startswith("--out ")
            return
        check_approved(root, path, kind, is_dir)
