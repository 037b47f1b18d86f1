"""``goodput plan layout`` through the real CLI: what it reads from a config, the candidates'
costs it prints, its JSON, the launcher's option names (and the deprecated ones), the config's
own layout (--layout-from-config), the thin call into ``plan.verify``, one-line errors (exit 2
for bad input, 1 when nothing fits), and the examples of docs/plan.md, run as written and
compared with the output the page shows."""

from __future__ import annotations

import json
import os
import re
import shlex
from types import SimpleNamespace

import pytest

from goodput import cli
from goodput.plan.calibration import DEVICES
from goodput.plan.memory import GIB, state_bytes_per_device
from goodput.testing.jobs import REPO

MACHINE = ["--nhosts", "8", "--ppn", "12", "--gpu-mem-gb", "64"]
BATCH = ["--gbs-tokens", "1572864", "--seq-len", "4096"]
# The shipped recipes' [model] tables alone (their [train] and [parallel] left out).
MODEL_ONLY = (REPO / "configs/llama-405b.toml").read_text().split("\n[train]")[0]
MODEL_20B = (REPO / "configs/llama-20b.toml").read_text().split("\n[train]")[0]


def run(capsys, *argv: object) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``goodput plan layout ARGV`` run in the repository."""
    here = os.getcwd()
    os.chdir(REPO)
    try:
        code = cli.main(["plan", "layout", *map(str, argv)])
    except SystemExit as exit_:  # argparse refuses a bad option itself
        code = int(exit_.code or 0)
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return code, out, err


def section(out: str, title: str) -> list[str]:
    """The indented lines under the line starting with ``title``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        rows.append(line)
    return rows


def test_the_text_shows_each_candidates_cost_and_why_the_chosen_one(capsys):
    code, out, err = run(capsys, "configs/llama-20b.toml", *MACHINE, *BATCH)
    assert code == 0 and err == ""
    assert "step cost at 400 TFLOP/s per device" in out
    assert "300 GB/s per device within a host, 25 GB/s between hosts" in out
    header, *rows = section(out, "candidates: ")
    assert header.split() == [
        "rung",
        "layout",
        "GiB",
        "comm",
        "s",
        "recomp",
        "s",
        "bubble",
        "s",
    ] + [
        "total",
        "s",
    ]
    totals = [float(row.split()[-1]) for row in rows]
    assert totals == sorted(totals) and len(rows) <= 8
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
    assert chosen.endswith(" s a step: the cheapest estimate")
    shown = float(re.search(r"; ([\d.]+) s a step", chosen).group(1))
    assert shown == pytest.approx(totals[0], rel=1e-3)
    assert rows[0].split()[0] in chosen  # the rung
    rejected = section(out, "rejected, by rung")
    assert rejected[0].split()[:2] == ["DP", "1"]
    assert out.splitlines()[-1].startswith("overrides: parallel.dp_replicate=")
    assert len(out.splitlines()) <= 40  # one screen


def test_the_launchers_option_names_and_the_deprecated_ones(capsys):
    new = run(capsys, "configs/llama-20b.toml", *MACHINE, *BATCH)
    old_argv = ["--nodes", "8", "--gpus-per-node", "12", "--gpu-mem-gb", "64"]
    code, out, err = run(capsys, "configs/llama-20b.toml", *old_argv, *BATCH)
    assert (code, out) == new[:2]
    assert err.splitlines() == [
        "goodput: warning: --nodes is deprecated; use --nhosts",
        "goodput: warning: --gpus-per-node is deprecated; use --ppn",
    ]


