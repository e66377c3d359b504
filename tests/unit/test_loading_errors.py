"""A checkpoint that does not fit the model is refused with one ValueError naming, by
checkpoint key, what is missing (one part of a merged projection included) and what has the
wrong shape (the whole tensor's, under tensor parallelism too); keys the model does not use
are logged by name and the rest loads, as transformers' from_pretrained does."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import hf_paged
from hf_paged.families.build import build_model
from hf_paged.modeling.tp import SINGLE, TensorParallel

SMALL = dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8, max_num_seqs=4)
IDS = torch.tensor([[5, 6, 7, 8]])
LAYER = "model.layers.1."


def rewrite(source: str, folder, edit=None, files: int = 1) -> str:
    """A copy of the checkpoint folder ``source`` whose tensors ``edit`` changed in place,
    split over ``files`` files (with an index) when more than one."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(source):
        if name.endswith(".json") and not name.startswith("model.safetensors"):
            shutil.copy(os.path.join(source, name), folder)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    if edit is not None:
        edit(tensors)
    if files == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return folder
    keys, weight_map = sorted(tensors), {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::files]}
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder


def drop(*keys):
    def edit(tensors):
        for key in keys:
            del tensors[key]
    return edit


def build(path: str, tp: TensorParallel = SINGLE):
    """The swapped model of a checkpoint folder, as rank ``tp.rank`` loads it."""
    return build_model(AutoConfig.from_pretrained(path), path, torch.float32,
                       torch.device("cpu"), "sdpa", 64, tp).hf_model


def params(path: str) -> dict[str, torch.Tensor]:
    return dict(build(path).named_parameters())


@pytest.fixture(scope="module")
def reference(checkpoints) -> torch.Tensor:
    with hf_paged.from_pretrained(checkpoints["gqa_tied"], **SMALL) as engine:
        return engine.generate(IDS, max_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                  "mlp.gate_proj", "mlp.up_proj"])
def test_missing_part_of_a_merged_projection_is_named(checkpoints, tmp_path, proj):
    key = f"{LAYER}{proj}.weight"
    path = rewrite(checkpoints["gqa_tied"], tmp_path, drop(key))
    with pytest.raises(ValueError, match=rf"missing \(1\):\n    {re.escape(key)}$"):
        hf_paged.from_pretrained(path, **SMALL)


@pytest.mark.parametrize("key", ["model.norm.weight", f"{LAYER}self_attn.q_norm.weight",
                                 f"{LAYER}self_attn.k_norm.weight",
                                 "model.layers.0.post_attention_layernorm.weight"])
def test_missing_norm_weight_is_named(checkpoints, tmp_path, key):
    path = rewrite(checkpoints["gqa_tied"], tmp_path, drop(key))
    with pytest.raises(ValueError, match=re.escape(key)):
        build(path)


