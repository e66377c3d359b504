"""transformers' ``Trainer.evaluate()`` and ``predict()`` over an hf_paged model give stock's
loss and logits. The examples differ in length, so batches are padded (labels -100 there), and
some mask their prompt out of the labels while others score every token: a loss normalised
differently (per row, over padding, or over a token count that forgets the causal shift) shows.
A hybrid checkpoint (Qwen3.5) predicts as stock too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import hf_paged
from hf_paged.random_checkpoint import make_checkpoint
from tests.conftest import FLOAT32_RTOL, SMALL

TEXTS = [
    ("Once upon a time", " there was a cat who lived by the river."),
    ("What is two plus two?", " Four."),
    ("The river starts", " in the mountains and runs through the valley to the sea."),
    ("Hello", " there, how are you today?"),
    ("Numbers:", " 0 1 2 3 4 5"),  # an odd count: the last batch holds one example
]


def examples(tokenizer) -> list[dict]:
    """Prompt and answer token ids. Odd examples score the answer only (-100 on the prompt);
    even ones, each the longest of its batch, score every token: their first label is real,
    which Trainer leaves out of its token count only if it knows the model's loss shifts
    labels (a causal LM's ``loss_type``)."""
    out = []
    for i, (prompt, answer) in enumerate(TEXTS):
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = prompt_ids + tokenizer(answer)["input_ids"]
        masked = len(prompt_ids) if i % 2 else 0
        out.append(dict(input_ids=ids, attention_mask=[1] * len(ids),
                        labels=[-100] * masked + ids[masked:]))
    return out


def trainer(model, tokenizer, output_dir) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    # Pads input_ids on the tokenizer's side (the left) and labels with -100.
    collator = transformers.DataCollatorForSeq2Seq(tokenizer, padding=True,
                                                   label_pad_token_id=-100)
    return transformers.Trainer(model=model, args=args, eval_dataset=examples(tokenizer),
                                data_collator=collator)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_evaluate_and_predict(paged_model, stock_model, tokenizer, tmp_path):
    stock = trainer(stock_model, tokenizer, tmp_path / "stock")
    paged = trainer(paged_model, tokenizer, tmp_path / "paged")
    expected, got = stock.evaluate(), paged.evaluate()
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-4)

    expected, got = stock.predict(examples(tokenizer)), paged.predict(examples(tokenizer))
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-4)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    np.testing.assert_allclose(got.predictions, expected.predictions, atol=1e-4, rtol=FLOAT32_RTOL)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_hybrid_model_evaluates_as_stock(tmp_path):
    """Qwen3.5 (linear-attention layers beside attention) over the same left-padded batches;
    logits within 5e-5 of their size (``tests/parity/test_hybrid_forward.py``)."""
    path = make_checkpoint("tiny-qwen3.5", str(tmp_path / "checkpoint"), dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    stock_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with hf_paged.AutoModelForCausalLM.from_pretrained(path, **SMALL) as paged_model:
        stock = trainer(stock_model.eval(), tokenizer, tmp_path / "stock")
        paged = trainer(paged_model, tokenizer, tmp_path / "paged")
        expected, got = stock.predict(examples(tokenizer)), paged.predict(examples(tokenizer))
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-4)
    scored = expected.label_ids != -100  # predictions beyond a row's end are -100 padding
    want, have = expected.predictions[scored], got.predictions[scored]
    np.testing.assert_allclose(have, want, atol=5e-5 * np.abs(want).max(), rtol=0)