def test_a_renamed_train_key_is_read_as_the_trainer_reads_it(capsys, tmp_path):
    recipe = (REPO / "configs/llama-20b.toml").read_text()
    assert "\nrun_dir = " in recipe
    new = run(capsys, "configs/llama-20b.toml", *MACHINE, *BATCH)
    old = tmp_path / "old.toml"
    old.write_text(recipe.replace("\nrun_dir = ", "\noutput = "))
    code, out, err = run(capsys, old, *MACHINE, *BATCH)
    assert (code, out.replace(str(old), "CONFIG")) == (
        0,
        new[1].replace("configs/llama-20b.toml", "CONFIG"),
    )
    assert err == "goodput: warning: train.output is deprecated; use train.run_dir\n"
    both = tmp_path / "both.toml"
    both.write_text(recipe.replace("\nrun_dir = ", '\noutput = "elsewhere"\nrun_dir = '))
    code, _, err = run(capsys, both, *MACHINE, *BATCH)
    assert code == 2 and "train.run_dir and train.output are both set, differently" in err


def test_json_is_one_object_with_the_documented_keys(capsys):
    code, out, _ = run(capsys, "configs/llama-80b.toml", *MACHINE, *BATCH, "--json")
    assert code == 0
    record = json.loads(out)
    assert list(record) == [
        "layout",
        "activation_checkpointing",
        "fp8",
        "compile",
        "pp_schedule",
        "pp_layers_per_stage",
        "rung",
        "memory_gib_per_device",
        "device_gib",
        "breakdown_gib",
        "stage",
        "accumulation",
        "sync_every_micro_batch",
        "cost_s",
        "seq_len",
        "seq_len_from",
        "rates",
        "candidates",
        "nearest_global_batches",
        "warnings",
        "overrides",
    ]
    terms = sum(record["breakdown_gib"].values())
    assert record["memory_gib_per_device"] == pytest.approx(terms, abs=1e-3)  # 4 decimals each
    cost = record["cost_s"]
    parts = cost["compute"] + cost["recompute"] + cost["bubble"] + cost["comm"]
    assert cost["total"] == pytest.approx(parts, abs=1e-3)
    # Without --device: the flags' defaults, and the H100's fitted fp8 and compile speed-ups.
    h100 = DEVICES["h100"]
    assert record["rates"] == {
        "tflops": 400.0,
        "intra_gbps": 300.0,
        "inter_gbps": 25.0,
        "fp8_rowwise": h100.fp8_rowwise,
        "fp8_tensorwise": h100.fp8_tensorwise,
        "compile": h100.compile,
        "gemm_half_dim": 0.0,
    }
    keys = {
        "rung",
        "layout",
        "activation_checkpointing",
        "fp8",
        "compile",
        "pp_schedule",
        "pp_layers_per_stage",
        "memory_gib_per_device",
        "cost_s",
        "fits",
        "reason",
    }
    assert all(set(c) == keys for c in record["candidates"])
    fitting = [c for c in record["candidates"] if c["fits"]]
    assert min(c["cost_s"]["total"] for c in fitting) == pytest.approx(cost["total"], rel=0.01)
    assert record["overrides"].startswith(
        " ".join(f"parallel.{k}={v}" for k, v in record["layout"].items())
    )


def test_the_commands_spellings_are_the_planners_and_the_trainers():
    # The parser spells them to import neither the planner nor the trainer's config.
    import typing

    from goodput.commands import plan
    from goodput.plan import layout
    from goodput.train.config.parallel import ParallelConfig

    trainer = typing.get_type_hints(ParallelConfig)
    assert plan.AC_MODES == layout.AC_MODES == typing.get_args(trainer["activation_checkpointing"])
    (recipes, none) = typing.get_args(trainer["fp8"])
    assert plan.FP8_RECIPES == layout.FP8_RECIPES == typing.get_args(recipes)
    assert none is type(None)
    assert tuple(DEVICES) == plan.DEVICE_NAMES


