"""An engine whose model costs nothing: for measuring what a server spends per streamed token.

``install(step_ms, token_ids)`` makes every ``PagedEngine`` loaded from then on (in this
process) keep its real host side (scheduler, block manager, prefix cache, ``EngineLoop``,
output routing) but hand its steps to ``FakeExecutor``: a step "runs" for ``step_ms`` after
the one before it (a device runs them in turn), the engine waiting for it with the GIL
released (as it waits for a GPU; 0: no time at all), and samples, for
every row that draws a token, the next of ``token_ids`` in turn (tokens that decode to text,
none of them an end of sequence). Tokens then come as fast as the host can schedule them, far
faster than a server streams them, so a server's per-token cost shows alone.

``child()`` is the engine process's entry point with the same engine (``hf-paged serve
--engine-process``): the settings travel in ``FAKE_STEPS_ENV``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from itertools import cycle

from hf_paged.step import StepPlan, StepResult

FAKE_STEPS_ENV = "HF_PAGED_BENCH_FAKE_STEPS"  # JSON: {"step_ms": ..., "token_ids": [...]}


class FakeExecutor:
    """The engine's executor with the model's work replaced: ``launch`` draws the step's
    tokens, ``collect`` waits out the step's time; everything else is the real executor's."""

    def __init__(self, executor, step_ms: float, token_ids: list[int]):
        self._executor = executor
        self._step_s = step_ms / 1e3
        self._tokens = cycle(token_ids)
        self._done_at = 0.0  # when the last step launched is done

    def __getattr__(self, name: str):
        return getattr(self._executor, name)

    def launch(self, plan: StepPlan) -> tuple[float, list[int]]:
        if plan.num_draft_tokens or plan.lora_slots:
            raise NotImplementedError("fake steps serve plain decoding: no speculation, no LoRA")
        drawn = sum(plan.sample) + len(plan.sample_copies)
        # A device runs its steps one after another: this one starts when the last is done.
        self._done_at = max(time.perf_counter(), self._done_at) + self._step_s
        return self._done_at, [next(self._tokens) for _ in range(drawn)]

    def collect(self, step: tuple[float, list[int]]) -> StepResult:
        ready, tokens = step
        wait = ready - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the GIL released, as while waiting for the device
        return StepResult(tokens, [])


def install(step_ms: float, token_ids: list[int]) -> Callable[[], None]:
    """Every ``PagedEngine`` loaded in this process from now on runs fake steps; returns what
    undoes it."""
    if not token_ids:
        raise ValueError("token_ids: at least one token to generate")
    from hf_paged.generation.paged_engine import PagedEngine

    load = PagedEngine.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        engine = load(cls, *args, **kwargs)
        engine.executor = FakeExecutor(engine.executor, step_ms, token_ids)
        return engine

    PagedEngine.from_pretrained = classmethod(from_pretrained)

    def uninstall() -> None:
        del PagedEngine.from_pretrained  # EngineCore's again

    return uninstall


def text_tokens(tokenizer) -> list[int]:
    """Ids that decode alone to printable text (no special token, no partial character)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special
            and (text := tokenizer.decode([i])).isprintable() and text.strip()]


def child() -> None:
    """The engine process's entry point (``engine_process_main.child``) with fake steps."""
    from hf_paged.integrations import engine_process_main

    settings = json.loads(os.environ[FAKE_STEPS_ENV])
    install(settings["step_ms"], settings["token_ids"])
    engine_process_main.child()
