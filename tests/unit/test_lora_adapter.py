"""read_adapter / adapter_from_state against PEFT itself: tiny stock models under PEFT's LoRA
(lora_B random), saved by PEFT, read back; every tensor and scaling equals PEFT's module's."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_paged.lora.adapter import PROJECTIONS, LoraAdapter
from hf_paged.lora.base_modules import is_sparse
from hf_paged.lora.reading import adapter_from_state, read_adapter
from tests.unit.lora_helpers import base_config, lora_layers, peft_model, plain_moe_matching


def assert_matches_peft(adapter: LoraAdapter, model) -> None:
    layers = lora_layers(model)
    assert adapter.weights.keys() == layers.keys()
    for target, weight in adapter.weights.items():
        layer = layers[target]
        assert torch.equal(weight.a, layer.lora_A["default"].weight), target
        assert torch.equal(weight.b, layer.lora_B["default"].weight), target
        assert weight.scaling == layer.scaling["default"], target
    assert adapter.max_rank == max(layer.r["default"] for layer in layers.values())


def saved(tmp_path, config, safe: bool = True, **lora):
    model = peft_model(config, **lora)
    model.save_pretrained(str(tmp_path), safe_serialization=safe)
    return model, str(tmp_path)


@pytest.mark.parametrize("lora", [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=list(PROJECTIONS), r=4, lora_alpha=16),
    dict(target_modules="all-linear", r=2, lora_alpha=5),
    dict(target_modules=r".*\.(k_proj|down_proj)", lora_alpha=3),
    dict(target_modules=["q_proj", "up_proj"], use_rslora=True, r=16, lora_alpha=7),
    dict(target_modules=["o_proj", "gate_proj"], layers_to_transform=[1]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=1, layers_pattern="layers"),
    dict(target_modules=list(PROJECTIONS), r=8, lora_alpha=8,
         rank_pattern={"q_proj": 2, r"model\.layers\.1\.mlp\.down_proj": 12},
         alpha_pattern={"v_proj": 3, r"layers\.0\.mlp\..*_proj": 32}),
], ids=["q_v", "all_seven", "all_linear", "regex", "rslora", "layers_to_transform",
        "layers_pattern", "rank_alpha_patterns"])
def test_read_matches_peft(tmp_path, lora):
    config = base_config("gqa_tied")
    model, path = saved(tmp_path, config, **lora)
    assert_matches_peft(read_adapter(path, "a", config, torch.float32), model)


def test_overlapping_patterns_as_peft_loads_them(tmp_path):
    # get_pattern_key takes the first pattern that matches; PEFT saves the patterns sorted, so
    # the model it reloads can differ from the one it saved: the adapter is the reloaded one
    config = base_config("gqa_tied")
    _, path = saved(tmp_path, config, target_modules=["v_proj"],
                    alpha_pattern={"v_proj": 3, r"layers\.0\..*_proj": 32})
    torch.manual_seed(0)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_config(config), path)
    adapter = read_adapter(path, "a", config, torch.float32)
    assert adapter.weights[0, "v_proj"].scaling == 32 / 8
    assert_matches_peft(adapter, reloaded)


def test_default_targets_of_peft(tmp_path):
    # no target_modules: PEFT's default for qwen3 (q_proj, v_proj), written to the saved config
    config = base_config("mha_untied")
    model, path = saved(tmp_path, config)
    adapter = read_adapter(path, "a", config, torch.float32)
    assert {p for _, p in adapter.weights} == {"q_proj", "v_proj"}
    assert_matches_peft(adapter, model)


@pytest.mark.parametrize("seed", range(10))
def test_random_configurations(tmp_path, monkeypatch, seed):
    """The rule beyond the examples: random shapes, target sets, ranks, alphas, patterns."""
    plain_moe_matching(monkeypatch)
    rng = random.Random(seed)
    name = rng.choice(["gqa_tied", "mha_untied", "gqa4_untied", "one_kv_head",
                       "moe_e6_k3_raw_dense0", "moe_e4_k1_step2", "moe_e16_k4_wide"])
    config = base_config(name)
    targets = rng.sample(PROJECTIONS, rng.randint(1, len(PROJECTIONS)))
    attention, every = PROJECTIONS[:4], range(config.num_hidden_layers)
    dense = [i for i in every if not is_sparse(config, i)]
    if not dense:  # every layer sparse: attention only
        targets = [t for t in targets if t in attention] or ["o_proj"]
    pool = dense if set(targets) - set(attention) else list(every)  # MLPs: dense layers only
    layers = sorted(rng.sample(pool, rng.randint(1, len(pool))))
    lora = dict(target_modules=targets, r=rng.choice([1, 3, 8, 16]),
                lora_alpha=rng.choice([1, 8, 24]), use_rslora=rng.random() < 0.5,
                layers_to_transform=layers)
    if not lora["use_rslora"]:  # PEFT refuses to convert rslora with patterns; reading is fine
        lora["rank_pattern"] = {rng.choice(targets): rng.choice([2, 5])}
        lora["alpha_pattern"] = {rf"layers\.{layers[0]}\..*": rng.choice([4, 9])}
    model, path = saved(tmp_path, config, seed=seed, **lora)
    assert_matches_peft(read_adapter(path, "a", config, torch.float32), model)


def test_moe_attention_and_dense_layers(tmp_path, monkeypatch):
    plain_moe_matching(monkeypatch)
    config = base_config("moe_e4_k1_step2")  # layers 0 and 2 dense, 1 and 3 sparse
    lora = dict(target_modules=r"model\.layers\.\d+\.self_attn\.(q|k)_proj"
                               r"|model\.layers\.\d+\.mlp\.(gate|up|down)_proj")
    model, path = saved(tmp_path, config, **lora)
    adapter = read_adapter(path, "a", config, torch.float32)
    assert {(i, p) for i, p in adapter.weights if p.endswith(("gate_proj", "down_proj"))} == {
        (0, "gate_proj"), (0, "down_proj"), (2, "gate_proj"), (2, "down_proj")}
    assert_matches_peft(adapter, model)


def test_moe_dense_layer_by_layers_to_transform(tmp_path, monkeypatch):
    plain_moe_matching(monkeypatch)
    config = base_config("moe_e6_k3_raw_dense0")  # mlp_only_layers [0]
    model, path = saved(tmp_path, config, target_modules=["v_proj", "up_proj", "down_proj",
                                                          "gate_proj"], layers_to_transform=[0])
    adapter = read_adapter(path, "a", config, torch.float32)
    assert {i for i, _ in adapter.weights} == {0}
    assert_matches_peft(adapter, model)


def test_bin_weights(tmp_path):
    config = base_config("gqa4_untied")
    model, path = saved(tmp_path, config, safe=False, target_modules=["k_proj", "o_proj"])
    assert os.path.isfile(os.path.join(path, "adapter_model.bin"))
    assert_matches_peft(read_adapter(path, "a", config, torch.float32), model)


def test_state_in_memory(tmp_path):
    config = base_config("gqa_tied")
    model = peft_model(config, target_modules=["q_proj", "down_proj"], r=4, lora_alpha=12)
    lora_config = model.peft_config["default"]
    saved_keys = get_peft_model_state_dict(model)  # the adapter's name stripped, as saved
    assert_matches_peft(adapter_from_state(lora_config, saved_keys, "a", config, torch.float32),
                        model)
    named = {k: v for k, v in model.state_dict().items() if ".lora_" in k}  # ".lora_A.default."
    assert all(".default." in k for k in named)
    adapter = adapter_from_state(lora_config, named, "a", config, torch.float32)
    assert_matches_peft(adapter, model)
    assert not any(t.requires_grad for w in adapter.weights.values() for t in (w.a, w.b))


def test_dtype_and_nbytes(tmp_path):
    config = base_config("gqa_tied")
    model, path = saved(tmp_path, config, target_modules=["q_proj", "gate_proj"], r=4,
                        rank_pattern={"gate_proj": 6})
    adapter = read_adapter(path, "named", config, torch.bfloat16)
    assert adapter.name == "named" and adapter.max_rank == 6
    assert all(t.dtype == torch.bfloat16 for w in adapter.weights.values() for t in (w.a, w.b))
    q_in, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    per_layer = 4 * (q_in + q_out) + 6 * (config.hidden_size + inter)
    assert adapter.nbytes() == 2 * per_layer * config.num_hidden_layers
    for target, layer in lora_layers(model).items():
        assert torch.equal(adapter.weights[target].a, layer.lora_A["default"].weight.bfloat16())


# Damaged adapters: each tensor error names its key.

def rewrite(path: str, edit) -> None:
    file = os.path.join(path, "adapter_model.safetensors")
    state = load_file(file)
    edit(state)
    save_file(state, file)


Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.__setitem__(Q_A, torch.zeros(8, 65)),
     f"{Q_A}: shape [8, 65], where model.layers.1.self_attn.q_proj with r=8 takes [8, 64]"),
    (lambda s: s.__setitem__(Q_A.replace("_A", "_B"), torch.zeros(64, 4)),
     f"{Q_A.replace('_A', '_B')}: shape [64, 4]"),
    (lambda s: s.pop(Q_A.replace("_A", "_B")),
     f"{Q_A.replace('_A', '_B')} is missing"),
    (lambda s: s.__setitem__(Q_A.replace("q_proj", "k_proj"), torch.zeros(8, 64)),
     f"{Q_A.replace('q_proj', 'k_proj')}: "),
    (lambda s: s.__setitem__(Q_A.replace("layers.1", "layers.5"), torch.zeros(8, 64)),
     f"{Q_A.replace('layers.1', 'layers.5')}: layer 5 is beyond the base model's "
     "num_hidden_layers=2"),
    (lambda s: s.__setitem__(Q_A.replace("q_proj.lora_A", "q_proj.lora_magnitude_vector"),
                             torch.zeros(64)),
     "q_proj.lora_magnitude_vector.weight: not a LoRA weight"),
    (lambda s: s.__setitem__("base_model.model.model.embed_tokens.lora_embedding_A",
                             torch.zeros(8, 1024)),
     "base_model.model.model.embed_tokens.lora_embedding_A: not a LoRA weight"),
    (lambda s: s.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 64)),
     "base_model.model.lm_head.lora_A.weight: LoRA on lm_head is not supported"),
], ids=["a_shape", "b_shape", "missing_b", "untargeted", "layer_beyond", "dora_vector",
        "embedding", "lm_head"])
def test_damaged_tensor_named(tmp_path, edit, message):
    config = base_config("gqa_tied")
    _, path = saved(tmp_path, config, target_modules=["q_proj", "v_proj"])
    rewrite(path, edit)
    with pytest.raises(ValueError) as error:
        read_adapter(path, "a", config, torch.float32)
    assert message in str(error.value)


@pytest.mark.parametrize("key, message", [
    ("base_model.model.model.layers.1.mlp.experts.2.gate_proj.lora_A.weight",
     "LoRA on MoE experts is not supported"),
    ("base_model.model.model.layers.1.mlp.experts.lora_A.weight",  # PEFT 0.18+'s fused layout
     "LoRA on MoE experts is not supported"),
    ("base_model.model.model.layers.1.mlp.gate.lora_A.weight",
     "LoRA on the MoE router (mlp.gate) is not supported"),
    ("base_model.model.model.layers.1.mlp.up_proj.lora_A.weight",
     "layer 1 is a sparse MoE layer: it has no dense up_proj"),
])
def test_moe_tensor_named(tmp_path, key, message):
    config = base_config("moe_e6_k3_raw_dense0")
    _, path = saved(tmp_path, config, target_modules=["q_proj"])
    rewrite(path, lambda s: s.__setitem__(key, torch.zeros(8, 64)))
    with pytest.raises(ValueError, match=f"^adapter tensor {key}: ") as error:
        read_adapter(path, "a", config, torch.float32)
    assert message in str(error.value)


def test_duplicate_tensor_named(tmp_path):
    config = base_config("gqa_tied")
    model = peft_model(config, target_modules=["q_proj"])
    state = get_peft_model_state_dict(model)
    state[Q_A.replace(".weight", ".default.weight")] = state[Q_A]
    with pytest.raises(ValueError, match="a second lora_A for model.layers.1.self_attn.q_proj"):
        adapter_from_state(model.peft_config["default"], state, "a", config, torch.float32)


def test_missing_files_named(tmp_path):
    config = base_config("gqa_tied")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        read_adapter(str(tmp_path), "a", config, torch.float32)
    _, path = saved(tmp_path, config, target_modules=["q_proj"])
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(FileNotFoundError, match="neither adapter_model.safetensors nor"):
        read_adapter(path, "a", config, torch.float32)


def test_unknown_saved_option_named(tmp_path):
    # PEFT drops options it does not know with a warning; a newer variant must not run as LoRA
    config = base_config("gqa_tied")
    _, path = saved(tmp_path, config, target_modules=["q_proj"])
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        saved_config = json.load(f)
    saved_config["use_newer_variant"] = True
    with open(file, "w") as f:
        json.dump(saved_config, f)
    with pytest.raises(ValueError, match=r"options \['use_newer_variant'\] are unknown"):
        read_adapter(path, "a", config, torch.float32)


def test_rank_not_positive_named(tmp_path):
    config = base_config("gqa_tied")
    model = peft_model(config, target_modules=["q_proj"])
    lora_config = model.peft_config["default"]
    lora_config.rank_pattern = {"q_proj": 0}
    with pytest.raises(ValueError, match="r / rank_pattern gives model.layers.0.self_attn.q_proj "
                                         "rank 0"):
        adapter_from_state(lora_config, get_peft_model_state_dict(model), "a", config,
                           torch.float32)


def test_config_refused_before_tensors_are_read(tmp_path):
    config = base_config("gqa_tied")
    _, path = saved(tmp_path, config, target_modules=["q_proj"], use_dora=True)
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="use_dora=True is not served"):
        read_adapter(path, "a", config, torch.float32)
