"""Qwen3-MoE checkpoints against stock transformers' ``Qwen3MoeForCausalLM``, float32 on CPU:
exact tokens for greedy (padded batches, preemption, chunked prefill, prefix hits), beams and
the drop-in model's forward; the drawable set when sampling; both checkpoint layouts of the
experts, and a checkpoint with a missing, mis-shaped or extra expert tensor refused by key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

import hf_paged
from tests.conftest import FLOAT32_RTOL, MOE_CONFIGS, left_padded, transformers_allowed_set

LENGTHS = [1, 7, 9, 17, 40]
ENGINE = dict(block_size=8, max_model_len=128, num_kv_blocks=64)
VOCAB = MOE_CONFIGS["e8_k2_tied"]["vocab_size"]


@pytest.fixture(scope="module")
def engines(moe_checkpoints):
    built = {name: hf_paged.from_pretrained(path, **ENGINE)
             for name, path in moe_checkpoints.items()}
    yield built
    for engine in built.values():
        engine.close()


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_greedy_padded_batch_matches_transformers(engines, moe_models, name):
    ids, mask = left_padded(LENGTHS, VOCAB, seed=1)
    ref = moe_models[name].generate(ids, attention_mask=mask, max_new_tokens=16,
                                    do_sample=False)
    assert torch.equal(engines[name].generate(ids, attention_mask=mask, max_new_tokens=16), ref)


def test_preemption_chunked_prefill_and_prefix_hits(moe_checkpoints, moe_models):
    name = "e6_k3_raw_dense0"
    ids, mask = left_padded([20, 25, 30, 35], VOCAB, seed=2)
    ref = moe_models[name].generate(ids, attention_mask=mask, max_new_tokens=20,
                                    do_sample=False)
    with hf_paged.from_pretrained(moe_checkpoints[name], block_size=8, num_kv_blocks=12,
                                  max_num_batched_tokens=16, max_model_len=128) as engine:
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=20), ref)
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=20), ref)
        stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats


def test_beam_search_matches_transformers(engines, moe_models):
    ids, mask = left_padded([6, 13, 21], VOCAB, seed=3)
    kwargs = dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, do_sample=False)
    ref = moe_models["e16_k4_wide"].generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(engines["e16_k4_wide"].generate(ids, attention_mask=mask, **kwargs), ref)


def test_sampling_draws_from_transformers_allowed_set(engines, moe_models):
    model, engine = moe_models["e8_k2_tied"], engines["e8_k2_tied"]
    prompt, _ = left_padded([11], VOCAB, seed=4)
    kwargs = dict(do_sample=True, max_new_tokens=1, temperature=2.5, top_k=30, top_p=0.95)
    allowed = transformers_allowed_set(model, prompt, kwargs)
    assert 3 <= len(allowed) <= 30
    torch.manual_seed(0)
    drawn = set(engine.generate(prompt, num_return_sequences=1000, **kwargs)[:, -1].tolist())
    assert drawn <= allowed and len(drawn) >= len(allowed) - 3


def test_the_drop_in_model_is_transformers_class_with_its_forward(moe_checkpoints, moe_models,
                                                                  tmp_path):
    name = "e4_k1_step2"
    stock = moe_models[name]
    with hf_paged.patch_transformers():
        with transformers.Qwen3MoeForCausalLM.from_pretrained(moe_checkpoints[name],
                                                              **ENGINE) as direct:
            assert type(direct) is hf_paged.integrations.causal_lm.Qwen3MoeForCausalLM
        model = transformers.AutoModelForCausalLM.from_pretrained(
            moe_checkpoints[name], dtype=torch.float32, **ENGINE)
    with model:
        assert type(model).__name__ == "Qwen3MoeForCausalLM"
        assert isinstance(model, transformers.Qwen3MoeForCausalLM)
        assert isinstance(model.model, transformers.Qwen3MoeModel)
        ids, mask = left_padded([5, 12], VOCAB, seed=5)
        out, ref = model(ids, attention_mask=mask), stock(ids, attention_mask=mask)
        assert type(out) is type(ref) is transformers.modeling_outputs.MoeCausalLMOutputWithPast
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=FLOAT32_RTOL)
        labels = ids.masked_fill(mask == 0, -100)
        torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).loss,
                                   stock(ids, attention_mask=mask, labels=labels).loss,
                                   atol=1e-5, rtol=FLOAT32_RTOL)
        with pytest.raises(ValueError, match="output_router_logits"):
            model(ids, output_router_logits=True)
        assert model.state_dict().keys() == stock.state_dict().keys()
        model.save_pretrained(tmp_path)
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    saved, expected = reloaded.state_dict(), stock.state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


def _rewrite(source: str, target, edit) -> str:
    """A copy of checkpoint ``source`` whose tensors ``edit(dict)`` rewrote."""
    shutil.copytree(source, target)
    file = f"{target}/model.safetensors"
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(target)


def _fuse_layer(tensors: dict, layer: int, experts: int) -> None:
    """One layer's experts as transformers 5's fused 3-D parameters."""
    prefix = f"model.layers.{layer}.mlp.experts"
    pop = lambda e, p: tensors.pop(f"{prefix}.{e}.{p}_proj.weight")  # noqa: E731
    tensors[f"{prefix}.gate_up_proj"] = torch.stack(
        [torch.cat([pop(e, "gate"), pop(e, "up")]) for e in range(experts)])
    tensors[f"{prefix}.down_proj"] = torch.stack([pop(e, "down") for e in range(experts)])


def test_fused_and_per_expert_layouts_load_alike(moe_checkpoints, moe_models, tmp_path):
    name = "e8_k2_tied"
    path = _rewrite(moe_checkpoints[name], tmp_path / "mixed", lambda t: _fuse_layer(t, 1, 8))
    with open(f"{path}/config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 2  # layer 0 per expert, layer 1 fused
    ids, mask = left_padded(LENGTHS, VOCAB, seed=6)
    ref = moe_models[name].generate(ids, attention_mask=mask, max_new_tokens=12,
                                    do_sample=False)
    with hf_paged.from_pretrained(path, **ENGINE) as engine:
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), ref)


def test_both_layouts_load_with_the_experts_split_whole(moe_checkpoints, moe_models, tmp_path):
    """moe_parallel="experts" over two gloo ranks: each loads its four experts of the
    per-expert layer (skipping the other rank's keys) and of the fused one (narrowed along the
    experts); the tokens are transformers'."""
    name = "e8_k2_tied"
    path = _rewrite(moe_checkpoints[name], tmp_path / "mixed", lambda t: _fuse_layer(t, 1, 8))
    ids, mask = left_padded(LENGTHS, VOCAB, seed=6)
    ref = moe_models[name].generate(ids, attention_mask=mask, max_new_tokens=12,
                                    do_sample=False)
    with hf_paged.from_pretrained(path, **ENGINE, tensor_parallel_size=2,
                                  moe_parallel="experts") as engine:
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), ref)


