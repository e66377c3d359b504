"""Continuous batching: admit, chunked prefill, decode, preempt, finish.

Every step hands out a budget of ``max_num_batched_tokens``. Running requests come first, in
admission order: each asks for all its uncomputed tokens (one when decoding, a chunk when a
long prompt is still being prefilled). Waiting requests are then admitted while the budget,
``max_num_seqs`` and free blocks allow; a prompt longer than what is left is prefilled in
chunks over several steps, sharing each with the decodes. When blocks run out even after
eviction, the most recently admitted request is preempted: its blocks are released (they stay
in the prefix cache) and it goes back to the front of the queue, to be recomputed.

Scheduling is asynchronous: a step is scheduled while the previous one still runs on the
device, so the host works beside the device instead of between its steps. ``schedule`` counts
the batch's tokens as computed at once and each sampled token as pending; ``postprocess``
receives a step's tokens one step later. A request whose pending token is its last by length
is not scheduled again; one that stops at an EOS may have computed one more token, which is
dropped.

Speculative decoding. A request given draft tokens (``seq.draft_token_ids``, by the engine's
``Speculator`` before ``schedule``) computes its newest token and its drafts in one chunk and
draws a token at each of those positions; ``postprocess`` keeps what its ``Verifier`` accepts
(the drafts up to the first the model disagreed with plus the model's token there), appending
them one at a time so that an EOS or the length ends the request where plain decoding would,
and gives back the cache of the rejected positions. Drafts never cost a preemption: when blocks
run short they are dropped first. A step holding a request that may speculate is collected
before the next is scheduled (``ScheduledBatch.feeds_next_step``), since drafting needs its
tokens. The scheduler knows speculation only through ``Verifier``; who drafts lives in
``hf_paged.engine.speculation``.

Forks, group choices, aborts and the queues themselves: ``RequestQueues``.
"""

from __future__ import annotations

from typing import Protocol

from hf_paged.engine.batch import ScheduledBatch
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.queues import RequestQueues
from hf_paged.engine.sequence import Sequence, SequenceGroup, Status


class Verifier(Protocol):
    """Speculative decoding as the scheduler sees it (the engine's ``Speculator``)."""

    def adopt(self, seq: Sequence) -> None:
        """Settle a new request's speculation."""

    def needs_tokens(self, seq: Sequence, num_running: int) -> bool:
        """Whether ``seq`` may draft at its next step while ``num_running`` requests run."""

    def verify(self, seq: Sequence, drafts: list[int], drawn: list[int]) -> list[int]:
        """The tokens a verified step of ``seq`` keeps, of those it ``drawn`` (one after its
        newest token and after each of its ``drafts``)."""


