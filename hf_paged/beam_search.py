"""Beam search as transformers' ``_beam_search`` does it, on forked engine sequences.

Each prompt row is one ``BeamGroup``: its prompt is prefilled once (the root sequence), and
every step each live beam reports its best ``(1 + number of EOS ids, at least 2) * num_beams``
log-probabilities, enough to hold the group's top candidates over all beams. The group then
replays transformers' bookkeeping on those candidates, in float32 as transformers computes it:
the top candidates by accumulated score, which of them stop (an EOS id, or the length limit),
the best ``num_beams`` that go on (forked over shared KV blocks by the scheduler), the
finished hypotheses scored with the length penalty, and the early-stop heuristic. A group
stops as soon as its finished hypotheses can no longer change; when per-step scores or logits
are returned, it goes on (changing nothing) until every group of the call could stop, as
transformers' batch loop does, so those tuples hold the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from hf_paged.engine.sequence import Sequence, SequenceGroup

_MASK = -1.0e9  # transformers' score of a beam that may not be chosen


@dataclass
class BeamSettings:
    """The beam-search fields of a resolved GenerationConfig."""

    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    keep_rows: bool  # return_dict_in_generate with output_scores or output_logits


@dataclass
class Hypothesis:
    score: torch.Tensor  # float32 scalar: sum of log-probs / generated length ** length_penalty
    tokens: list[int]  # generated tokens, the EOS included
    beam_indices: list[int]  # for each token, the batch-wide row of the beam it extended


class BeamCohort:
    """The groups of one generate call: how many could not stop yet, and the longest any
    ran before it could (the call's step count when rows are kept)."""

    def __init__(self) -> None:
        self.num_open = 0
        self.num_steps = 0


class BeamGroup(SequenceGroup):
    """One prompt row's beams. ``members`` are the live beams in transformers' running order."""

    def __init__(self, root: Sequence, row: int, settings: BeamSettings, cohort: BeamCohort):
        s = settings
        super().__init__(root, s.num_beams, max(2, 1 + len(s.eos_token_ids)) * s.num_beams,
                         keep_rows=s.keep_rows)
        self.row, self.settings, self.cohort = row, s, cohort
        self.running_scores = torch.zeros(1)  # float32, one per member
        self.histories: list[list[int]] = [[]]  # beam indices of each member's tokens
        self.finished: list[Hypothesis] = []  # best first, at most num_beams
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.open = True
        self.num_steps = 0
        self.score_rows: list[torch.Tensor] = []  # per step [num_beams, vocab], when kept
        self.logit_rows: list[torch.Tensor] = []
        cohort.num_open += 1

    def advance(self) -> list[tuple[Sequence, int]]:
        s, members = self.settings, self.members
        reports = [self.reports[m.seq_id] for m in members]
        if self.keep_rows:
            repeat = s.num_beams if len(members) == 1 else 1  # step 1: the beams are equal
            self.score_rows.append(torch.stack([r[2] for r in reports]).repeat(repeat, 1))
            self.logit_rows.append(torch.stack([r[3] for r in reports]).repeat(repeat, 1))
        k = self.num_candidates
        log_probs = torch.stack([r[0][:k] for r in reports])
        tokens = torch.stack([r[1][:k] for r in reports])
        accumulated = log_probs + self.running_scores[:, None]
        # The best k over all beams; equal scores in transformers' flat (beam, token) order.
        vocab = 1 << 40
        flat = (torch.arange(len(members))[:, None] * vocab + tokens).flatten()
        by_index = flat.argsort()
        order = by_index[accumulated.flatten()[by_index].argsort(descending=True, stable=True)]
        top = order[:k]
        scores = accumulated.flatten()[top]
        parents = (top // k).tolist()
        new_tokens = tokens.flatten()[top].tolist()
        length = self.num_steps + 1
        at_limit = length >= s.max_new_tokens
        stops = [at_limit or t in s.eos_token_ids for t in new_tokens]
        self._finish(parents, new_tokens, scores, stops, length)
        self.num_steps = length
        if at_limit:
            self._close()
            return []
        going = [i for i in range(k) if not stops[i]][: s.num_beams]
        self.running_scores = scores[going]
        self.histories = [self.histories[parents[i]] + [self._row_of(parents[i])] for i in going]
        self._update_heuristic(length)
        if self.open and not self._can_improve():
            self._close()
        if not self.open and (not self.keep_rows or self._cohort_done()):
            return []
        return [(members[parents[i]], new_tokens[i]) for i in going]

    def _row_of(self, parent: int) -> int:
        return self.row * self.settings.num_beams + parent

    def _finish(self, parents, new_tokens, scores, stops, length) -> None:
        """Among the best num_beams candidates, those that stop join the finished hypotheses
        (unless the finished ones can no longer change); keep the best num_beams."""
        s = self.settings
        if not self._can_improve():
            return
        penalised = scores / (length**s.length_penalty)
        new = []
        for i in range(s.num_beams):
            if stops[i]:
                member = self.members[parents[i]]
                new.append(Hypothesis(
                    penalised[i], member.output_token_ids + [new_tokens[i]],
                    self.histories[parents[i]] + [self._row_of(parents[i])],
                ))
        if new:
            merged = self.finished + new
            order = torch.stack([h.score for h in merged]).argsort(descending=True, stable=True)
            self.finished = [merged[i] for i in order[: s.num_beams].tolist()]

    def _can_improve(self) -> bool:
        """Whether new finished hypotheses may still be taken (transformers masks them once
        its early-stop heuristic is met, or, with early_stopping=True, once num_beams are)."""
        full = len(self.finished) == self.settings.num_beams
        return self.improvable and not (full and self.settings.early_stopping is True)

    def _update_heuristic(self, length: int) -> None:
        s = self.settings
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_length = s.max_new_tokens
        else:
            best_length = length
        best_possible = self.running_scores[0] / (best_length**s.length_penalty)
        full = len(self.finished) == s.num_beams
        worst = min(h.score for h in self.finished) if full else torch.tensor(_MASK)
        self.improvable = self.improvable and bool(best_possible > worst)

    def _close(self) -> None:
        if self.open:
            self.open = False
            self.cohort.num_open -= 1
            self.cohort.num_steps = max(self.cohort.num_steps, self.num_steps)

    def _cohort_done(self) -> bool:
        return self.cohort.num_open == 0 and self.num_steps >= self.cohort.num_steps


def add_beam_requests(engine, prompts: list[list[int]], params, settings: BeamSettings):
    """Queue one beam group per prompt; returns the groups in order."""
    if settings.num_beams > engine.config.max_num_seqs:
        raise ValueError(
            f"num_beams ({settings.num_beams}) exceeds the engine's max_num_seqs "
            f"({engine.config.max_num_seqs}): the beams of a prompt run together"
        )
    for prompt in prompts:
        engine.validate_request(prompt, params)
    cohort = BeamCohort()
    return [BeamGroup(engine.add_request(p, params), row, settings, cohort)
            for row, p in enumerate(prompts)]


def beam_outputs(input_ids: torch.Tensor, groups: list[BeamGroup], num_return_sequences: int,
                 fill: int, return_dict: bool, output_scores: bool, output_logits: bool):
    """transformers' outputs of ``_beam_search``: the best ``num_return_sequences`` finished
    hypotheses of each row after its (padded) prompt, filled with ``fill`` past their end."""
    best = [h for g in groups for h in g.finished[:num_return_sequences]]
    width = max(len(h.tokens) for h in best)
    prompts = input_ids.repeat_interleave(num_return_sequences, dim=0)
    new = torch.full((len(best), width), fill, dtype=input_ids.dtype)
    beam_indices = torch.full((len(best), width), -1, dtype=torch.int32)
    for i, h in enumerate(best):
        new[i, : len(h.tokens)] = torch.tensor(h.tokens, dtype=input_ids.dtype)
        beam_indices[i, : len(h.tokens)] = torch.tensor(h.beam_indices, dtype=torch.int32)
    sequences = torch.cat([prompts, new.to(input_ids.device)], dim=1)
    if not return_dict:
        return sequences
    device = input_ids.device
    steps = groups[0].cohort.num_steps  # the step at which transformers' batch loop ends

    def per_step(rows_of):
        return tuple(torch.cat([rows_of(g)[t] for g in groups]).to(device) for t in range(steps))

    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=torch.stack([h.score for h in best]).to(device) if output_scores
        else None,
        scores=per_step(lambda g: g.score_rows) if output_scores else None,
        logits=per_step(lambda g: g.logit_rows) if output_logits else None,
        beam_indices=beam_indices.to(device),
    )
