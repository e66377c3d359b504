"""``save_pretrained`` on an hf_paged model writes transformers' layout: stock transformers
loads the folder and computes the logits of the checkpoint it came from."""

from __future__ import annotations

import torch
import transformers

from tests.conftest import FLOAT32_RTOL, left_padded


def test_save_pretrained_loads_in_stock_transformers(paged_model, stock_model, tmp_path):
    paged_model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded) is transformers.Qwen3ForCausalLM
    assert reloaded.config.to_dict() | {"_name_or_path": None} == (
        stock_model.config.to_dict() | {"_name_or_path": None})
    expected = stock_model.state_dict()
    weights = reloaded.state_dict()
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    ids, mask = left_padded([7, 3, 12], stock_model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits,
                                   stock_model(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=FLOAT32_RTOL)
