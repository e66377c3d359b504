"""Qwen3.5's vision-language releases as their text model: the config transformers'
``AutoModelForCausalLM`` takes, every checkpoint tensor accounted for by key (the language
model's loaded from ``model.language_model.*``, a missing, mis-shaped or extra one named as the
file names it, the vision tower counted in one log line), image and video inputs refused by
name, and ``save_pretrained`` writing what transformers' causal LM writes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hf_paged
from hf_paged.families.vision_language import causal_lm_config
from hf_paged.random_checkpoint import shape_config
from tests.conftest import SMALL, VISION_LANGUAGE_CONFIGS, left_padded
from tests.unit.test_loading_errors import drop, rewrite

LINEAR = "model.language_model.layers.0.linear_attn."
SHAPES_VL = VISION_LANGUAGE_CONFIGS["qwen3.5_vl"]


def load(path: str):
    return hf_paged.AutoModelForCausalLM.from_pretrained(path, device="cpu", dtype=torch.float32,
                                                         **SMALL)


def test_the_release_config_becomes_its_text_config():
    release = transformers.AutoConfig.for_model(**SHAPES_VL, quantization_config={"a": 1})
    text = causal_lm_config(release)
    assert type(text) is transformers.Qwen3_5TextConfig and text is release.text_config
    assert text.quantization_config == {"a": 1}  # carried over, as transformers does
    assert causal_lm_config(text) is text
    other = transformers.Qwen3VLConfig()  # a release whose text model hf_paged does not serve
    assert causal_lm_config(other) is other


def test_make_checkpoint_layers_go_to_the_text_model():
    config = shape_config("tiny-qwen3.5-moe-vl", "float32", layers=8)
    assert config.model_type == "qwen3_5_moe"
    assert config.text_config.num_hidden_layers == 8 and config.text_config.dtype == torch.float32


def test_the_vision_tower_is_counted_in_one_log_line(vision_language_checkpoints, caplog):
    path = vision_language_checkpoints["qwen3.5_vl"]
    with caplog.at_level(logging.WARNING), load(path):
        pass
    lines = [r.getMessage() for r in caplog.records if "model.visual." in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "the vision tower (21 tensors, model.visual.*) not loaded" in lines[0]


def test_missing_and_mis_shaped_language_keys_are_named_as_the_file_names_them(
        vision_language_checkpoints, tmp_path):
    def edit(tensors):
        drop(LINEAR + "A_log", LINEAR + "conv1d.weight")(tensors)
        tensors[LINEAR + "in_proj_b.weight"] = tensors[LINEAR + "in_proj_b.weight"][:-1]

    with pytest.raises(ValueError) as raised:
        load(rewrite(vision_language_checkpoints["qwen3.5_vl"], tmp_path, edit))
    message = str(raised.value)
    assert "missing (2):" in message and "wrong shape (1):" in message
    for key in ("A_log", "conv1d.weight", "in_proj_b.weight"):
        assert LINEAR + key in message


def test_a_tensor_in_both_layouts_is_refused_naming_both(vision_language_checkpoints,
                                                          tmp_path):
    key = "model.layers.0.linear_attn.A_log"

    def edit(tensors):
        tensors[key] = tensors[LINEAR + "A_log"].clone()

    with pytest.raises(ValueError, match=f"holds both {LINEAR}A_log and {key}, which"):
        load(rewrite(vision_language_checkpoints["qwen3.5_vl"], tmp_path, edit))


def test_an_extra_language_key_is_logged_by_name(vision_language_checkpoints, tmp_path, caplog):
    def edit(tensors):
        tensors[LINEAR + "spare.weight"] = torch.zeros(2)

    path = rewrite(vision_language_checkpoints["qwen3.5_moe_vl_tied"], tmp_path, edit)
    with caplog.at_level(logging.WARNING), load(path):
        pass
    assert LINEAR + "spare.weight" in caplog.text


@pytest.mark.parametrize("argument", ["pixel_values", "pixel_values_videos", "image_grid_thw",
                                      "video_grid_thw"])
def test_image_and_video_inputs_are_refused_by_name(vision_language_checkpoints, argument):
    ids, mask = left_padded([3, 5], 1000)
    with load(vision_language_checkpoints["qwen3.5_vl"]) as model:
        for call, run in (("generate()", model.generate), ("forward()", model)):
            with pytest.raises(ValueError, match=f"^{re.escape(call)} got {argument}: image and") \
                    as raised:
                run(ids, attention_mask=mask, **{argument: torch.zeros(1)})
            assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name", VISION_LANGUAGE_CONFIGS)
def test_save_pretrained_writes_what_transformers_writes(vision_language_checkpoints, tmp_path,
                                                         name):
    """The text config and the release's key layout (``model.language_model.*``; experts one
    matrix per expert, as the release holds them), every value equal; both load it back."""
    path = vision_language_checkpoints[name]
    stock = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stock.save_pretrained(tmp_path / "stock")
    with load(path) as model:
        model.save_pretrained(tmp_path / "paged")
    want = load_file(os.path.join(tmp_path / "stock", "model.safetensors"))
    got = load_file(os.path.join(tmp_path / "paged", "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    configs = [json.loads((tmp_path / kind / "config.json").read_text())
               for kind in ("stock", "paged")]
    assert configs[0] == configs[1] and configs[1]["architectures"] == [type(stock).__name__]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "paged",
                                                              dtype=torch.float32)
    assert all(torch.equal(v, stock.state_dict()[k]) for k, v in again.state_dict().items())
    ids, mask = left_padded([4, 6], 1000, seed=3)
    with load(str(tmp_path / "paged")) as reloaded, torch.no_grad():
        greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(reloaded.generate(ids, attention_mask=mask, **greedy),
                           stock.generate(ids, attention_mask=mask, **greedy))


def fp8_release(vision_language_checkpoints, tmp_path) -> str:
    """A release whose config.json names fine-grained FP8 (its weights stay float)."""
    folder = str(tmp_path / "fp8")
    shutil.copytree(vision_language_checkpoints["qwen3.5_vl"], folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def test_fp8_releases_are_refused_by_name(vision_language_checkpoints, tmp_path):
    """A release's quantization_config names the release's modules (its language model's
    keys under ``model.language_model``), not the causal LM's: refused before anything
    loads."""
    folder = fp8_release(vision_language_checkpoints, tmp_path)
    with pytest.raises(ValueError, match="FP8 checkpoints of vision-language releases are not "
                                         "supported by hf_paged"):
        load(folder)


def test_patched_transformers_hands_fp8_releases_to_stock(vision_language_checkpoints,
                                                          tmp_path, monkeypatch):
    """Under ``patch_transformers`` such a release is not hf_paged's refusal but stock
    transformers' to load, with a warning naming why."""
    folder = fp8_release(vision_language_checkpoints, tmp_path)
    stock_calls = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(
        lambda cls, path, *args, **kwargs: stock_calls.append(path) or "stock's model"))
    with hf_paged.patch_transformers():
        with pytest.warns(UserWarning, match="FP8 checkpoints of vision-language releases are "
                                             "not supported by hf_paged; .* loads with stock"):
            assert transformers.AutoModelForCausalLM.from_pretrained(folder) == "stock's model"
    assert stock_calls == [folder]
