"""One request: its tokens, status, KV block table and SamplingParams. Plain data."""

from __future__ import annotations

import enum
import itertools

from hf_paged.sampling_params import SamplingParams
from hf_paged.step import CandidateRows, RowSampling

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's state as the scheduler and block manager see it.

    ``token_ids`` holds the prompt followed by every generated token the host has seen;
    ``num_pending`` more were sampled by steps still running on the device (their values reach
    the host one step later: asynchronous scheduling). ``num_computed_tokens`` counts the tokens
    whose K/V are in the cache or being written by a scheduled step (prefix-cache hits
    included); the tokens after it are what the next step must compute. ``block_table[i]`` is
    the cache block holding tokens ``i*block_size`` to ``(i+1)*block_size - 1``.
    """

    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: object = None,
                 lora: tuple[int, int] = (-1, 0)):
        self.seq_id = next(_ids)
        # The LoRA adapter's device slot (-1: the base model) and the id its prefix-cache
        # blocks are keyed by (0: the base model's): one adapter's blocks never serve another.
        self.lora_slot, self.prefix_salt = lora
        self.request_id = self.seq_id if request_id is None else request_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, in order
        self.num_published_blocks = 0  # leading blocks of block_table already offered for reuse
        self.state_slot = -1  # a hybrid model's state slot while it runs (``StateSlots``)
        self.shared_stop = 0  # a hybrid model's prefill snapshots here too (``match_prefix``)
        self.finish_reason: str | None = None
        # Requests added together that share this one's prompt: forked from it when its
        # prompt's logits are first sampled, each then draws its own token from them.
        self.followers: list[Sequence] = []
        self.leader: Sequence | None = None  # set on a follower until it is forked
        self.group: SequenceGroup | None = None  # beam search: whose host picks next tokens
        self._sampling: RowSampling | None = None
        # Speculative decoding: how this request drafts (None: it does not), how many tokens
        # it drafts now (its schedule adapts it), and the drafts of the step being scheduled.
        self.speculation = None
        self.draft_length = 0
        self.draft_token_ids: list[int] = []
        # Steps it sits out of drafting after its proposer found nothing (``draft_misses``
        # times in a row): those steps keep the host/device overlap.
        self.draft_pause = 0
        self.draft_misses = 0

    @property
    def sampling(self) -> RowSampling:
        """How the worker draws this sequence's tokens (built at its first step, once its
        group, if any, is set)."""
        if self._sampling is None:
            p, group = self.params, self.group
            self._sampling = RowSampling(
                self.seq_id, p.temperature, p.top_k, p.top_p, p.repetition_penalty,
                self.token_ids, p.hooks, self,
                None if group is None else CandidateRows(group.num_candidates, group.keep_rows,
                                                         group.scorer, group.sample),
                p.min_p)
        return self._sampling

    def fork(self) -> Sequence:
        """A new sequence with this one's tokens and progress (the caller shares the blocks)."""
        child = Sequence(self.token_ids, self.params, self.request_id,
                         (self.lora_slot, self.prefix_salt))
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.group = self.group
        child.speculation, child.draft_length = self.speculation, self.draft_length
        return child

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known to the host plus those still being sampled."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_seq_slots(self) -> int:
        """Sequences this waiting request may run as at once: what admitting it reserves of
        ``max_num_seqs`` (nothing for a member of a group already admitted)."""
        if self.group is not None:
            return 0 if self.group.admitted else self.group.width
        return 1 + len(self.followers)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )


class SequenceGroup:
    """Sequences whose next tokens the host chooses together (beam search).

    A member's step does not sample: its scores (``process`` of the log-softmax of its logits,
    on the device) go to the host as the ``num_candidates`` best (score, token) pairs, and
    once every live member has reported for the same length, ``advance`` says which
    (member, token) continue; the scheduler forks and frees members accordingly. ``root`` is
    the request's handle: it is reported finished when the group is done.
    """

    def __init__(self, root: Sequence, width: int, num_candidates: int,
                 keep_rows: bool = False):
        self.root = root
        self.width = width  # most live members at once
        self.num_candidates = num_candidates
        self.keep_rows = keep_rows  # also send each member's full score and logit rows
        self.members: list[Sequence] = [root]
        # seq_id -> (scores, tokens, score row, logit row, sampled keys), see CandidateRows
        self.reports: dict[int, tuple] = {}
        self.admitted = False
        root.group = self

    # Logits processors of the group's caller: ``scorer.process(seqs, log_probs)`` turns the
    # log-softmax rows ``[rows, vocab]`` of ``seqs`` (a device tensor; the members of every
    # group sharing the scorer that sample in a step) into the scores ranked. None: as they are.
    scorer = None
    sample = False  # draw the candidates (``CandidateRows.sample``)

    def report(self, seq: Sequence, candidates: tuple) -> bool:
        """Take a member's candidates (a recomputed member reports again: ignored); True once
        every live member has reported."""
        self.reports.setdefault(seq.seq_id, candidates)
        return len(self.reports) == len(self.members)

    def advance(self) -> list[tuple[Sequence, int]]:
        """The (member, token) pairs that continue, from ``reports``; none ends the group."""
        raise NotImplementedError
