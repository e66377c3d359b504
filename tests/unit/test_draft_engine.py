"""Draft engines beside a target (CPU, float32): built once from a stock transformers model
(options fitting the target, reused, rebuilt for another target, closed with the model),
taken from an hf_paged model, loaded from a checkpoint; models that cannot draft refused,
naming the argument; and the engine drafting for itself end to end."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_paged
from hf_paged.config import EngineConfig
from hf_paged.engine.engine import EngineCore
from hf_paged.engine.sequence import Sequence
from hf_paged.engine.speculation.draft_engine import draft_engine_from_checkpoint
from hf_paged.engine.speculation.draft_proposer import DraftProposer
from hf_paged.generation.assistant_engine import draft_engine_for
from hf_paged.random_checkpoint import random_qwen3
from hf_paged.sampling_params import SamplingParams, Speculation
from tests.conftest import SMALL, TINY_CONFIGS

NAME = "gqa_tied"
PROMPTS = [[5, 6, 7, 8, 9] * 3, [3, 4], list(range(10, 40))]


def drafts_of(engine: EngineCore, k: int = 4) -> list[list[int]]:
    proposer = DraftProposer(engine)
    seqs = [Sequence(p, SamplingParams(speculation=Speculation(proposer))) for p in PROMPTS]
    try:
        return proposer.propose(seqs, [k] * len(seqs))
    finally:
        proposer.close()


def test_stock_model_engine_fits_the_target_and_is_reused(checkpoints, hf_models):
    target = EngineCore.from_pretrained(checkpoints[NAME], **SMALL, max_num_batched_tokens=64)
    engine, owned = draft_engine_for(hf_models[NAME], target)
    assert not owned  # kept for the model: generate() calls share it
    assert engine is not target and not engine.closed
    assert engine.block_manager.num_blocks == target.block_manager.num_blocks
    assert engine.block_manager.block_size == target.config.block_size
    assert engine.max_model_len == target.max_model_len
    assert engine.config.max_num_batched_tokens == 64
    assert engine.config.attention_backend == target.config.attention_backend
    assert (engine.device, engine.dtype) == (target.device, target.dtype)
    assert drafts_of(engine) == target.generate_tokens(PROMPTS, SamplingParams(max_new_tokens=4))
    assert draft_engine_for(hf_models[NAME], target) == (engine, False)
    # Another target's options: built again, the first engine closed.
    other = EngineCore.from_pretrained(checkpoints[NAME], **{**SMALL, "block_size": 16})
    rebuilt, _ = draft_engine_for(hf_models[NAME], other)
    assert rebuilt is not engine and engine.closed
    assert rebuilt.block_manager.block_size == 16


def test_built_engine_closes_with_its_model(checkpoints):
    target = EngineCore.from_pretrained(checkpoints[NAME], **SMALL)
    model = random_qwen3(Qwen3Config(**TINY_CONFIGS[NAME], dtype="float32"), seed=3)
    engine, _ = draft_engine_for(model, target)
    del model
    gc.collect()
    assert engine.closed


def test_hf_paged_model_drafts_on_its_own_engine(checkpoints):
    target = EngineCore.from_pretrained(checkpoints[NAME], **SMALL)
    assistant = hf_paged.AutoModelForCausalLM.from_pretrained(checkpoints["one_kv_head"],
                                                              **SMALL)
    assert draft_engine_for(assistant, target) == (assistant.engine, False)
    assert draft_engine_for(assistant, assistant.engine) == (assistant.engine, False)
    assistant.engine.close()
    with pytest.raises(ValueError, match="assistant_model was closed"):
        draft_engine_for(assistant, target)


@pytest.mark.parametrize("make", [
    lambda: Qwen3ForCausalLM(Qwen3Config(**{**TINY_CONFIGS[NAME], "vocab_size": 512})),
    lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=TINY_CONFIGS[NAME]["vocab_size"], hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)),
    lambda: SimpleNamespace(config=SimpleNamespace(vocab_size=TINY_CONFIGS[NAME]["vocab_size"])),
], ids=["vocab", "family", "not_a_model"])
def test_models_that_cannot_draft_are_refused(checkpoints, make):
    target = EngineCore.from_pretrained(checkpoints[NAME], **SMALL)
    with pytest.raises(ValueError, match="assistant_model"):
        draft_engine_for(make(), target)


def test_engine_from_checkpoint(checkpoints):
    config = EngineConfig(**SMALL, max_num_seqs=4, speculative_model=checkpoints[NAME])
    options = dict(dtype=None, device="cpu", config=config, max_model_len=64, num_blocks=40)
    engine = draft_engine_from_checkpoint(checkpoints[NAME], EngineCore.from_pretrained, **options,
                                          vocab_size=1024)
    assert engine.block_manager.num_blocks == 40 and engine.max_model_len == 64
    assert engine.config.max_num_seqs == 4 and engine.config.speculative_method is None
    with pytest.raises(ValueError, match="speculative_model"):
        draft_engine_from_checkpoint(checkpoints[NAME], EngineCore.from_pretrained, **options,
                                     vocab_size=2048)


def test_engine_drafting_for_itself_keeps_greedy_output(checkpoints):
    prompts = PROMPTS + [[7] * 20]
    plain = EngineCore.from_pretrained(checkpoints[NAME], **SMALL)
    want = plain.generate_tokens(prompts, SamplingParams(max_new_tokens=24))
    engine = EngineCore.from_pretrained(checkpoints[NAME], **SMALL,
                                        speculative_model=checkpoints[NAME])
    assert engine.generate_tokens(prompts, SamplingParams(max_new_tokens=24)) == want
    stats = engine.stats()
    assert stats["num_draft_tokens"] == stats["num_accepted_tokens"] > 0
    draft = engine.speculator.default.proposer.engine
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks
