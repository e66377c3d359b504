"""FP8 weights under tensor parallelism: every rank holds its slice of each FP8 weight and the
blocks of the scale grid that cover it (KV heads replicated, merged parts apart, experts split
along moe_intermediate_size), read from an FP8 checkpoint or quantized on load; built as rank
r of N (loading needs no process group)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import FineGrainedFP8Config

from hf_paged import quantization
from hf_paged.families.build import build_model
from hf_paged.kernels.block_scales import dequantize
from hf_paged.modeling.tp import SINGLE, TensorParallel
from hf_paged.random_checkpoint import quantize_fp8, random_qwen3
from tests.conftest import SHAPES

# hidden 176 / 72: the last 32- / 16-column block of every unsplit input dimension cut short.
DENSE = dict(SHAPES["tiny"], hidden_size=176, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
MOE = dict(SHAPES["tiny-moe"], hidden_size=72, mlp_only_layers=[0], num_hidden_layers=3)
# name -> (shape, block, tensor_parallel_size, FP8 layers: attention's 2 a layer, then 2 a
# dense MLP, 1 a sparse layer's experts). Quantized on load, blocks of half the size: they
# divide every dimension (transformers leaves a weight with a cut block float).
CASES = {"dense_tp2": (DENSE, (32, 32), 2, 8), "dense_tp4": (DENSE, (32, 32), 4, 8),
         "moe_tp2": (MOE, (16, 16), 2, 10)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (float checkpoint, its FP8 copy in the case's block size)."""
    out = {}
    for name, (shape, block, *_) in CASES.items():
        config = transformers.AutoConfig.for_model(
            **{"model_type": "qwen3", **shape}, dtype="float32")
        model = random_qwen3(config, seed=5)
        plain, fp8 = (str(tmp_path_factory.mktemp(f"{kind}_{name}")) for kind in ("f", "q"))
        model.save_pretrained(plain)
        model.save_pretrained(fp8)
        quantize_fp8(fp8, config, block)
        out[name] = plain, fp8
    return out


def build(path: str, tp: TensorParallel, passed=None) -> dict[str, torch.nn.Module]:
    config = transformers.AutoConfig.from_pretrained(path)
    scheme = quantization.resolve(config, passed)
    model = build_model(config, path, torch.float32, torch.device("cpu"), "sdpa", 64, tp,
                        scheme).hf_model
    return dict(model.named_modules())


def values(module: torch.nn.Module) -> list[torch.Tensor]:
    """A layer's weights as the kernels compute with them, per checkpoint part (experts:
    gate/up and down of every expert)."""
    if hasattr(module, "gate_up_proj"):
        scales = module.scales
        gate_up = dequantize(module.gate_up_proj, scales["w13_scales"], torch.float32)
        down = dequantize(module.down_proj, scales["w2_scales"], torch.float32)
        return [*gate_up.chunk(2, dim=1), down]
    return list(dequantize(module.weight, module.scales, torch.float32).split(module.parts))


def rank_slice(full: torch.Tensor, module_name: str, part: int, rank: int, size: int,
               kv_heads: int) -> torch.Tensor:
    """Rank ``rank``'s slice of part ``part`` of a whole layer's weight."""
    if module_name.endswith(("o_proj", "down_proj")) or (module_name.endswith("experts")
                                                          and part == 2):
        return full.chunk(size, dim=-1)[rank]
    if module_name.endswith("qkv_proj") and part > 0 and kv_heads < size:  # replicated
        return full.chunk(kv_heads, dim=-2)[rank * kv_heads // size]
    return full.chunk(size, dim=-2)[rank]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("quantized_on_load", [False, True])
def test_each_rank_holds_its_slices_of_weights_and_scale_grids(folders, name,
                                                               quantized_on_load):
    shape, block, size, layers = CASES[name]
    plain, fp8 = folders[name]
    path, passed = (plain, FineGrainedFP8Config(
        weight_block_size=(block[0] // 2, block[1] // 2))) if quantized_on_load else (fp8, None)
    whole = build(path, SINGLE, passed)
    ranks = [build(path, TensorParallel(rank, size), passed) for rank in range(size)]
    checked = 0
    for module_name, module in whole.items():
        if getattr(module, "block", None) is None:
            continue
        for part, full in enumerate(values(module)):
            for rank in range(size):
                local = values(ranks[rank][module_name])[part]
                expected = rank_slice(full, module_name, part, rank, size,
                                      shape["num_key_value_heads"])
                assert torch.equal(local, expected), (module_name, part, rank)
        checked += 1
    assert checked == layers
