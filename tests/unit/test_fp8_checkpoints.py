"""Fine-grained FP8 checkpoints that do not fit the model are refused by key: a missing or
mis-shaped weight_scale_inv, a scale or zero-point tensor no layer uses, an FP8 tensor where
a float one belongs (an FP8 checkpoint stripped of its quantization_config) or a float one
where FP8 belongs, a merged projection of FP8 and float parts. The block quantization is
transformers' Fp8Quantize, and quantizing on load gives its weights and scales."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

import hf_paged
from hf_paged.kernels.block_scales import FP8, BlockScales, dequantize, grid_rows, quantize
from tests.conftest import FP8_CONFIGS, float32_checkpoint
from tests.unit.test_loading_errors import drop, rewrite

SMALL = dict(device="cpu", dtype=torch.float32, max_model_len=64, num_kv_blocks=16,
             block_size=8)
LAYER = "model.layers.1."


def edit_config(path: str, edit) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def refused(path: str, *lines: str) -> None:
    with pytest.raises(ValueError) as error:
        hf_paged.from_pretrained(path, **SMALL)
    for line in lines:
        assert line in str(error.value), str(error.value)


@pytest.mark.parametrize("name, key", [
    ("blocks_untied", f"{LAYER}self_attn.k_proj.weight_scale_inv"),
    ("blocks_untied", f"{LAYER}mlp.down_proj.weight_scale_inv"),
    ("moe_blocks_dense0", f"{LAYER}mlp.experts.3.up_proj.weight_scale_inv"),
])
def test_a_missing_scale_is_named(fp8_checkpoints, tmp_path, name, key):
    refused(rewrite(fp8_checkpoints[name], tmp_path, drop(key)), "missing (1):", f"    {key}")


def test_a_mis_shaped_scale_is_named_with_both_shapes(fp8_checkpoints, tmp_path):
    key = f"{LAYER}mlp.gate_proj.weight_scale_inv"  # [384, 256] in 128-blocks: [3, 2]
    path = rewrite(fp8_checkpoints["blocks_untied"], tmp_path,
                   lambda t: t.__setitem__(key, torch.ones(2, 2)))
    refused(path, f"    {key}: checkpoint [2, 2], model [3, 2]")


@pytest.mark.parametrize("key", ["lm_head.weight_scale_inv", f"{LAYER}mlp.down_proj.qzeros",
                                 f"{LAYER}self_attn.o_proj.input_scale",
                                 f"{LAYER}mlp.gate.weight_scale_inv"])
def test_an_unused_quantization_tensor_is_an_error(fp8_checkpoints, tmp_path, key):
    """The LM head and the router are float (modules_to_not_convert): their scales, or any
    other quantization tensor, mean the checkpoint is not what its config says."""
    path = rewrite(fp8_checkpoints["moe_blocks_dense0"], tmp_path,
                   lambda t: t.__setitem__(key, torch.ones(1, 2)))
    refused(path, "quantization tensors of layers the model holds unquantized", f"    {key}")


def test_an_fp8_checkpoint_without_its_quantization_config_is_refused(fp8_checkpoints,
                                                                       tmp_path):
    """The silent wrong load this guards against: FP8 values copied into float weights."""
    path = rewrite(fp8_checkpoints["blocks_untied"], tmp_path)
    edit_config(path, lambda c: c.pop("quantization_config"))
    layer = "model.layers.0."
    refused(path, f"    {layer}self_attn.q_proj.weight: checkpoint F8_E4M3, model not FP8",
            "quantization tensors", f"    {layer}self_attn.q_proj.weight_scale_inv")


def test_a_float_weight_where_fp8_belongs_is_refused(fp8_checkpoints, tmp_path):
    key = f"{LAYER}mlp.up_proj.weight"
    path = rewrite(fp8_checkpoints["blocks_untied"], tmp_path,
                   lambda t: t.__setitem__(key, t[key].float()))
    refused(path, f"    {key}: checkpoint F32, model F8_E4M3")


def test_a_merged_projection_of_fp8_and_float_parts_is_refused(fp8_checkpoints, tmp_path):
    path = edit_config(rewrite(fp8_checkpoints["blocks_untied"], tmp_path), lambda c: c[
        "quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.up_proj"))
    refused(path, "model.layers.0.mlp.gate_up_proj: the quantization_config makes "
                  "model.layers.0.mlp.gate_proj FP8 but not model.layers.0.mlp.up_proj")


def test_an_fp8_lm_head_is_refused(fp8_checkpoints, tmp_path):
    path = edit_config(rewrite(fp8_checkpoints["blocks_untied"], tmp_path),
                       lambda c: c["quantization_config"].update(modules_to_not_convert=[]))
    refused(path, "the quantization_config makes lm_head FP8, which hf_paged keeps in the "
                  "model dtype")


@pytest.mark.parametrize("shape", [(256, 384), (4, 384, 128), (128, 128)])
def test_block_quantization_is_transformers_fp8quantize(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.1
    weight[..., :128, :128] = 0  # an all-zero block keeps scale 1
    values, inv = quantize(weight, (128, 128))
    ref = Fp8Quantize(type("Quantizer", (), {"quantization_config": FineGrainedFP8Config()})
                      )._quantize_one("w.weight", weight)
    assert torch.equal(values.view(torch.uint8), ref["w.weight"].view(torch.uint8))
    assert torch.equal(inv, ref["w.weight_scale_inv"])


def test_a_block_cut_short_takes_the_max_of_its_own_elements():
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    values, inv = quantize(weight, (128, 128))
    assert values.shape == (300, 200) and inv.shape == (3, 2)
    assert inv[2, 1] == 1 / (torch.finfo(FP8).max / weight[256:, 128:].abs().max())
    assert values[256:, 128:].float().abs().max() == torch.finfo(FP8).max  # the block's max
    back = dequantize(values, BlockScales(inv, grid_rows([300], 128), 128), torch.float32)
    assert ((back - weight).abs() <= weight.abs() / 16 + inv.max() * 2**-10).all()  # e4m3


@pytest.fixture(scope="module")
def float_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Float checkpoints to quantize on load: whole blocks everywhere (dense and MoE), and
    gate/up/down of 300 rows or columns (blocks not whole: those modules stay float)."""
    shapes = {"blocks_untied": FP8_CONFIGS["blocks_untied"],
              "moe_blocks_dense0": FP8_CONFIGS["moe_blocks_dense0"],
              "mlp_300": dict(FP8_CONFIGS["blocks_untied"], intermediate_size=300)}
    return {name: float32_checkpoint(tmp_path_factory.mktemp(f"float_{name}"), shape, seed=3)[0]
            for name, shape in shapes.items()}


