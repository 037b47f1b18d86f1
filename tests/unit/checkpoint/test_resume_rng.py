"""A resumed run ends with the generators of the straight run, bit for bit, with the default
config: no ``train.peak_tflops``, so the CPU matmul probe runs at start, after the checkpoint's
RNG state was restored. A probe drawing from the global generator there would shift every later
draw (dropout, sampling) of the resumed run; the tiny model draws nothing itself, so the saved
generator states are what is compared."""

import json
from dataclasses import replace

from goodput.rundir import checkpoints_dir, rng_file, step_dir
from goodput.train.loop import train


def test_a_resumed_run_ends_with_the_generators_of_a_straight_run(run_config, tmp_path):
    default_peak = replace(run_config.train, peak_tflops=None)  # as a user's config has it
    cfg = replace(run_config, train=default_peak)

    def run(name, **checkpoint):
        changed = replace(cfg.checkpoint, interval_steps=4, **checkpoint)
        run_dir = tmp_path / name
        train(replace(cfg, train=replace(cfg.train, run_dir=str(run_dir)), checkpoint=changed))
        return checkpoints_dir(run_dir)

    straight = run("straight")
    resumed = run("resumed", resume=str(step_dir(straight, 4)))
    saved_at_4 = json.loads(rng_file(step_dir(straight, 4), 0).read_text())
    straight_end = json.loads(rng_file(step_dir(straight, 8), 0).read_text())
    resumed_end = json.loads(rng_file(step_dir(resumed, 8), 0).read_text())
    assert set(straight_end) == {"python", "numpy", "torch", "device"}
    for generator in straight_end:
        assert resumed_end[generator] == straight_end[generator], generator
    assert saved_at_4["torch"] == straight_end["torch"]  # nothing in the loop draws: unmoved
