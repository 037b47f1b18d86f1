from dataclasses import dataclass, field
from typing import Literal

import pytest

from goodput.config import NON_EMPTY, limits, load_config, read_present
from goodput.errors import ExitCode, GoodputError


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimConfig:
    kind: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    name: str
    steps: int = 10
    compile: bool = False
    warmup: int | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundedConfig:
    count: int = field(default=1, metadata=limits(at_least=1, at_most=8))
    rate: float = field(default=0.5, metadata=limits(above=0, below=1))
    ratio: float = 0.0  # no metadata: finite, in [0, 2**53]
    clip: float = field(default=1.0, metadata=limits(above=0, inf_ok=True))
    pair: tuple[float, float] = (0.0, 0.0)
    path: str = field(default="x", metadata=NON_EMPTY)
    label: str = ""
    inner: OptimConfig | None = None


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_toml_and_overrides_build_typed_frozen_config(tmp_path):
    path = write(tmp_path, 'name = "a"\nsteps = 5\n[optim]\nlr = 1\n')
    cfg = load_config(RunConfig, path, ["optim.kind=muon", "steps=7", "warmup=3", "name=b"])
    assert cfg == RunConfig(name="b", steps=7, warmup=3, optim=OptimConfig(kind="muon", lr=1.0))
    assert isinstance(cfg.optim.lr, float)
    with pytest.raises(AttributeError):
        cfg.steps = 3  # frozen


def test_unknown_key_lists_valid_keys(tmp_path):
    path = write(tmp_path, 'name = "a"\n[optim]\nlearning_rate = 1\n')
    with pytest.raises(GoodputError) as exc:
        load_config(RunConfig, path)
    message = exc.value.render()
    assert "unknown key 'optim.learning_rate'" in message and "betas, kind, lr" in message
    assert str(path) in message and exc.value.code == ExitCode.USAGE


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("steps=ten", "'steps' must be int"),
        ("compile=1", "'compile' must be true or false"),
        ("optim.kind=sgd", "'optim.kind' = 'sgd' is not allowed"),
        ("optim=3", "'optim' must be a table"),
        ("steps", "not of the form section.key=value"),
        ("optim.betas=[1, 'x']", "'optim.betas[1]' must be float"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, override, expected):
    path = write(tmp_path, 'name = "a"\n')
    with pytest.raises(GoodputError) as exc:
        load_config(RunConfig, path, [override])
    assert expected in exc.value.render() and "\n" not in exc.value.render()


def test_missing_required_key_and_bad_files(tmp_path):
    with pytest.raises(GoodputError, match="name"):
        load_config(RunConfig, write(tmp_path, "steps = 1\n"))
    with pytest.raises(GoodputError, match="invalid TOML"):
        load_config(RunConfig, write(tmp_path, "steps = \n"))
    with pytest.raises(GoodputError, match="nope.toml: No such file or directory; check the path"):
        load_config(RunConfig, tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("count=0", "'count' = 0 is not in [1, 8]"),
        ("count=9", "'count' = 9 is not in [1, 8]"),
        ("count=true", "'count' must be int, got True"),
        ("rate=0", "'rate' = 0 is not in (0, 1)"),
        ("rate=1", "'rate' = 1 is not in"),
        ("ratio=nan", "'ratio' = nan is not in [0, 2**53]"),
        ("ratio=inf", "'ratio' = inf is not in"),
        ("ratio=-0.5", "'ratio' = -0.5 is not in"),
        ("ratio=1e300", "'ratio' = 1e+300 is not in"),
        ("ratio=9223372036854775807", "'ratio' = 9223372036854775807 is not in"),
        ("clip=nan", "'clip' = nan is not in (0, 2**53] or inf"),
        ("pair=[1.0]", "'pair' must be a list of 2"),
        ("pair=[1.0, -inf]", "'pair[1]' = -inf is not in"),
        ("path=''", "'path' is empty"),
        ('label="a\\u0000b"', "'label' must be text without NUL bytes"),
        ("inner.lr=nan", "'inner.lr' = nan is not in"),  # X | None: X's own error
        ("inner.betas=[0.9, 'x']", "'inner.betas[1]' must be float"),
    ],
)
def test_every_number_is_finite_and_in_its_fields_range(tmp_path, override, expected):
    with pytest.raises(GoodputError) as exc:
        load_config(BoundedConfig, write(tmp_path, ""), [override])
    assert expected in exc.value.render() and exc.value.code == ExitCode.USAGE


def test_limits_admit_their_range(tmp_path):
    overrides = ["count=8", "rate=0.999", "ratio=0", "clip=inf", "pair=[0, 2]", "label=''"]
    cfg = load_config(BoundedConfig, write(tmp_path, ""), overrides)
    assert (cfg.count, cfg.clip, cfg.pair, cfg.label) == (8, float("inf"), (0.0, 2.0), "")


def test_hostile_files_are_one_line_usage_errors(tmp_path):
    deep = write(tmp_path, "x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(GoodputError, match="TOML nested too deeply") as exc:
        load_config(RunConfig, deep)
    assert exc.value.code == ExitCode.USAGE
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b'name = "\xff"\n')
    with pytest.raises(GoodputError, match="not valid UTF-8") as exc:
        load_config(RunConfig, binary)
    assert exc.value.code == ExitCode.USAGE
    with pytest.raises(GoodputError, match="'steps' must be int"):
        load_config(RunConfig, write(tmp_path, 'name = "a"\n'), ["steps=" + "[" * 10_000])


def test_read_present_checks_the_keys_there_and_adds_none():
    # What `goodput plan` reads of [train] and [parallel]: no required key asked for, no default
    # filled in, each value checked as from_table checks it.
    assert read_present(RunConfig, {"steps": 5}, "run.toml") == {"steps": 5}
    assert read_present(BoundedConfig, {"pair": [1, 2]}, "run.toml", "b.") == {"pair": (1.0, 2.0)}
    assert read_present(RunConfig, {}, "run.toml") == {}
    with pytest.raises(GoodputError, match=r"unknown key 'run.stepz'.*valid keys in \[run\]"):
        read_present(RunConfig, {"stepz": 5}, "run.toml", "run.")
    with pytest.raises(GoodputError, match=r"'b.count' = 9 is not in \[1, 8\]"):
        read_present(BoundedConfig, {"count": 9}, "run.toml", "b.")
