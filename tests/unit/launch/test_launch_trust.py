"""Hostile and careless input to ``goodput launch``, ``broadcast`` and ``broadcast --checkpoint``,
each through the real CLI: a destination outside its folder, someone's folder where a copy would
go, a run's own checkpoints as the node-local copy's folder, broken node lists and host files,
bad numbers in the environment, broken profiles and paths the OS refuses. Each is refused with
one line and a non-zero exit, and whatever was on disk before is there after. The local transport
copies for real; rsync and tar get the same destinations in test_broadcast_ssh.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from goodput import cli
from goodput.launch.transports import MARKER
from goodput.testing.jobs import JOB_PREFIXES, JOB_VARS
from goodput.testing.unprivileged import run_goodput


@pytest.fixture(autouse=True)
def outside_a_job(monkeypatch, tmp_path):
    """This process as if started by hand, outside any job, in an empty working directory."""
    for name in list(os.environ):
        if name.startswith(JOB_PREFIXES) or name in JOB_VARS:
            monkeypatch.delenv(name)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)


def refused(capsys, code: int, *needles: str) -> str:
    """The error line of a refused command: non-zero exit, no traceback, one line at the end."""
    err = capsys.readouterr().err
    *_, line = err.splitlines() or [""]
    assert code != 0 and "Traceback" not in err, err
    assert line.startswith("goodput: error: ") and "; " in line, err
    for needle in needles:
        assert needle in line, line
    return line


def tree(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def source(tmp_path: Path) -> Path:
    folder = tmp_path / "shared" / "payload"
    (folder / "lib").mkdir(parents=True)
    (folder / "lib" / "a.py").write_text("print('a')\n")
    return folder


def sentinel(folder: Path) -> Path:
    """Someone's folder with a file in it, that no broadcast may touch."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "keep.txt").write_text("mine\n")
    return folder


def local_broadcast(src: Path, dest: str, hosts: str = "a") -> int:
    return cli.main(["broadcast", str(src), "--transport", "local", "--hosts", hosts,
                     "--dest", dest])  # fmt: skip


# --- broadcast: where a copy may go ----------------------------------------------------------


@pytest.mark.parametrize(
    "dest",
    [
        "nodes/{host}/payload",  # relative: would land under the working directory
        "./nodes/{host}/payload",
        "{root}/nodes/{host}/../../victim",  # ".." climbs out to someone's folder
        "{root}/nodes/{host}/..",
        "{root}/nodes/{host}/.",
        "{root}//nodes/{host}/payload",
        "{root}/nodes/{host}/payload\n",  # a trailing newline is not a path character
        "{root}/nodes/{host}/pay load",
    ],
)
def test_a_dest_outside_its_folder_is_refused_and_touches_nothing(tmp_path, capsys, dest):
    src = source(tmp_path)
    victim = sentinel(tmp_path / "victim")
    sentinel(tmp_path / "work" / "nodes" / "a" / "payload")
    before = tree(tmp_path)
    code = local_broadcast(src, dest.replace("{root}", str(tmp_path)))
    refused(capsys, code, "--dest: ", "is not a safe absolute path")
    assert code == 2 and tree(tmp_path) == before
    assert (victim / "keep.txt").read_text() == "mine\n"


def test_a_host_name_cannot_carry_a_path_into_dest(tmp_path, capsys):
    src = source(tmp_path)
    sentinel(tmp_path / "victim")
    before = tree(tmp_path)
    for hosts in ("..", "a/../../victim", "a\n", "a,../victim"):
        code = local_broadcast(src, f"{tmp_path}/nodes/{{host}}/payload", hosts)
        refused(capsys, code, "--hosts: ", "is not a valid host name")
    assert tree(tmp_path) == before
    code = local_broadcast(src, f"{tmp_path}/nodes/{{host}}/payload", " , ")
    refused(capsys, code, "--hosts: names no host")


@pytest.mark.parametrize(
    ("dest", "hosts"),
    [
        ("{root}/shared/payload/{host}", "a"),  # inside the source: it would copy itself
        ("{root}/{host}", "shared"),  # the source's parent: replacing it takes the source
    ],
)
def test_a_dest_within_or_above_the_source_is_refused(tmp_path, capsys, dest, hosts):
    src = source(tmp_path)
    before = tree(tmp_path)
    code = local_broadcast(src, dest.replace("{root}", str(tmp_path)), hosts)
    refused(capsys, code, "--dest: ", "is inside", "or holds it")
    assert tree(tmp_path) == before