def test_missing_lm_head_of_an_untied_model_is_named(checkpoints, tmp_path):
    path = rewrite(checkpoints["mha_untied"], tmp_path, drop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing \(1\):\n    lm_head\.weight"):
        hf_paged.from_pretrained(path, **SMALL)


def test_missing_embedding_of_a_tied_model_is_named(checkpoints, tmp_path):
    path = rewrite(checkpoints["gqa_tied"], tmp_path, drop("model.embed_tokens.weight"))
    with pytest.raises(ValueError, match=r"missing \(1\):\n    model\.embed_tokens\.weight"):
        build(path)


def test_many_missing_keys_are_counted_not_all_listed(checkpoints, tmp_path):
    source = load_file(os.path.join(checkpoints["gqa_tied"], "model.safetensors"))
    layers = sorted(k for k in source if k.startswith("model.layers."))
    path = rewrite(checkpoints["gqa_tied"], tmp_path, drop(*layers))
    with pytest.raises(ValueError) as error:
        build(path)
    message = str(error.value)
    assert f"missing ({len(layers)}):" in message
    assert f"... and {len(layers) - 10} more" in message
    # layer 0's keys come first, one a line
    assert message.splitlines()[2] == "    model.layers.0.input_layernorm.weight"


@pytest.mark.parametrize("key, shape, expected", [
    ("model.layers.0.mlp.down_proj.weight", (64, 100), (64, 128)),
    (f"{LAYER}self_attn.k_proj.weight", (16, 64), (32, 64)),  # one part of the merged QKV
    (f"{LAYER}mlp.up_proj.weight", (128, 32), (128, 64)),  # one part of merged gate/up
    ("model.embed_tokens.weight", (1000, 64), (1024, 64)),
])
def test_wrong_shape_names_key_and_both_shapes(checkpoints, tmp_path, key, shape, expected):
    path = rewrite(checkpoints["gqa_tied"], tmp_path,
                   lambda t: t.__setitem__(key, torch.zeros(shape)))
    line = f"    {key}: checkpoint {list(shape)}, model {list(expected)}"
    with pytest.raises(ValueError, match=re.escape(line)):
        hf_paged.from_pretrained(path, **SMALL)


@pytest.mark.parametrize("rank", [0, 1])
def test_wrong_shape_under_tensor_parallelism_states_whole_tensors(checkpoints, tmp_path, rank):
    """Rank r of 2 reads only its slice, yet the message gives the whole tensors' shapes,
    not a shard's; the check comes before any copy, so no bare size-mismatch error escapes."""
    key = f"{LAYER}self_attn.v_proj.weight"
    path = rewrite(checkpoints["mha_untied"], tmp_path,
                   lambda t: t.__setitem__(key, torch.zeros(48, 64)))
    with pytest.raises(ValueError, match=re.escape(f"{key}: checkpoint [48, 64], model [64, 64]")):
        build(path, TensorParallel(rank, 2))


def test_one_error_lists_missing_mismatched_and_unexpected(checkpoints, tmp_path):
    def edit(t):
        del t[f"{LAYER}self_attn.q_proj.weight"]
        t["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 64)
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)

    path = rewrite(checkpoints["gqa_tied"], tmp_path, edit)
    with pytest.raises(ValueError) as error:
        build(path)
    assert str(error.value).splitlines()[1:] == [
        "  missing (1):",
        f"    {LAYER}self_attn.q_proj.weight",
        "  wrong shape (1):",
        "    model.layers.0.mlp.gate_proj.weight: checkpoint [3, 64], model [128, 64]",
        "  unexpected (1):",
        "    model.layers.0.self_attn.extra.weight",
    ]


def test_unexpected_key_is_logged_by_name_and_the_rest_loads(checkpoints, tmp_path, reference,
                                                             caplog):
    """As transformers: an unrelated tensor is reported as unexpected and ignored; a stale
    RoPE buffer (``rotary_emb.inv_freq``) is dropped without a word."""
    def edit(t):
        t["score.weight"] = torch.zeros(2, 64)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)

    path = rewrite(checkpoints["gqa_tied"], tmp_path, edit)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        with hf_paged.from_pretrained(path, **SMALL) as engine:
            out = engine.generate(IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("hf_paged"))
    assert "unexpected (1):\n    score.weight" in logged
    assert "inv_freq" not in logged


def test_sharded_checkpoint_loads_and_index_gaps_are_named(checkpoints, tmp_path):
    whole = params(checkpoints["mha_untied"])
    path = rewrite(checkpoints["mha_untied"], tmp_path / "sharded", files=2)
    assert all(torch.equal(p, whole[k]) for k, p in params(path).items())

    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    second = "model-00002-of-00002.safetensors"
    gone = sorted(k for k, file in weight_map.items() if file == second)
    with open(index, "w") as f:  # the index forgets the second file: its tensors are missing
        json.dump({"weight_map": {k: v for k, v in weight_map.items() if v != second}}, f)
    with pytest.raises(ValueError, match=rf"missing \({len(gone)}\)"):
        build(path)

    with open(index, "w") as f:
        json.dump({"weight_map": {**weight_map, "x": "model-00003-of-00003.safetensors"}}, f)
    with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors"):
        build(path)


