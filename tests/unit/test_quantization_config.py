"""A checkpoint's quantization_config (or one passed to from_pretrained) is served or refused
by name before anything loads: every quant_method but fine-grained FP8, and the FP8 variants
hf_paged does not run; a tensor-parallel split that would cut an FP8 block is refused naming
the dimension."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from transformers import AutoConfig, BitsAndBytesConfig, FineGrainedFP8Config, Qwen3Config

import hf_paged
from hf_paged import cli, families, quantization
from hf_paged.quantization import fp8
from hf_paged.random_checkpoint import shape_config
from tests.conftest import FP8_CONFIGS, TINY_CONFIGS

SMALL = dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}
OTHER_METHODS = ["awq", "gptq", "bitsandbytes", "compressed-tensors", "torchao", "hqq", "mxfp4",
                 "fbgemm_fp8", "nvfp4", "mxfp8", "quark", "auto-round", None]


def config_only(source: str, folder, quantization_config: dict) -> str:
    """A checkpoint folder holding only ``source``'s config.json with ``quantization_config``:
    no weights, so any error but the quantization's would come from loading them."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=quantization_config), f)
    return str(folder)


@pytest.mark.parametrize("method", OTHER_METHODS)
def test_a_checkpoint_of_another_method_is_refused_by_name(checkpoints, tmp_path, method):
    path = config_only(checkpoints["gqa_tied"], tmp_path, {"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=rf"quant_method {method!r} is not served by hf_paged, "
                                         r"which serves fine-grained FP8"):
        hf_paged.AutoModelForCausalLM.from_pretrained(path, **SMALL)


def test_the_engine_and_the_command_line_refuse_alike(checkpoints, tmp_path, capsys):
    path = config_only(checkpoints["gqa_tied"], tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        hf_paged.from_pretrained(path, **SMALL)
    assert cli.main(["generate", "--model", path, "--device", "cpu", "--token-ids", "1,2"]) == 2
    assert "quant_method 'gptq' is not served" in capsys.readouterr().err


@pytest.mark.parametrize("passed, method", [({"quant_method": "awq", "bits": 4}, "awq"),
                                            (BitsAndBytesConfig(load_in_8bit=True),
                                             "bitsandbytes")])
def test_a_passed_config_of_another_method_is_refused_by_name(checkpoints, passed, method):
    with pytest.raises(ValueError, match=f"quant_method {method!r} is not served"):
        hf_paged.AutoModelForCausalLM.from_pretrained(checkpoints["gqa_tied"],
                                                      quantization_config=passed, **SMALL)


def test_a_passed_config_of_another_method_than_the_checkpoints_is_refused():
    config = Qwen3Config(**TINY_CONFIGS["gqa_tied"], quantization_config=FP8)
    with pytest.raises(ValueError, match="quantized with quant_method 'fp8', the passed config "
                                         "names 'awq'"):
        quantization.resolve(config, {"quant_method": "awq"})


@pytest.mark.parametrize("override, named", [
    (dict(activation_scheme="static"), "activation_scheme='static'"),
    (dict(fmt="e5m2"), "fmt='e5m2'"),
    (dict(scale_fmt="ue8m0"), "scale_fmt='ue8m0'"),
    (dict(weight_block_size=None), "weight_block_size=None"),
    (dict(weight_block_size=[128]), "weight_block_size=[128]"),
    (dict(weight_block_size=[0, 128]), "weight_block_size=[0, 128]"),
    (dict(weight_block_size=[128, 96]), "weight_block_size=[128, 96]"),
    (dict(modules_to_convert=["model.embed_tokens"]), "modules_to_convert="),
    (dict(expert_dtype="fp4"), "expert_dtype='fp4'"),
    (dict(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme="),
])
def test_fp8_variants_not_served_are_refused_by_name(override, named):
    config = Qwen3Config(**TINY_CONFIGS["gqa_tied"], quantization_config={**FP8, **override})
    with pytest.raises(ValueError,
                       match=rf"quant_method 'fp8'\): {re.escape(named)}.* is not served"):
        quantization.resolve(config)


def test_blocks_narrower_than_the_gpu_kernels_step_are_served_on_the_cpu_only():
    config = Qwen3Config(**TINY_CONFIGS["gqa_tied"],
                         quantization_config={**FP8, "weight_block_size": [8, 8]})
    scheme = quantization.resolve(config)
    fp8.check_device(scheme, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"weight_block_size=\[8, 8\] is not served .*CUDA"):
        fp8.check_device(scheme, torch.device("cuda"))


def test_a_missing_block_size_is_refused_as_per_tensor_fp8():
    config = Qwen3Config(quantization_config={k: v for k, v in FP8.items()
                                              if k != "weight_block_size"})
    with pytest.raises(ValueError, match=r"weight_block_size=None is not served by hf_paged "
                                         r"\(per-tensor FP8 is not served"):
        quantization.resolve(config)


def test_fine_grained_fp8_resolves_to_plain_data():
    own = quantization.resolve(Qwen3Config(quantization_config=dict(
        FP8, weight_block_size=[64, 32], modules_to_not_convert=["lm_head"])))
    assert (own.block, own.modules_to_not_convert, own.pre_quantized) == (
        (64, 32), ("lm_head",), True)
    passed = quantization.resolve(Qwen3Config(), FineGrainedFP8Config())
    assert (passed.block, passed.modules_to_not_convert, passed.pre_quantized) == (
        (128, 128), None, False)
    assert passed.config["quant_method"] == "fp8" and json.dumps(passed.config)
    assert quantization.resolve(Qwen3Config()) is None
    assert not own.dequantize and not passed.dequantize


def test_dequantize_is_a_loading_attribute_of_fp8_checkpoints_only():
    """transformers' ``dequantize=True``: an FP8 checkpoint loads dequantized (its block still
    names the grid); asked of an unquantized checkpoint, there is nothing to dequantize."""
    dequantizing = FineGrainedFP8Config(dequantize=True)
    scheme = quantization.resolve(Qwen3Config(quantization_config=FP8), dequantizing)
    assert scheme.dequantize and scheme.pre_quantized and scheme.block == (128, 128)
    fp8.check_device(scheme, torch.device("cuda"))  # no kernel reads it: any block will do
    assert quantization.resolve(Qwen3Config(), dequantizing) is None


@pytest.mark.parametrize("shape, tp, message", [
    (dict(FP8_CONFIGS["cut_200_300"], head_dim=128), 2,
     "intermediate_size 300 / tensor_parallel_size 2 cuts the 128-row FP8 blocks of "
     "gate_up_proj"),
    (dict(TINY_CONFIGS["gqa_tied"], intermediate_size=512, num_attention_heads=2,
          num_key_value_heads=1, head_dim=64), 2,  # the one KV head is replicated whole
     "num_attention_heads * head_dim 128 / tensor_parallel_size 2 cuts the 128-row FP8 "
     "blocks of q_proj"),
    (dict(TINY_CONFIGS["gqa_tied"], intermediate_size=512, num_attention_heads=8,
          num_key_value_heads=4, head_dim=64), 4,
     "num_key_value_heads * head_dim 256 / tensor_parallel_size 4 cuts the 128-row FP8 "
     "blocks of k_proj and v_proj"),
    (dict(TINY_CONFIGS["gqa_tied"], intermediate_size=768, num_attention_heads=8,
          num_key_value_heads=2, head_dim=128), 4,
     "intermediate_size 768 / tensor_parallel_size 4 cuts the 128-column FP8 blocks of "
     "down_proj"),
])
def test_a_split_cutting_fp8_blocks_is_refused_naming_the_dimension(shape, tp, message):
    config = Qwen3Config(**shape, quantization_config=FP8)
    if "column" in message:  # rows of 64: blocks 64 high, 128 wide
        config.quantization_config = dict(FP8, weight_block_size=[64, 128])
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        families.check_model(config, tp, quantization.resolve(config))
    families.check_model(config, 1, quantization.resolve(config))
    families.check_model(Qwen3Config(**shape), tp)  # unquantized, the split is fine


def test_the_30b_a3b_shape_splits_over_2_ranks_not_4():
    """Each expert's 768 intermediate rows: 384 a rank of 2, 192 of 4 (a block and a half)."""
    config = shape_config("30b-a3b")
    config.quantization_config = FP8
    scheme = quantization.resolve(config)
    families.check_model(config, 2, scheme)
    with pytest.raises(ValueError, match="moe_intermediate_size 768 / tensor_parallel_size 4 "
                                         "cuts the 128-row FP8 blocks of the experts' "
                                         "gate_up_proj"):
        families.check_model(config, 4, scheme)


def test_a_cutting_split_is_refused_before_any_process_starts(fp8_checkpoints, tmp_path):
    path = shutil.copytree(fp8_checkpoints["cut_200_300"], tmp_path / "cut")
    with pytest.raises(ValueError, match="num_key_value_heads \\* head_dim 128 / "
                                         "tensor_parallel_size 2 cuts the 128-row"):
        hf_paged.from_pretrained(str(path), tensor_parallel_size=2, **SMALL)


def test_an_unquantized_config_stays_unquantized():
    assert quantization.resolve(AutoConfig.for_model("qwen3")) is None
