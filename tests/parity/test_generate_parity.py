"""hf_paged.generate vs stock transformers generate, float32 on CPU: exact tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from tests.conftest import TINY_CONFIGS, left_padded

# Prompt lengths around the block size 8 boundaries, and a long one spanning many blocks.
LENGTHS = [1, 7, 8, 9, 17, 40]


def engine_for(checkpoints, name, **options):
    options.setdefault("block_size", 8)
    return hf_paged.from_pretrained(checkpoints[name], **options)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_mixed_lengths(checkpoints, hf_models, name):
    vocab = TINY_CONFIGS[name]["vocab_size"]
    ids, mask = left_padded(LENGTHS, vocab)
    ref = hf_models[name].generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = engine_for(checkpoints, name).generate(ids, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(out, ref)


def test_eos_mid_way_pads_the_rest(checkpoints, hf_models):
    model = hf_models["gqa_tied"]
    ids, mask = left_padded([5, 12, 30], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=1)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                          eos_token_id=None)
    eos = [int(free[0, ids.shape[1] + 4]), int(free[2, ids.shape[1] + 9])]  # stops two rows
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    out = engine_for(checkpoints, "gqa_tied").generate(
        ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)
    assert (out[0, ids.shape[1] + 5 :] == 0).all()


def test_preemption_with_few_blocks(checkpoints, hf_models):
    ids, mask = left_padded([20, 25, 30, 35], TINY_CONFIGS["mha_untied"]["vocab_size"], seed=2)
    ref = hf_models["mha_untied"].generate(ids, attention_mask=mask, max_new_tokens=30,
                                           do_sample=False)
    # 12 blocks of 8 tokens: one sequence needs up to 9, so the four cannot run together.
    engine = engine_for(checkpoints, "mha_untied", num_kv_blocks=12)
    bm, evictions = engine.block_manager, []
    take = bm._take_free_block
    bm._take_free_block = lambda: evictions.append(not bm.free_uncached) or take()
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=30)
    assert torch.equal(out, ref)
    assert engine.stats()["num_preemptions"] > 0 and any(evictions)
    assert engine.stats()["num_free_blocks"] == 12


@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_and_prefix_cache(checkpoints, hf_models, caching):
    vocab = TINY_CONFIGS["gqa4_untied"]["vocab_size"]
    ids, mask = left_padded([70, 64, 9], vocab, seed=3)
    ref = hf_models["gqa4_untied"].generate(ids, attention_mask=mask, max_new_tokens=12,
                                            do_sample=False)
    # A 16-token budget: the 70-token prompt is prefilled in five chunks beside the decodes.
    engine = engine_for(checkpoints, "gqa4_untied", max_num_batched_tokens=16,
                        enable_prefix_caching=caching)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), ref)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), ref)
    stats = engine.stats()
    assert (stats["prefix_cache_hits"] > 0) == caching


def test_second_call_prefills_only_the_uncached_tail(checkpoints, hf_models, capsys):
    """A repeated 70-token prompt finds its 8 full blocks (64 tokens) cached: the second call
    computes its 6-token tail, then one token a decode step, and matches transformers; its
    progress bar shows the hit rate so far (64 of 140 prompt tokens)."""
    ids, mask = left_padded([70], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=5)
    ref = hf_models["gqa_tied"].generate(ids, attention_mask=mask, max_new_tokens=4,
                                         do_sample=False)
    engine = engine_for(checkpoints, "gqa_tied")
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=4), ref)
    assert engine.stats()["prefix_cache_hits"] == 0
    computed, launch = [], engine.executor.launch
    engine.executor.launch = lambda plan: computed.append(plan.num_tokens) or launch(plan)
    second = engine.generate(ids, attention_mask=mask, max_new_tokens=4, progress_bar=True)
    assert torch.equal(second, ref)
    stats = engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (140, 64)
    assert computed == [[6], [1], [1], [1]]
    assert "cache hit 46%" in capsys.readouterr().err


def test_generation_arguments(checkpoints, hf_models):
    model = hf_models["gqa_tied"]
    engine = engine_for(checkpoints, "gqa_tied")
    ids, mask = left_padded([6, 10], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=4)
    # max_length counts the padded width, as in transformers.
    for kwargs in (
        dict(max_length=ids.shape[1] + 7),
        dict(generation_config=GenerationConfig(max_new_tokens=5, eos_token_id=[7, 9],
                                                pad_token_id=0)),
        dict(max_new_tokens=6, do_sample=True, top_k=1),  # top_k=1 sampling is greedy
    ):
        ref_kwargs = {"do_sample": False, **kwargs}
        ref = model.generate(ids, attention_mask=mask, **ref_kwargs)
        assert torch.equal(engine.generate(ids, attention_mask=mask, **kwargs), ref), kwargs


def test_attention_mask_inferred_from_pad(checkpoints, hf_models):
    ids, _ = left_padded([4, 9], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=5)
    kwargs = dict(max_new_tokens=8, pad_token_id=0, eos_token_id=2)
    ref = hf_models["gqa_tied"].generate(ids, do_sample=False, **kwargs)
    assert torch.equal(engine_for(checkpoints, "gqa_tied").generate(ids, **kwargs), ref)


def test_sampling_is_seeded_and_in_vocab(checkpoints):
    engine = engine_for(checkpoints, "gqa_tied")
    ids, mask = left_padded([5, 11], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=1.5,
                  top_p=0.9, top_k=50)
    torch.manual_seed(0)
    a = engine.generate(ids, **kwargs)
    torch.manual_seed(0)
    b = engine.generate(ids, **kwargs)
    greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(a, b)
    assert not torch.equal(a, greedy)
    assert int(a.max()) < TINY_CONFIGS["gqa_tied"]["vocab_size"]


def test_a_failed_step_drops_only_its_requests_and_the_engine_goes_on(checkpoints, hf_models):
    """A step that raises (here: the device launch) aborts the requests that step and the one
    in flight held; the engine then serves the next call exactly."""
    ids, mask = left_padded([6, 15, 9], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=6)
    engine = engine_for(checkpoints, "gqa_tied")
    seqs = [engine.add_request(p, hf_paged.SamplingParams(max_new_tokens=10))
            for p in ([3, 4, 5], [6, 7, 8, 9])]
    engine.step()  # launched, not collected
    launch = engine.executor.launch
    engine.executor.launch = lambda plan: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.executor.launch = launch
    assert all(s.finish_reason == "abort" for s in seqs) and engine.in_flight is None
    assert not engine.has_unfinished_requests()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
    ref = hf_models["gqa_tied"].generate(ids, attention_mask=mask, max_new_tokens=12,
                                         do_sample=False)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), ref)


def test_step_by_step_tokens_arrive_one_step_later(checkpoints):
    engine = engine_for(checkpoints, "gqa_tied")
    seq = engine.add_request([3, 4, 5, 6], hf_paged.SamplingParams(max_new_tokens=3))
    assert engine.step() == [] and seq.num_pending == 1 and seq.output_token_ids == []
    assert engine.step() == [] and len(seq.output_token_ids) == 1  # second token in flight
    assert engine.step() == [] and len(seq.output_token_ids) == 2  # third (last) in flight
    assert engine.step() == [seq] and len(seq.output_token_ids) == 3
    assert not engine.has_unfinished_requests()
