"""A continuous-batching manager's requests as engine requests: their settings and hooks.

transformers' ``ContinuousBatchingManager`` reads one ``GenerationConfig`` for all its
requests: the logits processors ``_get_logits_processor`` builds from it, filtered by
``ContinuousBatchingLogitsProcessorList`` (which drops those it marks unsupported and, with
``per_request_processors``, lets a request override ``temperature`` / ``top_k`` / ``top_p``
through ``add_request(**kwargs)``), and ``do_sample``. A request also sets ``max_new_tokens``
and ``eos_token_id``, and, hf_paged's own keyword, ``adapter=NAME``: the LoRA adapter it runs
with (``EngineCore.add_lora``). ``RequestSettings`` builds the same list with the same transformers
code, then hands the engine what it computes natively (repetition penalty, temperature,
top-k, top-p, min-p: ``generation.processors.split``); anything else, and the log-probabilities
``return_logprobs`` asks for, runs in ``RowHooks`` as transformers' objects over each
request's own tokens.
"""

from __future__ import annotations

from collections import deque

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cb_logits_processors import (
    CLASSIC_TO_CB_PROCESSORS_MAP,
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.requests import (
    RequestState,
)
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.engine.sequence import Sequence
from hf_paged.generation import processors as procs
from hf_paged.sampling_params import RequestHooks, SamplingParams

# The warpers a request may override per request, by the keyword transformers takes.
_WARPERS = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k",
            TopPLogitsWarper: "top_p"}