def test_the_device_the_rungs_and_the_overrides_the_trainer_takes(capsys, tmp_path):
    # --device gives the memory and the calibrated constants; --fp8 any and --compile let the
    # planner choose them where the device and the trainer allow.
    tiny = ("configs/tiny-cpu.toml", "--nhosts", 1, "--ppn", 4)
    code, out, err = run(capsys, *tiny, "--device", "h100", "--fp8", "any", "--compile")
    assert code == 0 and err == ""
    assert out.splitlines()[0].endswith("= 4 of 80.0 GiB")
    h100 = DEVICES["h100"]
    assert f"step cost at {h100.tflops:g} TFLOP/s per device (linear layers: fp8 rowwise " in out
    overrides = out.splitlines()[-1].removeprefix("overrides: ")
    # fp8 tensorwise is the largest speed-up the calibration found; compile only without tp.
    assert "parallel.fp8=tensorwise parallel.compile=true" in overrides
    from goodput.config import load_config
    from goodput.train.config.run import RunConfig

    cfg = load_config(RunConfig, REPO / tiny[0], overrides.split())  # the trainer takes them
    assert (cfg.parallel.fp8, cfg.parallel.compile) == ("tensorwise", True)
    # Without FP8 matmuls (max1550) no candidate is fp8; --no-compile none compiled.
    code, out, _ = run(capsys, *tiny, "--device", "max1550", "--no-compile", "--json")
    record = json.loads(out)
    assert record["rates"]["fp8_rowwise"] is None
    candidates = [c for c in record["candidates"] if c["layout"] is not None]
    assert not any(c["fp8"] or c["compile"] for c in candidates)
    # One mode forced: every candidate has it; budget only with compile.
    code, out, _ = run(
        capsys, *tiny, "--device", "h100", "--activation-checkpointing", "budget", "--compile"
    )
    assert code == 0 and "parallel.activation_checkpointing=budget" in out.splitlines()[-1]
    assert "parallel.activation_memory_budget=0.5 " in out.splitlines()[-1]


def test_layout_from_config_prices_the_configs_modes(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        MODEL_20B + '\n[parallel]\nactivation_checkpointing = "op"\nfp8 = "tensorwise"\n'
    )
    argv = (config, *MACHINE[:4], *BATCH, "--device", "h100", "--layout-from-config", "--json")
    code, out, _ = run(capsys, *argv)
    record = json.loads(out)
    assert code == 0 and record["rung"] == "config"
    assert (record["activation_checkpointing"], record["fp8"], record["compile"]) == (
        "op",
        "tensorwise",
        False,
    )
    config.write_text(MODEL_20B + "\n[parallel]\n")
    code, out, _ = run(capsys, *argv)
    plain = json.loads(out)
    # fp8 tensorwise speeds the linear layers up; op recomputes a tenth of a forward.
    assert plain["cost_s"]["compute"] > record["cost_s"]["compute"]
    assert plain["cost_s"]["recompute"] == 0 < record["cost_s"]["recompute"]


def test_the_rates_change_the_choice(capsys):
    # A slow network between hosts makes FSDP across hosts dear: the plan moves to a pipeline.
    # (At the default 25 GB/s it already does; between hosts as fast as within, it does not.)
    _, fast, _ = run(
        capsys, "configs/llama-80b.toml", *MACHINE, *BATCH, "--inter-gbps", "300", "--json"
    )
    _, slow, _ = run(
        capsys, "configs/llama-80b.toml", *MACHINE, *BATCH, "--inter-gbps", "0.5", "--json"
    )
    fast_record, slow_record = json.loads(fast), json.loads(slow)
    assert slow_record["rates"]["inter_gbps"] == 0.5
    assert slow_record["cost_s"]["total"] > fast_record["cost_s"]["total"]
    assert slow_record["layout"]["pp"] > 1 and fast_record["layout"]["pp"] == 1


def test_seq_len_comes_from_train_else_a_stated_default(capsys, tmp_path):
    # The 405B shape's max_seq_len is 131,072: without train.seq_len the planner plans at 8192.
    config = tmp_path / "model-only.toml"
    config.write_text(MODEL_ONLY)
    code, out, _ = run(
        capsys, config, "--nhosts", 64, "--ppn", 8, "--gpu-mem-gb", 80, "--gbs-tokens", 4194304
    )
    assert code == 0
    assert "= 512 x 8192 (seq_len: the default 8192, no train.seq_len)" in out
    short = tmp_path / "short.toml"
    short.write_text((REPO / "configs/tiny-cpu.toml").read_text().split("[train]")[0])
    code, out, _ = run(
        capsys, short, "--nhosts", 1, "--ppn", 4, "--gpu-mem-gb", 16, "--gbs-tokens", 4096
    )
    assert "= 16 x 256 (seq_len: model.max_seq_len, below the default 8192)" in out


