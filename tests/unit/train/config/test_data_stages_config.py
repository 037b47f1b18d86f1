"""``[[data.stages]]`` and ``[schedule] decay_start`` as the loader reads them: each stage's start
as a step or as tokens, the first at 0, the starts increasing and inside the run, file_list and
stages exactly one of, every hostile value one usage error naming its key; written back by
``to_toml`` and read again to an equal config; and the wsd decay tied to a stage's start."""

from __future__ import annotations

from pathlib import Path

import pytest

from goodput.config import load_config, to_toml
from goodput.data.stages import MAX_STAGES
from goodput.errors import GoodputError
from goodput.testing.stages import load_tiny_cpu
from goodput.train.config.run import RunConfig
from goodput.train.config.schedule import learning_rate

TOKENS_PER_STEP = 2048  # set below, so the tests know it


def load(tmp_path: Path, data: str, *overrides: str, schedule: str = "") -> RunConfig:
    fixed = (f"train.tokens_per_step={TOKENS_PER_STEP}", "train.steps=100", *overrides)
    return load_tiny_cpu(tmp_path, data, fixed, schedule)


THREE = """[data]
cache = "c"
[[data.stages]]
file_list = "web.txt"
start_step = 0
[[data.stages]]
file_list = "code.txt"
start_tokens = 61440
[[data.stages]]
file_list = "anneal.txt"
start_step = 80
"""


