"""transformers.pipeline("text-generation") on an hf_paged model gives stock's outputs."""

from __future__ import annotations

import pytest
import transformers

import hf_paged
from tests.integrations.conftest import SMALL

CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pipelines(tiny_checkpoint, tokenizer, stock_model):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL)
    return [transformers.pipeline("text-generation", model=m, tokenizer=tokenizer)
            for m in (stock_model, model)]


@pytest.mark.parametrize("inputs, kwargs", [
    ("Once upon a time", dict(max_new_tokens=8)),
    (["The river starts", "What is two plus two? Four. What is"],
     dict(max_new_tokens=6, batch_size=2)),
    (["a", "Numbers: 0 1 2 3", "Tell me a story about a cat"], dict(max_new_tokens=5)),
    (CHAT, dict(max_new_tokens=7)),
    ([CHAT, CHAT[1:]], dict(max_new_tokens=4, batch_size=2)),
    (CHAT + [{"role": "assistant", "content": "The capital"}], dict(max_new_tokens=4)),
    ("Once upon a time", dict(max_new_tokens=6, return_full_text=False)),
    ("Once upon a time", dict(max_length=12)),
    ("Once upon a time", dict(max_new_tokens=5, return_tensors=True)),
])
def test_pipeline_matches_stock(pipelines, inputs, kwargs):
    stock, paged = pipelines
    assert paged(inputs, do_sample=False, **kwargs) == stock(inputs, do_sample=False, **kwargs)


def test_pipeline_generation_config(pipelines):
    stock, paged = pipelines
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False)
    assert paged("Hello", generation_config=config) == stock("Hello", generation_config=config)
