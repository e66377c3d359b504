"""The engine serving the hybrid families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against stock
transformers' ``generate`` on the same tiny checkpoints, float32 on CPU, exact tokens:
left-padded prompts of mixed lengths, chunked prefill with preemption, prefix-cache hits that
resume from state snapshots, beam search, and the graphs' padded inputs run eagerly."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from tests.conftest import HYBRID_CONFIGS, SMALL, left_padded
from tests.parity.test_graph_inputs import with_eager_decode_graphs, with_eager_prefill_graphs

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def stock(hybrid_checkpoints):
    """name -> transformers' model of each hybrid checkpoint."""
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval() for name, path in hybrid_checkpoints.items()}


def both(stock_model, path: str, ids: torch.Tensor, mask: torch.Tensor, options: dict,
         **generate) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """transformers' and the engine's output for one generate call; the engine's stats."""
    generate = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **generate)
    with torch.no_grad():
        expected = stock_model.generate(ids, attention_mask=mask, **generate)
    with hf_paged.from_pretrained(path, device="cpu", dtype=torch.float32,
                                  **{**SMALL, **options}) as engine:
        got = engine.generate(ids, attention_mask=mask, **generate)
        stats = engine.stats()
    return got, expected, stats


@pytest.mark.parametrize("name", HYBRID_CONFIGS)
def test_generate_matches_transformers(stock, hybrid_checkpoints, name):
    ids, mask = left_padded([5, 9, 3, 1, 17], 1000, seed=4)
    got, expected, stats = both(stock[name], hybrid_checkpoints[name], ids, mask, {})
    assert torch.equal(got, expected)
    assert stats["num_used_state_slots"] == 0


@pytest.mark.parametrize("name", ["next_dense1", "qwen3.5_moe"])
def test_chunked_prefill_and_preemption(stock, hybrid_checkpoints, name):
    """Six blocks of eight tokens for five sequences, sixteen tokens a step: prompts are
    prefilled in chunks and sequences preempted, recomputed from a zero state."""
    ids, mask = left_padded([5, 9, 3, 23, 17], 1000, seed=5)
    got, expected, stats = both(stock[name], hybrid_checkpoints[name], ids, mask,
                                dict(num_kv_blocks=6, max_num_batched_tokens=16))
    assert torch.equal(got, expected)
    assert stats["num_preemptions"] > 0


