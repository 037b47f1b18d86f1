"""Checksums written with every checkpoint; ``goodput broadcast --checkpoint`` copying the newest
complete one to node-local disk on "hosts" in a real child process (folders by the local
transport; rsync over the loopback sshd of ``.ci/start-sshd`` where it answers); and real 2-rank
gloo resumes that read a verified node-local copy, or the saved checkpoint when the copy is
damaged, of another step, or cannot be verified."""

import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from goodput.checkpoint.checksums import CHECKSUMS, checkpoint_files, read_checksums
from goodput.config import to_toml
from goodput.io import sha256_file
from goodput.launch.transports import MARKER
from goodput.rundir import checkpoints_dir, step_dir
from goodput.testing.dist import run_distributed
from goodput.testing.sshd import SSH_CONFIG, sshd_answers
from goodput.testing.tiny import tiny_run_config
from goodput.train.convert.checkpoints import from_torch, to_torch
from goodput.train.loop import train


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank run of 8 steps with complete checkpoints at steps 4 and 8; its losses."""
    directory = tmp_path_factory.mktemp("saved")
    cfg = tiny_run_config(directory)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval_steps=4))
    losses = run_distributed(train_on_rank, 2, cfg)[0]
    return cfg, checkpoints_dir(cfg.train.run_dir), losses


def train_on_rank(rank, world_size, cfg):
    return train(cfg)


def resumed(cfg, output, **checkpoint):
    """``cfg`` resumed into a fresh output folder, saving nothing."""
    return replace(
        cfg,
        train=replace(cfg.train, run_dir=str(output)),
        checkpoint=replace(cfg.checkpoint, interval_steps=0, **checkpoint),
    )


def tree(folder):
    """Every file's bytes but the marker's, which only node-local copies have."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path != folder / MARKER
    }


def copy_by_hand(source, copy):
    """A copy as an earlier ``goodput broadcast --checkpoint`` left it: marked as goodput's."""
    shutil.copytree(source, copy)
    (copy / MARKER).write_text('{"source": "an earlier copy"}\n')


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)


def test_every_complete_checkpoint_carries_the_checksums_of_its_files(saved, tmp_path):
    cfg, root, _ = saved
    for step in (4, 8):
        directory = step_dir(root, step)
        digests = read_checksums(directory)
        assert digests is not None and sorted(digests) == checkpoint_files(directory)
        # Both ranks' data and RNG files, rank 0's small files and DCP's .metadata.
        assert {"__0_0.distcp", "__1_0.distcp", "rng/rank-00001.json", ".metadata"} <= set(digests)
        assert {"train_state.json", "config.toml", "rng/rank-00000.json"} <= set(digests)
        assert all(sha256_file(directory / name) == digest for name, digest in digests.items())
    weights, config = tmp_path / "weights.pt", tmp_path / "model.toml"
    to_torch(step_dir(root, 8), weights)
    config.write_text(to_toml(cfg))
    imported = from_torch(weights, config, tmp_path / "imported")
    assert read_checksums(imported) == {
        name: sha256_file(imported / name) for name in checkpoint_files(imported)
    }


