"""Runs compared at matched tokens (``report.compare``), on synthetic run directories: the tokens
axis (a line's ``tokens``, or step x ``tokens_per_step``), the smoothing, where one run first
reaches another's final value, the three views, and every hostile input refused in one line."""

import html
import json
import math

import pytest

from goodput import rundir
from goodput.cli import main
from goodput.errors import GoodputError
from goodput.eval.records import EvalRecord, append_evals
from goodput.report.compare import (
    LOSS,
    MAX_RUNS,
    compare_runs,
    first_reach,
    reaches,
    tokens_by_step,
    trailing_mean,
)
from goodput.report.compare_views import (
    comparison_json,
    left_out_notes,
    reach_sentence,
    render_comparison_html,
    tokens_text,
)
from goodput.report.run_files import Step
from goodput.testing.run_dirs import TOKENS_PER_STEP, Attempt, write_run

T0 = 1_800_000_000.0


def step(number, *, line=0, tokens=None):
    """Step ``number``; ``tokens``: its line's (the run's tokens through it), None: not said."""
    return Step(step=number, time=T0, step_time_s=1.0, tokens=0, tokens_seen=tokens, line=line)


def synthetic_run(run_dir, steps, *, heldout=None, accuracy=None, config=True, attempts=None):
    """A run of ``steps`` (its loss 8 / (1 + 0.01 step)), with evals at its last step."""
    write_run(run_dir, attempts or [Attempt(start=T0, startup_s=1, steps=range(1, steps + 1))],
              done=True)  # fmt: skip
    if config:
        (run_dir / rundir.CONFIG).write_text(f"[train]\ntokens_per_step = {TOKENS_PER_STEP}\n")
    records = []
    if heldout is not None:
        records.append(EvalRecord("heldout/web", "loss", heldout))
    if accuracy is not None:
        records.append(EvalRecord("arc-easy", "acc", accuracy, 0.01))
    if records:
        append_evals(run_dir, steps, records, "train")


def with_tokens(run_dir, tokens_of):
    """Rewrite ``run_dir``'s metrics lines with ``"tokens": tokens_of(step)``."""
    path = run_dir / rundir.METRICS
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text(
        "".join(json.dumps({**r, "tokens": tokens_of(r["step"])}) + "\n" for r in lines)
    )


# --- the pure functions ---------------------------------------------------------------------


def test_tokens_come_from_the_line_or_from_the_step():
    steps = [step(1, tokens=100), step(2), step(3, tokens=900)]
    placed, derived = tokens_by_step(steps, 300, "m")
    assert placed == {1: 100, 2: 600, 3: 900} and derived
    placed, derived = tokens_by_step([step(1, tokens=5), step(2, tokens=7)], None, "m")
    assert placed == {1: 5, 2: 7} and not derived


@pytest.mark.parametrize(
    "steps, what",
    [
        ([step(1, tokens=10), step(2, tokens=10, line=2)], "'tokens' is 10 at step 2"),
        ([step(1, tokens=10), step(2, tokens=4, line=2)], "'tokens' is 4 at step 2"),
        ([step(1, tokens=0, line=2)], "'tokens' is 0 at step 1"),
        ([step(1, tokens=1 << 62, line=2)], "at step 1"),
    ],
)
def test_tokens_that_do_not_rise_are_refused_naming_the_line(steps, what):
    with pytest.raises(GoodputError) as refused:
        tokens_by_step(steps, None, "run/metrics.jsonl")
    assert refused.value.where == "run/metrics.jsonl:2" and what in refused.value.what


def test_derived_tokens_past_the_largest_count_are_refused_naming_the_line():
    with pytest.raises(GoodputError) as refused:
        tokens_by_step([step(1, tokens=5), step(1 << 40, line=2)], 1 << 30, "m")
    assert refused.value.where == "m:2" and f"below {1 << 62:,}" in refused.value.what


def test_tokens_past_2_to_the_53_are_exact_integers(tmp_path, capsys):
    """A float of 2**53 + 1 is 2**53: the tokens axis compares the lines' integers."""
    for name in ("a", "b"):
        synthetic_run(tmp_path / name, 10)
        with_tokens(tmp_path / name, lambda s: 2**53 + s)
    comparison = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert [t for t, _ in comparison.runs[0].series[LOSS].points] == [
        2**53 + s for s in range(1, 11)
    ]
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["runs"][1]["series"][LOSS]["tokens"][-1] == 2**53 + 10