def test_train_and_parallel_tables_fill_what_the_options_leave(capsys, tmp_path):
    # tiny-cpu.toml: tokens_per_step 4096, seq_len 128, micro_batch_size 8, precision fp32.
    tiny = ("configs/tiny-cpu.toml", "--nhosts", 1, "--ppn", 4, "--gpu-mem-gb", 16)
    code, out, _ = run(capsys, *tiny)
    assert code == 0
    assert "4,096 tokens = 32 x 128 (seq_len: train.seq_len); micro-batch 8; fp32" in out
    assert out.splitlines()[-1].endswith("parallel.ep=1 parallel.precision=fp32")
    code, out, _ = run(
        capsys,
        *tiny,
        *("--gbs-tokens", 2048, "--seq-len", 64, "--micro-batch-size", 2),
        *("--precision", "pure-bf16", "--activation-checkpointing"),
    )
    assert "2,048 tokens = 32 x 64 (seq_len: --seq-len); micro-batch 2; pure-bf16" in out
    assert "parallel.activation_checkpointing=full" in out.splitlines()[-1]
    config = tmp_path / "run.toml"
    config.write_text(MODEL_20B + "\n[parallel]\ntp = 16\n")
    code, out, _ = run(capsys, config, *MACHINE, *BATCH)
    assert code == 0
    assert out.splitlines()[-1].startswith(
        "warning: the config's [parallel]: tp = 16 does not divide the 12 ranks per host"
    )


def test_layout_from_config_reports_the_configs_own_layout(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        MODEL_ONLY
        + "\n[train]\nseq_len = 8192\ntokens_per_step = 16777216\n"
        + '[parallel]\npp = 16\ntp = 8\nactivation_checkpointing = "full"\n'
        + f"pp_layers_per_stage = [7, {', '.join(['8'] * 14)}, 7]\n"
    )
    machine = ["--nhosts", 1024, "--ppn", 8, "--gpu-mem-gb", 80]
    code, out, _ = run(capsys, config, *machine, "--layout-from-config")
    assert code == 0
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
    assert chosen.startswith("chosen: config pp 16 x dp_shard 64 x tp 8 + AC: ")
    assert chosen.endswith("the config's own [parallel] (--layout-from-config)")
    assert out.splitlines()[-1].endswith(
        "parallel.activation_checkpointing=full parallel.pp_layers_per_stage="
        "[7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]"
    )
    code, out, _ = run(capsys, config, *machine, "--layout-from-config", "--json")
    record = json.loads(out)
    assert record["rung"] == "config" and record["layout"]["dp_shard"] == 64
    assert record["pp_layers_per_stage"] == [7, *[8] * 14, 7]
    # A layout the world does not take is a usage error naming the config.
    code, _, err = run(
        capsys, config, "--nhosts", 3, "--ppn", 8, "--gpu-mem-gb", 80, "--layout-from-config"
    )
    assert code == 2 and "[parallel]" in err and "(--layout-from-config)" in err