def test_prefix_hits_resume_from_state_snapshots(stock, hybrid_checkpoints):
    name = "qwen3.5_tied"
    stem = torch.randint(3, 1000, (29,), generator=torch.Generator().manual_seed(6)).tolist()
    prompts = [stem + [40, 41], stem + [50]]
    with hf_paged.from_pretrained(hybrid_checkpoints[name], device="cpu", dtype=torch.float32,
                                  num_state_snapshots=4, **SMALL) as engine:
        first = engine.generate_tokens(prompts[:1], hf_paged.SamplingParams(max_new_tokens=6))
        again = engine.generate_tokens(prompts, hf_paged.SamplingParams(max_new_tokens=6))
        assert engine.stats()["prefix_cache_hits"] > 0
    assert again[0] == first[0]
    for prompt, tokens in zip(prompts, again):
        with torch.no_grad():
            expected = stock[name].generate(torch.tensor([prompt]), max_new_tokens=6,
                                            do_sample=False, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("name,shared_blocks,together", [
    ("qwen3.5_tied", 1, False), ("next_tied_attention_first", 3, False),
    ("qwen3.5_tied", 2, True)])
def test_requests_sharing_a_system_prompt_resume_at_its_end(stock, hybrid_checkpoints, name,
                                                             shared_blocks, together):
    """A, B, C and D share A's first blocks and differ after them, added one call after
    another (C and D in one) or ``together`` in one call: B stops at the shared prefix's end
    and snapshots it, C and D resume there (admitted a step later when together)."""
    block_size = SMALL["block_size"]
    tokens = torch.randint(3, 1000, (80,), generator=torch.Generator().manual_seed(9)).tolist()
    system = tokens[:shared_blocks * block_size]
    # B's own last full block ends past the system prompt: only the new stop snapshots there
    tails = [tokens[40:51], tokens[51:64], tokens[64:71], tokens[71:74]]
    prompts = [system + tail for tail in tails]
    params = hf_paged.SamplingParams(max_new_tokens=6)
    with hf_paged.from_pretrained(hybrid_checkpoints[name], device="cpu", dtype=torch.float32,
                                  num_state_snapshots=4, **SMALL) as engine:
        if together:
            got = engine.generate_tokens(prompts, params)
        else:
            got = engine.generate_tokens(prompts[:1], params) + engine.generate_tokens(
                prompts[1:2], params)
            assert engine.stats()["prefix_cache_hits"] == 0
            got += engine.generate_tokens(prompts[2:], params)
        assert engine.stats()["prefix_cache_hits"] == 2 * len(system)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            expected = stock[name].generate(torch.tensor([prompt]), max_new_tokens=6,
                                            do_sample=False, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()


def test_shared_system_prompt_through_chunks_preemption_and_snapshot_eviction(
        stock, hybrid_checkpoints):
    """Five prompts on a two-block system prompt, eight blocks, sixteen tokens a step, two
    snapshots: chunked prefills stop where prompts part, sequences are preempted and
    recomputed, snapshots are evicted, and hits resume from the survivors."""
    name = "next_dense1"
    tokens = torch.randint(3, 1000, (80,), generator=torch.Generator().manual_seed(10)).tolist()
    prompts = [tokens[:16] + tokens[20 + 9 * i:20 + 9 * i + 3 + 2 * i] for i in range(5)]
    with hf_paged.from_pretrained(hybrid_checkpoints[name], device="cpu", dtype=torch.float32,
                                  **{**SMALL, "num_kv_blocks": 8, "max_num_batched_tokens": 16},
                                  num_state_snapshots=2) as engine:
        got = engine.generate_tokens(prompts, hf_paged.SamplingParams(max_new_tokens=8))
        stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            expected = stock[name].generate(torch.tensor([prompt]), max_new_tokens=8,
                                            do_sample=False, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()


def test_beam_search(stock, hybrid_checkpoints):
    """Beams fork their parent's state slot (copies on the device before the step)."""
    name = "next_tied_attention_first"
    ids, mask = left_padded([6, 11], 1000, seed=7)
    got, expected, _ = both(stock[name], hybrid_checkpoints[name], ids, mask, {},
                            num_beams=3, num_return_sequences=2)
    assert torch.equal(got, expected)


def test_graph_inputs_run_eagerly(stock, hybrid_checkpoints):
    """Decode graphs padded to four rows and prefill graphs to 32 or 64 tokens, as eager
    stand-ins: padding rows on slot -1 through the real kernels."""
    name = "qwen3.5_one_value_head_a_key"
    ids, mask = left_padded([5, 9, 3], 1000, seed=8)
    with torch.no_grad():
        expected = stock[name].generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                        do_sample=False, pad_token_id=0)
    with hf_paged.from_pretrained(hybrid_checkpoints[name], device="cpu", dtype=torch.float32,
                                  **{**SMALL, "max_num_batched_tokens": 16}) as engine:
        decode = with_eager_decode_graphs(engine, max_bs=4)
        prefill = with_eager_prefill_graphs(engine, max_tokens=64, max_seqs=8)
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
        assert sum(r.replays for r in decode) > 0 and sum(r.replays for r in prefill) > 0
    assert torch.equal(got, expected)


def test_the_drop_in_class_generates_and_saves_transformers_layout(stock, hybrid_checkpoints,
                                                                    tmp_path):
    name = "qwen3.5_moe"
    model = hf_paged.AutoModelForCausalLM.from_pretrained(
        hybrid_checkpoints[name], dtype=torch.float32, device_map="cpu", **SMALL)
    assert isinstance(model, transformers.Qwen3_5MoeForCausalLM)
    ids, mask = left_padded([4, 7], 1000, seed=9)
    with torch.no_grad():
        expected = stock[name].generate(ids, attention_mask=mask, max_new_tokens=4,
                                        do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                      do_sample=False, pad_token_id=0), expected)
    model.save_pretrained(tmp_path)
    model.close()
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want = stock[name].state_dict()
    assert all(torch.equal(tensor, want[key]) for key, tensor in saved.state_dict().items())
