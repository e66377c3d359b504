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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step's work: ``num_tokens[i]`` new tokens of ``seqs[i]`` from position
    ``starts[i]``. ``sample[i]`` says whether that chunk reaches the end of the sequence, so
    that a token is drawn from its last logits."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly its one newest token."""
        return len(self.seqs) == sum(self.num_tokens) and all(self.sample)

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.is_decode else sum(n for n in self.num_tokens if n > 1)


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
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        allocate = self.block_manager.allocate
        while i < len(self.running) and budget:
            seq = self.running[i]
            if seq.num_pending and self._length_reached(seq, seq.num_tokens):
                i += 1  # its pending token is its last: nothing more to compute
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._add_to_batch(batch, seq, n)
                budget -= n
                i += 1
        # Admitting right after a preemption would only take the blocks back.
        while self.waiting and budget and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq)
            cached = len(hits) * self.block_manager.block_size
            n = min(len(seq) - cached, budget)
            if not self.block_manager.allocate(seq, n, hits):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_cached_tokens = cached
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += cached
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
            budget -= n
        return batch

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Append a finished step's sampled tokens (one per sequence with ``sample`` set, in
        order) and finish what must stop."""
        finished = []
        tokens = iter(sampled)
        for seq, sample in zip(batch.seqs, batch.sample):
            if not sample:
                continue
            token = next(tokens)
            if seq.is_finished:  # stopped or aborted while this step ran: a token too many
                continue
            seq.num_pending -= 1
            seq.token_ids.append(token)
            params = seq.params
            if not params.ignore_eos and token in params.eos_token_ids:
                seq.finish_reason = "stop"
            elif params.hooks is not None and params.hooks.on_token(seq):
                seq.finish_reason = "stop"
            elif self._length_reached(seq, len(seq.token_ids)):
                seq.finish_reason = "length"
            else:
                continue
            if seq.status is Status.RUNNING:
                self.block_manager.free(seq)
            else:  # preempted while the step ran
                self.waiting.remove(seq)
            seq.status = Status.FINISHED
            finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return finished

    def _length_reached(self, seq: Sequence, num_tokens: int) -> bool:
        new = num_tokens - seq.num_prompt_tokens
        return new >= seq.params.max_new_tokens or num_tokens >= self.max_model_len

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, releasing its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        """Count the chunk as computed (the step will have stored its K/V before any later
        step reads them) and its sampled token, if any, as pending."""
        start = seq.num_computed_tokens
        sample = start + n == seq.num_tokens
        batch.seqs.append(seq)
        batch.starts.append(start)
        batch.num_tokens.append(n)
        batch.sample.append(sample)
        seq.num_computed_tokens = start + n
        seq.num_pending += sample