def test_verify_is_a_thin_call_into_plan_verify(capsys, monkeypatch):
    import goodput.plan.verify as verify

    calls = []

    def fake(config_path, model, parallel, **options):
        calls.append((config_path, model, parallel, options))
        return SimpleNamespace(to_json=lambda: {"rank": options["rank"]}, format_text=lambda: "V")

    monkeypatch.setattr(verify, "verify_layout", fake)
    tiny = ("configs/tiny-cpu.toml", "--nhosts", 1, "--ppn", 4, "--gpu-mem-gb", 16)
    code, out, _ = run(capsys, *tiny, "--verify", "--rank", 3)
    assert code == 0 and out.endswith("\nV\n")
    ((path, model, parallel, options),) = calls
    assert str(path) == "configs/tiny-cpu.toml" and parallel.dp_replicate == 4
    assert parallel.precision == "fp32"
    assert {k: options[k] for k in ("nhosts", "ppn", "seq_len", "rank")} == {
        "nhosts": 1,
        "ppn": 4,
        "seq_len": 128,
        "rank": 3,
    }
    assert (options["micro_batch_size"], options["global_batch_size"]) == (8, 32)
    from goodput.plan.layout import Layout

    estimated = state_bytes_per_device(model, Layout(dp_replicate=4), "fp32") / GIB
    assert options["estimated_state_gib"] == estimated
    code, out, _ = run(capsys, *tiny, "--verify", "--json")
    assert json.loads(out)["verified"] == {"rank": None}
    code, _, err = run(capsys, *tiny, "--rank", 1)
    assert code == 2 and "--rank: only --verify materialises a rank" in err


