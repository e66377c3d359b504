"""TRL's generation path: a trainer prepares the model with accelerate, then generates through
``unwrap_model_for_generation``; an hf_paged model gives stock's tokens there."""

from __future__ import annotations

import pytest
import torch
import transformers
from accelerate import Accelerator
from trl.models.utils import unwrap_model_for_generation

PROMPTS = ["Once upon a time", "The river starts in the mountains", "a"]


def trl_generate(model, tokenizer) -> torch.Tensor:
    """What TRL's online trainers do each step: prepare, unwrap, then generate greedily with
    a GenerationConfig built from the training arguments."""
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)  # padded on the left
    config = transformers.GenerationConfig(
        max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id)
    with unwrap_model_for_generation(prepared, accelerator,
                                     generation_kwargs=config.to_diff_dict()) as unwrapped:
        return unwrapped.generate(input_ids=batch.input_ids,
                                  attention_mask=batch.attention_mask,
                                  generation_config=config)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_unwrap_model_for_generation(paged_model, stock_model, tokenizer):
    expected = trl_generate(stock_model, tokenizer)
    assert torch.equal(trl_generate(paged_model, tokenizer), expected)
