"""``quantization_config=FineGrainedFP8Config(dequantize=True)`` on a fine-grained FP8 checkpoint,
as transformers loads it: every weight dequantized into the model dtype as it loads (float
``nn.Linear``-shaped weights, no scale parameters), the model then an unquantized one (no
``quantization_config`` in its config, ``save_pretrained`` writes float weights), against stock
transformers given the same config: the same weights, greedy tokens on a padded batch, forward
logits. Shapes whose last block is cut short (``FP8_CUT``) are compared with the definition,
as in ``test_fp8``: transformers' dequantization derives the block from the grid and is wrong
there. Given to an unquantized checkpoint, ``dequantize=True`` asks for nothing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import FineGrainedFP8Config

import hf_paged
from hf_paged.kernels.block_scales import FP8
from tests.conftest import FP8_CONFIGS, FP8_CUT, left_padded
from tests.parity.test_fp8 import ENGINE, LENGTHS, assert_logits_match, definition_checkpoint
from tests.unit.test_fp8_checkpoints import edit_config

NAMES = ["blocks_untied", "cut_200_300", "moe_blocks_dense0", "moe_cut_160"]


def dequantizing() -> FineGrainedFP8Config:
    return FineGrainedFP8Config(dequantize=True)


@pytest.fixture(scope="module")
def oracles(fp8_checkpoints, tmp_path_factory) -> dict[str, transformers.PreTrainedModel]:
    out = {}
    for name in NAMES:
        path, load = fp8_checkpoints[name], {"quantization_config": dequantizing()}
        if name in FP8_CUT:
            path = definition_checkpoint(path, str(tmp_path_factory.mktemp(f"def_{name}")))
            load = {}
        out[name] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **load).eval()
    return out


@pytest.fixture(scope="module")
def models(fp8_checkpoints):
    built = {name: hf_paged.AutoModelForCausalLM.from_pretrained(
        fp8_checkpoints[name], quantization_config=dequantizing(), **ENGINE) for name in NAMES}
    yield built
    for model in built.values():
        model.close()


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_transformers_dequantized_ones_and_nothing_is_fp8(models, oracles, name):
    model = models[name]
    assert not any(p.dtype == FP8 for p in model.parameters())
    assert not any("scale" in n for n, _ in model.named_parameters())
    assert not hasattr(model.config, "quantization_config")
    assert not hasattr(oracles[name].config, "quantization_config")
    theirs = oracles[name].state_dict()
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, theirs[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logits_match_transformers(models, oracles, name):
    ids, mask = left_padded(LENGTHS, FP8_CONFIGS[name]["vocab_size"], seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(models[name].generate(ids, **kwargs), oracles[name].generate(ids, **kwargs))
    assert_logits_match(models[name], oracles[name], ids, mask)


def test_save_pretrained_writes_float_weights_as_transformers_does(models, oracles, tmp_path):
    models["blocks_untied"].save_pretrained(tmp_path / "ours")
    oracles["blocks_untied"].save_pretrained(tmp_path / "stock")
    ours = load_file(os.path.join(tmp_path / "ours", "model.safetensors"))
    stock = load_file(os.path.join(tmp_path / "stock", "model.safetensors"))
    assert sorted(ours) == sorted(stock)
    assert all(torch.equal(ours[key], stock[key]) for key in stock)
    with open(tmp_path / "ours" / "config.json") as f:
        assert "quantization_config" not in json.load(f)


def test_dequantize_in_the_checkpoints_own_config(fp8_checkpoints, models, tmp_path):
    """The loading attribute in config.json itself is read the same way."""
    path = shutil.copytree(fp8_checkpoints["moe_blocks_dense0"], tmp_path / "own")
    edit_config(str(path), lambda c: c["quantization_config"].update(dequantize=True))
    with hf_paged.AutoModelForCausalLM.from_pretrained(str(path), **ENGINE) as model:
        assert not any(p.dtype == FP8 for p in model.parameters())
        ids, mask = left_padded(LENGTHS, FP8_CONFIGS["moe_blocks_dense0"]["vocab_size"], seed=5)
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(ids, **kwargs),
                           models["moe_blocks_dense0"].generate(ids, **kwargs))


def test_dequantize_for_an_unquantized_checkpoint_asks_for_nothing(checkpoints, hf_models):
    with hf_paged.AutoModelForCausalLM.from_pretrained(
            checkpoints["gqa_tied"], quantization_config=dequantizing(), **ENGINE) as model:
        assert not any(p.dtype == FP8 for p in model.parameters())
        ids, mask = left_padded(LENGTHS, hf_models["gqa_tied"].config.vocab_size, seed=6)
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(ids, **kwargs),
                           hf_models["gqa_tied"].generate(ids, **kwargs))