def test_someones_folder_at_the_destination_survives(tmp_path, capsys):
    src = source(tmp_path)
    theirs = sentinel(tmp_path / "nodes" / "a" / "payload")
    link_target = sentinel(tmp_path / "elsewhere")
    (link_target / MARKER).write_text("{}\n")  # even a marked folder, when reached by a link
    (tmp_path / "nodes" / "b").mkdir()
    (tmp_path / "nodes" / "b" / "payload").symlink_to(link_target)
    (tmp_path / "nodes" / "c").mkdir()
    (tmp_path / "nodes" / "c" / "payload").write_text("a file where the copy would go\n")
    before = tree(tmp_path)
    for host in ("a", "b", "c"):
        code = local_broadcast(src, f"{tmp_path}/nodes/{{host}}/payload", host)
        line = refused(capsys, code, "is not a copy goodput made", "move it away")
        assert f"{tmp_path}/nodes/{host}/payload" in line
    assert tree(tmp_path) == before  # no partial copy left either
    assert not list(tmp_path.glob("nodes/*/.*partial"))
    assert (theirs / "keep.txt").read_text() == "mine\n"


def test_a_previous_goodput_copy_is_replaced(tmp_path, capsys):
    src = source(tmp_path)
    dest = f"{tmp_path}/nodes/{{host}}/payload"
    assert local_broadcast(src, dest, "a,b") == 0
    copy = tmp_path / "nodes" / "a" / "payload"
    assert json.loads((copy / MARKER).read_text())["source"] == str(src)
    (copy / "left-over").write_text("from the first copy\n")
    (src / "lib" / "a.py").write_text("print('new')\n")
    assert local_broadcast(src, dest, "a,b") == 0
    for host in ("a", "b"):
        copy = tmp_path / "nodes" / host / "payload"
        assert tree(copy) == {**tree(src), MARKER: (copy / MARKER).read_bytes()}
    capsys.readouterr()


# --- broadcast --checkpoint: the run's own checkpoints ---------------------------------------


def saved_run(folder: Path, steps=(4, 8)) -> Path:
    """A run folder with complete checkpoints as the trainer leaves them (the files the
    node-local copy looks at: .complete and checksums.json; it copies them, does not read them)."""
    for step in steps:
        directory = folder / "checkpoints" / f"step-{step:08d}"
        directory.mkdir(parents=True)
        (directory / "__0_0.distcp").write_bytes(os.urandom(1000))
        (directory / "checksums.json").write_text('{"algorithm": "sha256", "files": {}}\n')
        (directory / ".complete").touch()
    return folder


@pytest.mark.parametrize(
    ("checkpoint", "dest"),
    [
        ("run", "{root}/{host}/checkpoints"),  # the run's checkpoint folder itself
        ("run/checkpoints", "{root}/{host}/checkpoints"),
        ("run", "{root}/{host}/checkpoints/copied"),  # within it
        ("run", "{root}/{host}"),  # above it: the run folder
    ],
)
def test_the_node_local_copy_never_meets_the_runs_own_checkpoints(
    tmp_path, capsys, checkpoint, dest
):
    run = saved_run(tmp_path / "run")
    before = tree(run)
    dest = dest.replace("{root}", str(tmp_path))
    code = cli.main(["broadcast", "--checkpoint", str(tmp_path / checkpoint), "--transport",
                     "local", "--hosts", "run", "--dest", dest])  # fmt: skip
    refused(capsys, code, "--dest: ", "the run's checkpoint folder")
    assert code == 2 and tree(run) == before


