"""Which of transformers' logits processors the engine computes natively.

``resolve`` hands over the exact ``LogitsProcessorList`` transformers' generate would build.
The parts the engine does natively on the device, batched over every request of a step, are
split off: a leading repetition penalty (the engine's per-request seen-token mask, which also
serves requests from ``generate_tokens``) and the trailing temperature / top-k / top-p / min-p
warpers (the engine's sampling kernel). What is left runs, in order, as transformers' own objects
over the call's ``input_ids`` on the device (``generate.CallHooks``), so every convention and
every user processor behaves as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass
class Split:
    """A processor list as native settings plus the processors left to run as objects."""

    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    rest: LogitsProcessorList = field(default_factory=LogitsProcessorList)


def split(processors: LogitsProcessorList, padded: bool, keep_all: bool) -> Split:
    """Native settings for the head and tail of ``processors`` that the engine computes
    exactly as transformers does; ``keep_all`` (the caller needs the processed scores
    themselves) keeps every processor an object."""
    out = Split()
    items = list(processors)
    if keep_all:
        out.rest = LogitsProcessorList(items)
        return out
    if items and type(items[0]) is RepetitionPenaltyLogitsProcessor and _penalty_sees_prompt(
        items[0], padded
    ):
        out.repetition_penalty = items.pop(0).penalty
    # The sampling kernel applies temperature, then top-k, top-p and min-p: a suffix in that
    # order (transformers' own).
    tail = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k",
            TopPLogitsWarper: "top_p", MinPLogitsWarper: "min_p"}
    rank = {kind: i for i, kind in enumerate(tail)}
    cut, last = len(items), len(tail)
    while (cut and type(items[cut - 1]) in tail and _native_warper(items[cut - 1])
           and rank[type(items[cut - 1])] < last):
        cut -= 1
        last = rank[type(items[cut])]
    for warper in items[cut:]:
        setattr(out, tail[type(warper)], getattr(warper, tail[type(warper)]))
    out.rest = LogitsProcessorList(items[:cut])
    return out


def _penalty_sees_prompt(processor: RepetitionPenaltyLogitsProcessor, padded: bool) -> bool:
    """The engine's mask holds the unpadded prompt and the new tokens: equal to what the
    processor sees when no row is padded or when it skips each row's padding."""
    ignore = getattr(processor, "prompt_ignore_length", None)
    return not padded if ignore is None else isinstance(ignore, torch.Tensor)


def _native_warper(warper) -> bool:
    if getattr(warper, "filter_value", float("-inf")) != float("-inf"):
        return False
    return getattr(warper, "min_tokens_to_keep", 1) == 1
