"""The engine side of hf_paged's continuous-batching manager: requests as engine requests.

transformers' ``ContinuousBatchingManager`` reads one ``GenerationConfig`` for all its
requests: the logits processors ``_get_logits_processor`` builds from it, filtered by
``ContinuousBatchingLogitsProcessorList`` (which drops those it marks unsupported and, with
``per_request_processors``, lets a request override ``temperature`` / ``top_k`` / ``top_p``
through ``add_request(**kwargs)``), and ``do_sample``. A request also sets ``max_new_tokens``
and ``eos_token_id``. ``RequestSettings`` builds the same list with the same transformers
code, then hands the engine what it computes natively (repetition penalty, temperature,
top-k, top-p: ``generation.processors.split``); anything else, and the log-probabilities
``return_logprobs`` asks for, runs in ``RowHooks`` as transformers' objects over each
request's own tokens. ``EngineLoop`` queues transformers' ``RequestState`` objects on the
engine, steps it and copies tokens, status, log-probabilities and timestamps back into them.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cb_logits_processors import (
    CLASSIC_TO_CB_PROCESSORS_MAP,
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import (
    GenerationOutput,
    RequestState,
    RequestStatus,
)
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.engine.engine import PagedEngine
from hf_paged.engine.sequence import Sequence, Status
from hf_paged.generation import processors as procs
from hf_paged.sampling_params import RequestHooks, SamplingParams

logger = logging.getLogger(__name__)

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
        self.logprobs = bool(cb_config.return_logprobs)
        self.max_total_tokens = max_total_tokens
        rest = procs.split(LogitsProcessorList(self.processors), padded=False, keep_all=False).rest
        reads_ids = any(type(p) not in _WARPERS for p in rest)
        self.hooks = RowHooks(needs_history=reads_ids, logprobs=self.logprobs)

    def params(self, state: RequestState) -> tuple[SamplingParams, LogitsProcessorList]:
        """The request's SamplingParams and the processors its row runs in ``self.hooks``
        (empty: none). Raises naming what is wrong with the request."""
        overrides = state.logit_processor_kwargs
        self.cb_processors.check_kwargs(overrides)  # transformers' own check of the keywords
        chain = LogitsProcessorList(_override(p, overrides) for p in self.processors)
        split = procs.split(chain, padded=False, keep_all=False)
        rows = split.rest
        temperature, top_k, top_p = split.temperature, split.top_k, split.top_p
        if self.logprobs:  # the warpers run in the hooks, which take the processed scores' log
            head = int(split.repetition_penalty != 1.0)
            rows = LogitsProcessorList([*rows, *list(chain)[head + len(rows):]])
            temperature, top_k, top_p = 1.0, 0, 1.0
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
            repetition_penalty=split.repetition_penalty,
            eos_token_ids=_eos_ids(state.eos_token_id),
            hooks=self.hooks if rows or self.logprobs else None,
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


class EngineLoop:
    """A manager's requests on the engine; only the manager's background thread calls it (it
    is the manager's ``batch_processor``). ``active`` maps request ids to (state, sequence);
    outputs go to the manager's ``OutputRouter``."""

    def __init__(self, engine: PagedEngine, settings: RequestSettings, router: OutputRouter):
        self.engine = engine
        self.scheduler = engine.scheduler  # what transformers' server reads to monitor
        self.settings = settings
        self.router = router
        self.active: dict[str, tuple[RequestState, Sequence]] = {}

    def take(self, states: list[RequestState], cancellations: list[str]) -> None:
        """New requests first, then cancellations (in that order, as transformers)."""
        for state in states:
            self.add(state)
        for request_id in cancellations:
            self.cancel(request_id)

    def add(self, state: RequestState) -> None:
        """Queue ``state`` on the engine (with ``num_children`` more sequences sharing its
        prompt's blocks); a request the engine cannot serve fails alone, naming why."""
        n = 1 + state.num_children
        try:
            if state.request_id in self.active:
                raise ValueError(f"request_id {state.request_id!r} is already in use")
            params, rows = self.settings.params(state)
            if n == 1:
                seqs = [self.engine.add_request(state.initial_tokens, params, state.request_id)]
            else:
                seqs = self.engine.add_forked_requests(state.initial_tokens, params, n)
        except Exception as error:
            logger.warning("Request %s failed: %s", state.request_id, error)
            self.router.fail_and_deliver(state, error)
            return
        # transformers names forked children '<id>__child#<i>'; the parent keeps the id.
        children = [state.fork(f"{state.request_id}__child#{i}") for i in range(n - 1)]
        state.num_children = 0
        for child_state, seq in zip([state, *children], seqs):
            if params.hooks is not None:
                params.hooks.add(seq, rows)
            self.active[child_state.request_id] = (child_state, seq)

    def cancel(self, request_id: str) -> None:
        """Drop the request and free its KV blocks now; as in transformers, no output follows
        (an unknown or finished id is ignored)."""
        entry = self.active.pop(request_id, None)
        if entry is not None:
            self._release(entry[1])

    def step(self) -> None:
        """One engine step, then the states brought up to date. A step that fails drops the
        requests it ran and the engine stays usable: those requests fail with its error."""
        error = None
        try:
            self.engine.step()
        except Exception as failure:
            if self.engine.closed or self.engine.executor.broken:
                raise  # nothing more can run: the manager's fatal error
            logger.warning("An engine step failed: %s", failure)
            error = failure
        self.sync(error)

    def sync(self, error: Exception | None = None) -> None:
        """Copy what the engine produced into the states and deliver: every change of a
        streaming request, and each request as it ends. A request the engine dropped (a
        failed step: ``error``, here or in a ``generate`` call during a pause) fails."""
        outputs: list[GenerationOutput] = []
        now = time.perf_counter()
        on_host: dict = {}
        hooks = self.settings.hooks
        for request_id, (state, seq) in list(self.active.items()):
            if seq.is_finished and seq.finish_reason == "abort":
                self.fail(request_id, error or RuntimeError(
                    "the engine dropped this request: a step that ran it failed"))
                continue
            new = seq.num_new_tokens - len(state.generated_tokens)
            if state.status == RequestStatus.PENDING and (seq.status is not Status.WAITING or new):
                state.status = RequestStatus.PREFILLING  # stamps the start of its lifespan
            if new > 0:
                if state.status < RequestStatus.DECODING:
                    state.status = RequestStatus.DECODING
                state.generated_tokens.extend(seq.token_ids[len(seq.token_ids) - new:])
                if state.record_timestamps:
                    state.timestamps.extend([now] * new)
                if self.settings.logprobs:
                    state.logprobs.extend(hooks.take_logprobs(seq, new, on_host))
            if seq.is_finished:
                del self.active[request_id]
                hooks.drop(seq)
                state.status = RequestStatus.FINISHED  # stamps the end of its lifespan
                outputs.append(state.to_generation_output())
            elif new > 0 and state.streaming:
                outputs.append(state.to_generation_output())
        if outputs:
            self.router.deliver_batch(outputs)

    def fail(self, request_id: str, error: Exception) -> None:
        state, seq = self.active.pop(request_id)
        self._release(seq)
        self.router.fail_and_deliver(state, error)

    def fail_all(self, error: Exception) -> None:
        for request_id in list(self.active):
            self.fail(request_id, error)

    def _release(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.engine.abort(seq)
        self.settings.hooks.drop(seq)

    def synchronize(self) -> None:
        """Let the device finish what was launched (before a pause hands the model over)."""
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def close(self) -> None:
        """Abort what is left and collect the step still in flight, so the engine is idle for
        its next user (``generate``, another manager)."""
        try:
            for _, seq in self.active.values():
                self._release(seq)
            self.active.clear()
            if (self.engine.in_flight is not None and not self.engine.closed
                    and not self.engine.scheduler.has_work()):
                self.engine.step()  # schedules nothing, collects the last step
        except Exception as error:  # a broken engine: its error was reported already
            logger.warning("Could not collect the engine's last step: %s", error)
