"""Qwen3-Next and Qwen3.5 FP8 checkpoints (float8_e4m3fn weights, a float32
``weight_scale_inv`` per block: attention, Gated DeltaNet projections, dense MLPs, routed and
shared experts; the LM head, routers and shared-expert gates kept float) against stock
transformers, float32 on CPU, on one rank: greedy tokens on a padded batch and forward logits,
the weights held FP8. (Qwen3.5's ``in_proj_qkv`` grid is split between its query, key and
value parts: the tiny shapes' 32-row parts take 16-row blocks; 128-row ones are refused,
tests/unit/test_hybrid_families.py.)

The oracle is stock transformers on the definition's float copy (every weight times its
block's scale, ``test_fp8.definition_checkpoint``): with 128-blocks these tiny shapes cut
blocks short, where transformers' own CPU dequantization derives the block size from the
grid and dequantizes wrongly (as in tests/parity/test_fp8.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

import hf_paged
from hf_paged.kernels.block_scales import FP8
from hf_paged.random_checkpoint import quantize_fp8
from tests.conftest import left_padded
from tests.parity.test_fp8 import definition_checkpoint
from tests.parity.test_hybrid_families import assert_logits_close

CASES = [("next_dense1", 16), ("next_dense1", 128), ("next_tied_attention_first", 16),
         ("qwen3.5_tied", 16), ("qwen3.5_moe", 16)]
ENGINE = dict(device="cpu", dtype=torch.float32, block_size=8, max_model_len=128,
              num_kv_blocks=64)


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{b}" for n, b in CASES])
def pair(request, hybrid_checkpoints, tmp_path_factory):
    """hf_paged on an FP8 copy of the case's checkpoint, and the definition's oracle."""
    name, block = request.param
    path = str(tmp_path_factory.mktemp(f"fp8_{name}_{block}"))
    shutil.copytree(hybrid_checkpoints[name], path, dirs_exist_ok=True)
    quantize_fp8(path, transformers.AutoConfig.from_pretrained(path), (block, block))
    oracle_path = definition_checkpoint(path, str(tmp_path_factory.mktemp(f"def_{name}")), block)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_path,
                                                               dtype=torch.float32).eval()
    with hf_paged.AutoModelForCausalLM.from_pretrained(path, **ENGINE) as model:
        yield model, oracle


def test_weights_stay_fp8(pair):
    model, _ = pair
    layers = model.model.layers
    linear = next(layer for layer in layers if hasattr(layer, "linear_attn")).linear_attn
    attention = next(layer for layer in layers if hasattr(layer, "self_attn")).self_attn
    for projection in (linear.in_proj_qkvzba, linear.out_proj, attention.qkv_proj):
        assert projection.weight.dtype == FP8
    assert linear.conv1d.weight.dtype == model.lm_head.weight.dtype == torch.float32


def test_greedy_tokens_and_logits_match_transformers(pair):
    model, oracle = pair
    ids, mask = left_padded([1, 7, 12, 17], oracle.config.vocab_size, seed=1)
    with torch.no_grad():
        ref = oracle.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                              pad_token_id=0)
        ref_logits = oracle(ids, attention_mask=mask).logits
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(out, ref)
    kept = mask.bool()
    assert_logits_close(model(ids, attention_mask=mask).logits[kept], ref_logits[kept])
