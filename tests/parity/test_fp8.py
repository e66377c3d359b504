"""Fine-grained FP8 checkpoints (float8_e4m3fn weights, a float32 ``weight_scale_inv`` per
128x128 block) against stock transformers, float32 on CPU, where it dequantizes them: greedy
tokens on padded batches, forward logits and beams, dense and MoE, tied and untied; the
weights stay FP8 in memory; ``save_pretrained`` writes the FP8 layout back.

Where a dimension is not a multiple of 128 (hidden 200, intermediate 300, experts' 160), the
last block of the dimension is cut short. transformers' CPU dequantization derives the block
from ``rows // scale_rows`` (200 // 2 = 100 instead of 128) and so dequantizes such a
checkpoint wrongly; those shapes are compared with the definition instead: stock transformers
on the same model with float weights ``weight * weight_scale_inv`` of the 128-blocks
(``kernels.block_scales.dequantize``).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hf_paged
from hf_paged.kernels.block_scales import FP8, BlockScales, dequantize, grid_rows
from tests.conftest import FP8_CONFIGS, FP8_CUT, left_padded

ENGINE = dict(device="cpu", dtype=torch.float32, block_size=8, max_model_len=128,
              num_kv_blocks=64)
LENGTHS = [1, 7, 12, 17]
BEAM_SHAPES = ["blocks_untied", "cut_200_300", "moe_blocks_dense0"]


def definition_checkpoint(fp8_path: str, out: str, block: int = 128) -> str:
    """A float32 copy of an FP8 checkpoint of ``block``-row blocks: each weight (a fused
    experts tensor expert by expert) dequantized by the definition, the scales and the
    quantization_config dropped."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(fp8_path):
        if name.endswith(".json"):
            shutil.copy(os.path.join(fp8_path, name), out)
    tensors = load_file(os.path.join(fp8_path, "model.safetensors"))
    for key in [k for k in tensors if k.endswith("_scale_inv")]:
        inv, weight_key = tensors.pop(key), key.removesuffix("_scale_inv")
        weight = tensors[weight_key]
        matrices = zip(weight.view(-1, *weight.shape[-2:]), inv.view(-1, *inv.shape[-2:]))
        tensors[weight_key] = torch.stack([
            dequantize(w, BlockScales(s, grid_rows([w.shape[0]], block), block), torch.float32)
            for w, s in matrices]).view(weight.shape)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def oracles(fp8_checkpoints, tmp_path_factory) -> dict[str, transformers.PreTrainedModel]:
    """Stock transformers on each FP8 checkpoint (it dequantizes on a CPU), or on its
    definition's float copy where transformers' dequantization is wrong (``FP8_CUT``)."""
    out = {}
    for name, path in fp8_checkpoints.items():
        if name in FP8_CUT:
            path = definition_checkpoint(path, str(tmp_path_factory.mktemp(f"def_{name}")))
        out[name] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()
    return out


@pytest.fixture(scope="module")
def models(fp8_checkpoints):
    built = {name: hf_paged.AutoModelForCausalLM.from_pretrained(path, **ENGINE)
             for name, path in fp8_checkpoints.items()}
    yield built
    for model in built.values():
        model.close()


def test_weights_stay_fp8_and_the_rest_in_the_model_dtype(models):
    dense, moe = models["blocks_untied"], models["moe_blocks_dense0"]
    layer = dense.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
        assert linear.weight.dtype == FP8 and linear.weight_scale_inv.dtype == torch.float32
    sparse = moe.model.layers[1].mlp
    assert sparse.experts.gate_up_proj.dtype == sparse.experts.down_proj.dtype == FP8
    assert sparse.experts.gate_up_proj_scale_inv.shape == (8, 2, 2)
    assert moe.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8  # the dense layer
    for param in (sparse.gate.weight, moe.lm_head.weight, moe.model.embed_tokens.weight,
                  layer.input_layernorm.weight, layer.self_attn.q_norm.weight):
        assert param.dtype == torch.float32


@pytest.mark.parametrize("name", list(FP8_CONFIGS))
def test_greedy_padded_batch_matches_transformers(models, oracles, name):
    ids, mask = left_padded(LENGTHS, FP8_CONFIGS[name]["vocab_size"], seed=1)
    ref = oracles[name].generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(models[name].generate(ids, attention_mask=mask, max_new_tokens=12,
                                             do_sample=False), ref)


def assert_logits_match(model, oracle, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The model call's logits at the kept positions equal the oracle's, to float32 rounding
    of the largest logit."""
    with torch.no_grad():
        ref = oracle(ids, attention_mask=mask).logits
        out = model(ids, attention_mask=mask).logits
    kept = mask.bool()
    torch.testing.assert_close(out[kept], ref[kept], rtol=0,
                               atol=1e-5 * ref[kept].abs().max().item())


@pytest.mark.parametrize("name", list(FP8_CONFIGS))
def test_forward_logits_match_transformers(models, oracles, name):
    ids, mask = left_padded([9, 4, 13], FP8_CONFIGS[name]["vocab_size"], seed=2)
    assert_logits_match(models[name], oracles[name], ids, mask)


@pytest.mark.parametrize("name", BEAM_SHAPES)
def test_beam_search_matches_transformers(models, oracles, name):
    ids, mask = left_padded([6, 13], FP8_CONFIGS[name]["vocab_size"], seed=3)
    kwargs = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
    ref = oracles[name].generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(models[name].generate(ids, attention_mask=mask, **kwargs), ref)


@pytest.mark.parametrize("name", BEAM_SHAPES)
def test_save_pretrained_writes_the_fp8_checkpoint_back(models, oracles, fp8_checkpoints,
                                                        name, tmp_path):
    """The saved folder holds the checkpoint's own tensors, bit for bit (FP8 weights and
    per-part grids; MoE experts one matrix per expert, as Qwen's releases), and its
    quantization_config; stock transformers loads it to the same weights as the original."""
    models[name].save_pretrained(tmp_path)
    original = load_file(os.path.join(fp8_checkpoints[name], "model.safetensors"))
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for key, tensor in original.items():
        assert saved[key].dtype == tensor.dtype, key
        assert torch.equal(saved[key].view(torch.uint8), tensor.view(torch.uint8)), key
    with open(os.path.join(fp8_checkpoints[name], "config.json")) as f:
        expected = json.load(f)["quantization_config"]
    assert models[name].config.quantization_config == expected
    if name not in FP8_CUT:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                                    dtype=torch.float32)
        weights = reloaded.state_dict()
        for key, tensor in oracles[name].state_dict().items():
            assert torch.equal(weights[key], tensor), key
