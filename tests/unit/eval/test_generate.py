"""Generation with a KV cache: the same tokens and logits as recomputing the whole sequence with
the normal forward; seeded top-p sampling; the stop reasons; and ``goodput generate`` end to end
on a really trained run with a real SentencePiece tokenizer, and its one-line refusals."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from goodput import cli
from goodput.commands import generate as generate_command
from goodput.data.tokenizer import load_tokenizer
from goodput.errors import GoodputError
from goodput.eval import generate as gen
from goodput.eval.generate import CachedDecoder, Sampling, choose_token, generate
from goodput.testing.tiny import TINY_MODEL, tokenized_run_config
from goodput.train.config.model import MoEConfig
from goodput.train.convert.checkpoints import (
    load_model_state,
    read_model_config,
    write_model_only_checkpoint,
)
from goodput.train.loop import train
from goodput.train.model import Transformer

# A larger init than training's, so that a random model's predictions are peaked and differ
# from position to position: a cache that attends wrongly changes the tokens, not only noise.
BASE = replace(TINY_MODEL, max_seq_len=64, init_std=0.3)
CONFIGS = {
    "gqa": BASE,  # TINY_MODEL: 4 heads over 2 kv heads
    "mha": replace(BASE, num_kv_heads=None),
    "rope-llama3": replace(
        BASE, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=16
    ),
    "rope-linear": replace(BASE, rope_scaling="linear", rope_scaling_factor=4.0),
    "tied-moe": replace(
        BASE, tie_embeddings=True, moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32)
    ),
}
PROMPT = [5, 17, 3, 42, 8, 29, 11]


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


@torch.no_grad()
def full_logits(model, ids):
    """The normal forward over the whole sequence: the last position's logits."""
    return model(torch.tensor([ids]))[0, -1].float()


