"""One step's work as the scheduler decides it, and the plain-data plan the worker receives."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.engine.sequence import Sequence
from hf_paged.step import StepPlan


@dataclass
class ScheduledBatch:
    """One step's work: ``num_tokens[i]`` new tokens of ``seqs[i]`` from position
    ``starts[i]``. ``sample[i]`` says whether that chunk reaches the end of the sequence, so
    that a token is drawn from its last logits."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    # Followers forked by this step, each sampling the logits row of batch entry ``index``.
    sample_copies: list[tuple[int, Sequence]] = field(default_factory=list)
    # Copy-on-write block copies (source, destination) to make before the forward, in order.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # A hybrid model's state-slot copies (source, destination) before the forward, in order:
    # forks' and snapshots' recorded before this step, then restores of prefix-cache hits.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens ending each sequence's chunk (0: none), and
    # whether a request of the batch may draft next step (it needs this step's tokens first).
    num_draft_tokens: list[int] = field(default_factory=list)
    speculative: bool = False

    def add(self, seq: Sequence, start: int, n: int, sample: bool, drafts: int = 0) -> None:
        """``n`` tokens of ``seq`` from ``start``, the last ``drafts`` of them draft tokens."""
        self.seqs.append(seq)
        self.starts.append(start)
        self.num_tokens.append(n)
        self.sample.append(sample)
        self.num_draft_tokens.append(drafts)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly its one newest token."""
        return len(self.seqs) == sum(self.num_tokens) and all(self.sample)

    def plan(self) -> StepPlan:
        """The step as the worker reads it: plain data, the sequences' lists shared, not
        copied."""
        seqs = self.seqs
        drafting = any(self.num_draft_tokens)
        # A drafting sequence's chunk reads its drafts after its tokens: a list of its own.
        tokens = [s.token_ids + s.draft_token_ids if d else s.token_ids
                  for s, d in zip(seqs, self.num_draft_tokens)] if drafting else \
            [s.token_ids for s in seqs]
        return StepPlan(
            [s.seq_id for s in seqs], self.starts, self.num_tokens, tokens,
            [s.block_table for s in seqs], self.sample,
            [s.sampling for s in seqs], [(i, f.sampling) for i, f in self.sample_copies],
            self.block_copies, self.is_decode, self.num_draft_tokens if drafting else [],
            lora_slots=[s.lora_slot for s in seqs] if any(s.lora_slot >= 0 for s in seqs)
            else [],
            # A hybrid model's sequences all hold state slots; a chunk after others (or a
            # decode row) continues from its slot's state, a first chunk starts from zeros.
            state_slots=[s.state_slot for s in seqs] if seqs[0].state_slot >= 0 else [],
            has_initial_state=[start > 0 for start in self.starts]
            if seqs[0].state_slot >= 0 else [],
            state_copies=self.state_copies,
        )

    @property
    def feeds_next_step(self) -> bool:
        """Whether the host must read this step's results before scheduling the next: a beam
        group's member samples (the group's choice is the next step's input), or a request's
        hooks read its whole history, or a request may draft next step. One pass over the
        batch."""
        if self.speculative:
            return True
        for seq, sample in zip(self.seqs, self.sample):
            hooks = seq.params.hooks
            if (sample and seq.group is not None) or (hooks is not None and hooks.needs_history):
                return True
        return False

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.is_decode else sum(n for n in self.num_tokens if n > 1)