def test_tied_checkpoint_with_the_lm_head_only_fills_the_embedding(checkpoints, tmp_path):
    """transformers ties symmetrically: the LM head alone serves as the embedding too."""
    def edit(t):
        t["lm_head.weight"] = t.pop("model.embed_tokens.weight")

    whole = params(checkpoints["gqa_tied"])
    loaded = params(rewrite(checkpoints["gqa_tied"], tmp_path, edit))
    assert loaded.keys() == whole.keys()
    assert all(torch.equal(p, whole[k]) for k, p in loaded.items())


def test_tied_config_with_two_different_matrices_keeps_them_apart(checkpoints, tmp_path, caplog):
    """As transformers: both matrices present with different values are not tied."""
    head = torch.randn(1024, 64)
    path = rewrite(checkpoints["gqa_tied"], tmp_path,
                   lambda t: t.__setitem__("lm_head.weight", head))
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        model = build(path)
    assert torch.equal(model.lm_head.weight, head)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert "not tied" in caplog.text

    # the same values twice: tied, silently
    caplog.clear()
    path = rewrite(checkpoints["gqa_tied"], tmp_path / "same",
                   lambda t: t.__setitem__("lm_head.weight",
                                             t["model.embed_tokens.weight"].clone()))
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        model = build(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not caplog.text


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_base_model_keys_load_under_the_prefix(checkpoints, tmp_path, name):
    """Keys saved from a bare Qwen3Model (no ``model.`` prefix) load, as in transformers."""
    def edit(t):
        for key in list(t):
            t[key.removeprefix("model.")] = t.pop(key)

    whole = params(checkpoints[name])
    loaded = params(rewrite(checkpoints[name], tmp_path, edit))
    assert loaded.keys() == whole.keys()
    assert all(torch.equal(p, whole[k]) for k, p in loaded.items())


LOADERS = [hf_paged.from_pretrained, hf_paged.AutoModelForCausalLM.from_pretrained]


@pytest.mark.parametrize("damage", ["truncated", "corrupt header"])
def test_damaged_safetensors_file_is_named(checkpoints, tmp_path, reference, damage):
    """A download cut short or a damaged header: one line naming the file, not safetensors'
    bare 'Error while deserializing header'; a good checkpoint loads afterwards."""
    path = rewrite(checkpoints["gqa_tied"], tmp_path)
    file = os.path.join(path, "model.safetensors")
    if damage == "truncated":
        os.truncate(file, os.path.getsize(file) // 2)
    else:
        with open(file, "r+b") as f:
            f.seek(8)
            f.write(b"\xff" * 16)
    for load in LOADERS:
        with pytest.raises(OSError, match=f"^{re.escape(file)} is truncated or corrupt, not a "
                           r"readable safetensors file \(Error while deserializing header"):
            load(path, **SMALL)
    with hf_paged.from_pretrained(checkpoints["gqa_tied"], **SMALL) as engine:
        assert torch.equal(engine.generate(IDS, max_new_tokens=6, do_sample=False), reference)


def test_folder_without_config_json_is_named(checkpoints, tmp_path):
    """transformers' AutoConfig would say the config has no ``model_type`` key."""
    shutil.copy(os.path.join(checkpoints["gqa_tied"], "model.safetensors"), tmp_path)
    for load in LOADERS:
        with pytest.raises(OSError, match=f"^{re.escape(repr(str(tmp_path)))} is a folder "
                           "without a config.json, not a checkpoint$"):
            load(str(tmp_path), **SMALL)


def test_a_family_hf_paged_does_not_serve_is_refused_before_its_fields_are_read(tmp_path):
    """Qwen3-VL's vision-language config (its text model not served) has no
    ``max_position_embeddings`` at its top level: the family check names its model_type
    before anything reads it."""
    config_class = getattr(transformers, "Qwen3VLConfig", None)
    if config_class is None:
        pytest.skip("this transformers has no Qwen3VLConfig")
    config_class().save_pretrained(tmp_path)
    for load in LOADERS:
        with pytest.raises(ValueError, match="this checkpoint has model_type 'qwen3_vl'$"):
            load(str(tmp_path), **SMALL)
