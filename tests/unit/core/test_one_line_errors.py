"""One line, naming the input, from every command: a bad option value anywhere on a command line
(after the positionals too, and after ``goodput chaos CONFIG``) is one bounded ``goodput: error:``
line naming the option, exit 2, no usage block; a very long input is elided, not echoed whole;
``goodput chaos`` refuses what ``goodput train`` would refuse before it writes or runs anything."""

import argparse
import contextlib
import io
import subprocess
from pathlib import Path

import pytest

from goodput import cli
from goodput.errors import MAX_RENDERED_CHARS
from goodput.testing.jobs import run_goodput

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.toml"
BAD_VALUE = "-7e99x"  # no option's type or choices takes it


def goodput(*argv: object, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m goodput ARGV`` in ``cwd``, outside any job, as a user runs it."""
    return run_goodput(*argv, cwd=cwd, timeout=timeout, env={"GOODPUT_PROFILE": "generic"})


def assert_one_line(child: subprocess.CompletedProcess[str], code: int, *says: str) -> str:
    lines = child.stderr.splitlines()
    assert child.returncode == code and child.stdout == "", child.stderr
    assert len(lines) == 1 and lines[0].startswith("goodput: error: "), child.stderr
    assert "usage:" not in child.stderr and "Traceback" not in child.stderr
    for said in says:
        assert said in lines[0], lines[0]
    return lines[0]


def leaf_commands() -> list[tuple[list[str], argparse.ArgumentParser]]:
    """Every command of ``goodput`` (group and name) with its parser."""

    def leaves(parser: argparse.ArgumentParser, words: list[str]):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield words, parser
            return
        for name, sub in subs[0].choices.items():
            yield from leaves(sub, [*words, name])

    return list(leaves(cli.build_parser(), []))


def options_with_values() -> list[tuple[list[str], list[str], str]]:
    """(command, its positionals filled in, option) for every option that checks its value."""
    cases = []
    for words, parser in leaf_commands():
        positionals = [
            "x"
            for action in parser._actions
            if not action.option_strings and action.nargs in (None, 1, "+")
        ]
        for action in parser._actions:
            checked = action.type is not None or action.choices is not None
            # An optional value (nargs "?": the old bare flag) takes no word that starts with
            # "-": that is the next option, as argparse reads it.
            if action.option_strings and action.nargs not in (0, "?") and checked:
                cases.append((words, positionals, action.option_strings[-1]))
    return cases


@pytest.mark.parametrize(
    ("words", "positionals", "option"),
    options_with_values(),
    ids=lambda value: " ".join(value) if isinstance(value, list) else value,
)
def test_a_bad_value_after_the_positionals_is_one_line_naming_the_option(
    words, positionals, option
):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args([*words, *positionals, option, BAD_VALUE])
    lines = err.getvalue().splitlines()
    assert exited.value.code == 2 and len(lines) == 1, err.getvalue()
    assert lines[0].startswith("goodput: error: ") and option in lines[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kinds", "bogus"], ["argument --kinds", "'bogus' is not a fault kind"]),
        (["--faults", "0"], ["argument --faults"]),
        (["train.steps=4", "--seed", "x"], ["argument --seed"]),
        (["--nproc", "-1"], ["argument --nproc"]),
        (["--bogus", "1"], ["unrecognized arguments: --bogus"]),
        (["--", "--timeout", "-1"], ["argument --timeout"]),
        (["--", "--no-such-option"], ["--no-such-option is not a launch option"]),
        (["--", "--run-dir", "x"], ["--run-dir", "the campaign's to set"]),
    ],
)
def test_chaos_options_after_config_are_one_line_and_write_nothing(tmp_path, argv, says):
    child = goodput("chaos", TINY, *argv, cwd=tmp_path)
    assert_one_line(child, 2, "goodput chaos" if argv[0] != "--" else "", *says)
    assert list(tmp_path.iterdir()) == []


def test_chaos_without_config_and_its_help_after_config(tmp_path):
    assert_one_line(goodput("chaos", "--kinds", "kill", cwd=tmp_path), 2, "required: config")
    helped = goodput("chaos", TINY, "--help", cwd=tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: goodput chaos CONFIG")


@pytest.mark.parametrize(
    ("overrides", "code", "says"),
    [
        # The layout on the launch's 2 ranks (build_mesh's check on the ranks).
        (["parallel.dp_replicate=3"], 2, "[parallel]"),
        # The data, as rank 0 builds the blend first: the config's file list is not here.
        ([], 1, "demo/file_list.txt: No such file or directory"),
        # An override goodput train would refuse at load, given after CONFIG as documented.
        (["train.steps=0"], 2, "train.steps"),
    ],
)
def test_chaos_refuses_what_train_refuses_before_writing_or_running(
    tmp_path, overrides, code, says
):
    child = goodput(
        "chaos", TINY, *overrides, "--faults", 1, "--kinds", "kill", "--nproc", 2, cwd=tmp_path
    )
    assert_one_line(child, code, says)
    assert list(tmp_path.iterdir()) == []  # no campaign folder, no run started


def test_a_mistyped_perturb_control_is_refused_before_anything_runs(tmp_path):
    child = goodput("chaos", TINY, "--perturb", "optim.nosuch=1", "--nproc", 1, cwd=tmp_path)
    assert_one_line(child, 2, "nosuch")
    assert list(tmp_path.iterdir()) == []


def test_a_very_long_path_is_elided_not_echoed_whole(tmp_path):
    name = "d" * 200
    path = "/".join([str(tmp_path), *[name] * 25, "run-config-tail.toml"])  # ~5,000 characters
    line = assert_one_line(goodput("train", path, cwd=tmp_path), 2)
    assert len(line) <= len("goodput: error: ") + MAX_RENDERED_CHARS
    assert str(tmp_path)[:20] in line and "run-config-tail.toml" in line and " ... " in line


def test_a_very_long_option_value_is_elided_in_argparse_errors_too(tmp_path):
    line = assert_one_line(goodput("chaos", TINY, "--kinds", "k" * 5000, cwd=tmp_path), 2)
    assert "argument --kinds" in line and " ... " in line and len(line) < 1_200
