"""The FP8 KV cache end to end, float32 on CPU: the engine against its definition
(transformers' model with every key and value rounded through e4m3 by the engine's scales, as
the cache stores them) and against the float cache (logits, greedy top-1, and the set of
tokens top-k / top-p sampling can draw)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import transformers.models.qwen3.modeling_qwen3 as modeling_qwen3
from safetensors.torch import load_file, save_file

import hf_paged
from hf_paged import kernels
from hf_paged.kernels import reference
from tests.conftest import TINY_CONFIGS, left_padded

OPTIONS = dict(block_size=8, max_model_len=128, num_kv_blocks=64)
FP8_STEP = 2.0**-4  # e4m3's largest rounding error, relative to a normal value
SETTINGS = ((2, 1.0), (3, 1.0), (20, 0.5), (200, 0.3))  # (top_k, top_p)


def engine(checkpoints, name, kv_cache_dtype, **options):
    return hf_paged.from_pretrained(checkpoints[name], kv_cache_dtype=kv_cache_dtype,
                                    **{**OPTIONS, **options})


@pytest.fixture
def e4m3_attention(monkeypatch):
    """Make transformers' Qwen3 attention read keys and values rounded as ``engine``'s FP8
    cache stores them (``reference.quantize_kv`` with its layers' scales)."""
    real = modeling_qwen3.ALL_ATTENTION_FUNCTIONS

    def use(engine):
        layers = engine.model.attention_layers

        def rounded(x, scale):  # [B, Hkv, T, D]
            x = x.transpose(1, 2)
            return reference.dequantize_kv(reference.quantize_kv(x, scale), scale,
                                           x.dtype).transpose(1, 2)

        class Rounding:
            def get_interface(self, name, default):
                attend = real.get_interface(name, default)

                def attention(module, query, key, value, *args, **kwargs):
                    layer = layers[module.layer_idx]
                    return attend(module, query, rounded(key, layer.k_scale),
                                  rounded(value, layer.v_scale), *args, **kwargs)
                return attention

        monkeypatch.setattr(modeling_qwen3, "ALL_ATTENTION_FUNCTIONS", Rounding())
    return use


@pytest.mark.parametrize("name", ["gqa_tied", "one_kv_head"])
def test_greedy_is_transformers_over_e4m3_keys_and_values(checkpoints, hf_models,
                                                          e4m3_attention, name):
    fp8 = engine(checkpoints, name, "fp8")
    e4m3_attention(fp8)
    ids, mask = left_padded([1, 7, 9, 17, 40], TINY_CONFIGS[name]["vocab_size"])
    ref = hf_models[name].generate(ids, attention_mask=mask, max_new_tokens=24,
                                   do_sample=False)
    assert torch.equal(fp8.generate(ids, attention_mask=mask, max_new_tokens=24), ref)
    with torch.no_grad():
        expected = hf_models[name](ids, attention_mask=mask).logits
    logits = fp8.forward(ids, mask, torch.arange(ids.shape[1]).expand_as(ids)).float()
    # float32 round-off, and now and then a key rounding to the next e4m3 value: one step.
    kept = mask.bool()
    atol = 1e-3 * float(expected.abs().max())
    torch.testing.assert_close(logits[kept], expected[kept], rtol=0, atol=atol)
    # The drawable sets are the definition's wherever the rows' differences decide them.
    err = (logits[kept] - expected[kept]).abs().amax(-1)
    for top_k, top_p in SETTINGS:
        decided = ~undecided(expected[kept], err, top_k, top_p)
        same = (drawable(expected[kept], top_k, top_p) == drawable(logits[kept], top_k, top_p))
        assert same.all(-1)[decided].all() and decided.float().mean() > 0.4


def teacher_forced_logits(checkpoints, name, kv_cache_dtype, ids):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    model = engine(checkpoints, name, kv_cache_dtype)
    return model.forward(ids, torch.ones_like(ids), positions).float().flatten(0, 1)


def drawable(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Per row, the tokens top-k then top-p keep (``reference.sample``'s rule), as a mask."""
    order = logits.argsort(-1, descending=True)
    ranked = logits.gather(-1, order)
    ranked[:, top_k:] = -math.inf
    probs = ranked.softmax(-1)
    keep = (probs.cumsum(-1) - probs < top_p) | (top_p >= 1.0)
    keep &= ranked > -math.inf
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


def undecided(logits: torch.Tensor, err: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Rows whose drawable set logits within ``err`` of these (per row, every entry) could
    change: the k-th and (k+1)-th largest within ``2 err``, or a token of the top k whose mass
    of more likely tokens could fall on either side of ``top_p`` (< 1; 1 is off). Probabilities
    over a fixed set, and so the masses of its subsets, move by at most a factor
    ``exp(2 err)``; tokens less than ``2 err`` apart may swap."""
    ranked, _ = logits.sort(-1, descending=True)
    near_k = ranked[:, top_k - 1] - ranked[:, top_k] <= 2 * err
    if top_p >= 1.0:
        return near_k
    top = ranked[:, :top_k]
    probs = top.softmax(-1)
    above_surely = (top[:, None, :] > top[:, :, None] + 2 * err[:, None, None])
    above_maybe = (top[:, None, :] >= top[:, :, None] - 2 * err[:, None, None])
    above_maybe &= ~torch.eye(top_k, dtype=torch.bool)
    low = (above_surely * probs[:, None, :]).sum(-1) * torch.exp(-2 * err)[:, None]
    high = (above_maybe * probs[:, None, :]).sum(-1) * torch.exp(2 * err)[:, None]
    straddles = (low < top_p) & (high >= top_p)
    straddles[:, 0] = False  # the most likely token is always drawable
    return near_k | straddles.any(-1)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_agreement_with_the_float_cache(checkpoints, name):
    vocab = TINY_CONFIGS[name]["vocab_size"]
    ids = torch.randint(3, vocab, (4, 48), generator=torch.Generator().manual_seed(1))
    plain = teacher_forced_logits(checkpoints, name, "auto", ids)
    fp8 = teacher_forced_logits(checkpoints, name, "fp8", ids)
    err = (fp8 - plain).abs().amax(-1)
    # Every key and value is off by up to one e4m3 step; these random models carry that to
    # their logits by a few steps (the definition test above is the exact one). A lost scale
    # would be off by the logits' own size.
    size = float(plain.abs().max())
    assert float(err.median()) <= FP8_STEP * size and float(err.max()) <= 4 * FP8_STEP * size
    # Greedy: the same token wherever the float cache's top two are more than 2 err apart.
    top2 = plain.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 2 * err
    assert (fp8.argmax(-1) == plain.argmax(-1))[decided].all() and decided.float().mean() > 0.2
    for top_k, top_p in SETTINGS:
        same = (drawable(plain, top_k, top_p) == drawable(fp8, top_k, top_p)).all(-1)
        # Exact where the error bound decides the set, and the same set on most rows. On these
        # random models, whose logits move by up to a few e4m3 steps, the bound decides some
        # top-k sets and no top-p one (the masses' factor exp(2 err) spans their boundaries).
        decided = ~undecided(plain, err, top_k, top_p)
        assert same[decided].all() and (top_p < 1.0 or decided.any())
        assert same.float().mean() >= 0.6


def test_prefix_cache_hits_and_copy_on_write_over_fp8_blocks(checkpoints, hf_models,
                                                             e4m3_attention, monkeypatch):
    fp8 = engine(checkpoints, "gqa_tied", "fp8")
    e4m3_attention(fp8)
    ids, mask = left_padded([9, 20], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=3)
    first = fp8.generate(ids, attention_mask=mask, max_new_tokens=12)
    again = fp8.generate(ids, attention_mask=mask, max_new_tokens=12)  # from cached blocks
    assert torch.equal(again, first)
    assert fp8.stats()["prefix_cache_hits"] > 0
    # Beams fork sequences that share partly filled blocks: copy-on-write copies FP8 blocks.
    copied = []
    copy_blocks = kernels.copy_blocks
    monkeypatch.setattr(kernels, "copy_blocks", lambda k, v, *pairs: (
        copied.append(k.dtype), copy_blocks(k, v, *pairs)))
    ref = hf_models["gqa_tied"].generate(ids, attention_mask=mask, max_new_tokens=12,
                                         num_beams=3, do_sample=False)
    assert torch.equal(fp8.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=3),
                       ref)
    assert copied and set(copied) == {torch.float8_e4m3fn}


def test_fp8_cache_holds_twice_the_tokens(checkpoints):
    sizes = {kv: engine(checkpoints, "gqa_tied", kv, num_kv_blocks=None,
                        cpu_kv_cache_gib=2**-12).stats()["num_blocks"] for kv in ("auto", "fp8")}
    assert sizes["fp8"] == 4 * sizes["auto"]  # float32 -> one byte an element


def test_kv_cache_dtype_is_checked_by_name(checkpoints):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine(checkpoints, "gqa_tied", "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported by "
                                         "attention_backend 'flash_attn'"):
        engine(checkpoints, "gqa_tied", "fp8", attention_backend="flash_attn")


def with_scales(checkpoints, tmp_path, names: dict[str, torch.Tensor]) -> dict[str, str]:
    """gqa_tied's checkpoint plus the tensors ``names``."""
    tensors = load_file(f"{checkpoints['gqa_tied']}/model.safetensors")
    shutil.copytree(checkpoints["gqa_tied"], tmp_path, dirs_exist_ok=True)
    save_file({**tensors, **names}, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    return {"gqa_tied": str(tmp_path)}


def test_scales_from_the_checkpoint(checkpoints, hf_models, e4m3_attention, tmp_path):
    layers = TINY_CONFIGS["gqa_tied"]["num_hidden_layers"]
    kv_heads = TINY_CONFIGS["gqa_tied"]["num_key_value_heads"]
    # Per tensor in ModelOpt's names for layer 0, per KV head in compressed-tensors' for the rest.
    shipped = {"model.layers.0.self_attn.k_scale": torch.tensor(0.02),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.05)}
    for i in range(1, layers):
        shipped[f"model.layers.{i}.self_attn.k_proj.output_scale"] = torch.tensor([0.01, 0.03])
        shipped[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor([0.06, 0.04])
    path = with_scales(checkpoints, tmp_path, shipped)
    fp8 = engine(path, "gqa_tied", "fp8")
    first = fp8.model.attention_layers[0]
    assert torch.equal(first.k_scale, torch.full((kv_heads,), 0.02))
    assert torch.equal(fp8.model.attention_layers[1].v_scale, torch.tensor([0.06, 0.04]))
    e4m3_attention(fp8)
    ids, mask = left_padded([7, 17], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=5)
    ref = hf_models["gqa_tied"].generate(ids, attention_mask=mask, max_new_tokens=12,
                                         do_sample=False)
    assert torch.equal(fp8.generate(ids, attention_mask=mask, max_new_tokens=12), ref)


def test_checkpoint_scales_leave_the_float_cache_alone(checkpoints, tmp_path):
    path = with_scales(checkpoints, tmp_path, {
        f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.5)
        for i in range(TINY_CONFIGS["gqa_tied"]["num_hidden_layers"])})
    ids, mask = left_padded([7, 17], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=5)
    outs = [engine(p, "gqa_tied", "auto").generate(ids, attention_mask=mask, max_new_tokens=8)
            for p in (path, checkpoints)]
    assert torch.equal(*outs)


def test_scales_missing_for_a_layer_are_refused_by_key(checkpoints, tmp_path):
    path = with_scales(checkpoints, tmp_path, {"model.layers.0.self_attn.k_scale":
                                               torch.tensor(0.02),
                                               "model.layers.0.self_attn.v_scale":
                                               torch.tensor(0.02)})
    with pytest.raises(ValueError, match=r"not model\.layers\.1\.self_attn\.k_scale"):
        engine(path, "gqa_tied", "fp8")


def test_queries_beyond_float16_are_refused_by_layer(checkpoints, tmp_path):
    """The FP8 cache's attention computes 16-bit queries in float16: a q_norm weight that lets
    a normed query pass 65,504 refuses the cache, naming the layer; the float cache, and the
    FP8 cache of a float32 model (float32 tiles), still serve it."""
    head_dim = TINY_CONFIGS["gqa_tied"]["head_dim"]
    path = with_scales(checkpoints, tmp_path, {"model.layers.1.self_attn.q_norm.weight":
                                               torch.full((head_dim,), 7e4)})
    with pytest.raises(ValueError, match=r"layer 1's q_norm\.weight .* beyond float16"):
        engine(path, "gqa_tied", "fp8", dtype=torch.bfloat16)
    engine(path, "gqa_tied", "auto", dtype=torch.bfloat16)
    engine(path, "gqa_tied", "fp8", dtype=torch.float32)