def greedy_without_cache(model, prompt, num_new):
    ids = list(prompt)
    for _ in range(num_new):
        ids.append(int(full_logits(model, ids).argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_equals_recomputing_the_whole_sequence(name):
    model = random_model(CONFIGS[name])
    expected = greedy_without_cache(model, PROMPT, 20)
    assert len(set(expected)) > 3  # a varied continuation, not one token repeated
    result = generate(model, PROMPT, max_new_tokens=20, eod_id=None)
    assert result.tokens == expected
    assert result.stopped == "max_new_tokens"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_logits_equal_the_full_forwards_last_position_at_every_step(name):
    model = random_model(CONFIGS[name])
    tokens = greedy_without_cache(model, PROMPT, 12)
    decoder = CachedDecoder(model, len(PROMPT) + len(tokens))
    with torch.no_grad():
        cached = [decoder.prefill(PROMPT)] + [decoder.step(token) for token in tokens]
    for i, logits_v in enumerate(cached):
        reference = full_logits(model, PROMPT + tokens[:i])
        # fp32 rounding of matmuls of other shapes: MKL picks the kernels by shape and CPU (up to
        # 1.01e-5 on logits near 2 on an Intel Xeon, 5e-6 relative), far below what a cache that
        # attends wrongly changes (BASE makes peaked predictions for that).
        torch.testing.assert_close(logits_v, reference, atol=1e-5, rtol=1e-5)
    assert decoder.cache.length == len(PROMPT) + len(tokens)


def test_each_new_token_runs_one_position_through_the_model():
    model = random_model(BASE)
    lengths = []
    assert model.embedding is not None
    model.embedding.register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    generate(model, PROMPT, max_new_tokens=6, eod_id=None)
    assert lengths == [len(PROMPT)] + [1] * 5  # the prompt once; the 6th token is not fed back


@pytest.mark.parametrize("name", ["gqa", "rope-llama3"])
def test_a_prompt_prefilled_in_chunks_continues_at_the_right_positions(name):
    # A chunk after the first has several queries over a longer key range: the masked branch.
    model = random_model(CONFIGS[name])
    ids = PROMPT + [1, 2, 3, 4, 5, 6]
    cache = model.kv_cache(batch_size=1, capacity=len(ids))
    with torch.no_grad():
        model(torch.tensor([ids[:4]]), cache=cache)
        logits_btv = model(torch.tensor([ids[4:]]), cache=cache)
        reference_btv = model(torch.tensor([ids]))
    torch.testing.assert_close(logits_btv[0], reference_btv[0, 4:], atol=1e-5, rtol=0)


def test_training_forward_is_unchanged_by_a_cache_elsewhere():
    # The same model answers the normal forward bit for bit before and after cached decoding.
    model = random_model(BASE)
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(x)
        generate(model, PROMPT, max_new_tokens=5, eod_id=None)
        after = model(x)
    assert torch.equal(before, after)


def test_a_seed_reproduces_a_sample_and_another_seed_differs():
    model = random_model(replace(BASE, init_std=0.02))  # flat: many tokens are likely

    def sample(seed):
        sampling = Sampling(temperature=1.0, top_p=0.95, seed=seed)
        return generate(model, PROMPT, max_new_tokens=24, eod_id=None, sampling=sampling).tokens

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)
    greedy = generate(model, PROMPT, max_new_tokens=24, eod_id=None).tokens
    assert sample(3) != greedy


def test_a_tiny_top_p_is_greedy():
    model = random_model(replace(BASE, init_std=0.02))
    greedy = generate(model, PROMPT, max_new_tokens=16, eod_id=None)
    nucleus = Sampling(temperature=1.5, top_p=1e-6, seed=7)
    assert generate(model, PROMPT, max_new_tokens=16, eod_id=None, sampling=nucleus) == greedy


def test_top_p_samples_only_the_nucleus():
    logits_v = torch.tensor([0.5, 0.3, 0.2]).log()
    generator = torch.Generator().manual_seed(0)

    def seen(top_p):
        sampling = Sampling(temperature=1.0, top_p=top_p)
        return {choose_token(logits_v, sampling, generator) for _ in range(400)}

    assert seen(0.5) == {0}
    assert seen(0.75) == {0, 1}
    assert seen(1.0) == {0, 1, 2}


def test_stops_at_eod_without_it_in_the_tokens():
    model = random_model(BASE)
    tokens = greedy_without_cache(model, PROMPT, 8)
    eod = tokens[4]
    result = generate(model, PROMPT, max_new_tokens=8, eod_id=eod)
    assert result.stopped == "eod"
    assert result.tokens == tokens[: tokens.index(eod)]


def test_a_stop_callback_ends_generation_after_the_token_it_accepts():
    model = random_model(BASE)
    tokens = greedy_without_cache(model, PROMPT, 8)
    seen = []

    def stop(new):
        seen.append(list(new))
        return len(new) == 3

    result = generate(model, PROMPT, max_new_tokens=8, eod_id=None, stop=stop)
    assert (result.tokens, result.stopped) == (tokens[:3], "stop")
    assert seen == [tokens[:1], tokens[:2], tokens[:3]]  # asked after each new token


def test_stops_when_the_context_is_full():
    model = random_model(replace(BASE, max_seq_len=len(PROMPT) + 3))
    result = generate(model, PROMPT, max_new_tokens=10, eod_id=None)
    assert (len(result.tokens), result.stopped) == (3, "max_seq_len")
    assert result.tokens == greedy_without_cache(model, PROMPT, 3)
    # Both limits at once: the user's own one is named.
    both = generate(model, PROMPT, max_new_tokens=3, eod_id=None)
    assert both.stopped == "max_new_tokens"
    full = generate(model, PROMPT + [1, 2, 3], max_new_tokens=10, eod_id=None)
    assert (full.tokens, full.stopped) == ([], "max_seq_len")
    with pytest.raises(GoodputError, match="more than the model's max_seq_len"):
        generate(model, PROMPT + [1, 2, 3, 4], max_new_tokens=1, eod_id=None)


def test_ids_past_the_tokenizers_vocabulary_are_never_chosen():
    model = random_model(replace(BASE, init_std=0.02))
    sampling = Sampling(temperature=2.0, seed=1)
    result = generate(
        model, PROMPT, max_new_tokens=30, eod_id=None, sampling=sampling, vocab_size=6
    )
    assert len(result.tokens) == 30 and max(result.tokens) < 6


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"temperature": -0.5}, "--temperature"),
        ({"temperature": float("nan")}, "--temperature"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
    ],
)
def test_bad_sampling_is_a_usage_error(kwargs, where):
    with pytest.raises(GoodputError) as exc:
        Sampling(**kwargs)
    assert exc.value.where == where and exc.value.code == 2


def test_the_commands_bound_is_the_generators():
    assert generate_command.MAX_NEW_TOKENS == gen.MAX_NEW_TOKENS


