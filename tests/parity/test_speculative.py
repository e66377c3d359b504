"""Speculative decoding against plain decoding and transformers, float32 on CPU: prompt
lookup in generate() and in the engine, drafts that are right, half right and wrong, EOS and
the length inside a draft, preemption and prefix hits while speculating, stopping criteria,
aborts, and the sampled distribution."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria

import hf_paged
from hf_paged.engine.engine import EngineCore
from hf_paged.sampling_params import Proposer, SamplingParams, Speculation
from tests.conftest import TINY_CONFIGS, left_padded

SMALL = dict(block_size=8, max_model_len=160)


class Scripted(Proposer):
    """Drafts read from a known continuation of each request (by ``request_id``), every
    ``wrong``-th draft replaced by another token."""

    def __init__(self, continuations: dict, wrong: int = 0):
        self.continuations = continuations
        self.wrong = wrong
        self.released: list[int] = []

    def propose(self, seqs, limits):
        out = []
        for seq, limit in zip(seqs, limits):
            full = self.continuations[seq.request_id]
            drafts = list(full[len(seq.token_ids): len(seq.token_ids) + limit])
            if self.wrong:
                drafts = [t if (len(seq.token_ids) + i) % self.wrong else (t + 1) % 1000
                          for i, t in enumerate(drafts)]
            out.append(drafts)
        return out

    def release(self, seq_ids):
        self.released += seq_ids


def repeating(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so prompt lookup finds drafts at once."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(batch):
        phrase = torch.randint(3, vocab, (5 + 3 * i,), generator=gen).tolist()
        prompts.append(phrase * 3 + phrase[:2])
    return prompts


def pad_left(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    return ids, mask


@pytest.mark.parametrize("name", ["gqa_tied", "gqa4_untied"])
def test_prompt_lookup_single_prompt_matches_transformers(checkpoints, hf_models, name):
    stock = hf_models[name]
    ids = torch.tensor(repeating(1, TINY_CONFIGS[name]["vocab_size"]))
    plain = stock.generate(ids, max_new_tokens=40, do_sample=False)
    assisted = stock.generate(ids, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=4)
    engine = hf_paged.from_pretrained(checkpoints[name], **SMALL)
    out = engine.generate(ids, max_new_tokens=40, prompt_lookup_num_tokens=4)
    assert torch.equal(assisted, plain) and torch.equal(out, plain)
    assert engine.stats()["num_accepted_tokens"] > 0


def test_prompt_lookup_batch_equals_plain_greedy(checkpoints, hf_models):
    """transformers refuses batches here; every row equals plain greedy, padded as stock."""
    ids, mask = pad_left(repeating(4, TINY_CONFIGS["mha_untied"]["vocab_size"], seed=3)
                         + [[7, 8, 9]])
    ref = hf_models["mha_untied"].generate(ids, attention_mask=mask, max_new_tokens=30,
                                           do_sample=False)
    engine = hf_paged.from_pretrained(checkpoints["mha_untied"], **SMALL)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=30,
                          prompt_lookup_num_tokens=3, max_matching_ngram_size=3)
    assert torch.equal(out, ref)
    stats = engine.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("wrong", [0, 2, 1])
@pytest.mark.parametrize("max_new_tokens", [2, 3, 7, 25])
def test_drafts_right_half_right_or_wrong(checkpoints, wrong, max_new_tokens):
    prompts = repeating(3, 1000, seed=wrong)
    plain = EngineCore.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    free = plain.generate_tokens(prompts, SamplingParams(max_new_tokens=40))
    engine = EngineCore.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    proposer = Scripted({}, wrong)
    spec = Speculation(proposer, num_tokens=5)
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens,
                                                 speculation=spec)) for p in prompts]
    proposer.continuations = {s.request_id: p + f for s, p, f in zip(seqs, prompts, free)}
    engine.run(seqs)
    assert [s.output_token_ids for s in seqs] == [f[:max_new_tokens] for f in free]
    stats = engine.stats()
    if max_new_tokens > 2:
        assert stats["num_draft_tokens"] > 0
        assert (stats["num_accepted_tokens"] == stats["num_draft_tokens"]) == (wrong == 0)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert sorted(proposer.released) == sorted(s.seq_id for s in seqs)


def test_eos_inside_a_draft_ends_the_request_there(checkpoints):
    prompts = repeating(2, 1000, seed=5)
    plain = EngineCore.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    free = plain.generate_tokens(prompts, SamplingParams(max_new_tokens=30))
    eos = (free[0][6], free[1][9])
    stops = plain.generate_tokens(prompts, SamplingParams(max_new_tokens=30, eos_token_ids=eos))
    engine = EngineCore.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    proposer = Scripted({})
    spec = Speculation(proposer, num_tokens=8)
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=30, eos_token_ids=eos,
                                                 speculation=spec)) for p in prompts]
    proposer.continuations = {s.request_id: p + f for s, p, f in zip(seqs, prompts, free)}
    engine.run(seqs)
    assert [s.output_token_ids for s in seqs] == stops
    assert all(s.finish_reason == "stop" for s in seqs)
    # Every draft past the EOS was proposed and agreed with, then dropped with the request.
    assert engine.stats()["num_accepted_tokens"] > sum(len(s) for s in stops) - 2 * len(stops)


def test_preemption_and_prefix_hits_while_speculating(checkpoints, hf_models):
    vocab = TINY_CONFIGS["mha_untied"]["vocab_size"]
    ids, mask = left_padded([20, 25, 30, 35], vocab, seed=2)
    ids = torch.cat([ids, ids], dim=0)  # the second four hit the prefix cache
    mask = torch.cat([mask, mask], dim=0)
    ref = hf_models["mha_untied"].generate(ids, attention_mask=mask, max_new_tokens=30,
                                           do_sample=False)
    # 14 blocks of 8 tokens: one sequence needs up to 9, so they cannot all run together.
    engine = hf_paged.from_pretrained(checkpoints["mha_untied"], block_size=8, num_kv_blocks=14,
                                      max_model_len=160, speculative_method="ngram",
                                      num_speculative_tokens=4, prompt_lookup_max=1)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=30)
    assert torch.equal(out, ref)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == 14


class StopAfterToken(StoppingCriteria):
    """Stops a row once it generated ``token`` (a criterion transformers runs each step)."""

    def __init__(self, token: int, width: int):
        self.token, self.width = token, width

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.width:] == self.token).any(dim=1)


def test_stopping_criteria_inside_drafts(checkpoints, hf_models):
    stock = hf_models["gqa_tied"]
    ids = torch.tensor(repeating(1, 1000, seed=7))
    free = stock.generate(ids, max_new_tokens=30, do_sample=False)
    token = int(free[0, ids.shape[1] + 20])
    criteria = [StopAfterToken(token, ids.shape[1])]
    ref = stock.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    out = engine.generate(ids, max_new_tokens=30, stopping_criteria=criteria,
                          prompt_lookup_num_tokens=6)
    assert torch.equal(out, ref)
    assert engine.stats()["num_accepted_tokens"] > 0


def test_abort_while_speculating_frees_everything(checkpoints):
    engine = EngineCore.from_pretrained(checkpoints["gqa_tied"], speculative_method="ngram",
                                        **SMALL)
    stream = engine.stream(repeating(3, 1000, seed=1), SamplingParams(max_new_tokens=60))
    next(stream)
    next(stream)
    stream.close()
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert engine.generate_tokens([[5, 6, 7]], SamplingParams(max_new_tokens=3))


def test_speculation_steps_aside_for_large_batches(checkpoints):
    prompts = repeating(6, 1000, seed=4)
    plain = EngineCore.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    params = [SamplingParams(max_new_tokens=n) for n in (8, 10, 30, 30, 30, 30)]
    ref = plain.generate_tokens(prompts, params)
    engine = EngineCore.from_pretrained(checkpoints["gqa_tied"], speculative_method="ngram",
                                        speculative_max_batch=4, **SMALL)
    seqs = engine.add_requests(prompts, params)
    sizes = []
    while engine.has_unfinished_requests():
        engine.step()
        batch = engine._last_batch
        if batch is not None and any(batch.num_draft_tokens):
            sizes.append(len(engine.scheduler.running))
    assert [s.output_token_ids for s in seqs] == ref
    assert sizes and max(sizes) <= 4  # drafts only once few enough requests ran


def test_forks_and_verification_in_one_step(checkpoints):
    """A prompt forking three requests is sampled in a step that verifies another request's
    drafts: each takes its own rows (the forked ones their leader's last)."""
    first, second = repeating(2, 1000, seed=9)
    plain = EngineCore.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    ref = plain.generate_tokens([first, second], SamplingParams(max_new_tokens=24))
    engine = EngineCore.from_pretrained(checkpoints["gqa_tied"], speculative_method="ngram",
                                        **SMALL)
    [seq] = engine.add_requests([first], SamplingParams(max_new_tokens=24))
    while not engine.stats()["num_draft_tokens"]:
        engine.step()
    forks = engine.add_forked_requests(second, SamplingParams(max_new_tokens=24), 3)
    engine.step()
    assert any(engine._last_batch.num_draft_tokens) and engine._last_batch.sample_copies
    engine.run([seq, *forks])
    assert seq.output_token_ids == ref[0]
    assert [f.output_token_ids for f in forks] == [ref[1]] * 3


@pytest.mark.parametrize("kind", ["stock", "hf_paged"])
def test_assistant_model_matches_transformers_assisted_generate(checkpoints, hf_models, kind):
    """Another model of the vocabulary drafts (mostly wrong); transformers' own assisted
    generate is the oracle for one prompt, plain greedy for a padded batch."""
    stock = hf_models["gqa_tied"]
    assistant = (hf_models["mha_untied"] if kind == "stock"
                 else hf_paged.from_pretrained(checkpoints["mha_untied"], **SMALL))
    ids = torch.tensor(repeating(1, 1000, seed=2))
    plain = stock.generate(ids, max_new_tokens=24, do_sample=False)
    oracle = stock.generate(ids, max_new_tokens=24, do_sample=False,
                            assistant_model=hf_models["mha_untied"])
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    out = engine.generate(ids, max_new_tokens=24, assistant_model=assistant)
    assert torch.equal(oracle, plain) and torch.equal(out, plain)
    assert engine.stats()["num_draft_tokens"] > 0
    batch, mask = left_padded([3, 11, 26], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=6)
    ref = stock.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = engine.generate(batch, attention_mask=mask, max_new_tokens=20,
                          assistant_model=assistant)
    assert torch.equal(out, ref)


def test_the_model_as_its_own_assistant_is_always_right(checkpoints, hf_models):
    """A stock copy of the checkpoint drafts what the model would choose: every draft is
    accepted; the "heuristic" schedule then grows the draft length and keeps it on the
    assistant for its next call, as transformers does."""
    ids, mask = left_padded([5, 14], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=8)
    ref = hf_models["gqa_tied"].generate(ids, attention_mask=mask, max_new_tokens=30,
                                         do_sample=False)
    assistant = hf_paged.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=30, assistant_model=assistant)
    assert torch.equal(out, ref)
    stats = engine.stats()
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    assert assistant.generation_config.num_assistant_tokens > 3
    free = assistant.block_manager
    assert free.num_free_blocks == free.num_blocks  # the call's draft sequences are gone