def test_three_stages_start_at_their_steps_and_read_back(tmp_path):
    cfg = load(tmp_path, THREE)
    assert cfg.stage_steps() == (0, 61440 // TOKENS_PER_STEP, 80)
    assert cfg.data.file_lists() == ("web.txt", "code.txt", "anneal.txt")
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(RunConfig, again) == cfg


def test_a_plain_file_list_is_one_stage_from_step_0(tmp_path):
    cfg = load(tmp_path, '[data]\nfile_list = "a.txt"')
    assert (cfg.stage_steps(), cfg.data.file_lists()) == ((0,), ("a.txt",))


def test_the_command_line_wins_over_the_file_within_one_of(tmp_path):
    plain = load(tmp_path, THREE, "data.file_list=b.txt")
    assert (plain.data.stages, plain.data.file_lists()) == (None, ("b.txt",))
    staged = load(
        tmp_path, '[data]\nfile_list = "a"', 'data.stages=[{file_list="x", start_step=0}]'
    )
    assert (staged.data.file_list, staged.data.file_lists()) == (None, ("x",))
    tokens = load(tmp_path, THREE, "data.stages.0.start_tokens=0")
    assert tokens.data.stages is not None and tokens.data.stages[0].start_step is None


def test_dotted_overrides_reach_into_a_stage(tmp_path):
    cfg = load(tmp_path, THREE, "data.stages.2.start_step=90", "data.seed=7")
    assert (cfg.stage_steps()[2], cfg.data.seed) == (90, 7)
    whole = '[{file_list = "x.txt", start_step = 0}, {file_list = "y.txt", start_step = 5}]'
    cfg = load(tmp_path, "[data]", f"data.stages={whole}")
    assert cfg.stage_steps() == (0, 5)


STAGE = '[[data.stages]]\nfile_list = "a.txt"\nstart_step = 0\n'


@pytest.mark.parametrize(
    ("data", "overrides", "message"),
    [
        ("[data]", [], "[data] file_list is not set; add data.file_list=PATH (your corpora, "
         "see docs/data.md) or add data.stages="),
        (f'[data]\nfile_list = "a"\n{STAGE}', [], "'data.file_list' and 'data.stages' are both"),
        ("[data]\nstages = []", [], "stages holds 0 stages; give 1 to 64"),
        ("[data]\nstages = 3", [], "'data.stages' must be a list, got 3"),
        ("[data]\nstages = [3]", [], "'data.stages[0]' must be a table, got 3"),
        ('[[data.stages]]\nfile_list = "a"', [], "[data.stages[0]] start_step is not set; add "
         "data.stages.0.start_step=N or add data.stages.0.start_tokens=N"),
        ('[[data.stages]]\nstart_step = 0', [], "[data.stages[0]] file_list is not set"),
        (f"{STAGE}start_tokens = 0", [], "'data.stages[0].start_step' and "
         "'data.stages[0].start_tokens' are both set"),
        ('[[data.stages]]\nfile_list = ""\nstart_step = 0', [], "'data.stages[0].file_list' is "
         "empty"),
        ('[[data.stages]]\nfile_list = "a"\nstart_step = -1', [], "'data.stages[0].start_step' "
         "= -1 is not in [0, 2**53]"),
        ('[[data.stages]]\nfile_list = "a"\nstart_step = 1.5', [], "'data.stages[0].start_step' "
         "must be int, got 1.5"),
        ('[[data.stages]]\nfile_list = "a"\nstart_step = true', [], "must be int, got True"),
        ('[[data.stages]]\nfile_list = "a"\nstart_tokens = 1e400', [], "must be int, got inf"),
        (f'{STAGE}weight = 1', [], "unknown key 'data.stages[0].weight'"),
        ('[[data.stages]]\nfile_list = "a"\nstart_step = 3', [], "data.stages[0] starts at step "
         "3; start the first stage at 0"),
        (f'{STAGE}[[data.stages]]\nfile_list = "b"\nstart_step = 0', [], "data.stages[1] starts "
         "at step 0, not after data.stages[0] (step 0)"),
        (f'{STAGE}[[data.stages]]\nfile_list = "b"\nstart_step = 100', [], "data.stages[1] "
         "starts at step 100, not before the run's end (train.steps 100)"),
        (f'{STAGE}[[data.stages]]\nfile_list = "b"\nstart_tokens = 5000', [], "data.stages[1]"
         ".start_tokens 5000 is not a multiple of train.tokens_per_step 2048: a stage starts on "
         "a step; use 4096 or 6144"),
        (STAGE, ["data.stages.1.start_step=5"], "'1' is not an index of a list of 1"),
        (STAGE, ["data.stages.x.start_step=5"], "'x' is not an index of a list of 1"),
        (STAGE, ["data.stages.0=5"], "'stages' is a list of tables; override a key of one: "
         "data.stages.0.KEY=..."),
        (STAGE, ["data.stages.0.file_list.x=5"], "'file_list' is a value, not a section"),
    ],
)  # fmt: skip
def test_a_bad_stage_is_one_usage_error_naming_it(tmp_path, data, overrides, message):
    with pytest.raises(GoodputError) as caught:
        load(tmp_path, data, *overrides)
    assert caught.value.code == 2
    assert "\n" not in caught.value.render()
    assert message in caught.value.render()


def test_more_stages_than_the_bound_are_refused(tmp_path):
    stages = "".join(
        f'[[data.stages]]\nfile_list = "a"\nstart_step = {i}\n' for i in range(MAX_STAGES + 1)
    )
    with pytest.raises(GoodputError, match=f"stages holds {MAX_STAGES + 1} stages"):
        load(tmp_path, stages, "train.steps=1000")


WSD = '[schedule]\nkind = "wsd"\nwarmup_steps = 10\nmin_lr_ratio = 0.0\n'


def test_the_wsd_decay_starts_with_the_named_stage(tmp_path):
    cfg = load(tmp_path, THREE, schedule=f'{WSD}decay_start = "stage:2"')
    start = cfg.schedule.decay_start_step(cfg.stage_steps())
    assert start == 80
    lrs = [learning_rate(cfg.schedule, s, 100, start) for s in range(100)]
    assert lrs[79] == lrs[50] == cfg.schedule.lr  # flat through the stage before
    assert lrs[80] == cfg.schedule.lr and lrs[81] < lrs[80]  # decays from the stage's first step
    assert lrs[99] == pytest.approx(cfg.schedule.lr / 20)  # linear, to 0 at step 100


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (f'{WSD}decay_start = "stage:3"', "decay_start 'stage:3' names a stage the run does not "
         "have (it has 3, stage:0 to stage:2)"),
        (f'{WSD}decay_start = "stage:-1"', "decay_start 'stage:-1' is not of the form 'stage:N'"),
        (f'{WSD}decay_start = "last"', "is not of the form 'stage:N'"),
        (f'{WSD}decay_start = "stage:99999"', "is not of the form 'stage:N'"),
        (f'{WSD}decay_start = 2', "'schedule.decay_start' must be str, got 2"),
        (f'{WSD}decay_start = "stage:1"\ndecay_fraction = 0.5', "'schedule.decay_fraction' is "
         "set but has no effect: it needs decay_start unset"),
        ('[schedule]\ndecay_start = "stage:1"', "'schedule.decay_start' is set but has no "
         "effect: it needs kind = 'wsd'"),
    ],
)  # fmt: skip
def test_a_bad_decay_start_is_one_usage_error(tmp_path, schedule, message):
    with pytest.raises(GoodputError) as caught:
        load(tmp_path, THREE, schedule=schedule)
    assert caught.value.code == 2 and message in caught.value.render()


def test_a_shortened_run_keeps_the_stages_that_start_before_its_end(tmp_path):
    cfg = load(tmp_path, THREE, schedule=f'{WSD}decay_start = "stage:2"')
    short = cfg.shortened(50)
    assert (short.train.steps, short.stage_steps()) == (50, (0, 30))
    assert short.data.file_lists() == ("web.txt", "code.txt")
    assert short.schedule.decay_start is None  # its stage starts after the end
    whole = cfg.shortened(90)
    assert whole.stage_steps() == cfg.stage_steps() and whole.schedule == cfg.schedule
