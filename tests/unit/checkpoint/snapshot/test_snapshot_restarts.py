"""In-memory checkpoints (``[checkpoint] memory_interval_steps``) in real 2-rank ``goodput train``
processes on gloo: a killed run resumes from the newest snapshot every rank has — its own, or
its partner's copy on the other (emulated) host when its own is damaged or its host was
replaced — and ends bitwise where a straight run without snapshots ends (losses, weights,
optimizer, RNG and train state); a snapshot set some rank has no intact copy of is refused in
one line and the run resumes from its disk checkpoint; ``resume = "never"`` refuses every
snapshot of the earlier life. Hosts are emulated as ``goodput launch`` names them (their host
file, ``launched_on``, one rank per host); a host's snapshot folder is keyed by its name, so
restarting rank 1 as ``n3`` is a host whose memory is gone. The config keys' refusals are at the
end."""

from __future__ import annotations

import json
import signal
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from goodput import rundir
from goodput.chaos.compare import compare_checkpoints, compare_losses, final_checkpoint
from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.save import Checkpointer
from goodput.checkpoint.snapshot.files import (
    SLOTS,
    Kind,
    host_folder,
    manifest_name,
    memory_root,
    payload_name,
    read_manifest,
    run_key,
)
from goodput.checkpoint.state import CheckpointContents
from goodput.config import from_table, to_toml
from goodput.errors import GoodputError
from goodput.ranks import this_host
from goodput.report.run_files import read_run
from goodput.testing.dist import run_distributed
from goodput.testing.doc_commands import FENCE
from goodput.testing.jobs import REPO
from goodput.testing.ranks import launched_on, start_ranks
from goodput.testing.tiny import tiny_run_config

TIMEOUT_S = 240
STEPS = 8  # tiny_run_config's


def write_run(directory: Path, faults=(), **checkpoint) -> tuple[Path, Path, Path, dict[str, str]]:
    """The tiny run under ``directory`` (a disk checkpoint every 4 steps, ``checkpoint`` on
    top) and a plan of ``faults`` as (id, kind, step, rank): (config, run dir, memory dir,
    environment)."""
    directory.mkdir()
    cfg = tiny_run_config(directory)
    memory = directory / "memory"
    memory.mkdir()
    settings = {"interval_steps": 4, "memory_dir": str(memory), **checkpoint}
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, **settings))
    config = directory / "run.toml"
    config.write_text(to_toml(cfg))
    plan = directory / "plan.json"
    entries = [dict(zip(("id", "kind", "step", "rank"), fault, strict=True)) for fault in faults]
    plan.write_text(json.dumps({"fired_dir": str(directory / "fired"), "faults": entries}))
    return config, Path(cfg.train.run_dir), memory, {"GOODPUT_FAULTS": str(plan)}


def run_ranks(config: Path, env: dict[str, str], *overrides: str) -> list[tuple[int, str, str]]:
    """Both ranks of one attempt, to their end: (exit code, stdout, stderr) by rank."""
    ranks = start_ranks(config, env, *overrides)
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in ranks]
        return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outputs, strict=True)]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()


def run_attempt(
    config: Path, env: dict[str, str], *overrides: str, killed: bool = False
) -> tuple[str, str]:
    """One attempt: (rank 0's stdout, both ranks' stdout and stderr); ``killed``: rank 0
    SIGKILLs itself (a ``kill`` fault) and rank 1 fails on its lost peer, else both finish."""
    ranks = run_ranks(config, env, *overrides)
    every = "\n".join(out + err for _, out, err in ranks)
    codes = [code for code, _, _ in ranks]
    if killed:
        assert codes[0] == -signal.SIGKILL and codes[1] not in (0, None), every
    else:
        assert codes == [0, 0], every
    return ranks[0][1], every


def rank_folder(run_dir: Path, memory: Path, host: str) -> Path:
    """The snapshot folder of ``host`` for the run in ``run_dir``."""
    return host_folder(memory_root(str(memory)), run_key(rundir.checkpoints_dir(run_dir)), host)


def damage(folder: Path, kind: Kind, owner: int, step: int) -> None:
    """Flip the first byte of the payload of ``owner``'s ``kind`` copy of ``step`` in
    ``folder``: its chunk 0 no longer matches its manifest."""
    for slot in range(SLOTS):
        manifest = folder / manifest_name(kind, owner, slot)
        if manifest.exists() and read_manifest(manifest).step == step:
            payload = folder / payload_name(kind, owner, slot)
            data = bytearray(payload.read_bytes())
            data[0] ^= 0xFF
            payload.write_bytes(bytes(data))
            return
    raise AssertionError(f"no {kind} copy of rank {owner}'s step {step} in {folder}")


