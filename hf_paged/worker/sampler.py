"""Sampling, all of it: repetition penalties, the caller's hooks, the sampling kernel's per-row
settings (read by the decode graphs too), and beam-search members' candidates.

Rows without a repetition penalty or hooks skip logits processing altogether, and a decode
graph has then already drawn their tokens. Rows of a beam-search member are not sampled:
their log-softmax, through the group's scorer, goes to the host as its top candidates (and as
whole rows when the group keeps them). Followers forked by a step draw their own token from
their leader's row.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from hf_paged import kernels
from hf_paged.device_copy import to_device
from hf_paged.step import RowSampling, StepPlan


def kernel_settings(rows: list[RowSampling]) -> tuple[np.ndarray, ...]:
    """The sampling kernel's per-row settings: temperature (float32; 0 is greedy), top-k
    (int32; 0 is off), top-p (float32; 1 is off) and min-p (float32; 0 is off)."""
    return (np.array([r.temperature for r in rows], np.float32),
            np.array([r.top_k for r in rows], np.int32),
            np.array([r.top_p for r in rows], np.float32),
            np.array([r.min_p for r in rows], np.float32))


def draw_counts(plan: StepPlan) -> list[int]:
    """Tokens drawn for each sampled sequence of ``plan``, in order: one, or one more than its
    draft tokens (a verifying step draws at its newest token and at each draft)."""
    drafts = plan.num_draft_tokens or [0] * len(plan.sample)
    return [1 + d for d, sample in zip(drafts, plan.sample) if sample]


def per_draw(rows: list[RowSampling], counts: list[int]) -> list[RowSampling]:
    """Each row's settings once per token it draws. A verifying sequence's extra draws leave
    out its hooks: the engine verifies only for requests whose hooks do not touch logits, and
    their stopping runs on the host once the tokens are kept."""
    if all(c == 1 for c in counts):
        return rows
    out = []
    for row, count in zip(rows, counts):
        out.extend([row] if count == 1 else [replace(row, hooks=None)] * count)
    return out


class Sampler:
    """Rank 0's sampling state: the repetition penalties' seen-token masks, one row per
    penalized request, True where a token was seen."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.seen_rows: dict[int, int] = {}
        self.free_seen_rows: list[int] = []
        # The value marked, on the device: assigning a Python True copies it from the host and
        # waits for the device (no asynchronous overlap).
        self.true = torch.ones((), dtype=torch.bool, device=device)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            row = self.seen_rows.pop(seq_id, None)
            if row is not None:
                self.free_seen_rows.append(row)

    def close(self) -> None:
        self.seen = None

    def split_rows(self, plan: StepPlan, logits: torch.Tensor, drawn: torch.Tensor | None,
                   rows: list[RowSampling]):
        """The rows to sample (those of no group, then each follower on its leader's row) with
        their settings, and the group members' candidates. A graph's drawn tokens serve the
        plain rows, unless followers must draw their own from their leader's row. A verifying
        sequence's rows (``draw_counts``) all go to sampling."""
        counts = draw_counts(plan)
        firsts, last_of, at = [], {}, 0  # each row's first logits row; batch index -> last
        for i, sample in enumerate(plan.sample):
            if sample:
                firsts.append(at)
                at += counts[len(firsts) - 1]
                last_of[i] = at - 1
        plain = [r for r, s in enumerate(rows) if s.candidates is None]
        grouped = [firsts[r] for r, s in enumerate(rows) if s.candidates is not None]
        index = self._to_device([j for r in plain for j in range(firsts[r], firsts[r] + counts[r])]
                                + [last_of[i] for i, _ in plan.sample_copies])
        members = [s for s in rows if s.candidates is not None]
        candidates = self._candidates(logits[self._to_device(grouped)], members)
        sampled = (per_draw([rows[r] for r in plain], [counts[r] for r in plain])
                   + [f for _, f in plan.sample_copies])
        drawn = None if drawn is None or plan.sample_copies else drawn[index]
        return logits[index], drawn, sampled, candidates

    def _candidates(self, logits: torch.Tensor, members: list[RowSampling]):
        """Each member's top ``num_candidates`` log-probabilities after its group's scorer, as
        (scores, token ids, whole score rows or None, whole logit rows or None, keys or None);
        a sampling member's are drawn: the best of the scores plus Gumbel noise (the noisy
        keys, which rank them)."""
        if not members:
            return None
        logits = logits.float()
        scores = torch.log_softmax(logits, dim=-1)
        by_scorer: dict[int, list[int]] = {}
        for row, member in enumerate(members):
            if member.candidates.scorer is not None:
                by_scorer.setdefault(id(member.candidates.scorer), []).append(row)
        for rows in by_scorer.values():
            index = self._to_device(rows)
            scorer = members[rows[0]].candidates.scorer
            scores[index] = scorer.process([members[r].request for r in rows], scores[index])
        k = min(max(m.candidates.num_candidates for m in members), scores.shape[-1])
        drawn = [row for row, m in enumerate(members) if m.candidates.sample]
        if drawn:
            keys = scores.clone()
            index = self._to_device(drawn)
            # -log of a standard exponential is a standard Gumbel draw
            keys[index] -= torch.empty_like(keys[index]).exponential_().log()
            keys, ids = keys.topk(k, dim=-1)
            top = scores.gather(-1, ids)
        else:
            keys, (top, ids) = None, scores.topk(k, dim=-1)
        if any(m.candidates.keep_rows for m in members):
            return top, ids, scores, logits, keys
        return top, ids, None, None, keys

    def sample(self, logits: torch.Tensor, rows: list[RowSampling],
               drawn: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of ``logits`` (float32, or a decode graph's in the model dtype,
        which the sampling kernel and argmax read exactly). ``drawn``: the tokens a decode
        graph already drew from ``logits`` with these rows' settings."""
        penalized = [i for i, r in enumerate(rows) if r.repetition_penalty != 1.0]
        processed = penalized or any(r.hooks is not None for r in rows)
        if processed:  # on float32 logits, as transformers' generate processes them
            logits = self._process(logits.float(), rows, penalized)
        if drawn is not None and not processed:
            tokens = drawn
        elif not any(r.temperature for r in rows):
            tokens = logits.argmax(-1)
        else:
            settings = (torch.from_numpy(s).to(self.device, non_blocking=True)
                        for s in kernel_settings(rows))
            tokens = kernels.sample(logits, *settings)
        for members in _hook_groups(rows) if processed else ():
            rows[members[0]].hooks.record([rows[i].request for i in members],
                                          tokens[self._to_device(members)])
        if penalized:  # the new tokens count as seen from the next step on
            seen = self._to_device([self.seen_rows[rows[i].seq_id] for i in penalized])
            self.seen.index_put_((seen, tokens[self._to_device(penalized)]), self.true)
        return tokens

    def _process(self, logits: torch.Tensor, rows: list[RowSampling], penalized: list[int]):
        """Repetition penalties over each request's seen-token mask, then each hooks object's
        ``process`` over all of its requests at once. Works in place: ``logits`` is this
        step's own (a graph's output buffer is rewritten only by a later replay)."""
        if penalized:
            seen = self._to_device([self._seen_row(rows[i]) for i in penalized])
            penalty = to_device([rows[i].repetition_penalty for i in penalized], self.device,
                                torch.float32)[:, None]
            every = len(penalized) == len(rows)  # the common case: no gather, no scatter
            index = None if every else self._to_device(penalized)
            scores = logits if every else logits[index]
            penalized_scores = torch.where(scores < 0, scores * penalty, scores / penalty)
            scores = torch.where(self.seen[seen], penalized_scores, scores)
            if every:
                logits = scores
            else:
                logits[index] = scores
        for members in _hook_groups(rows):
            index = self._to_device(members)
            logits[index] = rows[members[0]].hooks.process([rows[i].request for i in members],
                                                           logits[index])
        return logits

    def _seen_row(self, row: RowSampling) -> int:
        """The row of ``seen`` marking the tokens of ``row``'s request, filled on first use."""
        found = self.seen_rows.get(row.seq_id)
        if found is not None:
            return found
        if not self.free_seen_rows:
            old = len(self.seen)
            grown = torch.zeros(max(2 * old, 8), self.vocab_size, dtype=torch.bool,
                                device=self.device)
            grown[:old] = self.seen
            self.seen = grown
            self.free_seen_rows = list(range(len(grown) - 1, old - 1, -1))
        found = self.seen_rows[row.seq_id] = self.free_seen_rows.pop()
        self.seen[found] = False
        self.seen.index_put_((self._to_device([found]), self._to_device(row.history)), self.true)
        return found

    def _to_device(self, values: list) -> torch.Tensor:
        return to_device(values, self.device)


def _hook_groups(rows: list[RowSampling]) -> list[list[int]]:
    """Indices of ``rows`` grouped by the hooks object their requests share."""
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if row.hooks is not None:
            groups.setdefault(id(row.hooks), []).append(i)
    return list(groups.values())
