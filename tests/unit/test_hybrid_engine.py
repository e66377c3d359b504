"""The engine over a model flagged hybrid (a Qwen3 checkpoint whose family is given
``linear_layer_ids`` and one stand-in linear-attention module): every step's metadata carries
each sequence's state slot, and a stand-in linear layer that counts the tokens each slot has
seen checks, step by step, that slots, ``has_initial_state`` and fork copies reach the device
right, through asynchronous scheduling, forks, beams and preemption. The tokens equal the
plain model's; no slot leaks; nothing is served from the prefix cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import hf_paged
from hf_paged.modeling.paged_model import PagedModel
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker import state_cache
from tests.conftest import SMALL
from tests.parity.test_graph_inputs import with_eager_decode_graphs, with_eager_prefill_graphs

FAMILY = SimpleNamespace(linear_layer_ids=lambda config: (0,),
                         state_shapes=lambda config, tp_size: {"conv_state": ((1,), None)})


class CountingLayer:
    """What a linear layer does with its slots, in miniature: a sequence's slot holds how many
    of its tokens it has seen; a continued chunk must find exactly its start there."""

    def __init__(self, model: PagedModel):
        self.model, self.forward = model, model.forward
        self.steps = self.rows = 0

    def __call__(self, input_ids, positions, meta, pending=None):
        pool = self.model.state_modules[0].conv_state
        cu = meta.cu_seqlens_q.tolist()
        for i, (slot, initial) in enumerate(zip(meta.state_slots.tolist(),
                                                meta.has_initial_state.tolist())):
            if slot < 0:  # a decode graph's padding row
                continue
            start, n = int(positions[cu[i]]), cu[i + 1] - cu[i]
            assert initial == (start > 0)
            if initial:
                assert pool[slot, 0] == start, (slot, start)
            pool[slot, 0] = start + n
            self.rows += 1
        self.steps += 1
        return self.forward(input_ids, positions, meta, pending)


@pytest.fixture
def hybrid_flag(monkeypatch):
    """Every model loaded meanwhile is hybrid, with one stand-in linear-attention module."""
    monkeypatch.setattr(state_cache, "family_for", lambda config: FAMILY)
    monkeypatch.setattr(PagedModel, "state_modules", property(
        lambda self: self.__dict__.setdefault("_linear", [nn.Module()])))


def load(path: str, **options):
    engine = hf_paged.from_pretrained(path, dtype=torch.float32, **{**SMALL, **options})
    model = engine.executor.runner.model
    if engine.block_manager.state_slots is not None:
        model.forward = CountingLayer(model)
    return engine


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * t) % 90 + 1 for t in range(5 + 6 * i)] for i in range(n)]


@pytest.mark.parametrize("options", [
    {},
    # Six blocks of eight tokens: preemptions recompute from a zero state.
    dict(num_kv_blocks=6, max_num_batched_tokens=16),
])
def test_steps_carry_slots_and_the_tokens_are_the_plain_models(tiny_checkpoint, hybrid_flag,
                                                                monkeypatch, options):
    params = SamplingParams(max_new_tokens=8)
    hybrid = load(tiny_checkpoint, **options)
    got = hybrid.generate_tokens(prompts(4), params)
    stats = hybrid.stats()
    assert stats["num_state_slots"] == hybrid.config.max_num_seqs
    assert stats["num_used_state_slots"] == 0 and stats["state_bytes"] == \
        hybrid.config.max_num_seqs * 4
    assert hybrid.executor.runner.model.forward.steps > 0
    if options:
        assert stats["num_preemptions"] > 0
    hybrid.close()
    monkeypatch.undo()  # the plain model, for reference
    plain = load(tiny_checkpoint, **options)
    assert plain.block_manager.state_slots is None and "num_state_slots" not in plain.stats()
    assert got == plain.generate_tokens(prompts(4), params)
    plain.close()


def test_forks_and_beams_copy_their_parents_state(tiny_checkpoint, hybrid_flag):
    engine = load(tiny_checkpoint)
    ids = torch.tensor(prompts(2)[1:])
    sampled = engine.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=3)
    beams = engine.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=2)
    assert sampled.shape[0] == 3 and beams.shape[0] == 2
    assert engine.stats()["num_used_state_slots"] == 0
    engine.close()


def test_no_prefix_cache_hits_no_speculation(tiny_checkpoint, hybrid_flag):
    engine = load(tiny_checkpoint)
    prompt = list(range(1, 40))
    engine.generate_tokens([prompt], SamplingParams(max_new_tokens=2))
    engine.generate_tokens([prompt], SamplingParams(max_new_tokens=2))
    assert engine.stats()["prefix_cache_hits"] == 0
    with pytest.raises(ValueError, match="^speculation .*not supported"):
        engine.generate(torch.tensor([prompt]), max_new_tokens=2, prompt_lookup_num_tokens=3)
    engine.close()
    with pytest.raises(ValueError, match="^speculative_method: .*not supported"):
        load(tiny_checkpoint, speculative_method="ngram")


def test_the_model_call_runs_on_scratch_state_pools(tiny_checkpoint, hybrid_flag):
    """The model call's rows take slots 0.. of zeroed pools of their own, from zeros; the
    engine's pools are put back after it."""
    engine = load(tiny_checkpoint)
    model = engine.executor.runner.model
    module, plain_forward = model.state_modules[0], model.forward.forward
    pool, seen = module.conv_state, []

    def spy(input_ids, positions, meta, pending=None, streams=None):
        seen.append((module.conv_state.clone(), meta.padded_rows))
        return plain_forward(input_ids, positions, meta, pending, streams)

    model.forward = spy
    ids = torch.tensor(prompts(2)[0][:5]).repeat(2, 1)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert engine.hidden_states(ids, mask, torch.arange(5)[None]).shape[:2] == (2, 5)
    (scratch, rows), = seen
    assert scratch.shape == (2, *pool.shape[1:]) and not scratch.any()
    assert module.conv_state is pool
    assert rows.meta.state_slots.tolist() == [0, 1] and not rows.meta.has_initial_state.any()
    assert rows.keep.flatten().tolist() == mask.flatten().tolist()
    engine.close()


