"""Which of transformers' processors the engine computes natively (``processors.split``): the
trailing warpers in transformers' order, min-p included; anything out of that order stays
transformers' object."""

from __future__ import annotations

from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.generation import processors


def split(*items):
    return processors.split(LogitsProcessorList(items), padded=False, keep_all=False)


def test_qwen3_settings_with_min_p_are_all_native():
    out = split(TemperatureLogitsWarper(0.6), TopKLogitsWarper(20), TopPLogitsWarper(0.95),
                MinPLogitsWarper(0.05))
    assert (out.temperature, out.top_k, out.top_p, out.min_p) == (0.6, 20, 0.95, 0.05)
    assert len(out.rest) == 0


def test_min_p_before_top_k_is_not_the_kernel_order():
    # Only the suffix in the kernel's order is native: min-p then top-k keeps min-p an object.
    out = split(TemperatureLogitsWarper(0.7), MinPLogitsWarper(0.1), TopKLogitsWarper(5))
    assert (out.top_k, out.min_p, out.temperature) == (5, 0.0, 1.0)
    assert [type(p) for p in out.rest] == [TemperatureLogitsWarper, MinPLogitsWarper]


def test_a_processor_after_min_p_keeps_the_warpers_objects():
    out = split(MinPLogitsWarper(0.1), NoRepeatNGramLogitsProcessor(2))
    assert out.min_p == 0.0 and len(out.rest) == 2
