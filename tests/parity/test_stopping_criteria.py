"""Stopping criteria see the call's batch as transformers passes it: once a step, the whole
``input_ids`` [B, L] in row order and ``scores`` as its sampling loop passes them (None, or
with ``output_scores`` the tuple of the steps' scores so far), with per-row state that lines
up (float32, CPU, against stock transformers on the same checkpoint)."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_paged
from tests.conftest import FLOAT32_RTOL, TINY_CONFIGS, left_padded

VOCAB = TINY_CONFIGS["gqa_tied"]["vocab_size"]


class Recording(StoppingCriteria):
    """Keeps every call's arguments; stops row ``r`` once its newest token is ``stop[r]``,
    remembering it per row as lm-eval's multi-token stop criterion does."""

    def __init__(self, stop: dict[int, int]):
        self.stop = stop
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.tracker: list[bool] | None = None

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.clone(), scores if scores is None else
                           torch.stack([s.clone() for s in scores])))
        if self.tracker is None:
            self.tracker = [False] * input_ids.shape[0]
        for row, token in self.stop.items():
            if int(input_ids[row, -1]) == token:
                self.tracker[row] = True
        return torch.tensor(self.tracker, device=input_ids.device)


@pytest.fixture(scope="module")
def model(checkpoints, hf_models):
    return hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8), hf_models["gqa_tied"]


def _stops(stock, ids, mask, rows: dict[int, int], **kwargs) -> dict[int, int]:
    """For each row, the token it generates at step ``rows[row]`` without criteria."""
    free = stock.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    return {r: int(free[r, ids.shape[1] + step]) for r, step in rows.items()}


def _compare(engine, stock, ids, mask, stop, **kwargs):
    mine, theirs = Recording(stop), Recording(stop)
    kwargs = dict(dict(attention_mask=mask, do_sample=False, pad_token_id=0), **kwargs)
    expected = stock.generate(ids, stopping_criteria=StoppingCriteriaList([theirs]), **kwargs)
    out = engine.generate(ids, stopping_criteria=StoppingCriteriaList([mine]), **kwargs)
    assert torch.equal(out, expected)
    assert len(mine.calls) == len(theirs.calls)
    for (my_ids, my_scores), (ids_ref, scores_ref) in zip(mine.calls, theirs.calls):
        assert torch.equal(my_ids, ids_ref)
        assert my_scores is None and scores_ref is None
    return mine, theirs


@pytest.mark.parametrize("engine_options", [
    dict(),
    dict(max_num_batched_tokens=16),  # chunked prefill staggers the rows
    dict(num_kv_blocks=12, max_num_batched_tokens=16),  # and blocks run out: preemption
])
def test_criteria_see_the_whole_batch(checkpoints, hf_models, engine_options):
    stock = hf_models["gqa_tied"]
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8, **engine_options)
    ids, mask = left_padded([5, 17, 9, 12], VOCAB, seed=3)
    stop = _stops(stock, ids, mask, {0: 3, 2: 7}, max_new_tokens=12)
    _compare(engine, stock, ids, mask, stop, max_new_tokens=12)
    engine.close()


def test_criteria_with_eos_and_forked_rows(model):
    engine, stock = model
    ids, mask = left_padded([6, 11], VOCAB, seed=5)
    free = stock.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    eos = int(free[1, ids.shape[1] + 2])  # the second row ends early at EOS
    stop = {0: int(free[0, ids.shape[1] + 5])}
    _compare(engine, stock, ids, mask, stop, max_new_tokens=10, eos_token_id=eos)
    # num_return_sequences: the rows a prompt forks into, in transformers' order
    _compare(engine, stock, ids, mask, {1: stop[0], 2: stop[0]}, max_new_tokens=8,
             do_sample=True, top_k=1, num_return_sequences=2)


def test_criteria_in_lockstep_with_scores(model):
    engine, stock = model
    ids, mask = left_padded([4, 9, 7], VOCAB, seed=6)
    stop = _stops(stock, ids, mask, {1: 2}, max_new_tokens=9)
    kwargs = dict(max_new_tokens=9, return_dict_in_generate=True, output_scores=True)
    mine, theirs = Recording(stop), Recording(stop)
    args = dict(attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)
    expected = stock.generate(ids, stopping_criteria=StoppingCriteriaList([theirs]), **args)
    out = engine.generate(ids, stopping_criteria=StoppingCriteriaList([mine]), **args)
    assert torch.equal(out.sequences, expected.sequences)
    for my_step, ref_step in zip(out.scores, expected.scores, strict=True):
        torch.testing.assert_close(my_step, ref_step, atol=1e-4, rtol=FLOAT32_RTOL)
    assert [c[0].tolist() for c in mine.calls] == [c[0].tolist() for c in theirs.calls]
    for (_, my_scores), (_, scores_ref) in zip(mine.calls, theirs.calls):
        torch.testing.assert_close(my_scores, scores_ref, atol=1e-4, rtol=FLOAT32_RTOL)


def test_a_criterion_that_reads_scores(model):
    """A criterion deciding on the latest processed scores (the chosen token's margin)."""
    engine, stock = model

    class Confident(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            top = scores[-1].topk(2, dim=-1).values
            return (top[:, 0] - top[:, 1]) > 9.0

    ids, mask = left_padded([5, 8, 3], VOCAB, seed=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True,
                  stopping_criteria=StoppingCriteriaList([Confident()]))
    for sampling in (dict(do_sample=False), dict(do_sample=True, top_k=1, temperature=0.7)):
        assert torch.equal(engine.generate(ids, **kwargs, **sampling).sequences,
                           stock.generate(ids, **kwargs, **sampling).sequences)
