"""Qwen3.5's vision-language releases (``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` checkpoints: the text model under
``model.language_model`` beside a vision tower) served as transformers'
``AutoModelForCausalLM`` serves them: the text model, the same class and config, exact greedy
float32 tokens on a left-padded batch, through each way in (``hf_paged.from_pretrained``, the
drop-in ``AutoModelForCausalLM``, ``patch_transformers``)."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from tests.conftest import SMALL, VISION_LANGUAGE_CONFIGS, left_padded

NEW_TOKENS = 8
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def stock(vision_language_checkpoints):
    """name -> transformers' causal LM of each release."""
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval() for name, path in vision_language_checkpoints.items()}


def expected(stock_model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return stock_model.generate(ids, attention_mask=mask, **GREEDY)


@pytest.mark.parametrize("name", VISION_LANGUAGE_CONFIGS)
def test_the_engine_generates_transformers_tokens(stock, vision_language_checkpoints, name):
    ids, mask = left_padded([5, 9, 3, 1, 17], 1000, seed=4)
    with hf_paged.from_pretrained(vision_language_checkpoints[name], device="cpu",
                                  dtype=torch.float32, **SMALL) as engine:
        got = engine.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, expected(stock[name], ids, mask))


@pytest.mark.parametrize("name", VISION_LANGUAGE_CONFIGS)
def test_the_drop_in_class_is_transformers_causal_lm(stock, vision_language_checkpoints, name):
    """The class and config a user sees are stock's: the text model's causal LM, its text
    config (no ``architectures``, as transformers' swap leaves it)."""
    ids, mask = left_padded([7, 2, 12], 1000, seed=5)
    with hf_paged.AutoModelForCausalLM.from_pretrained(
            vision_language_checkpoints[name], device="cpu", dtype=torch.float32,
            **SMALL) as model:
        assert type(model).__name__ == type(stock[name]).__name__
        assert type(model.config) is type(stock[name].config)
        assert model.config.to_dict() == stock[name].config.to_dict()
        got = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, expected(stock[name], ids, mask))


def test_patched_transformers_serves_the_release(stock, vision_language_checkpoints):
    name = "qwen3.5_moe_vl_tied"
    path, engine = vision_language_checkpoints[name], dict(device="cpu", **SMALL)
    ids, mask = left_padded([4, 10], 1000, seed=6)
    with hf_paged.patch_transformers():
        with transformers.Qwen3_5MoeForCausalLM.from_pretrained(path, **engine) as direct:
            assert type(direct) is hf_paged.integrations.causal_lm.Qwen3_5MoeForCausalLM
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  **engine)
    with model:
        assert isinstance(model, transformers.Qwen3_5MoeForCausalLM)
        assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY),
                           expected(stock[name], ids, mask))