def test_a_request_with_nothing_to_draft_keeps_most_steps_overlapped(checkpoints):
    """Prompt lookup that never finds a match: after each miss the request sits out of
    drafting, so at most one step in four waits for its tokens before the next is scheduled."""
    engine = EngineCore.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    proposer = Scripted({})  # no continuation known: no drafts, ever
    seq = engine.add_request(list(range(10, 30)), SamplingParams(
        max_new_tokens=40, speculation=Speculation(proposer, num_tokens=4)))
    proposer.continuations = {seq.request_id: []}
    waited = []
    while not seq.is_finished:
        engine.step()
        if engine._last_batch is not None and seq in engine._last_batch.seqs:
            waited.append(engine._last_batch.feeds_next_step)
    assert len(waited) >= 30 and sum(waited) <= len(waited) / 4 + 3


def test_stop_string_inside_accepted_drafts(tiny_checkpoint, tokenizer, stock_model):
    """A stop string completed by a token in the middle of a verified step's kept drafts ends
    the request there, as stock transformers stops one token at a time."""
    ids = tokenizer("the cat sat on the mat. the cat sat on the mat. the cat",
                    return_tensors="pt").input_ids
    free = stock_model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:]
    # The last three tokens of the first run of one token repeated five times after step 10.
    run = next(j for j in range(10, 25) if len(set(free[j:j + 5].tolist())) == 1)
    stop = tokenizer.decode(free[run + 2: run + 5])
    assert stop.strip()
    kwargs = dict(max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    ref = stock_model.generate(ids, do_sample=False, **kwargs)
    engine = hf_paged.from_pretrained(tiny_checkpoint, **SMALL)
    out = engine.generate(ids, prompt_lookup_num_tokens=4, max_matching_ngram_size=1, **kwargs)
    assert torch.equal(out, ref) and out.shape[1] < ids.shape[1] + 30
    assert engine.stats()["num_accepted_tokens"] > 0


def test_the_model_as_its_own_assistant_object(checkpoints, hf_models):
    """``generate(assistant_model=model)`` with the model itself, as transformers allows: it
    drafts on its own engine between its own steps, every draft accepted."""
    model = hf_paged.AutoModelForCausalLM.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    model.generation_config.num_assistant_tokens = 3
    ids, mask = left_padded([6, 19], TINY_CONFIGS["gqa_tied"]["vocab_size"], seed=12)
    ref = hf_models["gqa_tied"].generate(ids, attention_mask=mask, max_new_tokens=20,
                                         do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, assistant_model=model)
    assert torch.equal(out, ref)
    stats = model.engine.stats()
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


class Recorder:
    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value)

    def end(self):
        self.puts.append(None)


def test_streamer_gets_each_steps_kept_tokens(checkpoints, hf_models):
    """One row: ``put`` of the prompt, then ``[1, n]`` tensors of kept tokens as transformers'
    assisted generation streams them, then ``end``; the same tokens as transformers'."""
    ids = torch.tensor(repeating(1, 1000, seed=3))
    mine, theirs = Recorder(), Recorder()
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], **SMALL)
    engine.generate(ids, max_new_tokens=30, prompt_lookup_num_tokens=4, streamer=mine)
    hf_models["gqa_tied"].generate(ids, max_new_tokens=30, do_sample=False,
                                   prompt_lookup_num_tokens=4, streamer=theirs)
    for puts in (mine.puts, theirs.puts):
        assert torch.equal(puts[0], ids) and puts[-1] is None
        assert all(p.dim() == 2 and p.shape[0] == 1 for p in puts[1:-1])
    assert torch.equal(torch.cat(mine.puts[1:-1], 1), torch.cat(theirs.puts[1:-1], 1))
    assert any(p.shape[1] > 1 for p in mine.puts[1:-1])
