"""Draft-model speculation: a small model of the target's tokenizer, served by a paged engine
of its own, drafts greedily for each target sequence.

Each target sequence has a draft ``Sequence`` in the draft engine, keyed by the target's
``seq_id``, whose cache outlives a ``propose`` call: the next call keeps the cache of the
tokens the target still shares with it (its accepted drafts included) and computes only the
rest. The draft engine's scheduler is not involved: ``propose`` builds the steps itself, every
sequence of the call batched in each (at most ``max_num_seqs`` a step): a first step computes
each sequence's uncomputed tokens (chunked to ``max_num_batched_tokens``; a sequence's first
use takes prefix-cache hits as admission does) and draws its first draft, then one-token steps
draw the rest. Every input token is on the host when a step is built (no pending tokens).

A sequence stops drafting at its limit, after drafting an EOS of the target's request (kept,
as transformers' assistant stops), or after a draft the draft model gave a probability below
the request's ``confidence_threshold`` (kept: transformers' ``ConfidenceCriteria``). It never
drafts past the draft engine's ``max_model_len``. When the draft cache has no room even after
the draft sequences not in the call are freed, a sequence keeps the drafts it has and its
draft sequence is freed; it is rebuilt at its next call, from the prefix cache where blocks
survived.

Building a draft engine (from a model object or a checkpoint) lives in ``draft_engine``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hf_paged.config import EngineConfig
from hf_paged.engine.batch import ScheduledBatch
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.sequence import Sequence
from hf_paged.sampling_params import Proposer, SamplingParams
from hf_paged.worker.executor import Executor


class DraftEngine(Protocol):
    """What drafting uses of the engine it drafts on (an ``EngineCore``): its steps go
    straight to the executor, over the engine's blocks."""

    config: EngineConfig
    max_model_len: int
    block_manager: BlockManager
    executor: Executor

    def close(self) -> None:
        """Free the engine (a proposer that owns it closes it)."""

# Drafts are greedy and never end on their own: the proposer decides where they stop.
_GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 62, ignore_eos=True)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0])


@dataclass
class _Drafting:
    """One target sequence's drafting during a ``propose`` call."""

    key: int  # the target's seq_id
    draft: Sequence  # the target's tokens in the draft engine, then the drafts
    limit: int
    eos: tuple[int, ...]
    threshold: float | None
    fresh: bool  # no cache yet: its first allocation takes prefix-cache hits
    drafts: list[int] = field(default_factory=list)
    done: bool = False
    pending: int = 0  # drafts drawn by launched steps, not collected yet

    @property
    def wants_step(self) -> bool:
        """Whether a step should draw another draft for it (or finish its catch-up chunk)."""
        return not self.done and len(self.drafts) + self.pending < self.limit

    def take(self, token: int, prob: float | None) -> None:
        """Keep a drafted token; stop at the limit, after an EOS or a low-confidence draft.
        A draft drawn after it stopped (its step was launched before the stop was known) is
        dropped."""
        self.pending -= 1
        if self.done:
            return
        self.drafts.append(token)
        self.draft.token_ids.append(token)
        self.done = (len(self.drafts) == self.limit or token in self.eos
                     or (self.threshold is not None and prob < self.threshold))


