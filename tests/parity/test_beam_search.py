"""Beam search vs stock transformers, float32 on CPU: same sequences and beam indices, scores
within 1e-4, over num_beams / length_penalty / early_stopping / num_return_sequences, mixed
prompt lengths, EOS mid-way and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_paged
from tests.conftest import FLOAT32_RTOL, TINY_CONFIGS, left_padded

LENGTHS = [3, 8, 13]


def assert_same_beams(out, ref):
    """Scores agree to 1e-4, or to 1e-6 relative where a length penalty scales them up."""
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.beam_indices, ref.beam_indices)
    if ref.sequences_scores is not None:
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-4,
                                   rtol=1e-6)
    for name in ("scores", "logits"):
        ours, theirs = getattr(out, name), getattr(ref, name)
        assert (ours is None) == (theirs is None)
        if theirs is not None:
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=FLOAT32_RTOL)


def engine_for(checkpoints, name="gqa_tied", **options):
    return hf_paged.from_pretrained(checkpoints[name], block_size=8, **options)


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {name: engine_for(checkpoints, name) for name in ("gqa_tied", "mha_untied")}


def eos_ids_of(model, ids, mask, positions):
    """Tokens that beam search picks at ``positions`` (row, step) when no EOS stops it."""
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=2,
                          do_sample=False, eos_token_id=None)
    return [int(free[r, ids.shape[1] + t]) for r, t in positions]


@pytest.mark.parametrize(
    "num_beams, length_penalty, early_stopping, num_return_sequences",
    [(2, 1.0, False, 1), (3, 0.0, True, 3), (4, 2.0, "never", 2), (4, -1.0, False, 4),
     (5, 1.0, "never", 1), (3, 1.5, True, 2)],
)
def test_beam_search_matches_transformers(checkpoints, hf_models, engines, num_beams,
                                          length_penalty, early_stopping, num_return_sequences):
    model = hf_models["gqa_tied"]
    ids, mask = left_padded(LENGTHS, TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=6)
    # Two EOS ids that beams meet mid-way, so hypotheses finish at different lengths.
    eos = eos_ids_of(model, ids, mask, [(0, 2), (1, 2)])
    kwargs = dict(max_new_tokens=12, num_beams=num_beams, length_penalty=length_penalty,
                  early_stopping=early_stopping, num_return_sequences=num_return_sequences,
                  eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    assert torch.isin(ref.sequences[:, ids.shape[1] : -1], torch.tensor(eos)).any()
    out = engines["gqa_tied"].generate(ids, attention_mask=mask, **kwargs)
    assert_same_beams(out, ref)


def test_plain_tensor_logits_and_default_fill(hf_models, engines):
    model = hf_models["mha_untied"]
    ids, mask = left_padded([6, 17], TINY_CONFIGS["mha_untied"]["vocab_size"], seed=7)
    eos = eos_ids_of(model, ids, mask, [(0, 2)])
    kwargs = dict(max_new_tokens=9, num_beams=3, eos_token_id=eos, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    out = engines["mha_untied"].generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(out, ref)
    kwargs.update(return_dict_in_generate=True, output_logits=True, num_return_sequences=2)
    assert_same_beams(engines["mha_untied"].generate(ids, attention_mask=mask, **kwargs),
                      model.generate(ids, attention_mask=mask, **kwargs))


def test_beams_share_blocks_with_other_requests_and_free_everything(hf_models, engines):
    """Beams run in the same batches as a plain greedy request; afterwards no block is held."""
    engine = engines["gqa_tied"]
    ids, mask = left_padded([11], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=8)
    greedy = engine.add_request([5, 6, 7, 8, 9], hf_paged.SamplingParams(max_new_tokens=30))
    kwargs = dict(max_new_tokens=10, num_beams=4, do_sample=False)
    shared = []
    step = engine.step
    engine.step = lambda: shared.append(engine.stats()["num_shared_blocks"]) or step()
    try:
        out = engine.generate(ids, attention_mask=mask, **kwargs)
    finally:
        del engine.step
    assert torch.equal(out, hf_models["gqa_tied"].generate(ids, attention_mask=mask, **kwargs))
    assert max(shared) > 0 and not greedy.is_finished  # it ran beside the beams
    engine.run([greedy])
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_shared_blocks"] == 0


def test_preempted_beams_give_the_same_result(checkpoints, hf_models):
    ids, mask = left_padded([20, 25, 30], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=9)
    kwargs = dict(max_new_tokens=16, num_beams=4, num_return_sequences=2, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    ref = hf_models["gqa_tied"].generate(ids, attention_mask=mask, **kwargs)
    # 16 blocks of 8 tokens: a beam needs up to 6, so the three groups cannot run together.
    engine = engine_for(checkpoints, num_kv_blocks=16)
    assert_same_beams(engine.generate(ids, attention_mask=mask, **kwargs), ref)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == 16 and stats["num_shared_blocks"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(num_beams=300), "max_num_seqs"),
    (dict(num_beams=2, streamer=object()), "streamer"),
])
def test_bad_beam_arguments_are_refused(engines, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engines["gqa_tied"].generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kwargs)


class StopAfter(StoppingCriteria):
    """A user criterion: stop a beam whose last token is ``token``."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("kwargs", [
    dict(repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=4),
    dict(bad_words_ids=[[7], [9, 10]], length_penalty=0.5, num_return_sequences=2,
         return_dict_in_generate=True, output_scores=True, output_logits=True),
    dict(prefix_allowed_tokens_fn=lambda batch_id, ids: list(range(3 + batch_id, 400, 2))),
])
def test_processors_run_on_log_probs_as_transformers_runs_them(hf_models, engines, kwargs):
    model = hf_models["gqa_tied"]
    ids, mask = left_padded([4, 9], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=10)
    kwargs = dict(kwargs, max_new_tokens=10, num_beams=3, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    out = engines["gqa_tied"].generate(ids, attention_mask=mask, **kwargs)
    if isinstance(ref, torch.Tensor):
        assert torch.equal(out, ref)
    else:
        assert_same_beams(out, ref)


def test_user_stopping_criteria_stop_beams(hf_models, engines):
    model = hf_models["gqa_tied"]
    ids, mask = left_padded([6, 11], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=11)
    kwargs = dict(max_new_tokens=10, num_beams=2, do_sample=False, eos_token_id=None)
    free = model.generate(ids, attention_mask=mask, **kwargs)
    criteria = StoppingCriteriaList([StopAfter(int(free[0, ids.shape[1] + 3]))])
    ref = model.generate(ids, attention_mask=mask, stopping_criteria=criteria, **kwargs)
    out = engines["gqa_tied"].generate(ids, attention_mask=mask, stopping_criteria=criteria,
                                       **kwargs)
    assert torch.equal(out, ref) and not torch.equal(ref, free)
