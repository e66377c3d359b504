"""generate() prints nothing, as transformers' does: no progress bar unless asked for."""

from __future__ import annotations

import pytest
import torch

import hf_paged

IDS = torch.arange(5, 13).repeat(4, 1)
MASK = torch.ones_like(IDS)


@pytest.fixture(scope="module")
def engine(checkpoints):
    return hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8, max_model_len=64)


def test_generate_prints_nothing(engine, capfd):
    """No length makes a bar appear by itself (there was one from 4,096 new tokens a call):
    the engine option is off unless set, and a few tokens show what any length does."""
    assert engine.config.progress_bar is False
    capfd.readouterr()
    engine.generate(IDS, attention_mask=MASK, max_new_tokens=8)
    engine.generate_tokens(IDS.tolist(), hf_paged.SamplingParams(max_new_tokens=8))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_progress_bar_when_asked_for(engine, checkpoints, capfd):
    capfd.readouterr()
    engine.generate(IDS[:2], attention_mask=MASK[:2], max_new_tokens=2, progress_bar=True)
    assert "hf_paged" in capfd.readouterr().err
    with hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8, max_model_len=64,
                                  progress_bar=True) as loud:
        capfd.readouterr()
        loud.generate(IDS[:2], attention_mask=MASK[:2], max_new_tokens=2)
        assert "hf_paged" in capfd.readouterr().err