# --- goodput generate end to end -------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained on shards tokenized with a real SentencePiece model: its blend pins
    the tokenizer. The model's vocabulary (320) is padded past the tokenizer's (300)."""
    root = tmp_path_factory.mktemp("generate")
    cfg, tokenizer = tokenized_run_config(root)
    cfg = replace(
        cfg,
        checkpoint=replace(cfg.checkpoint, interval_steps=4, async_save=False),
    )
    train(cfg)
    return root / "tiny" / "run", tokenizer


def generate_cli(capsys, *argv):
    code = cli.main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_a_run_directory_as_json(run, capsys):
    run_dir, tokenizer_file = run
    code, out, err = generate_cli(
        capsys, run_dir, "--prompt", "alpha beta", "--max-new-tokens", 5, "--json"
    )
    assert code == 0, err
    (line,) = out.splitlines()
    result = json.loads(line)
    assert set(result) == {"prompt", "completion", "tokens", "num_new_tokens", "stopped"}
    assert result["prompt"] == "alpha beta"
    assert result["num_new_tokens"] == len(result["tokens"])
    assert (result["num_new_tokens"], result["stopped"]) == (5, "max_new_tokens") or result[
        "stopped"
    ] == "eod"
    tokenizer = load_tokenizer(tokenizer_file)
    assert all(0 <= t < tokenizer.vocab_size for t in result["tokens"])
    assert result["completion"] == tokenizer.decode(result["tokens"])
    assert "checkpoints/step-00000008" in err  # the newest complete checkpoint, said on stderr


def test_generate_a_step_directory_matches_the_in_process_model(run, capsys):
    run_dir, tokenizer_file = run
    step = run_dir / "checkpoints" / "step-00000008"
    code, out, err = generate_cli(
        capsys, step, "--prompt", "gamma delta", "--max-new-tokens", 7, "--json"
    )
    assert code == 0, err
    tokens = json.loads(out)["tokens"]
    # The same checkpoint loaded by hand and decoded without a cache.
    cfg = read_model_config(step)
    model = Transformer(cfg).eval()
    model.load_state_dict(load_model_state(step, cfg))
    tokenizer = load_tokenizer(tokenizer_file)
    prompt = tokenizer.encode_batch(["gamma delta"])[0]
    reference = []
    for _ in range(7):
        logits_v = full_logits(model, prompt + reference)
        logits_v[tokenizer.vocab_size :] = -float("inf")
        token = int(logits_v.argmax())
        if token == tokenizer.eod_id:
            break
        reference.append(token)
    assert tokens == reference


def test_generate_prints_the_completion_and_takes_sampling_options(run, capsys):
    run_dir, tokenizer_file = run
    argv = [run_dir, "--prompt", "alpha", "--max-new-tokens", 6, "--temperature", 0.8]
    first = generate_cli(capsys, *argv, "--top-p", 0.9, "--seed", 5, "--tokenizer", tokenizer_file)
    again = generate_cli(capsys, *argv, "--top-p", 0.9, "--seed", 5)
    assert first[0] == again[0] == 0, first[2]
    assert first[1] == again[1]  # plain text: the completion alone
    assert not first[1].lstrip().startswith("{")


def test_a_moved_or_changed_tokenizer_says_to_pass_tokenizer(run, capsys):
    run_dir, tokenizer_file = run
    original = tokenizer_file.read_bytes()
    moved = tokenizer_file.with_name("elsewhere.model")
    try:
        tokenizer_file.rename(moved)
        code, out, err = generate_cli(capsys, run_dir, "--prompt", "alpha")
        assert code == 1 and out == ""
        assert len(err.splitlines()) == 1 and "missing" in err and "--tokenizer" in err
        assert generate_cli(capsys, run_dir, "--prompt", "alpha", "--tokenizer", moved)[0] == 0
        moved.rename(tokenizer_file)
        tokenizer_file.write_bytes(original + b"\0")
        code, out, err = generate_cli(capsys, run_dir, "--prompt", "alpha")
        assert code == 1 and "changed since the blend pinned it" in err and "--tokenizer" in err
        assert len(err.splitlines()) == 1
    finally:
        if moved.exists():
            moved.rename(tokenizer_file)
        tokenizer_file.write_bytes(original)


def test_a_model_only_checkpoint_needs_tokenizer(run, capsys, tmp_path):
    run_dir, tokenizer_file = run
    step = run_dir / "checkpoints" / "step-00000008"
    cfg = read_model_config(step)
    write_model_only_checkpoint(tmp_path / "imported", load_model_state(step, cfg).items(), cfg)
    capsys.readouterr()
    code, _, err = generate_cli(capsys, tmp_path / "imported", "--prompt", "alpha")
    assert code == 2 and "model-only" in err and "--tokenizer" in err
    argv = [tmp_path / "imported", "--prompt", "alpha", "--tokenizer", tokenizer_file]
    assert generate_cli(capsys, *argv)[0] == 0


def test_a_tokenizer_larger_than_the_model_is_refused(run, capsys, tmp_path):
    _, tokenizer_file = run
    model = random_model(TINY_MODEL)  # vocabulary 61, the tokenizer's 300
    write_model_only_checkpoint(tmp_path, model.state_dict().items(), TINY_MODEL)
    capsys.readouterr()
    code, out, err = generate_cli(capsys, tmp_path, "--prompt", "a", "--tokenizer", tokenizer_file)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "vocabulary (300) is larger than the model's (61)" in err


def damaged_copy(run_dir, tmp_path, *, complete=True):
    step = tmp_path / "step-00000008"
    shutil.copytree(run_dir / "checkpoints" / "step-00000008", step)
    if not complete:
        (step / ".complete").unlink()
        return step
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return step


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--prompt", ""], 2, "--prompt: is empty"),
        (["--prompt", "a", "--temperature", "-1"], 2, "--temperature"),
        (["--prompt", "a", "--top-p", "0"], 2, "--top-p"),
        (["--prompt", "a", "--top-p", "1.5"], 2, "--top-p"),
        (["--prompt", "a", "--top-p", "x"], 2, "--top-p"),
        (["--prompt", "a", "--max-new-tokens", "0"], 2, "--max-new-tokens"),
        (["--prompt", "a", "--max-new-tokens", "65537"], 2, "--max-new-tokens"),
        (["--prompt", "a", "--seed", "-1"], 2, "--seed"),
        ([], 2, "--prompt"),
    ],
)
def test_bad_options_are_one_line(run, capsys, argv, code, says):
    run_dir, _ = run
    try:
        found = cli.main(["generate", str(run_dir), *argv])
    except SystemExit as exc:  # argparse's own errors
        found = exc.code
    out, err = capsys.readouterr()
    assert found == code and out == ""
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["missing", "no-checkpoint", "empty-run", "incomplete", "damaged"])
def test_bad_checkpoints_are_one_line(run, capsys, tmp_path, case):
    run_dir, _ = run
    if case == "missing":
        path, code, says = tmp_path / "nothing", 2, "no such checkpoint or run directory"
    elif case == "no-checkpoint":
        path, code, says = tmp_path, 2, "neither a checkpoint directory"
    elif case == "empty-run":
        (tmp_path / "checkpoints").mkdir()
        path, code, says = tmp_path, 2, "has no complete checkpoint"
    elif case == "incomplete":
        path, code, says = damaged_copy(run_dir, tmp_path, complete=False), 1, "incomplete"
    else:
        path, code, says = damaged_copy(run_dir, tmp_path), 1, "refused"
    found, out, err = generate_cli(capsys, path, "--prompt", "alpha", "--json")
    assert found == code and out == ""
    assert len(err.splitlines()) == 1, err
    assert says in err and "Traceback" not in err


def run_generate(run_dir, *argv, timeout=300):
    """``python -m goodput generate RUN ARGV`` as a user runs it (``argv`` may hold bytes, as a
    shell passes them)."""
    return subprocess.run(
        [sys.executable, "-m", "goodput", "generate", str(run_dir), *argv],
        capture_output=True,
        timeout=timeout,
    )


def test_a_prompt_that_is_not_utf8_is_one_line_naming_prompt(run):
    run_dir, _ = run
    child = run_generate(run_dir, "--prompt", b"alpha \xff beta")
    err = child.stderr.decode()
    assert child.returncode == 2 and child.stdout == b"" and len(err.splitlines()) == 1
    assert err.startswith("goodput: error: --prompt: is not UTF-8 text: byte 0xff at character 6")


@pytest.mark.parametrize(
    "sampling", [["--temperature", "1e-300"], ["--temperature", "1e300", "--top-p", "5e-324"]]
)
def test_extreme_documented_temperatures_and_top_p_generate(run, sampling):
    run_dir, _ = run
    child = run_generate(run_dir, "--prompt", "alpha", "--max-new-tokens", "4", "--json", *sampling)
    assert child.returncode == 0, child.stderr.decode()
    result = json.loads(child.stdout)
    assert result["num_new_tokens"] + (result["stopped"] == "eod") >= 1
