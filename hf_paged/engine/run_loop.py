"""Stepping an engine until a set of its requests has finished: with tqdm's progress bar when
asked for (off by default: transformers' generate() prints nothing, and a drop-in must not
either), or yielding new tokens as they arrive."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from tqdm.auto import tqdm

from hf_paged.engine.batch import ScheduledBatch
from hf_paged.engine.sequence import Sequence


def step_until_finished(
    seqs: list[Sequence],
    step: Callable[[], list[Sequence]],
    abort: Callable[[Sequence], None],
    on_step: Callable[[list[Sequence]], None] | None = None,
    progress: Callable[[float], str] | None = None,
) -> None:
    """``step()`` until every one of ``seqs`` has finished, calling ``on_step(seqs)`` after
    each step; if anything fails, the unfinished ones are ``abort``ed (the engine stays usable)
    and the error propagates. ``progress(seconds of the step)``: the bar's text (no bar when
    None)."""
    bar = tqdm(total=len(seqs), desc="hf_paged", unit="req", disable=progress is None)
    pending = {s.seq_id for s in seqs if not s.is_finished}
    try:
        while pending:
            t0 = time.perf_counter()
            finished = step()
            pending.difference_update(s.seq_id for s in finished)
            if on_step is not None:
                on_step(seqs)
            if progress is not None:
                bar.set_postfix_str(progress(time.perf_counter() - t0))
                bar.update(len(finished))
    except BaseException:
        for s in seqs:
            if not s.is_finished:
                abort(s)
        raise
    finally:
        bar.close()


def stream_new_tokens(seqs: list[Sequence], step: Callable[[], list[Sequence]],
                      abort: Callable[[Sequence], None]) -> Iterator[tuple[int, list[int]]]:
    """``step()`` until every one of ``seqs`` has finished, yielding ``(index in seqs, new
    token ids)`` as they arrive; those still running when the iterator is closed are
    ``abort``ed."""
    sent = [0] * len(seqs)
    try:
        while not all(s.is_finished for s in seqs):
            step()
            for i, seq in enumerate(seqs):
                if seq.num_new_tokens > sent[i]:
                    yield i, seq.output_token_ids[sent[i]:]
                    sent[i] = seq.num_new_tokens
    finally:
        for seq in seqs:
            if not seq.is_finished:
                abort(seq)


def progress_text(batch: ScheduledBatch, stats: dict[str, int], seconds: float) -> str:
    """The progress bar's text after a step of ``seconds`` that ran ``batch``, with the
    engine's ``stats`` then."""
    kind = "decode" if batch.is_decode else "prefill"
    tokens = len(batch.seqs) if batch.is_decode else batch.num_prefill_tokens
    hit = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
    return f"{kind} {tokens / seconds:,.0f} tok/s, cache hit {hit:.0%}"