class Scheduler(RequestQueues):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        speculator: Verifier | None = None,
    ):
        super().__init__(block_manager)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.speculator = speculator  # None: requests never speculate

    def add(self, seq: Sequence, followers: list[Sequence] = ()) -> None:
        """Queue a request; ``followers`` (requests with the same prompt) fork from it when
        its prompt is first sampled."""
        seq.followers = list(followers)
        for follower in followers:
            follower.leader = seq
        if self.speculator is not None:
            for request in (seq, *followers):
                self.speculator.adopt(request)
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        # A hybrid model's fork and snapshot copies recorded so far run before this step's
        # forward; those recorded while scheduling it need its states, and wait for the next.
        state_slots = self.block_manager.state_slots
        ready = len(state_slots.copies) if state_slots is not None else 0
        if state_slots is not None and state_slots.snapshots is not None:
            state_slots.snapshots.publish()  # the last step's snapshots are filled first
        budget, preempted = self._schedule_running(batch, respect_holds=True)
        # Admitting right after a preemption would only take the blocks back.
        while self.waiting and budget and not preempted:
            seq = self.waiting[0]
            slots = seq.num_seq_slots
            if self.num_seq_slots + slots > self.max_num_seqs:
                break
            hits = self.block_manager.match_prefix(seq)
            if self.block_manager.awaits_state(seq, hits):
                break  # a hybrid model's snapshot this step fills serves it from the next
            cached = len(hits) * self.block_manager.block_size
            n = self._chunk(seq, cached, min(len(seq) - cached, budget))
            if not self.block_manager.allocate(seq, n, hits):
                if batch.seqs or not self._preempt_idle_member():
                    break
                continue
            self.waiting.popleft()
            self.num_seq_slots += slots
            if seq.group is not None:
                seq.group.admitted = True
            seq.status = Status.RUNNING
            seq.num_cached_tokens = cached
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += cached
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
            budget -= n
        if not batch.seqs and not preempted:
            # Nothing but held requests can run (what they wait for cannot be admitted yet):
            # a hold is a preference, never a deadlock.
            self._schedule_running(batch, respect_holds=False)
        # Followers forked by this step run from the next one (their tokens are being sampled).
        self.running.extend(follower for _, follower in batch.sample_copies)
        batch.block_copies = self.block_manager.take_copies()
        if state_slots is not None and batch.seqs:  # with no step, the copies wait
            batch.state_copies = state_slots.take_copies(ready)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, respect_holds: bool) -> tuple[int, bool]:
        """Running requests first, in admission order; returns the budget left and whether
        a request was preempted."""
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        allocate = self.block_manager.allocate
        while i < len(self.running) and budget:
            seq = self.running[i]
            if seq.num_pending and self._length_reached(seq, seq.num_tokens):
                i += 1  # its pending token is its last: nothing more to compute
                continue
            hooks = seq.params.hooks
            if respect_holds and hooks is not None and not hooks.may_compute(seq):
                i += 1
                continue
            n = self._chunk(seq, seq.num_computed_tokens,
                            min(seq.num_tokens - seq.num_computed_tokens, budget))
            if n == 0:  # a group member waiting for its group's choice
                i += 1
                continue
            if seq.draft_token_ids:
                del seq.draft_token_ids[budget - n:]
                if not allocate(seq, n + len(seq.draft_token_ids)):
                    seq.draft_token_ids = []  # drafts give way before anything is preempted
                else:
                    n += len(seq.draft_token_ids)
                    self._add_to_batch(batch, seq, n)
                    budget -= n
                    i += 1
                    continue
            while not allocate(seq, n):
                preempted = True
                # A member waiting for its group's choice gives way first: it may be waiting
                # for this very sequence, whose preemption would then repeat forever.
                j = self._idle_member_index(besides={seq.seq_id, *(s.seq_id for s in batch.seqs)})
                if j is not None:
                    self._preempt(self.running.pop(j), park=True)
                    i -= j < i
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._add_to_batch(batch, seq, n)
                budget -= n
                i += 1
        return budget, preempted

    def postprocess(
        self, batch: ScheduledBatch, sampled: list[int], candidates: list[tuple] = ()
    ) -> list[Sequence]:
        """Append a finished step's sampled tokens (one per sequence with ``sample`` set that
        belongs to no group, in order, then one per follower in ``sample_copies``), hand group
        members their ``candidates`` (in order), and finish what must stop."""
        finished: list[Sequence] = []
        tokens, reports = iter(sampled), iter(candidates)
        ready: dict[int, SequenceGroup] = {}
        appended: list[Sequence] = []
        for seq, sample, drafts in zip(batch.seqs, batch.sample, batch.num_draft_tokens):
            if not sample:
                continue
            if drafts:
                drawn = [next(tokens) for _ in range(drafts + 1)]
                if self._verified(seq, drawn, finished):
                    appended.append(seq)
            elif seq.group is None:
                if self._append(seq, next(tokens), finished):
                    appended.append(seq)
            else:
                report = next(reports)
                if not seq.is_finished and seq.group.report(seq, report):
                    ready[id(seq.group)] = seq.group
        for _, follower in batch.sample_copies:
            if self._append(follower, next(tokens), finished):
                appended.append(follower)
        self._run_hooks(appended, finished)
        for group in ready.values():
            self._advance(group, finished)
        if finished or ready:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return finished

    def _append(self, seq: Sequence, token: int, finished: list[Sequence]) -> bool:
        """Append ``token`` to ``seq`` and finish it at EOS or its length; False when the
        request had stopped meanwhile (the token is one too many)."""
        if seq.is_finished:
            return False
        seq.num_pending -= 1
        seq.token_ids.append(token)
        seq.finish_reason = self.finish_reason(seq)
        if seq.finish_reason is not None:
            self._finish(seq, finished)
        return True

    def _verified(self, seq: Sequence, drawn: list[int], finished: list[Sequence]) -> bool:
        """Keep what a verified step of ``seq`` accepted (each token appended as if decoded
        alone) and give back the cache of the positions past them; False when the request had
        stopped meanwhile."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if seq.is_finished:
            return False
        kept = self.speculator.verify(seq, drafts, drawn)
        self._append(seq, kept[0], finished)
        for token in kept[1:]:
            if seq.is_finished:
                break
            seq.num_pending += 1
            self._append(seq, token, finished)
        if not seq.is_finished:
            seq.num_computed_tokens = len(seq.token_ids) - 1
            self.block_manager.truncate(seq, seq.num_computed_tokens)
        return True

    def finish_reason(self, seq: Sequence) -> str | None:
        """Why ``seq`` ends at its newest token ("stop": an EOS; "length"), or None."""
        params = seq.params
        if not params.ignore_eos and seq.token_ids[-1] in params.eos_token_ids:
            return "stop"
        return "length" if self._length_reached(seq, len(seq.token_ids)) else None

    def _run_hooks(self, appended: list[Sequence], finished: list[Sequence]) -> None:
        """Each hooks object sees its requests that got a token this step, once; the
        requests it stops keep the tokens it says."""
        by_hooks: dict[int, tuple] = {}
        for seq in appended:
            if seq.params.hooks is not None:
                by_hooks.setdefault(id(seq.params.hooks), (seq.params.hooks, []))[1].append(seq)
        for hooks, seqs in by_hooks.values():
            for seq, kept in hooks.on_tokens(seqs):
                del seq.token_ids[seq.num_prompt_tokens + kept:]
                if not seq.is_finished:
                    seq.finish_reason = "stop"
                    self._finish(seq, finished)

    def _length_reached(self, seq: Sequence, num_tokens: int) -> bool:
        new = num_tokens - seq.num_prompt_tokens
        return new >= seq.params.max_new_tokens or num_tokens >= self.max_model_len

    def _chunk(self, seq: Sequence, start: int, n: int) -> int:
        """``n`` tokens from ``start``, or fewer: a hybrid model's prefill chunk ends where a
        state snapshot is taken."""
        stop = self.block_manager.state_stop(seq, start)
        return stop - start if start < stop < start + n else n

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        """Count the chunk as computed (the step will have stored its K/V before any later
        step reads them) and its sampled token, if any, as pending. A group member's step
        yields candidates, not a token. Followers are forked when the prompt is sampled."""
        start = seq.num_computed_tokens
        drafts = len(seq.draft_token_ids)
        sample = start + n == seq.num_tokens + drafts
        batch.add(seq, start, n, sample, drafts)
        if sample and self.speculator is not None \
                and self.speculator.needs_tokens(seq, len(self.running)):
            batch.speculative = True  # its next step may draft: it needs this one's tokens
        seq.num_computed_tokens = start + n
        if start + n == self.block_manager.state_stop(seq, start):
            self.block_manager.save_state(seq, start + n)
        seq.num_pending += sample and seq.group is None
        if sample and seq.followers:
            for follower in seq.followers:
                self.block_manager.fork(seq, follower)
                follower.num_computed_tokens = seq.num_computed_tokens
                follower.num_pending = 1
                follower.status, follower.leader = Status.RUNNING, None
                batch.sample_copies.append((len(batch.seqs) - 1, follower))
            seq.followers = []
