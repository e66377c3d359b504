"""Prompt lookup's drafts against transformers' ``PromptLookupCandidateGenerator``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from hf_paged.engine.speculation.ngram import lookup


def transformers_drafts(tokens: list[int], limit: int, max_ngram: int, eos: list[int]):
    generator = PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor(eos) if eos else None, num_output_tokens=limit,
        max_matching_ngram_size=max_ngram, max_length=len(tokens) + limit + 1)
    ids = torch.tensor([tokens])
    candidates, _ = generator.get_candidates(ids)
    return candidates[0, len(tokens):].tolist()


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=40),
       limit=st.integers(1, 8), max_ngram=st.integers(1, 4),
       eos=st.lists(st.integers(0, 5), max_size=2))
def test_lookup_is_transformers_prompt_lookup(tokens, limit, max_ngram, eos):
    assert lookup(tokens, limit, max_ngram, tuple(eos)) == transformers_drafts(
        tokens, limit, max_ngram, eos)


def test_lookup_examples():
    assert lookup([1, 2, 3, 9, 1, 2], 3, 2) == [3, 9, 1]
    assert lookup([1, 2, 3, 9, 1, 2], 3, 2, eos=(9,)) == [3]
    assert lookup([5, 6, 7], 2, 2) == []
    assert lookup([4, 4], 3, 2) == [4]