def first_records(run_dir: Path) -> list[tuple[str | None, int | None]]:
    """(resumed_from, resumed_step) of each step record that says where its process resumed."""
    steps = read_run(run_dir).steps
    return [(s.resumed_from, s.resumed_step) for s in steps if s.resumed_from is not None]


def assert_bitwise(reference: Path, run_dir: Path) -> None:
    """Every step's loss (of every attempt) and the final checkpoint as the reference's."""
    losses = compare_losses(read_run(reference).steps, read_run(run_dir).steps, STEPS)
    assert losses is None, losses
    found = compare_checkpoints(
        final_checkpoint(reference, STEPS), final_checkpoint(run_dir, STEPS)
    )
    assert found == dict.fromkeys(found), found


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The run dir of a straight 2-rank run without snapshots: what every other run must end
    at, bit for bit."""
    config, run_dir, _, env = write_run(tmp_path_factory.mktemp("straight") / "run")
    run_attempt(config, env)
    return run_dir


def test_a_rank_reads_its_partners_copy_when_its_own_is_damaged_or_its_host_replaced(
    tmp_path, straight
):
    # Snapshots every 2 steps; a kill after step 3 (no snapshot: step 2's is committed on both
    # hosts) and after step 5 (step 4's, copied from the async save's host copy).
    faults = [(1, "kill", 3, 0), (2, "kill", 5, 0)]
    config, run_dir, memory, env = write_run(tmp_path / "run", faults, memory_interval_steps=2)
    hosts = launched_on(tmp_path, ["n1", "n2"])
    out, _ = run_attempt(config, env | hosts, killed=True)
    assert "memory snapshots: every 2 steps in " in out and "partner copy on the next host" in out

    # Rank 1's own copy damaged: read from rank 0's host, where its partner copy is.
    damage(rank_folder(run_dir, memory, "n2"), "own", 1, 2)
    out, _ = run_attempt(config, env | hosts, killed=True)
    assert (
        "warning: memory snapshot of step 2 on rank 1 (n2): chunk 0 checksum differs; reading "
        "its partner copy on rank 0 (n1)"
    ) in out
    assert "resume: from memory snapshot of step 2 (1 rank(s) from a partner's copy)" in out

    # Rank 1's host replaced by n3, whose memory holds nothing: its partner copy again.
    out, _ = run_attempt(config, env | launched_on(tmp_path, ["n1", "n3"]))
    assert "resume: from memory snapshot of step 4 (1 rank(s) from a partner's copy)" in out
    assert first_records(run_dir) == [("partner", 2), ("partner", 4)]
    assert_bitwise(straight, run_dir)
    # Each snapshot's copy held the next step: the first attempt's step 3 and the last one's
    # step 7 (neither a resumed process's first); nothing held the straight run.
    stalls = [s.snapshot_stall_s for s in read_run(run_dir).steps if s.step in (3, 7)]
    assert stalls[0] > 0 and stalls[-1] > 0
    assert {s.snapshot_stall_s for s in read_run(straight).steps} == {0.0}
    # A finished run leaves no snapshot of its ranks' hosts behind (n2 was lost with rank 1).
    assert not rank_folder(run_dir, memory, "n1").exists()
    assert not rank_folder(run_dir, memory, "n3").exists()


def test_resume_never_refuses_the_earlier_life_and_a_damaged_set_falls_back_to_disk(
    tmp_path, straight
):
    # One host (no partner copy), synchronous saves: the disk checkpoint of step 4 is complete
    # when step 5 runs. Killed after step 5 twice: snapshot 4 is the newest.
    faults = [(1, "kill", 5, 0), (2, "kill", 5, 0)]
    config, run_dir, memory, env = write_run(
        tmp_path / "run", faults, memory_interval_steps=2, async_save=False
    )
    out, _ = run_attempt(config, env, killed=True)
    assert "one host: no partner copy" in out
    first_life = (run_dir / rundir.RUN_ID).read_text()

    # A new life: the first one's snapshots are another run's, refused by name and not loaded.
    out, every = run_attempt(config, env, "checkpoint.resume=never", killed=True)
    assert "resume: from" not in out
    assert "memory snapshot is of another run id" in every
    second_life = (run_dir / rundir.RUN_ID).read_text()
    assert rundir.RUN_ID_TEXT.fullmatch(second_life.strip()) and second_life != first_life

    # Rank 0's only copy of step 4 damaged: the set is refused, the disk checkpoint loaded.
    damage(rank_folder(run_dir, memory, this_host()), "own", 0, 4)
    out, _ = run_attempt(config, env)
    checkpoint = rundir.step_dir(rundir.checkpoints_dir(run_dir), 4)
    assert (
        "warning: refusing memory snapshots of step 4: rank 0 has no intact copy (own: chunk 0 "
        f"checksum differs; partner: missing); falling back to {checkpoint}"
    ) in out
    assert f"resume: from {checkpoint} (step 4)" in out
    assert (run_dir / rundir.RUN_ID).read_text() == second_life
    assert first_records(run_dir) == [("checkpoint", 4)]
    assert_bitwise(straight, run_dir)


def staged_copies(rank: int, world_size: int, tmp_path: Path) -> list[object]:
    """What an async save, then a synchronous one, leave as ``Checkpointer.staged``."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    contents = CheckpointContents(parts=[model], optimizers=[optimizer])
    checkpointer = Checkpointer(CheckpointConfig(), tmp_path, torch.device("cpu"), contents)
    try:
        seen: list[object] = []
        checkpointer.save(1)  # async: staged in host memory
        staged = checkpointer.staged
        assert staged is not None
        host = staged["model"]["weight"]
        seen.append(torch.equal(host, model.weight.detach()))
        seen.append(host.data_ptr() != model.weight.data_ptr())  # a copy, not the live tensor
        seen.append(sorted(staged["optim"]["weight"]))
        checkpointer.save(2, blocking=True)
        seen.append(checkpointer.staged)
        return seen
    finally:
        checkpointer.close()


