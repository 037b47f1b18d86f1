from dataclasses import dataclass, field
from typing import Literal

import pytest

from goodput.config import load_config
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
