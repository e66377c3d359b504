"""The model call (``model(input_ids, attention_mask=...)``) of the hybrid families (Qwen3-Next,
Qwen3.5, Qwen3.5-MoE) against stock transformers' forward, float32 on CPU: rows padded on the
left and on the right, holes in the mask, a row the mask keeps nothing of, rows longer than
the delta rule's 64-token chunk, a width of one; ``logits_to_keep``, ``labels``, the inner
model's hidden state, the engine's own state pools left alone; generate over a fully masked
row (its first token comes from the model call). Every position is compared, the padding's
too: transformers runs each row whole through the linear-attention layers with the padding's
input zeroed, and so does hf_paged.

Tolerances are those of ``test_hybrid_families``: 5e-5 of the logits' size in float32."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from tests.conftest import HYBRID_CONFIGS, SMALL, left_padded
from tests.parity.test_hybrid_families import assert_logits_close

WIDTH = 70  # longer than one 64-token chunk of the delta rule
BOS = 1


def padded_batch(width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows: none masked, left-padded, right-padded, holes, none kept, both ends padded."""
    ids = torch.randint(3, 1000, (6, width), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :width - 9] = 0
    mask[2, 12:] = 0
    mask[3, 2], mask[3, 20:23], mask[3, width - 1] = 0, 0, 0
    mask[4] = 0
    mask[5, :3], mask[5, width - 5:] = 0, 0
    return ids, mask


@pytest.fixture(scope="module")
def pairs(hybrid_checkpoints):
    """name -> (hf_paged's drop-in model, transformers' model), built once each."""
    built = {}

    def pair(name: str):
        if name not in built:
            path = hybrid_checkpoints[name]
            built[name] = (
                hf_paged.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              **SMALL),
                transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32).eval())
        return built[name]

    yield pair
    for model, _ in built.values():
        model.close()


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", HYBRID_CONFIGS)
def test_forward_logits_equal_transformers(pairs, name, masked):
    model, stock = pairs(name)
    ids, mask = padded_batch()
    mask = mask if masked else None
    out = model(ids, attention_mask=mask)
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask)
    assert type(out) is type(ref)
    assert_logits_close(out.logits, ref.logits)


@pytest.mark.parametrize("name", ["next_tied_attention_first", "qwen3.5_tied"])
def test_short_rows_and_a_width_of_one(pairs, name):
    """Rows shorter than the convolution's window; a width of one, where transformers zeroes
    no padding in the linear-attention layers (a masked token there runs as any other)."""
    model, stock = pairs(name)
    ids, mask = padded_batch(3)
    for width in (3, 2, 1):
        with torch.no_grad():
            ref = stock(ids[:, :width], attention_mask=mask[:, :width]).logits
        assert_logits_close(model(ids[:, :width], attention_mask=mask[:, :width]).logits, ref)


@pytest.mark.parametrize("name", ["next_dense1", "qwen3.5_moe"])
def test_forward_options_equal_transformers(pairs, name):
    model, stock = pairs(name)
    ids, mask = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask, labels=labels, use_cache=False)
        positions = torch.arange(3, 3 + ids.shape[1])[None]
        ref_positions = stock(ids, position_ids=positions).logits
        ref_hidden = stock.model(ids, attention_mask=mask).last_hidden_state
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, atol=5e-5 * ref.loss.item(), rtol=0)
    assert_logits_close(model(ids, position_ids=positions).logits, ref_positions)
    assert_logits_close(model(ids, attention_mask=mask, logits_to_keep=1).logits,
                        ref.logits[:, -1:])
    keep = torch.tensor([0, 40, WIDTH - 1])
    assert_logits_close(model(ids, attention_mask=mask, logits_to_keep=keep).logits,
                        ref.logits[:, keep])
    loss, logits, _ = model(ids, attention_mask=mask, labels=labels, return_dict=False)
    torch.testing.assert_close(loss, ref.loss, atol=5e-5 * ref.loss.item(), rtol=0)
    assert_logits_close(model.model(ids, attention_mask=mask).last_hidden_state, ref_hidden)


def test_forward_leaves_the_engine_state_alone(pairs):
    """The model call runs on scratch pools: the engine's state pools (and KV cache) keep
    their tensors and contents, and generate gives the same tokens after it."""
    model, _ = pairs("qwen3.5_tied")
    prompt = padded_batch(9)[0][:2]
    expected = model.generate(prompt, max_new_tokens=5, do_sample=False)
    modules = model.engine.model.state_modules
    pools = [(m.conv_state, m.recurrent_state) for m in modules]
    before = [tuple(p.clone() for p in pair) for pair in pools]
    assert any(recurrent.abs().sum() > 0 for _, recurrent in pools)  # generate's leftovers
    model(*padded_batch())
    for module, (conv, recurrent), (conv_before, recurrent_before) in zip(
            modules, pools, before, strict=True):
        assert module.conv_state is conv and module.recurrent_state is recurrent
        assert torch.equal(conv, conv_before) and torch.equal(recurrent, recurrent_before)
    assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), expected)


@pytest.mark.parametrize("name", ["next_dense1", "qwen3.5_tied"])
def test_generate_with_a_masked_row(pairs, name):
    """generate draws a fully masked row's first token from the model call (``masked_rows``),
    then the engine continues from a zero state, as transformers' zeroed padding leaves it. A
    one-token prompt is not zeroed by transformers, so masking it is refused by name."""
    model, stock = pairs(name)
    ids, mask = left_padded([6, 9], 1000, pad=BOS, seed=2)
    ids = torch.cat([ids, torch.full((1, ids.shape[1]), BOS)])
    mask = torch.cat([mask, torch.zeros(1, ids.shape[1], dtype=mask.dtype)])
    options = dict(pad_token_id=BOS, bos_token_id=BOS, max_new_tokens=8, do_sample=False)
    expected = stock.generate(ids, attention_mask=mask, **options)
    assert torch.equal(model.generate(ids, attention_mask=mask, **options), expected)
    with pytest.raises(ValueError, match="^attention_mask: row 0 keeps no token of a one-token"):
        model.generate(torch.tensor([[BOS]]), **options)