def test_an_async_save_leaves_its_staged_copy(tmp_path):
    expected = [True, True, ["exp_avg", "exp_avg_sq", "step"], None]
    assert run_distributed(staged_copies, 2, tmp_path) == [expected, expected]


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"memory_interval_steps": -1}, "'checkpoint.memory_interval_steps' = -1 is not in [0,"),
        ({"memory_interval_steps": 2**40 + 1}, "= 1099511627777 is not in [0,"),
        ({"memory_interval_steps": 1.5}, "'checkpoint.memory_interval_steps' must be int"),
        ({"memory_interval_steps": True}, "'checkpoint.memory_interval_steps' must be int"),
        ({"memory_interval_steps": "5"}, "'checkpoint.memory_interval_steps' must be int"),
        ({"memory_dir": ""}, "'checkpoint.memory_dir'"),
        ({"memory_dir": "  "}, "'checkpoint.memory_dir'"),
        ({"memory_dir": "/dev/shm\0x"}, "'checkpoint.memory_dir'"),
        ({"memory_dir": 5}, "'checkpoint.memory_dir' must be"),
        ({"memory_dir": ["/dev/shm"]}, "'checkpoint.memory_dir' must be"),
    ],
)
def test_a_bad_memory_key_names_the_key(table, says):
    with pytest.raises(GoodputError, match="run.toml") as error:
        from_table(CheckpointConfig, table, "run.toml", "checkpoint.")
    assert says in error.value.render() and error.value.code == 2


def test_the_docs_table_is_a_valid_checkpoint_table():
    """docs/checkpoints.md's [checkpoint] table of in-memory checkpoints loads as it says."""
    (block,) = [
        body
        for language, body in FENCE.findall((REPO / "docs" / "checkpoints.md").read_text())
        if language == "toml" and "memory_interval_steps" in body
    ]
    cfg = from_table(CheckpointConfig, tomllib.loads(block)["checkpoint"], "checkpoints.md")
    assert (cfg.interval_steps, cfg.memory_interval_steps, cfg.memory_dir) == (500, 5, None)


def test_a_damaged_run_id_is_refused_by_name_and_resume_never_draws_a_new_one(tmp_path):
    path = tmp_path / rundir.RUN_ID
    drawn = rundir.run_id(tmp_path, fresh=False)  # none yet
    rundir.write_run_id(tmp_path, drawn)
    assert rundir.run_id(tmp_path, fresh=False) == drawn
    assert rundir.run_id(tmp_path, fresh=True) not in (drawn, rundir.run_id(tmp_path, fresh=True))
    for damaged in (b"", b"ABCDEF0123456789\n", b"0123\n", b"0" * 17, b"\xff" * 16, b"0" * 99):
        path.write_bytes(damaged)
        with pytest.raises(GoodputError, match=rundir.RUN_ID):
            rundir.run_id(tmp_path, fresh=False)
        assert len(rundir.run_id(tmp_path, fresh=True)) == 16
    path.unlink()
    path.symlink_to(tmp_path / "nowhere")
    with pytest.raises(GoodputError, match=rundir.RUN_ID):
        rundir.run_id(tmp_path, fresh=False)
    path.unlink()
    path.mkdir()
    with pytest.raises(GoodputError, match="folder"):
        rundir.run_id(tmp_path, fresh=False)
