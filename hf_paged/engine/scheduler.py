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
draws a token at each of those positions; ``postprocess`` keeps the drafts up to the first the
model disagreed with plus the model's token there (``speculative.accepted``), appending them one
at a time so that an EOS or the length ends the request where plain decoding would, and gives
back the cache of the rejected positions. Drafts never cost a preemption: when blocks run short
they are dropped first. A step holding a request that may speculate is collected before the next
is scheduled (``ScheduledBatch.feeds_next_step``), since drafting needs its tokens.

Forks. Requests added as followers of a leader share its prompt: when the leader's prompt is
first sampled they are forked from it (sharing its blocks) and each samples its own token from
the same logits row. The members of a ``SequenceGroup`` (beam search) report candidates
instead of sampling; once all have reported, the group's choice forks the members that
continue and frees the others. Admission reserves the most sequences a request may become
(``Sequence.num_seq_slots``) so that forks never exceed ``max_num_seqs``.
"""

from __future__ import annotations

from collections import deque

from hf_paged.engine.batch import ScheduledBatch
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.sequence import Sequence, SequenceGroup, Status
from hf_paged.engine.speculative import Speculator, accepted, drafts_next


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        # Preempted group members that had reported: they need nothing until their group's
        # choice, which sends those that go on to the front of the queue.
        self.parked: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_seq_slots = 0  # of max_num_seqs, reserved by admitted requests
        self.dropped: list[Sequence] = []  # group members freed since the last take_dropped
        self.speculator: Speculator | None = None  # set by the engine

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

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget, preempted = self._schedule_running(batch, respect_holds=True)
        # Admitting right after a preemption would only take the blocks back.
        while self.waiting and budget and not preempted:
            seq = self.waiting[0]
            slots = seq.num_seq_slots
            if self.num_seq_slots + slots > self.max_num_seqs:
                break
            hits = self.block_manager.match_prefix(seq)
            cached = len(hits) * self.block_manager.block_size
            n = min(len(seq) - cached, budget)
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
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
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
        kept = accepted(drafts, drawn)
        self.speculator.verified(seq, drafts, kept)
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

    def _finish(self, seq: Sequence, finished: list[Sequence]) -> None:
        self._release(seq)
        seq.status = Status.FINISHED
        finished.append(seq)

    def _advance(self, group: SequenceGroup, finished: list[Sequence]) -> None:
        """Apply a group's choice: each chosen member continues with its token (a member
        chosen again is forked first, sharing its blocks); the members not chosen leave."""
        choices = group.advance()
        group.reports = {}
        if not choices:
            for seq in group.members:
                self._drop(seq)
            self.num_seq_slots -= group.width
            group.admitted = False
            root = group.root
            root.status, root.finish_reason = Status.FINISHED, root.finish_reason or "stop"
            finished.append(root)
            return
        chosen: set[int] = set()
        members = []
        for parent, token in choices:  # forks first: they copy the parent's tokens
            if parent.seq_id in chosen:
                child = self.fork(parent)
                child.token_ids.append(token)
                members.append(child)
            else:
                chosen.add(parent.seq_id)
                members.append(parent)
        for parent, token in choices:  # a parent continues with its first choice
            if parent.seq_id in chosen:
                chosen.discard(parent.seq_id)
                parent.token_ids.append(token)
        kept = {s.seq_id for s in members}
        for seq in group.members:
            if seq.seq_id not in kept:
                self._drop(seq)
        group.members = members
        for seq in reversed(members):
            if seq in self.parked:
                self.parked.remove(seq)
                self.waiting.appendleft(seq)

    def fork(self, parent: Sequence) -> Sequence:
        """A copy of ``parent`` sharing its blocks, next to it in the running or waiting queue."""
        child = parent.fork()
        if parent.status is Status.RUNNING:
            self.block_manager.fork(parent, child)
            self.running.append(child)
        elif parent in self.parked:
            self.parked.append(child)
        else:
            self.waiting.insert(self.waiting.index(parent) + 1, child)
        return child

    def _drop(self, seq: Sequence) -> None:
        """A group member leaves (its group holds the slots)."""
        if seq.status is Status.RUNNING:
            self.block_manager.free(seq)
        elif seq.status is Status.WAITING:
            self._unqueue(seq)
        seq.status = Status.FINISHED
        self.dropped.append(seq)

    def _unqueue(self, seq: Sequence) -> None:
        (self.parked if seq in self.parked else self.waiting).remove(seq)

    def take_dropped(self) -> list[Sequence]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def _release(self, seq: Sequence) -> None:
        """Free a request that stops while running, or take it off the queue if it was
        preempted meanwhile; give back its slots."""
        if seq.status is Status.RUNNING:
            self.block_manager.free(seq)
            self.num_seq_slots -= 1 + len(seq.followers)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)

    def _length_reached(self, seq: Sequence, num_tokens: int) -> bool:
        new = num_tokens - seq.num_prompt_tokens
        return new >= seq.params.max_new_tokens or num_tokens >= self.max_model_len

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, releasing its blocks (a group: all its members)."""
        group = seq.group
        if group is not None:
            for member in group.members:
                if member is not group.root:
                    self._drop(member)
            self.running = [s for s in self.running if s.status is Status.RUNNING]
            if group.admitted:
                self.num_seq_slots -= group.width
                group.admitted = False
            group.members = [group.root]
            seq = group.root
        elif seq.leader is not None:  # a follower not forked yet: in no queue
            seq.leader.followers.remove(seq)
            self.num_seq_slots -= seq.leader.status is Status.RUNNING
            seq.leader, seq.status, seq.finish_reason = None, Status.FINISHED, "abort"
            return
        elif seq.followers:  # the first follower takes the prompt over, from the queue's front
            heir, *rest = seq.followers
            heir.leader, heir.followers = None, rest
            for follower in rest:
                follower.leader = heir
            seq.followers = []
            if seq.status is Status.RUNNING:
                self.num_seq_slots -= 1 + len(rest)
            self.waiting.appendleft(heir)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
            self.num_seq_slots -= seq.group is None
        elif seq.status is Status.WAITING:
            self._unqueue(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def _preempt_idle_member(self) -> bool:
        """Preempt the latest group member that waits for its group's choice (it is parked),
        when nothing else can run: the request at the queue's head (maybe the member the group
        waits for) needs its blocks."""
        i = self._idle_member_index()
        if i is not None:
            self._preempt(self.running.pop(i), park=True)
        return i is not None

    def _idle_member_index(self, besides: set[int] = frozenset()) -> int | None:
        """Where the latest running group member waiting for its group's choice is, other than
        the sequence ids ``besides`` (those of the batch being built look idle: their chunk
        counts as done)."""
        for i in range(len(self.running) - 1, -1, -1):
            seq = self.running[i]
            if (seq.group is not None and seq.num_computed_tokens == seq.num_tokens
                    and seq.seq_id not in besides):
                return i
        return None

    def _preempt(self, seq: Sequence, park: bool = False) -> None:
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        if park:
            self.parked.append(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if seq.group is None:  # a group keeps its slots for its members
            self.num_seq_slots -= 1 + len(seq.followers)

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        """Count the chunk as computed (the step will have stored its K/V before any later
        step reads them) and its sampled token, if any, as pending. A group member's step
        yields candidates, not a token. Followers are forked when the prompt is sampled."""
        start = seq.num_computed_tokens
        drafts = len(seq.draft_token_ids)
        sample = start + n == seq.num_tokens + drafts
        batch.add(seq, start, n, sample, drafts)
        if sample and self.speculator is not None and self.speculator.active \
                and drafts_next(seq):
            batch.speculative = True  # its next step may draft: it needs this one's tokens
        seq.num_computed_tokens = start + n
        seq.num_pending += sample and seq.group is None
        if sample and seq.followers:
            for follower in seq.followers:
                self.block_manager.fork(seq, follower)
                follower.num_computed_tokens = seq.num_computed_tokens
                follower.num_pending = 1
                follower.status, follower.leader = Status.RUNNING, None
                batch.sample_copies.append((len(batch.seqs) - 1, follower))
            seq.followers = []
