"""``goodput plan reliability``: the failure budget against hand-computed values, the optimum
against the goodput formula it optimises, the spare pool against the Poisson tail, memory
snapshots' lost work and goodput against hand-computed values (one node: no partner), the real
CLI's JSON, text and one-line errors, and the examples of docs/plan.md as written."""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import replace

import pytest

from goodput import cli
from goodput.plan.reliability import (
    Budget,
    daly_interval_s,
    expected_goodput,
    plan_reliability,
    spares_needed,
)
from goodput.testing.jobs import REPO

# The seed's arithmetic: 16,000 nodes, one failure a node-year; the seed's 20B save stall.
SEED = Budget(
    nodes=16_000,
    node_mtbf_s=365 * 86400,
    save_stall_s=23.6,
    restart_s=60,
    walltime_s=86400,
    survival=0.99,
    step_s=10,
    interval_steps=100,
)


def test_the_seeds_machine_fails_about_44_times_a_day():
    report = plan_reliability(SEED)
    # M = 365 x 86,400 / 16,000 = 1,971 s; 86,400 / 1,971 = 43.84 failures a day.
    assert report.cluster_mtbf_s == pytest.approx(1971.0)
    assert report.failures_per_day == pytest.approx(43.835616, rel=1e-6)
    # Young: sqrt(2 x 23.6 x 1,971) = sqrt(93,031.2) = 305.01 s.
    assert report.young_interval_s == pytest.approx(305.0102, rel=1e-6)
    # Daly: 23.6 / 3,942 = 0.0059868; 305.0102 x (1 + 0.077375 / 3 + 0.0059868 / 9) - 23.6.
    assert report.optimal_interval_s == pytest.approx(289.4797, rel=1e-6)
    # Goodput at it: 289.48 / (1,971 x e^(60/1,971) x (e^(313.08/1,971) - 1)) = 0.82755.
    assert report.expected_goodput == pytest.approx(0.827549, rel=1e-5)
    # The configured 100 steps of 10 s: 1,000 / (1,971 x 1.030909 x (e^(1,023.6/1,971) - 1)).
    assert report.configured_interval_s == 1000
    assert report.configured_goodput == pytest.approx(0.722784, rel=1e-5)


def test_dalys_interval_is_where_the_goodput_peaks():
    for stall, mtbf in ((23.6, 1971.0), (1.0, 11_135.0), (148.8, 11_135.0), (600.0, 900.0)):
        best = daly_interval_s(stall, mtbf)
        at_best = expected_goodput(best, stall, 60.0, mtbf)
        for factor in (0.8, 0.9, 1.1, 1.25):
            assert expected_goodput(best * factor, stall, 60.0, mtbf) < at_best
    assert daly_interval_s(500.0, 200.0) == 200.0  # a save longer than 2M: checkpoint every M


def test_goodput_falls_with_the_restart_and_never_overflows():
    assert expected_goodput(300, 20, 0, 2000) > expected_goodput(300, 20, 600, 2000)
    assert expected_goodput(1e8, 1e8, 1e8, 1.0) == 0.0  # e^(2e8) would overflow


def test_memory_snapshots_bound_the_lost_work_by_their_interval():
    # The seed's machine, snapshots every 5 steps of 10 s holding training 2 s each.
    memory = plan_reliability(replace(SEED, memory_interval_steps=5, memory_stall_s=2)).memory
    assert memory is not None and (memory.interval_s, memory.stall_s) == (50, 2)
    # p = e^(-(60 + 50) / 31,536,000) = 0.99999651: the partner lives past the re-copy.
    assert memory.partner_survives == pytest.approx(0.9999965119, rel=1e-9)
    # p x 25 + (1 - p) x 500 against the configured interval's 500.
    assert memory.lost_s == pytest.approx(25.0016568, rel=1e-6) and memory.disk_lost_s == 500
    # Daly at (50, 2): 50 / (1,971 x e^(60/1,971) x (e^(52/1,971) - 1)) = 0.9204594; times
    # e^(-(1 - p) x 950 / 3,942) for the failures that reach disk, 1,000 / 1,023.6 for its saves.
    assert memory.goodput == pytest.approx(0.9204594 * 0.99999916 * 1000 / 1023.6, rel=1e-6)
    assert memory.disk_goodput == plan_reliability(SEED).configured_goodput


def test_one_node_has_no_partner_and_snapshots_only_cost():
    alone = replace(SEED, nodes=1, memory_interval_steps=5, memory_stall_s=2)
    memory = plan_reliability(alone).memory
    assert memory is not None and memory.partner_survives == 0.0
    assert memory.lost_s == memory.disk_lost_s == 500  # every failure reaches disk
    assert memory.goodput < memory.disk_goodput
    # Without a configured interval, the disk checkpoints are Daly's optimum.
    daly = plan_reliability(replace(SEED, interval_steps=None, memory_interval_steps=5))
    assert daly.memory is not None and daly.memory.disk_interval_s == daly.optimal_interval_s
    assert daly.memory.stall_s == SEED.save_stall_s  # the default: the save's stall


def test_off_the_report_is_what_it_was(capsys):
    code, out, _ = run(capsys, *SEED_ARGS, "--step-s", 10, "--interval-steps", 100, "--json")
    assert code == 0 and "memory_snapshots" not in json.loads(out)
    on = [*SEED_ARGS, "--step-s", 10, "--interval-steps", 100, "--memory-interval-steps", 5]
    code, out, _ = run(capsys, *on, "--json")
    assert code == 0 and json.loads(out)["memory_snapshots"]["stall_s"] == 23.6