@pytest.mark.parametrize("name", ["blocks_untied", "moe_blocks_dense0", "mlp_300"])
def test_quantize_on_load_gives_fp8quantizes_weights_and_scales(float_checkpoints, name,
                                                               tmp_path):
    """Every tensor as transformers' Fp8Quantize turns the checkpoint's (the fused MoE
    experts as its per-expert matrices), and the saved model loads as what it holds."""
    quantizer = Fp8Quantize(type("Quantizer", (), {
        "quantization_config": FineGrainedFP8Config()}))
    with hf_paged.AutoModelForCausalLM.from_pretrained(
            float_checkpoints[name], quantization_config=FineGrainedFP8Config(),
            **SMALL) as model:
        model.save_pretrained(tmp_path)
        generated = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5)
    expected = {}
    for key, tensor in load_file(os.path.join(float_checkpoints[name],
                                              "model.safetensors")).items():
        quantized = re.search(r"(proj|experts\.\d+\.\w+)\.weight$", key) is not None
        expected.update(quantizer._quantize_one(key, tensor) if quantized else {key: tensor})
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert sorted(saved) == sorted(expected)
    for key, tensor in expected.items():
        assert saved[key].dtype == tensor.dtype, key
        assert torch.equal(saved[key].view(torch.uint8), tensor.view(torch.uint8)), key
    if name == "mlp_300":
        assert model.config.quantization_config["modules_to_not_convert"] == [
            "lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj",
            "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    with hf_paged.AutoModelForCausalLM.from_pretrained(tmp_path, **SMALL) as reloaded:
        assert torch.equal(reloaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5),
                           generated)


def test_quantize_on_load_refuses_a_half_quantized_merged_projection(float_checkpoints,
                                                                     tmp_path):
    """q_proj's 256 rows are whole blocks, k_proj's and v_proj's 64 are not."""
    path = rewrite(float_checkpoints["blocks_untied"], tmp_path)
    edit_config(path, lambda c: c.update(num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"qkv_proj: the quantization_config makes "
                                         r"model\.layers\.0\.self_attn\.q_proj FP8 but not"):
        hf_paged.from_pretrained(path, quantization_config=FineGrainedFP8Config(), **SMALL)


def fused(tensors: dict) -> None:
    """The per-expert FP8 layout -> transformers 5's fused one (``FP8Experts``' parameters:
    ``gate_up_proj`` [E, 2I, H] and ``gate_up_proj_scale_inv``, ``down_proj`` and its grid)."""
    for layer in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        count = len({k.split(".")[5] for k in tensors if k.startswith(layer + ".experts.")})
        for suffix in ("", "_scale_inv"):
            gate, up, down = ([tensors.pop(f"{layer}.experts.{e}.{part}_proj.weight{suffix}")
                               for e in range(count)] for part in ("gate", "up", "down"))
            tensors[f"{layer}.experts.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat(pair) for pair in zip(gate, up)])
            tensors[f"{layer}.experts.down_proj{suffix}"] = torch.stack(down)


def test_fused_fp8_experts_load_as_the_per_expert_layout(fp8_checkpoints, tmp_path):
    name = "moe_blocks_dense0"
    path = rewrite(fp8_checkpoints[name], tmp_path, fused)
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in load_file(
        os.path.join(path, "model.safetensors"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with hf_paged.from_pretrained(path, **SMALL) as engine:
        out = engine.generate(ids, max_new_tokens=6, do_sample=False)
    with hf_paged.from_pretrained(fp8_checkpoints[name], **SMALL) as engine:
        assert torch.equal(engine.generate(ids, max_new_tokens=6, do_sample=False), out)
    missing = rewrite(path, tmp_path / "missing", drop(
        "model.layers.1.mlp.experts.down_proj_scale_inv"))
    refused(missing, "    model.layers.1.mlp.experts.down_proj_scale_inv")