def test_a_line_without_tokens_and_no_tokens_per_step_is_refused():
    with pytest.raises(GoodputError, match="has steps without 'tokens'"):
        tokens_by_step([step(1)], None, "m")


def test_the_trailing_mean_covers_its_window():
    points = [(10, 4.0), (20, 2.0), (30, 0.0), (40, 6.0)]
    assert trailing_mean(points, 1) == tuple(points)
    assert trailing_mean(points, 20) == ((10, 4.0), (20, 3.0), (30, 1.0), (40, 3.0))
    assert trailing_mean(points, 1000) == ((10, 4.0), (20, 3.0), (30, 2.0), (40, 3.0))


def test_first_reach_is_the_first_point_at_or_past_the_target():
    falling = [(1, 5.0), (2, 3.0), (3, 4.0), (4, 2.0)]
    assert first_reach(falling, 3.5, higher_is_better=False) == 2
    assert first_reach(falling, 2.0, higher_is_better=False) == 4
    assert first_reach(falling, 1.0, higher_is_better=False) is None
    assert first_reach(falling, 4.5, higher_is_better=True) == 1
    assert first_reach(falling, 6.0, higher_is_better=True) is None


# --- runs -----------------------------------------------------------------------------------


def test_a_longer_run_reaches_the_shorter_ones_loss_at_its_tokens(tmp_path):
    synthetic_run(tmp_path / "short", 20, heldout=5.0, accuracy=0.4)
    synthetic_run(tmp_path / "long", 40, heldout=4.0, accuracy=0.6)
    comparison = compare_runs([tmp_path / "short", tmp_path / "long"])
    short, long = comparison.runs
    assert short.tokens_derived and long.tokens_derived  # no "tokens" in write_run's lines
    assert short.series[LOSS].final[0] == 20 * TOKENS_PER_STEP
    assert comparison.smoothing_tokens == round(20 * TOKENS_PER_STEP / 50)
    assert comparison.series_names() == [LOSS, "acc/arc-easy", "heldout/web"]
    found = {(r.series, r.run): r for r in comparison.reaches}
    # The same curve: the long run is at the short one's final loss where the short one ended.
    assert found[LOSS, "long"].tokens == 20 * TOKENS_PER_STEP
    assert found[LOSS, "long"].ratio == pytest.approx(1.0)
    assert found[LOSS, "short"].tokens is None and found[LOSS, "short"].ratio is None
    assert found["heldout/web", "long"].tokens == 40 * TOKENS_PER_STEP  # its one point
    assert found["heldout/web", "long"].target == 5.0
    assert found["acc/arc-easy", "short"].tokens is None  # 0.4 never reaches 0.6


def test_tokens_on_the_lines_set_the_axis_whatever_the_steps(tmp_path):
    """Two batch sizes (or layouts) with the same loss per step: on the tokens axis, the run
    with half the tokens a step reaches the other's final loss in half the tokens."""
    synthetic_run(tmp_path / "small", 40)
    synthetic_run(tmp_path / "big", 40)
    with_tokens(tmp_path / "small", lambda s: 1000 * s)
    with_tokens(tmp_path / "big", lambda s: 2000 * s)
    comparison = compare_runs([tmp_path / "small", tmp_path / "big"])
    assert not any(run.tokens_derived for run in comparison.runs)
    found = {(r.series, r.run): r for r in comparison.reaches}
    assert (found[LOSS, "small"].tokens, found[LOSS, "small"].target_tokens) == (40_000, 80_000)
    assert found[LOSS, "small"].ratio == 2.0 and found[LOSS, "big"].ratio == 0.5


def test_a_chain_counts_each_step_once_its_last_run(tmp_path):
    """Steps 11-15 run twice (a failure, a resume from step 10): the last run of each counts."""
    first = Attempt(start=T0, startup_s=1, steps=range(1, 16), class_="error", exit_code=1,
                    wait_s=1)  # fmt: skip
    second = Attempt(start=first.end() + 1, startup_s=1, steps=range(11, 31))
    synthetic_run(tmp_path / "chain", 30, attempts=[first, second])
    synthetic_run(tmp_path / "straight", 30)
    comparison = compare_runs([tmp_path / "chain", tmp_path / "straight"])
    chain, straight = comparison.runs
    assert chain.series[LOSS].points == straight.series[LOSS].points
    assert len(chain.series[LOSS].raw or ()) == 30


