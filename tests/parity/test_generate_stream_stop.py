"""Streamers, stop strings, max_time, num_return_sequences and the engine-level iterator,
against stock transformers (float32, CPU)."""

from __future__ import annotations

import threading

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
    TextIteratorStreamer,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged.sampling_params import SamplingParams
from tests.conftest import TINY_CONFIGS, left_padded

VOCAB = TINY_CONFIGS["gqa_tied"]["vocab_size"]
TEXT = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hex "
        "a jovial sphinx of black quartz and judge my vow ") * 20


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE small enough for the tiny model's vocabulary, trained here."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def pair(checkpoints, hf_models):
    return hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8), hf_models["gqa_tied"]


class Recorder(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


@pytest.mark.parametrize("lengths", [[6], [4, 9, 13]])
def test_streamer_sees_transformers_calls(pair, lengths):
    engine, model = pair
    ids, mask = left_padded(lengths, VOCAB, seed=4)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    eos = int(free[0, ids.shape[1] + 3])  # the first row stops early
    mine, theirs = Recorder(), Recorder()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    model.generate(ids, streamer=theirs, **kwargs)
    engine.generate(ids, streamer=mine, **kwargs)
    assert mine.calls == theirs.calls


def test_text_streamers_print_the_same(pair, tokenizer, capsys):
    engine, model = pair
    ids = tokenizer("the lazy dog", return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=12, streamer=TextStreamer(tokenizer))
    theirs = capsys.readouterr().out
    engine.generate(ids, max_new_tokens=12, streamer=TextStreamer(tokenizer))
    assert theirs.strip()
    assert capsys.readouterr().out == theirs
    texts = []
    for generate in (model.generate, engine.generate):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        thread = threading.Thread(target=generate, args=(ids,),
                                  kwargs=dict(max_new_tokens=12, streamer=streamer))
        thread.start()
        texts.append(list(streamer))
        thread.join()
    assert texts[0] == texts[1]


def test_stop_strings(tiny_checkpoint, stock_model):
    """A stop string of one row's text (the checkpoint's own tokenizer: every id it can draw
    decodes to text) ends that row there; the others run on."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    engine = hf_paged.from_pretrained(tiny_checkpoint, block_size=8)
    batch = tokenizer(["the lazy dog", "seven wizards quietly", "a jovial"], return_tensors="pt",
                      padding=True, padding_side="left")
    free = stock_model.generate(**batch, max_new_tokens=16, do_sample=False)
    width = batch.input_ids.shape[1]
    # Two tokens of some row, after its first two, whose text is new there.
    row, at = next((r, j) for r in range(3) for j in range(2, 14)
                   if (t := tokenizer.decode(free[r, width + j: width + j + 2])).strip()
                   and t not in tokenizer.decode(free[r, width: width + j + 1]))
    stop = tokenizer.decode(free[row, width + at: width + at + 2])
    kwargs = dict(max_new_tokens=16, stop_strings=[stop, "zzzz"], tokenizer=tokenizer)
    ref = stock_model.generate(**batch, **kwargs)
    out = engine.generate(**batch, **kwargs)
    assert torch.equal(out, ref)
    assert (out[row, width + at + 2:] == tokenizer.pad_token_id).all()  # the row stopped there
    assert out.shape[1] > width + at + 2  # another row ran on


def test_max_time_stops_all_rows(pair):
    engine, _ = pair
    ids, mask = left_padded([5, 8], VOCAB)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=200, max_time=0.0)
    assert out.shape[1] - ids.shape[1] <= 2  # the token in flight may still land


def test_num_return_sequences_sampled(pair):
    engine, model = pair
    ids, mask = left_padded([5, 11], VOCAB, seed=5)
    torch.manual_seed(0)
    out = engine.generate(ids, attention_mask=mask, do_sample=True, num_return_sequences=4,
                          max_new_tokens=8, top_k=0, temperature=2.0)
    ref = model.generate(ids, attention_mask=mask, do_sample=True, num_return_sequences=4,
                         max_new_tokens=8, top_k=0, temperature=2.0)
    assert out.shape == ref.shape
    assert torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(4, dim=0))
    assert len({tuple(r) for r in out[:4, ids.shape[1]:].tolist()}) > 1  # copies diverge
    with pytest.raises(ValueError, match="num_return_sequences"):
        engine.generate(ids, attention_mask=mask, num_return_sequences=2, max_new_tokens=4)


def test_staggered_rows_keep_transformers_processing(checkpoints, hf_models):
    """A token budget smaller than the batch's prompts prefills rows in different steps; the
    call's processors still see transformers' input_ids for each row."""
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8,
                                      max_num_batched_tokens=16)
    ids, mask = left_padded([30, 12, 25], VOCAB, seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, no_repeat_ngram_size=2,
                  sequence_bias={(7,): 2.0}, repetition_penalty=1.4, min_new_tokens=3)
    ref = hf_models["gqa_tied"].generate(ids, **kwargs)
    assert torch.equal(engine.generate(ids, **kwargs), ref)


def test_engine_penalty_matches_transformers_and_stream(pair):
    engine, model = pair
    prompt = [5, 9, 33, 7, 9, 120]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, repetition_penalty=1.3,
                         do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
    params = SamplingParams(max_new_tokens=12, repetition_penalty=1.3)
    assert engine.generate_tokens([prompt], params) == [ref]
    pieces = list(engine.stream([prompt, prompt[:3]], params))
    assert [t for i, toks in pieces if i == 0 for t in toks] == ref
    assert {i for i, _ in pieces} == {0, 1}
    stream = engine.stream([prompt], SamplingParams(max_new_tokens=50))
    next(stream)
    stream.close()  # closing early aborts the request
    assert engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0


def test_num_return_sequences_prefill_each_prompt_once(pair):
    engine, _ = pair
    ids, mask = left_padded([21, 30], VOCAB, seed=7)
    before = engine.stats()
    forward = engine.model.forward
    computed = []

    def counting(tokens, *args, **kwargs):
        computed.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    engine.model.forward = counting
    try:
        out = engine.generate(ids, attention_mask=mask, do_sample=True, num_return_sequences=5,
                              max_new_tokens=4)
    finally:
        engine.model.forward = forward
    assert out.shape == (10, ids.shape[1] + 4)
    # 21 + 30 prompt tokens once, then at most 5 x 2 rows a decode step (cache hits aside).
    assert 21 + 30 <= sum(computed) <= 21 + 30 + 3 * 10
    assert engine.stats()["num_free_blocks"] == before["num_free_blocks"]