def test_prefix_hits_resume_from_state_snapshots(tiny_checkpoint, hybrid_flag):
    engine = load(tiny_checkpoint, num_state_snapshots=4)
    stem = list(range(1, 30))
    params = SamplingParams(max_new_tokens=4)
    first = engine.generate_tokens([stem + [40, 41]], params)
    again = engine.generate_tokens([stem + [40, 41], stem + [50]], params)
    stats = engine.stats()
    # A snapshot after 24 tokens (three 8-token blocks): both resume there.
    assert stats["prefix_cache_hits"] == 48 and again[0] == first[0]
    assert stats["num_state_snapshots"] == 4 and stats["num_used_state_snapshots"] >= 1
    assert stats["state_bytes"] == (engine.config.max_num_seqs + 4) * 4
    assert stats["num_used_state_slots"] == 0
    engine.close()
    with pytest.raises(ValueError, match="^num_state_snapshots must be a non-negative"):
        hf_paged.EngineConfig(num_state_snapshots=-1)


def test_a_hybrid_model_cannot_draft(tiny_checkpoint, hybrid_flag, monkeypatch):
    hybrid = load(tiny_checkpoint)
    monkeypatch.undo()
    plain = load(tiny_checkpoint)
    with pytest.raises(ValueError, match="^assistant_model: the model has linear-attention"):
        plain.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, assistant_model=hybrid)
    plain.close()
    hybrid.close()


def test_graphs_address_the_slots_through_their_inputs(tiny_checkpoint, hybrid_flag,
                                                       monkeypatch):
    """Decode graphs padded to 4 rows, prefill graphs to 32 or 64 tokens and 8 sequences."""
    engine = load(tiny_checkpoint, max_num_batched_tokens=16)
    decode = with_eager_decode_graphs(engine, max_bs=4)
    prefill = with_eager_prefill_graphs(engine, max_tokens=64, max_seqs=8)
    got = engine.generate_tokens(prompts(3), SamplingParams(max_new_tokens=6))
    steps = engine.executor.runner.model.forward
    replays = [r.replays for r in decode + prefill]
    # Every step replayed a graph (the stand-ins ran each once as they were made, all padding)
    assert sum(replays) == steps.steps - len(replays) and sum(r.replays for r in prefill) == 3
    # and every row of them read its slot: four prefill chunks (budget 16: 5 + 11, then 16 + 1
    # of the third prompt's 17) and five decode rows each.
    assert steps.rows == 4 + 3 * 5
    engine.close()
    monkeypatch.undo()
    plain = hf_paged.from_pretrained(tiny_checkpoint, dtype=torch.float32, **SMALL)
    assert got == plain.generate_tokens(prompts(3), SamplingParams(max_new_tokens=6))
    plain.close()
