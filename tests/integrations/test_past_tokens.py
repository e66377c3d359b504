"""The model call's ``past_key_values`` (the tokens so far) against transformers' KV cache,
float32 on CPU: a hand-written decoding loop that passes the past back with one token a step
gives transformers' tokens and logits, on a left-padded batch, under both names of the
argument, through the inner model too and for a hybrid model; the cache's row and length
edits as transformers' do them; a cache not made by the model, or a mask that does not cover
the past, refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from tests.conftest import FLOAT32_RTOL, SMALL, left_padded

STEPS = 6


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    stock = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint,
                                                              dtype=torch.float32).eval()
    with hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL) as model:
        yield model, stock


@torch.no_grad()
def decode_by_hand(model, ids, mask, name="past_key_values", steps=STEPS, in_place=False):
    """Greedy tokens and their logits from a loop that feeds one token a step with the
    past of the call before (the mask grown by one each step); ``in_place``: the first call's
    past passed every time, relying on its update in place."""
    out = model(ids, attention_mask=mask)
    first, tokens, logits = out.past_key_values, [], []
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        logits.append(out.logits[:, -1])
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        past = first if in_place else out.past_key_values
        out = model(token, attention_mask=mask, **{name: past})
    return torch.cat(tokens, 1), torch.stack(logits, 1), out.past_key_values


@pytest.mark.parametrize("name, in_place", [("past_key_values", False), ("cache", False),
                                            ("past_key_values", True)])
def test_a_decoding_loop_by_hand_gives_transformers_tokens(pair, name, in_place):
    model, stock = pair
    ids, mask = left_padded([4, 9, 13], 1024, seed=3)
    ours, ours_logits, past = decode_by_hand(model, ids, mask, name, in_place=in_place)
    theirs, their_logits, their_past = decode_by_hand(stock, ids, mask)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours_logits, their_logits, atol=1e-4, rtol=FLOAT32_RTOL)
    assert past.get_seq_length() == their_past.get_seq_length() == ids.shape[1] + STEPS
    assert isinstance(past, transformers.cache_utils.Cache)


@torch.no_grad()
def test_the_past_with_several_tokens_labels_and_logits_to_keep(pair):
    model, stock = pair
    ids, mask = left_padded([5, 8], 1024, seed=4)
    new = torch.randint(3, 1024, (2, 3), generator=torch.Generator().manual_seed(5))
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    for kwargs in (dict(labels=new), dict(logits_to_keep=2),
                   dict(logits_to_keep=torch.tensor([0, 2]))):
        ours = model(new, past_key_values=model(ids, attention_mask=mask).past_key_values,
                     attention_mask=full_mask, **kwargs)
        theirs = stock(new, past_key_values=stock(ids, attention_mask=mask).past_key_values,
                       attention_mask=full_mask, **kwargs)
        torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=FLOAT32_RTOL)
        if "labels" in kwargs:
            torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=FLOAT32_RTOL)
    inner = model.model(new[:, :1], past_key_values=model.model(ids).past_key_values)
    reference = stock.model(new[:, :1], past_key_values=stock.model(ids).past_key_values)
    torch.testing.assert_close(inner.last_hidden_state, reference.last_hidden_state,
                               atol=1e-4, rtol=FLOAT32_RTOL)
    assert model(ids, use_cache=False).past_key_values is None


@torch.no_grad()
def test_cache_edits_as_transformers(pair):
    """``crop`` (also by a negative count), ``batch_select_indices`` and
    ``batch_repeat_interleave`` leave a past that continues as transformers' does."""
    model, stock = pair
    ids, _ = left_padded([7, 7, 7], 1024, seed=6)
    next_ids = torch.tensor([[11], [12], [13]])
    pasts = [model(ids).past_key_values, stock(ids).past_key_values]
    for past in pasts:
        past.crop(-2)
        past.batch_select_indices(torch.tensor([2, 0]))
        past.batch_repeat_interleave(2)
    ours, theirs = (m(next_ids[[2, 2, 0, 0]], past_key_values=p).logits
                    for m, p in zip((model, stock), pasts))
    assert pasts[0].get_seq_length() == 5 + 1  # extended in place, as transformers' cache
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=FLOAT32_RTOL)


def test_a_hybrid_model_decodes_by_hand_as_transformers(hybrid_checkpoints):
    path = hybrid_checkpoints["next_dense1"]
    stock = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_padded([4, 9], stock.config.vocab_size, seed=7)
    with hf_paged.AutoModelForCausalLM.from_pretrained(path, **SMALL) as model:
        ours, ours_logits, _ = decode_by_hand(model, ids, mask, steps=4)
    theirs, their_logits, _ = decode_by_hand(stock, ids, mask, steps=4)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours_logits, their_logits, atol=1e-4, rtol=FLOAT32_RTOL)


@pytest.mark.parametrize("call, message", [
    (lambda m, p: m(torch.tensor([[5]]), past_key_values=transformers.DynamicCache()),
     "^past_key_values: a DynamicCache is not served"),
    (lambda m, p: m(torch.tensor([[5]]), past_key_values=p, attention_mask=torch.ones(1, 1)),
     r"^attention_mask: with past_key_values it covers the past and the new tokens, shape "
     r"\(1, 4\)"),
    (lambda m, p: m(torch.tensor([[5], [6]]), past_key_values=p), "^input_ids: past_key_values "
     "holds 1 rows"),
    (lambda m, p: m(torch.tensor([[5]]), past_key_values=p, cache=p),
     "^cache and past_key_values: pass the past once"),
    (lambda m, p: p.update(None, None, 0), "holds the tokens so far"),
])
def test_a_past_the_model_cannot_continue_is_refused_by_name(pair, call, message):
    model, _ = pair
    past = model(torch.tensor([[5, 6, 7]])).past_key_values
    with pytest.raises((ValueError, NotImplementedError), match=message):
        call(model, past)