def poisson_cdf(k: int, mean: float) -> float:
    return math.fsum(math.exp(-mean) * mean**i / math.factorial(i) for i in range(k + 1))


@pytest.mark.parametrize(("mean", "survival"), [(0.5, 0.99), (3.0, 0.9), (43.84, 0.99)])
def test_the_spare_pool_is_the_smallest_that_lasts_with_the_asked_probability(mean, survival):
    spares, achieved = spares_needed(mean, survival)
    assert achieved == pytest.approx(poisson_cdf(spares, mean), rel=1e-9)
    assert poisson_cdf(spares, mean) >= survival > poisson_cdf(spares - 1, mean)
    assert spares_needed(0.0, 0.99) == (0, 1.0)


def test_a_huge_expected_count_stays_in_log_space():
    # e^-1e5 underflows to 0: a direct Poisson sum would say no pool is ever enough.
    spares, achieved = spares_needed(1e5, 0.99)
    assert 1e5 + 2.2 * math.sqrt(1e5) < spares < 1e5 + 2.5 * math.sqrt(1e5)  # z(0.99) = 2.33
    assert 0.99 <= achieved < 0.992


def run(capsys, *argv: object) -> tuple[int, str, str]:
    try:
        code = cli.main(["plan", "reliability", *map(str, argv)])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


SEED_ARGS = ["--nhosts", 16000, "--node-mtbf-days", 365, "--save-stall-s", 23.6, "--restart-s", 60]


def test_the_json_has_the_documented_keys(capsys):
    code, out, err = run(capsys, *SEED_ARGS, "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    for key in ("failures_per_day", "cluster_mtbf_s", "optimal_interval_s", "expected_goodput"):
        assert isinstance(report[key], float)
    assert round(report["failures_per_day"]) == 44
    assert report["spare_nodes"] == 60 and report["configured_goodput"] is None


def test_nodes_is_the_deprecated_spelling_of_nhosts(capsys):
    code, out, err = run(capsys, "--nodes", *SEED_ARGS[1:], "--json")
    assert code == 0 and json.loads(out)["spare_nodes"] == 60
    assert err == "goodput: warning: --nodes is deprecated; use --nhosts\n"


def test_the_text_names_the_configured_interval_against_the_optimum(capsys):
    code, out, _ = run(capsys, *SEED_ARGS, "--step-s", 10, "--interval-steps", 100)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].endswith("cluster MTBF 1,971 s (0.55 h), 43.8 failures a day")
    assert "289 s of compute = 29 steps of 10 s (Young: 305 s): expected goodput 82.8%" in lines[2]
    assert lines[3] == (
        "  configured: every 100 steps = 1,000 s: expected goodput 72.3% (10.5 points below the "
        "optimum)"
    )
    assert "60 spare nodes last it with probability 99.19% (asked: 99%)" in lines[4]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--interval-steps", "10"], "--interval-steps: needs --step-s"),
        (["--survival", "1"], "--survival: 1 is not a probability below 1"),
        (["--walltime-h", "1e8"], "failures expected in one walltime: more than 1e+06"),
        (["--nhosts", "1000000"], "--nhosts: 1000000 hosts is beyond any machine"),
        (["--restart-s", "-1"], "argument --restart-s: -1 is not in [0, 315360000]"),
        (["--save-stall-s", "nan"], "argument --save-stall-s: nan is not in (0, 315360000]"),
        # Values the options admit, for which the model has no finite answer:
        (["--step-s", "1e-320"], "--step-s: a step of 9.99989e-321 s makes the optimal interval"),
        (["--step-s", "1e-12"], "more than 1,099,511,627,776 steps, beyond any run"),
        (["--node-mtbf-days", "1e-320", "--walltime-h", "1e-300"], "--node-mtbf-days: "),
        (["--node-mtbf-days", "1e-9", "--walltime-h", "1e-9"], "more than 1e+06 failures a day"),
        (["--save-stall-s", "5e-324"], "--save-stall-s: 4.94066e-324 s is below 1e-06 s"),
        (["--memory-interval-steps", "5"], "--memory-interval-steps: needs --step-s"),
        (["--memory-stall-s", "2"], "--memory-stall-s: is a memory snapshot's stall: there are"),
        (
            ["--step-s", "10", "--interval-steps", "100", "--memory-interval-steps", "101"],
            "--memory-interval-steps: 101 steps of 10 s = 1,010 s is longer than the disk",
        ),
        (
            ["--step-s", "10", "--memory-interval-steps", "5", "--memory-stall-s", "5e-324"],
            "--memory-stall-s: 4.94066e-324 s is below 1e-06 s",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, extra, message):
    code, out, err = run(capsys, *SEED_ARGS, *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("goodput: error: ") and message in err


def test_the_pages_examples_print_what_they_show(capsys):
    page = (REPO / "docs" / "plan.md").read_text()
    examples = re.findall(
        r"```sh\n(goodput plan reliability [^\n]*)\n```\n+```text\n(.*?)```", page, re.S
    )
    assert len(examples) == 2  # disk checkpoints alone; with memory snapshots
    for line, shown in examples:
        code, out, err = run(capsys, *shlex.split(line)[3:])
        assert (code, err) == (0, "") and out.strip() == shown.strip()
    async_save = dict(zip(SEED_ARGS[::2], SEED_ARGS[1::2], strict=True)) | {"--save-stall-s": 2}
    code, out, _ = run(capsys, *[x for pair in async_save.items() for x in pair])
    assert "87 s of compute (Young: 89 s): expected goodput 92.7%" in out  # as the page says
    assert "`--save-stall-s 2`: 87 s, goodput 92.7%" in page
