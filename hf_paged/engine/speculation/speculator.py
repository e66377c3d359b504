"""Speculative decoding on the host: which requests draft this step, how many tokens, and
what a verified step keeps.

Before a step is scheduled, each running request that speculates and whose every token is
known (its last step was collected) asks its proposer for drafts: up to its draft length, and
never past its ``max_new_tokens`` or the model's length, counting the token the model adds
after them. The scheduler then computes the newest token and the drafts in one chunk and
draws a token at each of those positions; ``accepted`` keeps the drafts up to the first one
the model did not draw, plus the model's own token there. Under greedy decoding that is plain
greedy's output; under sampling, a draft is kept exactly when an independent draw from the
model's (processed) distribution equals it, which is transformers' speculative acceptance rule
for a draft that is a single token (``min(1, p/q)`` with ``q`` one at the draft) and leaves
the output distributed as plain sampling.

Speculation steps aside for requests whose logits the caller processes or penalises (their
processors would have to run once per draft position), and for every request while more than
``speculative_max_batch`` requests run: a large batch decodes near the compute bound already.
A request whose proposer found nothing sits out a few steps (more after each miss in a row),
which keep the host/device overlap that drafting gives up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_paged.config import EngineConfig
from hf_paged.engine.sequence import Sequence, Status
from hf_paged.engine.speculation.draft_engine import DraftEngine, draft_engine_from_checkpoint
from hf_paged.engine.speculation.draft_proposer import DraftProposer
from hf_paged.engine.speculation.ngram import NgramProposer
from hf_paged.sampling_params import Proposer, Speculation


def accepted(drafts: list[int], drawn: list[int]) -> list[int]:
    """The tokens a verified step keeps: ``drawn[i]`` is the model's token after the newest
    token and ``drafts[:i]``; the drafts it agrees with are kept, then its first own token."""
    kept = 0
    while kept < len(drafts) and drawn[kept] == drafts[kept]:
        kept += 1
    return drawn[: kept + 1]


def drafts_next(seq: Sequence) -> bool:
    """Whether ``seq`` may draft at its next step (its tokens are then needed on the host)."""
    return can_speculate(seq) and not seq.draft_pause


def can_speculate(seq: Sequence) -> bool:
    """Whether ``seq``'s settings allow verifying drafts on the model's raw logits."""
    params = seq.params
    hooks = params.hooks
    return (seq.speculation is not None and seq.group is None
            and params.repetition_penalty == 1.0
            and (hooks is None or not hooks.processes_logits))


MAX_PAUSE = 3  # most steps a request sits out of drafting after finding nothing


class Speculator:
    """The engine's speculative decoding: proposes before each step, verifies what a step
    drew (the scheduler's ``Verifier``), keeps counts."""

    def __init__(self, config: EngineConfig, max_model_len: int, default: Speculation | None):
        self.max_batch = config.speculative_max_batch
        self.max_model_len = max_model_len
        self.default = default  # for requests whose SamplingParams name none
        self.proposers: dict[int, Proposer] = {}  # every proposer a request used, by id
        self.drafted: list[Sequence] = []  # the requests given drafts by the last ``propose``
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0

    def adopt(self, seq: Sequence) -> None:
        """Settle a new request's speculation (its own, or the engine's)."""
        spec = seq.params.speculation or self.default
        seq.speculation = spec
        if spec is not None:
            seq.draft_length = spec.num_tokens
            self.proposers.setdefault(id(spec.proposer), spec.proposer)

    def needs_tokens(self, seq: Sequence, num_running: int) -> bool:
        """Whether ``seq`` may draft at its next step while ``num_running`` requests run (its
        tokens are then needed on the host before that step is scheduled)."""
        return num_running <= self.max_batch and drafts_next(seq)

    def propose(self, running: list[Sequence]) -> None:
        """Give each of the ``running`` requests that may speculate this step its drafts
        (``seq.draft_token_ids``), one proposer call for all the requests that share it;
        none while more than ``speculative_max_batch`` run."""
        for seq in self.drafted:  # drafts of a step that left a request out are stale
            seq.draft_token_ids = []
        self.drafted = []
        if len(running) > self.max_batch:
            return
        by_proposer: dict[int, tuple[Proposer, list[Sequence], list[int]]] = {}
        for seq in running:
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            limit = self._limit(seq)
            if limit > 0:
                proposer = seq.speculation.proposer
                entry = by_proposer.setdefault(id(proposer), (proposer, [], []))
                entry[1].append(seq)
                entry[2].append(limit)
        for proposer, seqs, limits in by_proposer.values():
            for seq, drafts in zip(seqs, proposer.propose(seqs, limits)):
                seq.draft_token_ids = list(drafts[: self._limit(seq)])
                self.drafted.append(seq)
                # Nothing to draft: sit out 1, then 3 steps, so that a request its
                # proposer cannot help (prompt lookup over text that never repeats) decodes
                # nearly as fast as without speculation.
                seq.draft_misses = 0 if seq.draft_token_ids else seq.draft_misses + 1
                seq.draft_pause = min(2 ** seq.draft_misses - 1, MAX_PAUSE)

    def _limit(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may draft this step (0: none)."""
        if (seq.status is not Status.RUNNING or seq.num_pending or not can_speculate(seq)
                or seq.num_computed_tokens != len(seq.token_ids) - 1):
            return 0
        hooks = seq.params.hooks
        if hooks is not None and not hooks.may_compute(seq):
            return 0
        room = min(seq.params.max_new_tokens - seq.num_new_tokens,
                   self.max_model_len - len(seq.token_ids))
        return max(0, min(seq.draft_length, room - 1))

    def verify(self, seq: Sequence, drafts: list[int], drawn: list[int]) -> list[int]:
        """The tokens a verified step of ``seq`` keeps (``accepted``); counts them and adapts
        the request's draft length to its schedule."""
        kept = accepted(drafts, drawn)
        agreed = len(kept) - 1
        self.num_verify_steps += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += agreed
        if seq.speculation.schedule != "constant":
            if agreed == len(drafts):
                seq.draft_length += 2
            else:
                seq.draft_length = max(1, seq.draft_length - 1)
        return kept

    def release(self, seqs: list[Sequence]) -> None:
        """Tell the proposers that these requests are over."""
        by_proposer: dict[int, list[int]] = {}
        for seq in seqs:
            if seq.speculation is not None:
                by_proposer.setdefault(id(seq.speculation.proposer), []).append(seq.seq_id)
        for key, seq_ids in by_proposer.items():
            self.proposers[key].release(seq_ids)

    def forget(self, proposer: Proposer) -> None:
        """A caller's proposer is done with (its requests are over)."""
        self.proposers.pop(id(proposer), None)

    def close(self) -> None:
        for proposer in self.proposers.values():
            proposer.close()
        self.proposers = {}

    def stats(self) -> dict[str, int]:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }


def default_speculation(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                        max_model_len: int, num_blocks: int, vocab_size: int,
                        build: Callable[..., DraftEngine], is_leader: bool = True
                        ) -> Speculation | None:
    """The engine's own speculation (``EngineConfig.speculative_method``), for requests whose
    SamplingParams name none; a draft checkpoint loads beside the model (on the scheduling
    rank only: the others follow its steps) through ``build`` (the engine class's
    ``from_pretrained``)."""
    method = config.speculative_method
    if method is None or not is_leader:
        return None
    if method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_max)
    else:
        draft = draft_engine_from_checkpoint(config.speculative_model, build, dtype=dtype,
                                             device=device, config=config,
                                             max_model_len=max_model_len,
                                             num_blocks=num_blocks, vocab_size=vocab_size)
        proposer = DraftProposer(draft, owns_engine=True)
    return Speculation(proposer, config.num_speculative_tokens)
