"""The ``goodput`` dispatcher: each command group is one module of ``goodput.commands`` and one
name in ``cli.GROUPS``; ``main`` is the one error boundary (one line and the exit code, the
traceback only when asked for); ``goodput submit`` checks its launch line as ``goodput launch``
would read it."""

import argparse
import errno
import json
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
import types

import pytest

from goodput import cli, commands
from goodput.commands import launch
from goodput.errors import DEBUG_HINT, ExitCode, GoodputError
from goodput.testing.jobs import outside_any_job


def _group_names(parser: argparse.ArgumentParser) -> list[str]:
    (groups,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(groups.choices)


def _add_group(monkeypatch, handler):
    """A group ``hello`` as a new module of goodput.commands adds it, plus its name in GROUPS."""
    module = types.ModuleType("goodput.commands.hello")

    def register(groups):
        groups.add_parser("hello", help="greet the world").set_defaults(handler=handler)

    module.register = register
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(cli, "GROUPS", (*cli.GROUPS, "hello"))


def test_every_module_of_commands_is_a_group_registered_under_its_name():
    modules = [module.name for module in pkgutil.iter_modules(commands.__path__)]
    assert sorted(modules) == sorted(cli.GROUPS)
    assert _group_names(cli.build_parser()) == list(cli.GROUPS)


def test_a_new_group_is_one_module_and_one_name(monkeypatch, capsys):
    _add_group(monkeypatch, lambda args: ExitCode.OK)
    assert cli.main(["hello"]) == 0
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "greet the world" in capsys.readouterr().out


def test_help_lists_every_group_and_imports_no_handler_code():
    # `goodput --help` stays instant: building the parser imports argparse and goodput's light
    # helpers only, whatever the handlers need comes when one runs.
    code = textwrap.dedent("""
        import contextlib, io, json, sys
        from goodput.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
        print(json.dumps({"help": out.getvalue(), "modules": sorted(sys.modules)}))
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], env=outside_any_job(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert re.findall(r"^    (\S+)", found["help"], re.MULTILINE) == list(cli.GROUPS)
    goodput = {name for name in found["modules"] if name.split(".")[0] == "goodput"}
    light = {"goodput", "goodput.argtypes", "goodput.cli", "goodput.errors", "goodput.commands"}
    assert goodput == light | {f"goodput.commands.{name}" for name in cli.GROUPS}
    assert not {"torch", "numpy"} & set(found["modules"])


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (GoodputError.usage("a.toml", "bad key", "remove it"), 2, "a.toml: bad key; remove it"),
        (
            OSError(errno.ENOENT, "No such file or directory", "x.bin"),
            1,
            "x.bin: No such file or directory; check the path",
        ),
        (ValueError("first\nsecond"), 1, f"goodput: ValueError: first; {DEBUG_HINT}"),
    ],
)
def test_whatever_a_handler_raises_leaves_as_one_line(monkeypatch, capsys, raised, code, line):
    def handler(args):
        raise raised

    _add_group(monkeypatch, handler)
    monkeypatch.delenv("GOODPUT_DEBUG", raising=False)
    assert cli.main(["hello"]) == code
    assert capsys.readouterr().err == f"goodput: error: {line}\n"


@pytest.mark.parametrize(("argv", "env"), [(["--debug", "hello"], "0"), (["hello"], "1")])
def test_the_traceback_only_when_asked_for(monkeypatch, capsys, argv, env):
    def handler(args):
        raise ValueError("boom")

    _add_group(monkeypatch, handler)
    monkeypatch.setenv("GOODPUT_DEBUG", env)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "ValueError: boom" in err
    assert err.splitlines()[-1].startswith("goodput: error: goodput: ValueError: boom; ")


def test_ctrl_c_is_an_interruption_not_an_error(monkeypatch, capsys):
    def handler(args):
        raise KeyboardInterrupt

    _add_group(monkeypatch, handler)
    assert cli.main(["hello"]) == ExitCode.INTERRUPTED
    assert capsys.readouterr().err == "goodput: interrupted\n"


def test_submit_reads_the_launch_line_into_the_launch_options_goodput_launch_runs():
    line = ["--nhosts", "2", "--profile", "aurora", "--timeout", "60", "--no-prefix", "--", "x"]
    args, unknown = launch.parse(line)
    assert unknown == []
    direct = cli.build_parser().parse_args(["launch", *line])
    assert launch.options(args) == launch.options(direct)
    assert launch.options(args).command == ("x",) and not launch.options(args).prefix


def _submit(tmp_path, *launch_options):
    """``goodput submit`` of a launch line whose command would leave ``tmp_path/ran`` behind."""
    chain = ["--scheduler", "slurm", "--run-dir", str(tmp_path / "run"), "--nhosts", "1"]
    launch_line = ["goodput", "launch", *launch_options, "--", "touch", str(tmp_path / "ran")]
    return ["submit", *chain, "--time", "01:00:00", "--", *launch_line]


@pytest.mark.parametrize(("option", "env"), [(["--profile", "summit"], ""), ([], "summit")])
def test_submit_loads_the_profile_of_the_launch_line(monkeypatch, tmp_path, capsys, option, env):
    # A mistyped profile fails when the chain is submitted, not when its first job starts.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GOODPUT_PROFILE", env)
    assert cli.main(_submit(tmp_path, *option)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("goodput: error: --profile: unknown machine profile 'summit'; ")
    assert not (tmp_path / "run").exists()


def test_submit_runs_nothing_of_its_launch_line(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GOODPUT_PROFILE", raising=False)
    assert cli.main(_submit(tmp_path, "--profile", "polaris", "--nhosts", "1")) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "run" / "chain.sbatch")
    assert not (tmp_path / "ran").exists()
    assert os.listdir(tmp_path / "run") == ["chain.sbatch"]