def test_the_views_hold_every_run_and_reach(tmp_path):
    synthetic_run(tmp_path / "a", 20, heldout=5.0)
    synthetic_run(tmp_path / "b", 30, heldout=4.5)
    comparison = compare_runs([tmp_path / "a", tmp_path / "b"])
    shown = comparison_json(comparison)
    assert [run["label"] for run in shown["runs"]] == ["a", "b"]
    assert len(shown["runs"][0]["series"][LOSS]["tokens"]) == 20
    assert len(shown["reaches"]) == len(comparison.reaches) == 4
    page = render_comparison_html(comparison)
    assert page.count("<figure") == 2 and "goodput" in page


def test_tokens_text():
    assert [tokens_text(n) for n in (950, 1200, 3_000_000, 7_770_000_000_000, 2**53, 2**62)] == [
        "950", "1.2K", "3M", "7.77T", "9.01e+15", "4.61e+18"
    ]  # fmt: skip


def test_the_command_prints_the_table_json_and_page(tmp_path, capsys):
    synthetic_run(tmp_path / "a", 20)
    synthetic_run(tmp_path / "b", 30)
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert main(["report", *runs]) == 0
    out = capsys.readouterr().out
    assert "runs at matched tokens" in out
    comparison = compare_runs([tmp_path / "a", tmp_path / "b"])
    for reach in comparison.reaches:
        assert reach_sentence(reach) in out
    assert "b reaches a's final loss" in out and "as many tokens" in out and "never" in out
    assert main(["report", *runs, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {reach["run"] for reach in shown["reaches"]} == {"a", "b"}
    page = tmp_path / "compare.html"
    assert main(["report", *runs, "--html", str(page)]) == 0
    assert page.read_text().count("<img") == 1


# --- hostile inputs: one line, non-zero exit ------------------------------------------------


def refusal(capsys, argv):
    code = main(["report", *map(str, argv)])
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return code, err


def test_hostile_runs_are_refused_in_one_line(tmp_path, capsys):
    synthetic_run(tmp_path / "a", 10)
    synthetic_run(tmp_path / "b", 10)
    a, b = tmp_path / "a", tmp_path / "b"
    assert refusal(capsys, [a, tmp_path / "missing"])[0] == 2
    code, err = refusal(capsys, [a, tmp_path / "a" / ".." / "a"])
    assert code == 2 and "is the same run as" in err
    code, err = refusal(capsys, [a] * (MAX_RUNS + 1))
    assert code == 2 and f"compares 2 to {MAX_RUNS} runs" in err
    assert refusal(capsys, [a, b, "--watch"])[0] == 2
    (tmp_path / "empty").mkdir()
    assert refusal(capsys, [a, tmp_path / "empty"])[0] == 2  # no metrics, no attempts


def test_a_run_without_a_loss_is_refused(tmp_path, capsys):
    synthetic_run(tmp_path / "a", 10)
    write_run(tmp_path / "none", [Attempt(start=T0, startup_s=1, steps=range(0))], done=False)
    code, err = refusal(capsys, [tmp_path / "a", tmp_path / "none"])
    assert code == 2 and "no step with a finite loss" in err


def test_broken_metrics_lines_are_refused_naming_the_line(tmp_path, capsys):
    synthetic_run(tmp_path / "a", 10)
    synthetic_run(tmp_path / "b", 10)
    metrics = tmp_path / "b" / rundir.METRICS
    metrics.write_text(metrics.read_text() + '{"step": "x", "loss": 1}\n')
    code, err = refusal(capsys, [tmp_path / "a", tmp_path / "b"])
    assert code == 1 and "metrics.jsonl:11" in err


def test_tokens_that_fall_are_refused_naming_the_line(tmp_path, capsys):
    synthetic_run(tmp_path / "a", 10)
    synthetic_run(tmp_path / "b", 10)
    with_tokens(tmp_path / "b", lambda s: 1000 * s if s != 6 else 10)
    code, err = refusal(capsys, [tmp_path / "a", tmp_path / "b"])
    assert "metrics.jsonl:6" in err and "must rise with the step" in err


def test_a_run_without_tokens_or_config_is_refused(tmp_path, capsys):
    synthetic_run(tmp_path / "a", 10)
    synthetic_run(tmp_path / "b", 10, config=False)
    code, err = refusal(capsys, [tmp_path / "a", tmp_path / "b"])
    assert "has steps without 'tokens'" in err and "config.toml" in err
    (tmp_path / "b" / rundir.CONFIG).write_text("[train]\ntokens_per_step = -3\n")
    code, err = refusal(capsys, [tmp_path / "a", tmp_path / "b"])
    assert code == 2 and "tokens_per_step is -3" in err


def test_reaches_need_the_series_in_both_runs(tmp_path):
    synthetic_run(tmp_path / "a", 10, accuracy=0.5)
    synthetic_run(tmp_path / "b", 10)
    comparison = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert {r.series for r in reaches(comparison.runs)} == {LOSS}
    assert all(math.isfinite(r.target) for r in comparison.reaches)


def test_evals_at_steps_without_a_line_are_placed_by_the_config_or_counted(tmp_path):
    synthetic_run(tmp_path / "a", 10)
    synthetic_run(tmp_path / "b", 10, config=False)
    for run in ("a", "b"):
        with_tokens(tmp_path / run, lambda s: TOKENS_PER_STEP * s)
        append_evals(tmp_path / run, 0, [EvalRecord("heldout/web", "loss", 8.0)], "goodput eval")
        append_evals(tmp_path / run, 20, [EvalRecord("heldout/web", "loss", 3.0)], "goodput eval")
    a, b = compare_runs([tmp_path / "a", tmp_path / "b"]).runs
    assert a.series["heldout/web"].points == ((0, 8.0), (20 * TOKENS_PER_STEP, 3.0))
    assert a.evals_left_out == 0 and not a.tokens_derived
    assert "heldout/web" not in b.series and b.evals_left_out == 2
    comparison = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert left_out_notes(comparison) == [
        "b: 2 eval point(s) left out: at steps with no metrics line, and no config.toml to "
        "place them"
    ]
    assert html.escape(left_out_notes(comparison)[0], quote=True) in render_comparison_html(
        comparison
    )


def test_runs_of_the_same_name_are_labelled_by_their_paths(tmp_path):
    synthetic_run(tmp_path / "x" / "run", 10)
    synthetic_run(tmp_path / "y" / "run", 10)
    comparison = compare_runs([tmp_path / "x" / "run", tmp_path / "y" / "run"])
    assert [run.label for run in comparison.runs] == [
        str(tmp_path / "x" / "run"),
        str(tmp_path / "y" / "run"),
    ]


def test_a_broken_evals_line_is_refused_naming_the_line(tmp_path, capsys):
    synthetic_run(tmp_path / "a", 10)
    synthetic_run(tmp_path / "b", 10, heldout=4.0)
    evals = tmp_path / "b" / rundir.EVALS
    evals.write_text(evals.read_text() + '{"step": 3, "task": "<b>", "metric": 1}\n')
    code, err = refusal(capsys, [tmp_path / "a", tmp_path / "b"])
    assert code == 1 and "evals.jsonl:2" in err


def test_a_stage_change_marks_where_the_stage_began(tmp_path):
    """A run across two data-mix stages: one tokens axis, the boundary where ``stage`` changes."""
    synthetic_run(tmp_path / "staged", 10)
    synthetic_run(tmp_path / "plain", 10)
    path = tmp_path / "staged" / rundir.METRICS
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    staged = [{**r, "stage": int(r["step"] > 6)} for r in lines]
    path.write_text("".join(json.dumps(r) + "\n" for r in staged))
    comparison = compare_runs([tmp_path / "staged", tmp_path / "plain"])
    staged_run, plain = comparison.runs
    assert staged_run.stage_starts == (6 * TOKENS_PER_STEP,) and plain.stage_starts == ()
    assert staged_run.series[LOSS].points == plain.series[LOSS].points
    assert comparison_json(comparison)["runs"][0]["stage_starts"] == [6 * TOKENS_PER_STEP]
