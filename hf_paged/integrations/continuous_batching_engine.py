"""The engine side of hf_paged's continuous-batching manager: ``EngineLoop`` queues
transformers' ``RequestState`` objects on the engine (with ``RequestSettings``), steps it and
copies tokens, status, log-probabilities and timestamps back into them.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import (
    GenerationOutput,
    RequestState,
    RequestStatus,
)

from hf_paged.engine.sequence import Sequence, Status
from hf_paged.generation.paged_engine import PagedEngine
from hf_paged.integrations.continuous_batching_requests import RequestSettings
from hf_paged.integrations.output_delivery import OutputDelivery
from hf_paged.integrations.request_times import RequestTimes

logger = logging.getLogger(__name__)
# What a partial output shares with its request's state (``EngineLoop._partial``).
_SHARED = ("generated_tokens", "logprobs", "error", "status", "created_time", "lifespan",
           "timestamps")


class EngineLoop:
    """A manager's requests on the engine; only the manager's background thread calls it (it
    is the manager's ``batch_processor``). ``active`` maps request ids to (state, sequence);
    outputs go to the manager's ``OutputRouter`` (through ``OutputDelivery``: a stream's
    partial output is skipped while its last one waits for its handler); ``times`` totals
    what a server reports of them (``/metrics``)."""

    def __init__(self, engine: PagedEngine, settings: RequestSettings, router: OutputRouter):
        self.engine = engine
        self.scheduler = engine.scheduler  # what transformers' server reads to monitor
        self.settings = settings
        self.router = router
        self.delivery = OutputDelivery(router)
        self.active: dict[str, tuple[RequestState, Sequence]] = {}
        self.times = RequestTimes()
        self.first_token_at: dict[str, float] = {}  # request id -> when its first token came

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
        self.first_token_at.pop(request_id, None)
        if entry is not None:
            self._release(entry[1])

    def step(self) -> None:
        """One engine step, then the states brought up to date. A step that fails drops the
        requests it ran and the engine stays usable: those requests fail with its error."""
        error = None
        try:
            self.engine.step()
        except Exception as failure:
            if self.engine.closed or self.engine.broken:
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
                    self.first_token_at[request_id] = now
                self.times.tokens += new
                state.generated_tokens.extend(seq.token_ids[len(seq.token_ids) - new:])
                if state.record_timestamps:
                    state.timestamps.extend([now] * new)
                if self.settings.logprobs:
                    state.logprobs.extend(hooks.take_logprobs(seq, new, on_host))
            if seq.is_finished:
                del self.active[request_id]
                hooks.drop(seq)
                first = self.first_token_at.pop(request_id, None)
                self.times.request_done(state.created_time, first, now,
                                        len(state.generated_tokens))
                state.status = RequestStatus.FINISHED  # stamps the end of its lifespan
                outputs.append(state.to_generation_output())
            elif new > 0 and state.streaming and not self.delivery.waiting(request_id):
                outputs.append(self._partial(state))
        if outputs:
            self.delivery.deliver(outputs)

    def _partial(self, state: RequestState) -> GenerationOutput:
        """A streaming request's output before its last. For a request a result handler
        reads (transformers serve's streamer, on the event loop: ``generated_tokens`` from where
        it left off), the state's own lists rather than copies, which would cost this thread
        O(length) a token every step; this thread only appends to them, so a reader sees a
        prefix. Outputs read from the queue are copies, as transformers makes them."""
        if state.request_id not in self.router.result_handlers or state._true_initial_tokens:
            return state.to_generation_output()
        output = GenerationOutput(state.request_id, prompt_ids=state.initial_tokens)
        for name in _SHARED:
            setattr(output, name, getattr(state, name))
        return output

    def fail(self, request_id: str, error: Exception) -> None:
        state, seq = self.active.pop(request_id)
        self.first_token_at.pop(request_id, None)
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
            self.first_token_at.clear()
            if (self.engine.in_flight is not None and not self.engine.closed
                    and not self.engine.scheduler.has_work()):
                self.engine.step()  # schedules nothing, collects the last step
        except Exception as error:  # a broken engine: its error was reported already
            logger.warning("Could not collect the engine's last step: %s", error)
