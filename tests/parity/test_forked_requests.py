"""Requests added with one prompt: prefilled once, forked over shared blocks, then each its own."""

from __future__ import annotations

import torch

import hf_paged
from hf_paged.sampling_params import SamplingParams
from tests.conftest import TINY_CONFIGS, left_padded


def test_forked_requests_prefill_once_and_match_transformers(checkpoints, hf_models):
    ids, _ = left_padded([13], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=4)
    ref = hf_models["gqa_tied"].generate(ids, max_new_tokens=10, do_sample=False)
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8)
    scheduled, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
    seqs = engine.add_forked_requests(ids[0].tolist(), SamplingParams(max_new_tokens=10), 3)
    engine.step()
    assert engine.stats()["num_shared_blocks"] == 2  # the full block and the partial one
    engine.run(seqs)
    for seq in seqs:
        assert seq.output_token_ids == ref[0, 13:].tolist()
    assert sum(sum(b.num_tokens) for b in scheduled) == 13 + 3 * 9  # one prefill, then decodes
    assert sum(len(b.block_copies) for b in scheduled) == 2  # the partial block, copied twice
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


def test_forked_sampled_requests_diverge_and_finish(checkpoints):
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8)
    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=6, temperature=50.0)
    seqs = engine.run(engine.add_forked_requests([5, 6, 7], params, 4))
    assert all(s.num_new_tokens == 6 for s in seqs)
    assert len({s.output_token_ids[0] for s in seqs}) > 1  # each drew its own first token
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
