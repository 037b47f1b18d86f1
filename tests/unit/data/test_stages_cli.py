"""``goodput data blend --stage START_SAMPLE:FILE_LIST``: each stage's target and achieved
mixture in the text and JSON output; a bad ``--stage`` is one line and exit 2."""

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput import cli
from goodput.commands.data import _stage


@pytest.fixture
def blend_args(three_corpora, tmp_path):
    file_list, _ = three_corpora
    stage1 = file_list.parent / "stage1.txt"
    stage1.write_text("0.9 code code\n0.1 math math\n")
    common = ["--seq-len", "16", "--num-samples", "256", "--seed", "3", "--cache"]
    return file_list, stage1, [*common, str(tmp_path / "cache"), "--step-samples", "32"]


def test_each_stage_is_reported_in_text_and_json(blend_args, capsys):
    file_list, stage1, common = blend_args
    argv = ["data", "blend", str(file_list), "--stage", f"128:{stage1}", *common]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert f"stage 0 from sample 0 ({file_list})" in text
    assert f"stage 1 from sample 128 ({stage1})" in text
    assert cli.main([*argv, "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    stages = manifest["stages"]
    assert [stage["start_sample"] for stage in stages] == [0, 128]
    rows = stages[1]["report"]["corpora"]
    assert [(row["name"], row["target"]) for row in rows] == [("code", 0.9), ("math", 0.1)]
    assert all(abs(row["achieved"] - row["target"]) <= 1 / 128 for row in rows)
    for row in rows:  # stage 1's line of each of its corpora, target then achieved
        assert f"  {row['name']:<20} {row['target']:>8.4f} {row['achieved']:>9.4f}" in text


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (["x:{stage1}"], "START_SAMPLE 'x' is not a whole number"),
        (["--stage=-5:{stage1}"], "START_SAMPLE -5 is not in [1,"),
        (["128"], "'128' is not START_SAMPLE:FILE_LIST"),
        (["128:"], "'128:' is not START_SAMPLE:FILE_LIST"),
        (["128:{stage1}.missing"], "stage 1 (file list {stage1}.missing): the file list does"),
        (["192:{stage1}", "128:{stage1}"], "stage 2 (file list {stage1}): starts at sample 128"),
        (["256:{stage1}"], "before the run's end (256)"),
        (["100:{stage1}"], "inside a step of 32 samples; start it at sample 96 or 128"),
    ],
)
def test_a_bad_stage_is_one_line_and_exit_2(blend_args, capsys, stages, message):
    file_list, stage1, common = blend_args
    argv = ["data", "blend", str(file_list)]
    for stage in stages:
        stage = stage.format(stage1=stage1)
        argv += [stage] if stage.startswith("--stage=") else ["--stage", stage]
    try:
        code = cli.main([*argv, *common])
    except SystemExit as exit_:  # argparse's own checks exit from inside the parser
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("goodput: error: ") and err.count("\n") == 1, err
    assert message.format(stage1=stage1) in err


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_the_stage_parser_takes_any_text_without_crashing(text):
    try:
        stage = _stage(text)
    except argparse.ArgumentTypeError:
        return
    assert stage.start_sample >= 1 and str(stage.file_list) == text.partition(":")[2]
