"""generate() arguments against stock transformers, float32 on CPU: exact tokens, and scores
and logits within 1e-4, for every deterministic argument; the drawable token set for
sampling; settings resolution with a checkpoint generation_config.json."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen3ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)

import hf_paged
from tests.conftest import TINY_CONFIGS, left_padded, transformers_allowed_set

VOCAB = TINY_CONFIGS["gqa_tied"]["vocab_size"]


@pytest.fixture(scope="module")
def setup(checkpoints, hf_models):
    engine = hf_paged.from_pretrained(checkpoints["gqa_tied"], block_size=8)
    ids, mask = left_padded([3, 9, 17], VOCAB, seed=3)
    free = hf_models["gqa_tied"].generate(ids, attention_mask=mask, max_new_tokens=12,
                                          do_sample=False)
    new = free[:, ids.shape[1]:]  # tokens greedy picks, to aim the processors at
    return engine, hf_models["gqa_tied"], ids, mask, new


class BanEvenAfterThree(LogitsProcessor):
    """A user processor that reads input_ids: bans even ids once a row is 3 tokens past."""

    def __init__(self, width):
        self.width = width

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.width + 3:
            scores = scores.clone()
            scores[:, ::2] = float("-inf")
        return scores


class StopAtToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def cases(ids, new):
    width = ids.shape[1]
    a, b, c = int(new[0, 1]), int(new[1, 2]), int(new[2, 3])
    return {
        "no_length_argument": {},
        "defaults_passed_explicitly": dict(
            max_new_tokens=12, num_beams=1, num_return_sequences=1, repetition_penalty=1.0,
            length_penalty=1.0, no_repeat_ngram_size=0, streamer=None, logits_processor=None,
            stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None,
            do_sample=False, use_cache=True, output_scores=False),
        "max_length": dict(max_length=width + 7),
        "without_cache": dict(max_new_tokens=12, use_cache=False),  # transformers recomputes
        "repetition_penalty": dict(max_new_tokens=12, repetition_penalty=1.5),
        "repetition_reward": dict(max_new_tokens=12, repetition_penalty=0.6),
        "no_repeat_ngram_size": dict(max_new_tokens=12, no_repeat_ngram_size=2),
        "bad_words_ids": dict(max_new_tokens=12, bad_words_ids=[[a], [b, c]]),
        "suppress_tokens": dict(max_new_tokens=12, suppress_tokens=[a, b]),
        "begin_suppress_tokens": dict(max_new_tokens=12, begin_suppress_tokens=[int(new[0, 0])]),
        "sequence_bias": dict(max_new_tokens=12, sequence_bias={(a,): -8.0, (b, c): 9.0}),
        "min_new_tokens": dict(max_new_tokens=12, min_new_tokens=6, eos_token_id=[a, b]),
        "min_length": dict(max_new_tokens=12, min_length=width + 5, eos_token_id=[a, b]),
        "eos_list": dict(max_new_tokens=12, eos_token_id=[a, c], pad_token_id=0),
        "forced_bos": dict(max_new_tokens=12, forced_bos_token_id=7),
        "forced_eos": dict(max_new_tokens=12, forced_eos_token_id=5),
        "exponential_decay": dict(max_new_tokens=12, exponential_decay_length_penalty=(3, 1.6),
                                  eos_token_id=[a]),
        "renormalize_and_invalid": dict(max_new_tokens=12, renormalize_logits=True,
                                        remove_invalid_values=True),
        "prefix_allowed_tokens_fn": dict(
            max_new_tokens=12, prefix_allowed_tokens_fn=lambda batch, ids: list(
                range(3 + batch, VOCAB, 3))),
        "user_logits_processor": dict(
            max_new_tokens=12, logits_processor=LogitsProcessorList([BanEvenAfterThree(width)])),
        "user_stopping_criteria": dict(
            max_new_tokens=12, stopping_criteria=StoppingCriteriaList([StopAtToken(b)])),
        "encoder_repetition_penalty": dict(max_new_tokens=12, encoder_repetition_penalty=1.6),
        "encoder_no_repeat_ngram_size": dict(max_new_tokens=12, encoder_no_repeat_ngram_size=1),
        "penalty_with_ngrams": dict(max_new_tokens=12, repetition_penalty=1.3,
                                    no_repeat_ngram_size=3),
    }


CASES = list(cases(torch.zeros(1, 1), torch.zeros(3, 12, dtype=torch.long)))


@pytest.mark.parametrize("case", CASES)
def test_argument_matches_transformers(setup, case):
    engine, model, ids, mask, new = setup
    kwargs = cases(ids, new)[case]
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    out = engine.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("case", ["eos_list", "repetition_penalty", "no_repeat_ngram_size",
                                  "min_new_tokens", "user_stopping_criteria", "without_cache"])
def test_scores_and_logits_match_transformers(setup, case):
    engine, model, ids, mask, new = setup
    kwargs = dict(cases(ids, new)[case], return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    out = engine.generate(ids, attention_mask=mask, **kwargs)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
    for mine, theirs in zip(out.scores + out.logits, ref.scores + ref.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_input_ids_keyword_and_positional_generation_config(setup):
    engine, model, ids, mask, _ = setup
    config = GenerationConfig(max_new_tokens=6, do_sample=False)
    ref = model.generate(ids, config, attention_mask=mask)
    assert torch.equal(engine.generate(ids, config, attention_mask=mask), ref)
    assert torch.equal(engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6),
                       ref)


@pytest.fixture(scope="module")
def configured_checkpoint(checkpoints, tmp_path_factory, setup):
    """The gqa_tied checkpoint with a generation_config.json that sets an EOS list, a
    penalty and a length, as real checkpoints do."""
    _, _, _, _, new = setup
    path = str(tmp_path_factory.mktemp("configured"))
    for name in os.listdir(checkpoints["gqa_tied"]):
        shutil.copy(os.path.join(checkpoints["gqa_tied"], name), path)
    settings = dict(bos_token_id=1, eos_token_id=[2, int(new[1, 4])], pad_token_id=0,
                    repetition_penalty=1.2, max_new_tokens=9, do_sample=False)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(settings, f)
    return path


@pytest.mark.parametrize("call", [
    {},
    {"generation_config": GenerationConfig(max_new_tokens=12, do_sample=False)},
    {"generation_config": GenerationConfig(max_new_tokens=12), "repetition_penalty": 1.0},
    {"max_new_tokens": 11, "eos_token_id": 2},
    {"generation_config": GenerationConfig(max_new_tokens=12, eos_token_id=[3])},
])
def test_checkpoint_generation_config_merges_as_in_transformers(configured_checkpoint, setup,
                                                                call):
    _, _, ids, mask, _ = setup
    model = Qwen3ForCausalLM.from_pretrained(configured_checkpoint, dtype=torch.float32)
    engine = hf_paged.from_pretrained(configured_checkpoint, block_size=8)
    ref = model.generate(ids, attention_mask=mask, **call)
    assert torch.equal(engine.generate(ids, attention_mask=mask, **call), ref)


@pytest.mark.parametrize("warpers", [
    dict(temperature=1.5, top_p=0.97),  # and transformers' default top_k=50
    dict(top_k=20, top_p=0.9, repetition_penalty=1.3),
    dict(top_k=0, min_p=0.02),
    dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.1),  # all four in the sampling kernel
    dict(top_k=0, typical_p=0.9),
    dict(top_k=0, epsilon_cutoff=2e-3),
    dict(top_k=0, eta_cutoff=2e-3, temperature=0.8),
])
def test_sampling_draws_from_transformers_allowed_set(setup, warpers):
    """Over many one-token draws the engine's tokens are exactly the set transformers' own
    processors and warpers leave for that step."""
    engine, model, ids, _, _ = setup
    prompt = ids[2:, :]
    kwargs = dict(do_sample=True, max_new_tokens=1, **warpers)
    allowed = transformers_allowed_set(model, prompt, kwargs)
    assert 3 <= len(allowed) <= 60
    torch.manual_seed(0)
    out = engine.generate(prompt, num_return_sequences=1500, **kwargs)
    drawn = set(out[:, -1].tolist())
    assert drawn <= allowed
    assert len(drawn) >= len(allowed) - 3  # nearly all of the allowed set shows up


# Modes transformers moved to hub ``custom_generate`` repositories: stock generate() refuses
# them naming the mode ("Contrastive Search requires `trust_remote_code=True`...") or, with
# trust_remote_code=True, tries the hub; hf_paged refuses them naming the argument.
HUB_MODES = [
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha=0.6, top_k=4 (contrastive search)"),
    (dict(dola_layers="high"), "dola_layers='high' (DoLa decoding)"),
    (dict(num_beams=4, num_beam_groups=2), "num_beam_groups=2, num_beams=4 (group beam search)"),
    (dict(num_beams=2, force_words_ids=[[7]]), "force_words_ids (constrained beam search)"),
]


@pytest.mark.parametrize("kwargs,message", HUB_MODES, ids=[m for _, m in HUB_MODES])
def test_hub_moved_modes_name_the_argument(setup, kwargs, message):
    engine, model, ids, mask, _ = setup
    with pytest.raises(ValueError, match="requires `trust_remote_code=True`"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, **kwargs)
    for extra in ({}, {"trust_remote_code": True}):
        with pytest.raises(ValueError) as error:
            engine.generate(ids, attention_mask=mask, max_new_tokens=4, **kwargs, **extra)
        assert str(error.value).startswith(f"{message} is not supported by hf_paged"), error.value


def test_trust_remote_code_is_accepted_as_by_transformers(setup):
    """transformers' generate() takes it (it gates hub code only): a plain call runs alike."""
    engine, model, ids, mask, _ = setup
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, trust_remote_code=True)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=4, trust_remote_code=True)
    assert torch.equal(out, ref)
