"""Continuous batching: admit, chunked prefill, decode, preempt, finish.

Every step hands out a budget of ``max_num_batched_tokens``. Running requests come first, in
admission order: each asks for all its uncomputed tokens (one when decoding, a chunk when a
long prompt is still being prefilled). Waiting requests are then admitted while the budget,
``max_num_seqs`` and free blocks allow; a prompt longer than what is left is prefilled in
chunks over several steps, sharing each with the decodes. When blocks run out even after
eviction, the most recently admitted request is preempted: its blocks are released (they stay
in the prefix cache) and it goes back to the front of the queue, to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step's work: ``num_tokens[i]`` new tokens of ``seqs[i]``, starting at its
    ``num_computed_tokens``. ``sample[i]`` says whether that chunk reaches the end of the
    sequence, so that a token is drawn from its last logits."""

    seqs: list[Sequence] = field(default_factory=list)
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
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
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
        """Record the computed tokens, append the sampled ones (``sampled`` has one entry per
        sequence with ``sample`` set, in order) and finish what must stop."""
        finished = []
        tokens = iter(sampled)
        for seq, n, sample in zip(batch.seqs, batch.num_tokens, batch.sample):
            seq.num_computed_tokens += n
            if not sample:
                continue
            token = next(tokens)
            seq.token_ids.append(token)
            params = seq.params
            if not params.ignore_eos and token in params.eos_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_new_tokens >= params.max_new_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            else:
                continue
            seq.status = Status.FINISHED
            self.block_manager.free(seq)
            finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return finished

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
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        batch.sample.append(seq.num_computed_tokens + n == len(seq.token_ids))
