"""A rank's model parts and their optimizers as one checkpoint's tensors, by whole-model name:
the pipeline stages of a tied model merge into what one whole model saves, and load back from
it; a checkpoint with other optimizer groups is refused by name."""

from dataclasses import replace

import pytest
import torch

from goodput.checkpoint.parts import check_param_groups, gather, load_into
from goodput.errors import GoodputError
from goodput.testing.tiny import TINY_MODEL
from goodput.train.config.optim import OptimConfig
from goodput.train.model import Transformer
from goodput.train.optim.optimizers import Optimizers
from goodput.train.parallel.pipeline import cut_stage

TIED = replace(TINY_MODEL, tie_embeddings=True, num_layers=4)


def trained(parts):
    optimizers = Optimizers(parts, OptimConfig(), lr=1e-2)
    tokens = torch.randint(0, TIED.vocab_size, (2, 8))
    hidden = parts[0](tokens)
    for part in parts[1:]:
        hidden = part(hidden)
    hidden.float().pow(2).mean().backward()
    optimizers.step()
    return optimizers


def copy_from(saved):
    def load(request):
        for section, tensors in request.items():
            for name, value in tensors.items():
                if isinstance(value, dict):
                    for key, tensor in value.items():
                        if isinstance(tensor, torch.Tensor):
                            tensor.copy_(saved[section][name][key])
                else:
                    value.copy_(saved[section][name])

    return load


def test_stages_merge_into_the_whole_models_names_and_load_back_from_them():
    torch.manual_seed(0)
    whole = Transformer(TIED)
    optimizers = trained([whole])
    model, optim, groups = gather([whole], optimizers.optimizers)
    torch.manual_seed(1)  # other values: the load must overwrite them all
    other = Transformer(TIED)
    stages = [cut_stage(other, range(0, 2), last=False), cut_stage(other, range(2, 4), last=True)]
    stage_optimizers = trained(stages)
    stage_model, stage_optim, stage_groups = gather(stages, stage_optimizers.optimizers)
    # The stages name what the whole model names; the last stage's copy of the tied weight
    # keeps its optimizer state under the whole model's name.
    assert stage_model.keys() == model.keys() and stage_optim.keys() == optim.keys()
    assert [sorted(g["params"]) for g in stage_groups] == [sorted(g["params"]) for g in groups]
    load_into(
        stages,
        stage_optimizers.optimizers,
        copy_from({"model": model, "optim": optim}),
        groups,
        source=None,
    )
    assert torch.equal(stages[1].output.weight, whole.embedding.weight)
    assert torch.equal(
        stages[0].blocks["1"].attention.wq.weight, whole.blocks["1"].attention.wq.weight
    )
    tied_state = stage_optimizers.optimizers[1].state[stages[1].output.weight]
    assert torch.equal(
        tied_state["exp_avg"], optimizers.optimizers[0].state[whole.embedding.weight]["exp_avg"]
    )


def test_a_checkpoint_with_other_optimizer_groups_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    whole = Transformer(TIED)
    optimizers = trained([whole])
    _, _, groups = gather([whole], optimizers.optimizers)
    source = tmp_path / "train_state.json"
    with pytest.raises(GoodputError, match="holds 1 optimizer parameter groups, this run has 2"):
        check_param_groups(optimizers.optimizers, groups[:1], source)