def goodput_broadcast(*args):
    return subprocess.run(
        [sys.executable, "-m", "goodput", "broadcast", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_broadcast_copies_the_newest_complete_checkpoint_only(saved, tmp_path):
    _, root, _ = saved
    run = tmp_path / "run"
    shutil.copytree(root, checkpoints_dir(run))
    newer = step_dir(checkpoints_dir(run), 12)
    shutil.copytree(step_dir(root, 8), newer)
    (newer / ".complete").unlink()  # as a save killed mid-flush leaves it
    older = tmp_path / "nodes" / "a" / "ckpt" / "step-00000004"
    copy_by_hand(step_dir(root, 4), older)  # copied before an earlier relaunch
    dest = tmp_path / "nodes" / "{host}" / "ckpt"

    copying = goodput_broadcast(
        "--checkpoint", run, "--transport", "local", "--hosts", "a,b", "--dest", dest
    )
    assert copying.returncode == 0, copying.stderr
    assert f"skipping {newer}: incomplete" in copying.stderr
    saved_step = step_dir(checkpoints_dir(run), 8)
    assert copying.stdout.startswith(
        f"broadcast: copied {saved_step} to node-local disk as {dest}/step-00000008 on 2 of 2 "
        "hosts in "
    )
    assert "removed older step-00000004 on 1 host(s)" in copying.stdout
    for host in ("a", "b"):
        copied = tmp_path / "nodes" / host / "ckpt"
        assert [path.name for path in copied.iterdir()] == ["step-00000008"]  # no temp left
        assert tree(copied / "step-00000008") == tree(saved_step)

    (saved_step / CHECKSUMS).unlink()  # as saved by a goodput before checksums
    again = goodput_broadcast(
        "--checkpoint", run, "--transport", "local", "--hosts", "a", "--dest", dest
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout == (
        f"broadcast: nothing copied to node-local disk: {saved_step} has no {CHECKSUMS} (saved "
        "before goodput wrote checksums), so the trainer could not verify a copy; it reads this "
        "checkpoint where it is\n"
    )
    refused = goodput_broadcast("--checkpoint", tmp_path, "--hosts", "a", "--dest", dest)
    assert refused.returncode == 2 and "no step-N checkpoints" in refused.stderr


@pytest.mark.skipif(not sshd_answers(), reason="needs the test sshd of .ci/start-sshd")
def test_over_ssh_older_copies_are_removed_by_the_same_ssh(saved, tmp_path):
    _, root, _ = saved
    older = tmp_path / "node1" / "ckpt" / "step-00000004"
    copy_by_hand(step_dir(root, 4), older)
    (tmp_path / "node1" / "ckpt" / "step-00000004x").mkdir()  # not a step folder: left alone
    # A step folder goodput did not copy (no marker): left alone too.
    shutil.copytree(step_dir(root, 4), tmp_path / "node1" / "ckpt" / "step-00000002")
    dest = tmp_path / "{host}" / "ckpt"
    copying = goodput_broadcast(
        "--checkpoint", root.parent, "--transport", "rsync", "--ssh-config", SSH_CONFIG,
        "--hosts", "node1,node2", "--dest", dest,
    )  # fmt: skip
    assert copying.returncode == 0, copying.stderr
    assert "removed older step-00000004 on 1 host(s)" in copying.stdout
    for host in ("node1", "node2"):
        assert tree(tmp_path / host / "ckpt" / "step-00000008") == tree(step_dir(root, 8))
    assert sorted(path.name for path in (tmp_path / "node1" / "ckpt").iterdir()) == [
        "step-00000002",
        "step-00000004x",
        "step-00000008",
    ]


def test_the_node_local_copy_never_imports_torch(saved, tmp_path):
    _, root, _ = saved
    code = (
        "import sys; from goodput import cli; "
        f"cli.main(['broadcast', '--checkpoint', {str(root.parent)!r}, '--transport', 'local', "
        f"'--hosts', 'a', '--dest', {str(tmp_path / '{host}')!r}]); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.splitlines()[-1] == "False", result.stderr
    assert (tmp_path / "a" / "step-00000008" / ".complete").is_file()


def resume_twice(rank, world_size, first, second, damaged):
    """Two resumes on one pair of ranks; between them rank 0 flips a byte of ``damaged``."""
    losses = [train(first)]
    if rank == 0:
        flip_a_byte(damaged)
    losses.append(train(second))  # rank 1 waits in its first collective for rank 0
    return losses


def test_a_verified_local_copy_is_read_and_a_damaged_one_is_not(saved, tmp_path, capfd):
    cfg, root, straight = saved
    local = tmp_path / "local"
    shutil.copytree(step_dir(root, 4), local / "step-00000004")
    damaged = local / "step-00000004" / "__1_0.distcp"
    at_step_4 = str(step_dir(root, 4))
    capfd.readouterr()
    from_local, from_saved = run_distributed(
        resume_twice,
        2,
        resumed(cfg, tmp_path / "a", resume=at_step_4, local_dir=str(local)),
        resumed(cfg, tmp_path / "b", resume=at_step_4, local_dir=str(local)),
        damaged,
    )[0]
    out = capfd.readouterr().out
    assert from_local == from_saved  # the same bytes, whichever copy they came from
    assert from_local == straight[4:]
    resumes = [line for line in out.splitlines() if line.startswith("resume: from")]
    assert len(resumes) == 2
    assert resumes[0].startswith(f"resume: from {local / 'step-00000004'} (step 4) loaded in ")
    assert "; node-local copy read on 1 of 1 host(s), checksums checked in " in resumes[0]
    assert resumes[1].startswith(f"resume: from {at_step_4} (step 4) loaded in ")
    assert "; node-local copy read on 0 of 1 host(s)" in resumes[1]
    warnings = [line for line in out.splitlines() if line.startswith("warning: node-local")]
    assert len(warnings) == 1  # one line for the host, not one a rank
    assert warnings[0].startswith(f"warning: node-local copy {local / 'step-00000004'} on ")
    assert warnings[0].endswith(
        ": __1_0.distcp: checksum differs from the saved checkpoint's; reading the saved "
        f"checkpoint {at_step_4} instead"
    )


def test_copies_of_another_step_or_without_checksums_are_not_read(saved, tmp_path, capsys):
    cfg, root, _ = saved
    run = tmp_path / "run"
    shutil.copytree(root.parent, run)  # the whole run folder: its run.json makes it one
    local = tmp_path / "local"
    shutil.copytree(step_dir(root, 4), local / "step-00000004")
    newest = step_dir(checkpoints_dir(run), 8)
    capsys.readouterr()
    # auto takes step 8, of which there is no local copy; 1 rank loads the 2-rank checkpoint.
    assert train(resumed(cfg, run, local_dir=str(local))) == []
    out = capsys.readouterr().out
    assert f"resume: from {newest} (step 8)" in out and "read on 0 of 1 host(s)" in out
    assert "warning" not in out

    shutil.copytree(newest, local / newest.name)
    (newest / CHECKSUMS).unlink()  # saved before checksums: still resumes, where it was saved
    assert train(resumed(cfg, run, local_dir=str(local))) == []
    out = capsys.readouterr().out
    assert f"warning: {newest} has no {CHECKSUMS} (saved before goodput wrote them)" in out
    assert f"resume: from {newest} (step 8)" in out and "read on 0 of 1 host(s)" in out