@pytest.mark.parametrize("edit, named", [
    (lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
     r"missing \(1\):\n    model.layers.1.mlp.experts.5.up_proj.weight"),
    (lambda t: t.__setitem__("model.layers.0.mlp.experts.2.down_proj.weight", torch.zeros(64, 8)),
     r"model.layers.0.mlp.experts.2.down_proj.weight: checkpoint \[64, 8\], model \[64, 32\]"),
    (lambda t: (_fuse_layer(t, 0, 8), t.pop("model.layers.0.mlp.experts.down_proj")),
     r"missing \(1\):\n    model.layers.0.mlp.experts.down_proj"),
    (lambda t: t.pop("model.layers.1.mlp.gate.weight"),
     r"missing \(1\):\n    model.layers.1.mlp.gate.weight"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_by_key(moe_checkpoints, tmp_path, edit,
                                                          named):
    path = _rewrite(moe_checkpoints["e8_k2_tied"], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=named):
        hf_paged.from_pretrained(path, **ENGINE)


def test_an_extra_expert_is_reported_and_ignored(moe_checkpoints, tmp_path, caplog):
    extra = "model.layers.1.mlp.experts.8.up_proj.weight"
    path = _rewrite(moe_checkpoints["e8_k2_tied"], tmp_path / "extra",
                    lambda t: t.__setitem__(extra, torch.zeros(32, 64)))
    with hf_paged.from_pretrained(path, **ENGINE) as engine:
        assert engine.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2).shape == (1, 5)
    assert extra in caplog.text


@pytest.mark.parametrize("override, match", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must be between 1 and "
                                  r"num_experts \(8\)"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_a_config_the_modules_cannot_run_is_refused(override, match):
    from hf_paged import families

    config = transformers.AutoConfig.for_model(**{**MOE_CONFIGS["e8_k2_tied"], **override})
    with pytest.raises(ValueError, match=match):
        families.check_model(config, 1)


def test_tensor_parallel_splits_are_checked_by_name():
    from hf_paged import families

    config = transformers.AutoConfig.for_model(**MOE_CONFIGS["e8_k2_tied"])
    families.check_model(config, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(32\) is not divisible by "
                                         r"tensor_parallel_size \(3\)"):
        families.check_model(transformers.AutoConfig.for_model(
            **{**MOE_CONFIGS["e8_k2_tied"], "num_attention_heads": 6, "num_key_value_heads": 3,
               "intermediate_size": 96}), 3)
