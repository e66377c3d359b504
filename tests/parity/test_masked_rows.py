"""Rows the attention mask keeps nothing of (an empty prompt: a lone BOS that is also the pad
token) generate as in transformers, alone and beside ordinary rows (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_paged
from tests.conftest import FLOAT32_RTOL, TINY_CONFIGS, left_padded

VOCAB = TINY_CONFIGS["gqa_tied"]["vocab_size"]
BOS = 1


@pytest.fixture(scope="module")
def pair(checkpoints, hf_models):
    return hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8), hf_models["gqa_tied"]


class StopAt(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _both(pair, ids, **kwargs):
    engine, stock = pair
    kwargs = dict(dict(pad_token_id=BOS, bos_token_id=BOS, max_new_tokens=8, do_sample=False),
                  **kwargs)
    return engine.generate(ids, **kwargs), stock.generate(ids, **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(max_new_tokens=1),
    dict(do_sample=True, top_k=1, num_return_sequences=2),
])
def test_a_lone_bos_that_is_the_pad_token(pair, kwargs):
    """transformers infers an all-zero mask (the pad token is no EOS) and still generates."""
    mine, theirs = _both(pair, torch.tensor([[BOS]]), **kwargs)
    assert torch.equal(mine, theirs)


def test_a_masked_row_beside_others(pair):
    ids, mask = left_padded([6, 9], VOCAB, pad=BOS, seed=2)
    ids = torch.cat([ids, torch.full((1, ids.shape[1]), BOS)])
    mask = torch.cat([mask, torch.zeros(1, ids.shape[1], dtype=mask.dtype)])
    mine, theirs = _both(pair, ids, attention_mask=mask)
    assert torch.equal(mine, theirs)
    free = theirs[2, ids.shape[1] + 3].item()  # a criterion that stops the masked row
    stop = StoppingCriteriaList([StopAt(free)])
    for extra in (dict(), dict(eos_token_id=theirs[0, ids.shape[1] + 1].item())):
        mine, theirs = _both(pair, ids, attention_mask=mask, stopping_criteria=stop, **extra)
        assert torch.equal(mine, theirs)
    mine, theirs = _both(pair, ids, attention_mask=mask, return_dict_in_generate=True,
                         output_scores=True, output_logits=True, eos_token_id=free)
    assert torch.equal(mine.sequences, theirs.sequences)
    for name in ("scores", "logits"):
        for step, ref in zip(getattr(mine, name), getattr(theirs, name), strict=True):
            torch.testing.assert_close(step, ref, atol=1e-4, rtol=FLOAT32_RTOL)


def test_beam_search_over_a_masked_row_is_refused_by_name(pair):
    with pytest.raises(ValueError, match="attention_mask: row 0 keeps no token"):
        _both(pair, torch.tensor([[BOS]]), num_beams=2)