def test_nothing_fits_is_one_line_and_exit_1(capsys):
    argv = ["configs/llama-80b.toml", "--nhosts", 1, *MACHINE[2:], *BATCH]
    code, out, err = run(capsys, *argv, "--no-activation-checkpointing")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(
        "goodput: error: configs/llama-80b.toml: no layout fits: the smallest estimate is "
    )
    code, out, err = run(capsys, *argv, "--no-activation-checkpointing", "--json")
    assert code == 1 and json.loads(out)["layout"] is None
    assert json.loads(out)["error"].startswith("no layout fits")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.toml", *MACHINE, *BATCH], "missing.toml"),
        (["BAD", *MACHINE, *BATCH], "invalid TOML"),
        (["UNKNOWN_MODEL_KEY", *MACHINE, *BATCH], "unknown key 'model.dims'"),
        (["UNKNOWN_TRAIN_KEY", *MACHINE, *BATCH], "unknown key 'train.seqlen'"),
        (["ZERO_SEQ_LEN", *MACHINE, "--gbs-tokens", "4096"], "'train.seq_len' = 0 is not in"),
        (["NO_MODEL", *MACHINE, *BATCH], "no [model] table"),
        (["MODEL_ONLY", *MACHINE], "--gbs-tokens: no global batch"),
        (["MODEL_ONLY", *MACHINE, "--gbs-tokens", "1000"], "not a multiple of seq_len 8192"),
        (
            ["configs/llama-20b.toml", *MACHINE, *BATCH[:2], "--seq-len", "9000"],
            "exceeds model.max_seq_len",
        ),
        (
            ["configs/llama-20b.toml", "--nhosts", "0", *MACHINE[2:], *BATCH],
            "argument --nhosts/--nodes: 0 is not in",
        ),
        (["configs/llama-20b.toml", "--nhosts", "-2", *MACHINE[2:], *BATCH], "argument --nhosts"),
        (
            ["configs/llama-20b.toml", "--nhosts", "2.5", *MACHINE[2:], *BATCH],
            "'2.5' is not a whole number",
        ),
        (["configs/llama-20b.toml", *MACHINE[:4], "--gpu-mem-gb", "nan", *BATCH], "--gpu-mem-gb"),
        (["configs/llama-20b.toml", *MACHINE[:4], "--gpu-mem-gb", "0", *BATCH], "--gpu-mem-gb"),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--precision", "fp8"], "invalid choice"),
        (["configs/llama-20b.toml", *MACHINE[2:], *BATCH], "--nhosts"),
        (
            ["configs/llama-20b.toml", "--nhosts", "1000000", *MACHINE[2:], *BATCH],
            "beyond any machine",
        ),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--tflops", "0"], "argument --tflops"),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--intra-gbps", "nan"], "--intra-gbps"),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--inter-gbps", "-1"], "--inter-gbps"),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--inter-gbps", "inf"], "--inter-gbps"),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--verify", "--rank", "-1"], "--rank"),
        (
            ["BAD_PARALLEL", *MACHINE, *BATCH, "--layout-from-config"],
            "unknown key 'parallel.tpp'",
        ),
        (["configs/llama-20b.toml", *MACHINE[:4], *BATCH], "--gpu-mem-gb: no memory per device"),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--device", "a100"], "invalid choice"),
        (
            ["configs/llama-20b.toml", *MACHINE, *BATCH, "--device", "mi250x", "--fp8", "any"],
            "--fp8: mi250x has no FP8 matmuls",
        ),
        (
            ["configs/llama-20b.toml", *MACHINE, *BATCH, "--activation-checkpointing", "budget"],
            "a memory budget is torch.compile's",
        ),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--fp8", "fp16"], "invalid choice"),
        (
            ["FP8_PARALLEL", *MACHINE[:4], *BATCH, "--device", "max1550", "--layout-from-config"],
            "fp8 = 'rowwise', but max1550 has no FP8 matmuls",
        ),
        (
            ["BUDGET_PARALLEL", *MACHINE, *BATCH, "--layout-from-config"],
            "activation_checkpointing = 'budget' needs compile = true",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    configs = {
        "BAD": "[model\nvocab_size = 3\n",
        "UNKNOWN_MODEL_KEY": "[model]\nvocab_size = 8\ndims = 8\n",
        "UNKNOWN_TRAIN_KEY": MODEL_ONLY + "\n[train]\nseqlen = 4\n",
        "ZERO_SEQ_LEN": MODEL_ONLY + "\n[train]\nseq_len = 0\n",
        "NO_MODEL": "[train]\nseq_len = 4\n",
        "MODEL_ONLY": MODEL_ONLY,
        "BAD_PARALLEL": MODEL_ONLY + "\n[parallel]\ntpp = 2\n",
        "FP8_PARALLEL": MODEL_20B + '\n[parallel]\ntp = 4\nfp8 = "rowwise"\n',
        "BUDGET_PARALLEL": MODEL_20B + '\n[parallel]\nactivation_checkpointing = "budget"\n',
    }
    if argv[0] in configs:
        path = tmp_path / f"{argv[0]}.toml"
        path.write_text(configs[argv[0]])
        argv = [str(path), *argv[1:]]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("goodput: error: ") and message in err
    assert "Traceback" not in err


def page_commands() -> list[tuple[str, str | None]]:
    """(command line, the output the page shows or None) for each ``goodput plan layout``
    block of docs/plan.md."""
    text = (REPO / "docs" / "plan.md").read_text()
    blocks = re.findall(
        r"```sh\n(goodput plan layout [^\n]*)\n```(\n+```(?:json|text)\n(.*?)```)?", text, re.S
    )
    return [(line, output if shown else None) for line, shown, output in blocks]


def test_the_page_shows_examples():
    commands = page_commands()
    shown = [line for line, output in commands if output is not None]
    assert len(shown) >= 4
    assert any("llama-8b" in line for line in shown) and any("llama-405b" in line for line in shown)
    assert any("--layout-from-config" in line for line in shown)
    unshown = [line for line, output in commands if output is None]
    assert any("--json" in line for line in unshown) and any("--verify" in line for line in unshown)


@pytest.mark.parametrize(
    ("line", "shown"), [c for c in page_commands() if c[1] is not None], ids=lambda v: str(v)[:60]
)
def test_the_pages_examples_print_what_it_shows(capsys, line, shown):
    code, out, err = run(capsys, *shlex.split(line)[3:])
    assert (out + err).strip() == shown.strip()
    assert code == (1 if err else 0)


@pytest.mark.parametrize(
    "line", [line for line, shown in page_commands() if shown is None], ids=lambda v: v[20:80]
)
def test_the_pages_other_commands_run(capsys, line):
    # --verify builds the demo model in two child processes: seconds.
    code, out, err = run(capsys, *shlex.split(line)[3:])
    assert code == 0 and err == "", err
    if "--json" in line:
        record = json.loads(out)
        assert set(record) >= {"layout", "cost_s", "candidates", "overrides"}
    if "--verify" in line:
        assert "verified on this CPU under a fake process group of 4 ranks" in out