class DraftProposer(Proposer):
    """Drafts with ``engine``'s model (same vocabulary as the target's), on its paged cache.

    ``owns_engine``: ``close`` closes the engine too (one built for this proposer alone).
    ``stats`` counts calls, draft steps, drafted tokens and the sequences the cache had no
    room for.
    """

    def __init__(self, engine: DraftEngine, owns_engine: bool = False):
        self.engine = engine
        self.owns_engine = owns_engine
        self.block_manager = engine.block_manager
        self.executor = engine.executor
        self.drafts: dict[int, Sequence] = {}  # target seq_id -> its draft sequence
        self.num_calls = 0
        self.num_steps = 0
        self.num_drafted_tokens = 0
        self.num_no_room = 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        self.num_calls += 1
        work = [self._start(seq, limit) for seq, limit in zip(seqs, limits)]
        live = [w for w in work if w is not None]
        busy = {w.key for w in live}
        launched = None
        try:
            # Each step is launched before the previous one is collected: its inputs are the
            # previous step's draws, read on the device (pending tokens), so the host builds
            # step N+1 while the device runs step N. A stop (EOS, confidence) is seen one step
            # late; that step's draw is dropped.
            while True:
                step = self._launch([w for w in live if w.wants_step], busy)
                if launched is not None:
                    self._take(*launched)
                if step is None:
                    break
                launched = step
        except BaseException:  # the call's draft caches are in an unknown state: rebuilt later
            self.release(list(busy))
            raise
        return [[] if w is None else w.drafts for w in work]

    def _start(self, seq: Sequence, limit: int) -> _Drafting | None:
        """Bring ``seq``'s draft sequence in line with its tokens; None when it cannot draft."""
        target = seq.token_ids
        limit = min(limit, self.engine.max_model_len - len(target))
        if limit <= 0:  # the draft model's length is reached, for good: its cache goes
            self.release([seq.seq_id])
            return None
        draft = self.drafts.get(seq.seq_id)
        fresh = draft is None
        if fresh:
            draft = self.drafts[seq.seq_id] = Sequence(target, _GREEDY)
        else:
            # Positions the target still shares keep their cache, but for its newest token,
            # computed again: its logits draw the first draft.
            keep = min(common_prefix_len(draft.token_ids, target), len(target) - 1)
            del draft.token_ids[keep:]
            self.block_manager.truncate(draft, keep)
            draft.token_ids.extend(target[keep:])
        params = seq.params
        speculation = seq.speculation or params.speculation
        threshold = None if speculation is None else speculation.confidence_threshold
        eos = () if params.ignore_eos else params.eos_token_ids
        return _Drafting(seq.seq_id, draft, limit, eos, threshold, fresh)

    def _launch(self, live: list[_Drafting], busy: set[int]) -> tuple | None:
        """Launch one draft step: every live sequence's uncomputed tokens (its pending draft,
        once drafting), as far as the token budget and ``max_num_seqs`` allow, each drawing a
        token when its chunk reaches its end. Returns the launched step, the sequences that
        draw in it and whether it reports probabilities; None when there is nothing to
        launch."""
        config = self.engine.config
        budget = config.max_num_batched_tokens
        batch, drawing = ScheduledBatch(), []
        for w in live:
            if len(batch.seqs) == config.max_num_seqs or not budget:
                break
            draft = w.draft
            # Matched right before the allocation that takes them: an allocation in between
            # could evict the blocks matched.
            hits = self.block_manager.match_prefix(draft) if w.fresh else []
            cached = len(hits) * self.block_manager.block_size
            end = len(draft) + w.pending
            n = min(end - draft.num_computed_tokens - cached, budget)
            if not self._allocate(draft, n, hits, busy):
                self.num_no_room += 1
                w.done = True
                if not w.pending:  # else its launched step still reads its blocks
                    self.release([w.key])
                continue
            w.fresh = False
            start = draft.num_computed_tokens  # prefix-cache hits count as computed
            draft.num_computed_tokens = start + n
            batch.add(draft, start, n, start + n == end)
            if start + n == end:
                drawing.append(w)
            budget -= n
        if not batch.seqs:
            return None
        batch.block_copies = self.block_manager.take_copies()
        plan = batch.plan()
        plan.report_probs = any(w.threshold is not None for w in drawing)
        handle = self.executor.launch(plan)
        for w in drawing:
            w.pending += 1
        self.num_steps += 1
        return handle, drawing, plan.report_probs

    def _take(self, handle, drawing: list[_Drafting], probs_reported: bool) -> None:
        """Collect a launched draft step and hand each sequence its draw."""
        result = self.executor.collect(handle)
        probs = result.probs if probs_reported else [None] * len(drawing)
        for w, token, prob in zip(drawing, result.tokens, probs):
            w.take(token, prob)
        self.num_drafted_tokens += len(drawing)

    def _allocate(self, draft: Sequence, n: int, hits: list[int], busy: set[int]) -> bool:
        """``allocate``, after freeing the draft sequences outside this call if it fails
        first (their full blocks stay in the prefix cache)."""
        if self.block_manager.allocate(draft, n, hits):
            return True
        idle = [key for key in self.drafts if key not in busy]
        if not idle:
            return False
        self.release(idle)
        return self.block_manager.allocate(draft, n, hits)

    def release(self, seq_ids: list[int]) -> None:
        gone = [self.drafts.pop(k) for k in seq_ids if k in self.drafts]
        for draft in gone:
            self.block_manager.free(draft)
        if gone:
            self.executor.release([d.seq_id for d in gone])

    def close(self) -> None:
        """Free every draft sequence's blocks (the engine may serve others), then close the
        engine if this proposer owns it."""
        self.release(list(self.drafts))
        if self.owns_engine:
            self.engine.close()

    def stats(self) -> dict[str, int]:
        return {
            "draft_calls": self.num_calls,
            "draft_steps": self.num_steps,
            "draft_tokens": self.num_drafted_tokens,
            "draft_no_room": self.num_no_room,
        }
