"""Assisted generation: ``prompt_lookup_num_tokens`` and ``assistant_model`` as the engine's
speculative decoding.

transformers picks the candidate generator as ``_get_candidate_generator`` does: prompt lookup
when ``prompt_lookup_num_tokens`` is set (``max_matching_ngram_size``, default 2), else the
assistant model, whose knobs come from the assistant's own generation config over
transformers' global defaults (``num_assistant_tokens`` 20, ``num_assistant_tokens_schedule``
"constant", ``assistant_confidence_threshold`` 0.4), as ``AssistedCandidateGenerator`` reads
them. The assistant drafts greedily on a paged engine of its own (an hf_paged model's engine,
or one built once from a stock model's weights); verification keeps greedy output token for
token and sampled output distributed as plain sampling, so the draft's own sampling (which
transformers' rule corrects for) is not needed. transformers decodes one row at a time here;
the engine serves every row of the batch, each with its own drafts. Its confidence threshold
is not re-tuned from ROC curves between rounds as transformers does when scikit-learn is
installed: that tuning changes speed, never output.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from hf_paged.engine.speculation.draft_proposer import DraftProposer
from hf_paged.engine.speculation.ngram import NgramProposer
from hf_paged.generation.assistant_engine import draft_engine_for
from hf_paged.generation.settings import Resolved
from hf_paged.sampling_params import SCHEDULES, Speculation


@contextmanager
def speculating(engine, resolved: Resolved) -> Iterator[Speculation | None]:
    """The call's speculation for its requests; its proposer is let go when the call ends."""
    speculation = speculation_for(engine, resolved)
    try:
        yield speculation
    finally:
        if speculation is not None:
            engine.speculator.forget(speculation.proposer)
            speculation.proposer.close()


def speculation_for(engine, resolved: Resolved) -> Speculation | None:
    """The call's speculation (None when it is not assisted generation)."""
    config = resolved.config
    if config.get_generation_mode(resolved.assistant_model) is not \
            GenerationMode.ASSISTED_GENERATION:
        return None
    if config.prompt_lookup_num_tokens is not None:
        num = _positive("prompt_lookup_num_tokens", config.prompt_lookup_num_tokens)
        ngram = _positive("max_matching_ngram_size", config.max_matching_ngram_size or 2)
        return Speculation(NgramProposer(ngram), num)
    assistant = resolved.assistant_model
    draft, owned = draft_engine_for(assistant, engine)  # checks the assistant first
    knobs = assistant_settings(assistant)
    threshold = knobs.assistant_confidence_threshold
    return Speculation(
        DraftProposer(draft, owns_engine=owned),
        _positive("num_assistant_tokens", int(knobs.num_assistant_tokens)),
        _schedule(knobs.num_assistant_tokens_schedule),
        float(threshold) if threshold else None,
    )


def assistant_settings(assistant) -> GenerationConfig:
    """The assistant's generation config over transformers' global defaults (a copy)."""
    config = copy.deepcopy(assistant.generation_config)
    config.update(**config._get_default_generation_params(), defaults_only=True)
    return config


def finish(resolved: Resolved, speculation: Speculation | None, seqs: list) -> None:
    """After the call: a "heuristic" schedule keeps its draft length on the assistant for the
    next call (transformers' rule, taken from the first row)."""
    if speculation is None or resolved.assistant_model is None or not seqs:
        return
    if speculation.schedule == "heuristic" and resolved.config.prompt_lookup_num_tokens is None:
        resolved.assistant_model.generation_config.num_assistant_tokens = seqs[0].draft_length


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _schedule(value) -> str:
    if value not in SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}, "
                         f"got {value!r}")
    return value