class RowHooks(RequestHooks):
    """The processors of each request that the engine does not compute natively, run as
    transformers' objects on that request's row alone (its prompt and tokens as
    ``input_ids``), and the log-probability of each sampled token under the processed scores
    (as transformers' manager reports them). One object serves all of a manager's requests,
    so the engine hands it every such row of a step at once."""

    def __init__(self, needs_history: bool, logprobs: bool):
        # Processors that read input_ids need the host to know every token before the next
        # step is launched; warpers alone do not.
        self.needs_history = needs_history
        self.logprobs = logprobs
        self.rows: dict[int, LogitsProcessorList] = {}
        self.pending: dict[int, deque] = {}  # seq_id -> (step's log-probs, row), in order
        self._log_probs: torch.Tensor | None = None

    def add(self, seq: Sequence, processors: LogitsProcessorList) -> None:
        self.rows[seq.seq_id] = processors
        self.pending[seq.seq_id] = deque()

    def drop(self, seq: Sequence) -> None:
        self.rows.pop(seq.seq_id, None)
        self.pending.pop(seq.seq_id, None)

    def process(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for i, seq in enumerate(seqs):
            chain = self.rows.get(seq.seq_id)
            if chain:
                ids = torch.tensor([seq.token_ids], device=logits.device) if self.needs_history \
                    else None
                logits[i:i + 1] = chain(ids, logits[i:i + 1])
        if self.logprobs:
            self._log_probs = torch.log_softmax(logits, dim=-1)
        return logits

    def record(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        if not self.logprobs:
            return
        chosen = self._log_probs.gather(1, tokens[:, None].long())[:, 0]
        for i, seq in enumerate(seqs):
            queue = self.pending.get(seq.seq_id)
            if queue is not None:
                queue.append((chosen, i))

    def take_logprobs(self, seq: Sequence, count: int, on_host: dict) -> list[float]:
        """The log-probabilities of ``seq``'s next ``count`` tokens (in the order sampled).
        ``on_host`` caches each step's values on the host for one round of calls."""
        queue = self.pending[seq.seq_id]
        values = []
        for _ in range(count):
            step, row = queue.popleft()
            host = on_host.get(id(step))
            if host is None:
                host = on_host[id(step)] = (step, step.tolist())  # the tensor kept: ids stay unique
            values.append(host[1][row])
        return values


class RequestSettings:
    """A manager's generation settings, as transformers' manager reads them, turned into
    engine ``SamplingParams`` for each of its requests."""

    def __init__(self, model, generation_config: GenerationConfig,
                 cb_config: ContinuousBatchingConfig, max_total_tokens: int):
        classic = list(model._get_logits_processor(generation_config))
        # transformers' own filter: its warnings, its drop rule, its per-request keywords.
        self.cb_processors = ContinuousBatchingLogitsProcessorList(
            logits_processor=LogitsProcessorList(classic),
            per_request_processors=cb_config.per_request_processors,
            drop_unsupported_processors=cb_config.drop_unsupported_processors,
        )
        self.processors = _kept(classic, list(self.cb_processors.logits_processor))
        self.do_sample = bool(getattr(generation_config, "do_sample", True))  # as transformers
        self.default_adapter: str | None = None  # a request naming none runs on it
        self.logprobs = bool(cb_config.return_logprobs)
        self.max_total_tokens = max_total_tokens
        rest = procs.split(LogitsProcessorList(self.processors), padded=False, keep_all=False).rest
        reads_ids = any(type(p) not in _WARPERS for p in rest)
        self.hooks = RowHooks(needs_history=reads_ids, logprobs=self.logprobs)

    def params(self, state: RequestState) -> tuple[SamplingParams, LogitsProcessorList]:
        """The request's SamplingParams and the processors its row runs in ``self.hooks``
        (empty: none). Raises naming what is wrong with the request."""
        overrides = dict(state.logit_processor_kwargs)
        # hf_paged's own keyword: the LoRA adapter the request runs with (its name)
        adapter = overrides.pop("adapter", None) or self.default_adapter
        self.cb_processors.check_kwargs(overrides)  # transformers' own check of the keywords
        chain = LogitsProcessorList(_override(p, overrides) for p in self.processors)
        split = procs.split(chain, padded=False, keep_all=False)
        rows = split.rest
        warpers = split.temperature, split.top_k, split.top_p, split.min_p
        if self.logprobs:  # the warpers run in the hooks, which take the processed scores' log
            head = int(split.repetition_penalty != 1.0)
            rows = LogitsProcessorList([*rows, *list(chain)[head + len(rows):]])
            warpers = 1.0, 0, 1.0, 0.0
        temperature, top_k, top_p, min_p = warpers
        prompt_len = len(state.initial_tokens)
        max_new_tokens = state.max_new_tokens
        if max_new_tokens is None:  # transformers: no limit but EOS; here the engine's room
            max_new_tokens = max(self.max_total_tokens - prompt_len, 1)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature if self.do_sample else 0.0,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=split.repetition_penalty,
            eos_token_ids=_eos_ids(state.eos_token_id),
            hooks=self.hooks if rows or self.logprobs else None,
            adapter=adapter,
        )
        return params, rows


def _kept(classic: list, kept: list) -> list:
    """The processors of ``classic`` that transformers' list kept: itself, or (with
    ``per_request_processors``) its per-request twin, which is never dropped; in order."""
    convertible = tuple(CLASSIC_TO_CB_PROCESSORS_MAP)
    out, index = [], 0
    for processor in classic:
        here = kept[index] if index < len(kept) else None
        twin = isinstance(here, ContinuousBatchingLogitsProcessor) and isinstance(
            processor, convertible)
        if here is processor or twin:
            out.append(processor)
            index += 1
    return out


def _override(processor, overrides: dict):
    """``processor``, or transformers' warper of the same kind with the request's value (its
    constructor validates it: a bad value raises naming the argument)."""
    name = _WARPERS.get(type(processor))
    if name is None or name not in overrides:
        return processor
    value = overrides[name]
    if name == "temperature":
        return TemperatureLogitsWarper(value)
    return type(processor)(value, filter_value=processor.filter_value,
                           min_tokens_to_keep=processor.min_tokens_to_keep)


def _eos_ids(eos_token_id) -> tuple[int, ...]:
    """transformers' RequestState rule: an int or a list, negative ids (-1: none) skipped."""
    if eos_token_id is None:
        return ()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return tuple(int(t) for t in ids if t >= 0)