def test_the_node_local_copy_removes_only_older_copies_it_made(tmp_path, capsys):
    run = saved_run(tmp_path / "run")
    copied = tmp_path / "nodes" / "a" / "ckpt"
    ours = sentinel(copied / "step-00000004")
    (ours / MARKER).write_text("{}\n")
    theirs = sentinel(copied / "step-00000002")  # a step folder goodput did not copy
    linked = sentinel(tmp_path / "linked")
    (linked / MARKER).write_text("{}\n")
    (copied / "step-00000003").symlink_to(linked)
    code = cli.main(["broadcast", "--checkpoint", str(run), "--transport", "local",
                     "--hosts", "a", "--dest", f"{tmp_path}/nodes/{{host}}/ckpt"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert "removed older step-00000004 on 1 host(s)" in capsys.readouterr().out
    assert sorted(path.name for path in copied.iterdir()) == [
        "step-00000002",
        "step-00000003",
        "step-00000008",
    ]
    assert (theirs / "keep.txt").is_file() and (linked / "keep.txt").is_file()


# --- node lists, host files and the environment ----------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "message"),
    [
        ("x[1-", "cannot expand 'x[1-': an unmatched or nested '['"),
        ("x[1-2]]", "an unmatched or nested ']'"),
        ("x[1-[2-3]]", "an unmatched or nested '['"),
        ("x[3-1]", "the range 3-1 runs backwards"),
        ("x[1-100000000]", "names more than 100,000 hosts"),
        ("a[1-1000]b[1-1000]", "names more than 100,000 hosts"),
        ("x[1-9999999999999999999999]", "is not numbers and ranges"),
        ("x1\n", "'x1\\n' is not a valid host name"),
        ("x1,,x2", "an empty name"),
        ("x[1-2],x2", "names x2 twice"),
        ("", "is empty or not set"),
    ],
)
def test_a_broken_slurm_node_list_is_one_line_naming_it(monkeypatch, capsys, nodelist, message):
    monkeypatch.setenv("SLURM_JOB_ID", "812")
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    began = time.monotonic()
    code = cli.main(["launch", "--dry-run", "--", "true"])
    assert time.monotonic() - began < 2.0  # counted, never expanded
    refused(capsys, code, "SLURM_JOB_NODELIST: ", message)


@pytest.mark.parametrize(
    ("env", "where", "message"),
    [
        ({"MASTER_PORT": "70000"}, "MASTER_PORT", "70000 is not in [1, 65535]"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT", "0 is not in [1, 65535]"),
        ({"MASTER_PORT": " 29500"}, "MASTER_PORT", "' 29500' is not a count"),
        ({"RANK": "٣", "WORLD_SIZE": "4"}, "RANK", "is not a count"),  # int() would take it
        ({"RANK": "1", "WORLD_SIZE": "-4"}, "WORLD_SIZE", "'-4' is not a count"),
        ({"RANK": "1", "WORLD_SIZE": "0"}, "WORLD_SIZE", "0 is not in [1, 10000000]"),
        ({"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_LOCAL_SIZE": "x"}, "PMI_LOCAL_SIZE", "count"),
        ({"SLURM_JOB_ID": "../../x", "SLURM_JOB_NODELIST": "n1"}, "SLURM_JOB_ID", "not a job id"),
        ({"MASTER_ADDR": "node1\n"}, "MASTER_ADDR", "is not a valid host name"),
    ],
)
def test_bad_numbers_and_names_in_the_environment_are_named(
    monkeypatch, capsys, env, where, message
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refused(capsys, cli.main(["launch", "--dry-run", "--", "true"]), f"{where}: ", message)


def test_host_files_are_read_strictly(tmp_path, capsys):
    src = source(tmp_path)
    dest = f"{tmp_path}/nodes/{{host}}/payload"
    hostfile = tmp_path / "hosts"
    cases = [
        (b"n1\nn2\xff\n", f"{hostfile}: is not valid UTF-8 text (byte 5)"),
        (b"n1\n# a comment\nn2 n3\n", f"{hostfile}:3: 'n2 n3' is not a valid host name"),
        (b"n1\n$(reboot)\n", f"{hostfile}:2: '$(reboot)' is not a valid host name"),
        (b"n1\r\nn2\n", "is not a copy goodput made"),  # CRLF is fine; it gets past the names
        (b"# only a comment\n\n", f"{hostfile}: names no host"),
    ]
    (tmp_path / "nodes" / "n1" / "payload").mkdir(parents=True)  # ... to be refused here
    for data, message in cases:
        hostfile.write_bytes(data)
        code = cli.main(["broadcast", str(src), "--transport", "local", "--hostfile",
                         str(hostfile), "--dest", dest])  # fmt: skip
        refused(capsys, code, message)
    code = cli.main(["broadcast", str(src), "--transport", "local", "--hostfile", str(tmp_path),
                     "--dest", dest])  # fmt: skip
    refused(capsys, code, f"{tmp_path}: is a folder, not a regular file; pass a regular file")


def test_a_pbs_node_file_is_read_strictly(tmp_path, monkeypatch, capsys):
    nodefile = tmp_path / "nodefile"
    monkeypatch.setenv("PBS_JOBID", "42.pbs")
    monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
    for data, message in [
        (b"x1\nx1\n\xc3\x28\n", f"{nodefile}: is not valid UTF-8 text (byte 6)"),
        (b"x1\nx2\n-oProxyCommand=x\n", f"{nodefile}:3: '-oProxyCommand=x' is not a valid"),
        (b"\n\n", f"{nodefile}: names no host"),
    ]:
        nodefile.write_bytes(data)
        refused(capsys, cli.main(["launch", "--dry-run", "--", "true"]), message)
    nodefile.unlink()
    refused(capsys, cli.main(["launch", "--dry-run", "--", "true"]), f"{nodefile}: No such file")


# --- profiles and the paths goodput launch writes ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"ppn = 4\nppm = 4\n", "unknown key 'ppm'"),
        (b'ppn = "4"\n', "'ppn' must be int"),
        (b"ppn = 100000\n", "'ppn' = 100000 is not in [1, 1024]"),
        (b"ppn = true\n", "'ppn' must be int"),
        (b"health_timeout_s = nan\n", "'health_timeout_s' = nan is not in"),
        (b'cpu_bind = "cores\\n-x"\n', "is not a binding"),
        (b'env = ["A\\n=1"]\n', "is not NAME=VALUE"),
        (b"bad_node_patterns = ['(?P<host>x']\n", "is not a regular expression"),
        (b"bad_node_patterns = ['x{4294967296}(?P<host>y)']\n", "is not a regular expression"),
        (b'description = "caf\xe9"\n', "is not valid UTF-8 text"),
        (b"ppn = [" * 5000, "profile.toml: "),
    ],
)
def test_a_broken_profile_is_one_line_naming_its_file(tmp_path, capsys, text, message):
    profile = tmp_path / "profile.toml"
    profile.write_bytes(text)
    code = cli.main(["launch", "--dry-run", "--profile", str(profile), "--", "true"])
    refused(capsys, code, f"{profile}", message)
    assert code == 2


def test_paths_goodput_launch_cannot_write_are_named_before_any_rank_starts(tmp_path, capsys):
    marker = tmp_path / "ran"
    command = ["--", "touch", str(marker)]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for options, message in [
        (["--run-dir", str(a_file)], f"--run-dir {a_file}: is a file where a folder should"),
        (["--run-dir", str(a_file / "run")], f"--run-dir {a_file / 'run'}: {a_file} is a file"),
        (["--log", str(tmp_path)], f"--log {tmp_path}: is a folder, not a file"),
        (["--log", str(a_file / "log")], f"--log {a_file / 'log'}: {a_file} is a file"),
    ]:
        refused(capsys, cli.main(["launch", *options, *command]), message)
    assert not marker.exists()


def test_a_folder_without_permission_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    result = run_goodput("launch", "--run-dir", locked / "run", "--", "true")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"goodput: error: --run-dir {locked / 'run'}: permission denied")
    assert "permissions" in line


def test_a_submit_run_dir_that_is_a_file_is_named(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for run_dir, message in [
        (a_file, f"--run-dir {a_file}: is a file where a folder should be"),
        (a_file / "run", f"--run-dir {a_file / 'run'}: {a_file} is a file where a folder"),
    ]:
        code = cli.main(["submit", "--run-dir", str(run_dir), "--nhosts", "1", "--time",
                         "01:00:00", "--scheduler", "slurm", "--", "goodput", "launch", "--",
                         "true"])  # fmt: skip
        refused(capsys, code, message)
    assert a_file.read_text() == ""
