"""Beam search's groups (``num_beams > 1``): transformers' ``_beam_search`` bookkeeping on
forked engine sequences (the call: ``beam_search``).

Each prompt row is one ``BeamGroup``: its prompt is prefilled once (the root sequence), and
every step each live beam reports its best ``(1 + number of EOS ids, at least 2) * num_beams``
log-probabilities, enough to hold the group's top candidates over all beams. The group then
replays transformers' bookkeeping on those candidates, in float32 as transformers computes it:
the top candidates by accumulated score, which of them stop (an EOS id, the length limit, or
the call's other stopping criteria),
the best ``num_beams`` that go on (forked over shared KV blocks by the scheduler), the
finished hypotheses scored with the length penalty, and the early-stop heuristic. A group
stops as soon as its finished hypotheses can no longer change; when per-step scores or logits
are returned, it goes on (changing nothing) until every group of the call could stop, as
transformers' batch loop does, so those tuples hold the same rows. The call's logits
processors run, as transformers runs them, on the log-softmax of the logits, over rows laid out
as transformers' ``[batch * num_beams]`` batch (``BeamCohort.process``).

Beam sampling (``do_sample=True``) draws the candidates where beam search takes the best:
transformers draws them without replacement from the softmax of the accumulated scores over
all beams (``torch.multinomial``); from 5.24 on it orders them by score, before it kept them in
the order drawn, so that the first ``num_beams`` drawn, not the best, are those that may
finish (the beams that go on are the best either way). Here each beam reports the best of its
scores plus Gumbel noise, and the group takes the best keys over the beams (the beam's
accumulated score added): the Gumbel-top-k draw, the same distribution, its keys' order the
order drawn; the random stream is the engine's, so tokens differ from transformers' under the
same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import transformers
from packaging.version import Version
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_paged.device_copy import to_device
from hf_paged.engine.sequence import Sequence, SequenceGroup
from hf_paged.generation.settings import Resolved
from hf_paged.sampling_params import RequestHooks

_MASK = -1.0e9  # transformers' score of a beam that may not be chosen
# Whether the installed transformers orders beam sampling's drawn candidates by score (module
# docstring).
SAMPLED_BY_SCORE = Version(transformers.__version__).release >= (5, 24)


@dataclass
class BeamSettings:
    """The beam-search fields of a resolved GenerationConfig."""

    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    keep_rows: bool  # return_dict_in_generate with output_scores or output_logits
    do_sample: bool = False  # beam sampling: candidates drawn, not the best taken


@dataclass
class Hypothesis:
    score: np.float32  # sum of log-probs / generated length ** length_penalty
    tokens: list[int]  # generated tokens, the EOS included
    beam_indices: list[int]  # for each token, the batch-wide row of the beam it extended


class BeamCohort(RequestHooks):
    """One generate call's groups: its logits processors and stopping criteria, how many
    groups could not stop yet, and the longest any ran before it could (the call's step count
    when rows are kept). As the roots' hooks it hands the groups' results to the other ranks
    under torchrun (the roots sample nothing, so no other hook is called)."""

    def __init__(self, resolved: Resolved, settings: BeamSettings, pad: int):
        self.prompt_ids = resolved.input_ids[:: settings.num_beams]  # padded, one per group
        self.num_beams = settings.num_beams
        self.processors = resolved.processors
        native = (MaxLengthCriteria, EosTokenCriteria)  # checked by the groups themselves
        self.criteria = [c for c in resolved.criteria if type(c) not in native]
        self.pad = pad
        self.num_open = 0
        self.num_steps = 0
        self.groups: list[BeamGroup] = []

    def shared_state(self) -> tuple:
        return self.num_steps, [(g.finished, g.num_steps, g.score_rows, g.logit_rows)
                                for g in self.groups]

    def load_shared_state(self, state: tuple) -> None:
        self.num_steps, groups = state
        for group, (finished, num_steps, score_rows, logit_rows) in zip(self.groups, groups):
            group.finished, group.num_steps = finished, num_steps
            group.score_rows, group.logit_rows = score_rows, logit_rows

    def running_ids(self, group: BeamGroup, tokens: list[list[int]]) -> torch.Tensor:
        """Rows of transformers' running sequences: the group's padded prompt, then tokens."""
        prompt = self.prompt_ids[group.row]
        new = torch.tensor(tokens, dtype=prompt.dtype).view(len(tokens), -1)
        return torch.cat([prompt.expand(len(tokens), -1), new], dim=1)

    def process(self, seqs: list[Sequence], log_probs: torch.Tensor) -> torch.Tensor:
        """The processors over the beams of a step, one batch per generated length, each
        beam at its row of transformers' ``[batch * num_beams]`` batch."""
        by_length: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_length.setdefault(seq.num_new_tokens, []).append(i)
        size, device = len(self.prompt_ids) * self.num_beams, log_probs.device
        for length, members in by_length.items():
            ids = torch.full((size, self.prompt_ids.shape[1] + length), self.pad)
            rows = []
            for i in members:
                group = seqs[i].group
                rows.append(group.row * self.num_beams + group.members.index(seqs[i]))
                ids[rows[-1]] = self.running_ids(group, [seqs[i].output_token_ids])[0]
            index, at = (to_device(x, device) for x in (members, rows))
            full = log_probs.new_zeros(size, log_probs.shape[1])
            full[at] = log_probs[index]
            log_probs[index] = self.processors(ids.to(device), full)[at]
        return log_probs


class BeamGroup(SequenceGroup):
    """One prompt row's beams. ``members`` are the live beams in transformers' running order."""

    def __init__(self, root: Sequence, row: int, settings: BeamSettings, cohort: BeamCohort):
        s = settings
        super().__init__(root, s.num_beams, max(2, 1 + len(s.eos_token_ids)) * s.num_beams,
                         keep_rows=s.keep_rows)
        self.row, self.settings, self.cohort = row, s, cohort
        self.scorer = cohort if cohort.processors else None
        self.sample = s.do_sample
        # float32 as transformers' tensors (numpy: far cheaper per call than torch here)
        self.running_scores = np.zeros(1, dtype=np.float32)  # one per member
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
        log_probs = np.stack([r[0][:k].numpy() for r in reports])
        tokens = np.stack([r[1][:k].numpy() for r in reports])
        accumulated = (log_probs + self.running_scores[:, None]).ravel()
        if s.do_sample:
            top = self._drawn(reports, k, accumulated)
        else:
            # The best k over all beams; equal scores in transformers' flat (beam, token) order.
            flat = (np.arange(len(members))[:, None] * (1 << 40) + tokens).ravel()
            top = np.lexsort((flat, -accumulated))[:k]
        scores = accumulated[top]
        k = len(top)
        parents = (top // tokens.shape[1]).tolist()
        new_tokens = tokens.ravel()[top].tolist()
        length = self.num_steps + 1
        at_limit = length >= s.max_new_tokens
        stops = [at_limit or t in s.eos_token_ids for t in new_tokens]
        if self.cohort.criteria and not at_limit:
            ids = self.cohort.running_ids(self, [members[p].output_token_ids + [t]
                                                 for p, t in zip(parents, new_tokens)])
            for criterion in self.cohort.criteria:
                stops = [a or bool(b) for a, b in zip(stops, criterion(ids, None))]
        self._finish(parents, new_tokens, scores, stops, length)
        self.num_steps = length
        if at_limit:
            self._close()
            return []
        going = [i for i in range(k) if not stops[i]]
        if s.do_sample and not SAMPLED_BY_SCORE:  # in the order drawn: the best go on
            going.sort(key=lambda i: -scores[i])
        going = going[: s.num_beams]
        self.running_scores = scores[going]
        self.histories = [self.histories[parents[i]] + [self._row_of(parents[i])] for i in going]
        self._update_heuristic(length)
        if self.open and not self._can_improve():
            self._close()
        if not self.open and (not self.keep_rows or self._cohort_done()):
            return []
        return [(members[parents[i]], new_tokens[i]) for i in going]

    def _drawn(self, reports: list[tuple], k: int, accumulated: np.ndarray) -> np.ndarray:
        """The k candidates drawn over all beams (flat indices), by score or in the order
        drawn as the installed transformers orders them: the best noisy keys, each beam's
        accumulated score added."""
        keys = np.stack([r[4][:k].numpy() for r in reports]) + self.running_scores[:, None]
        # Where fewer than k tokens are drawable, the rest are impossible ones (-inf), ranked
        # last, as transformers' draw returns zero-probability candidates there.
        top = np.argsort(-keys.ravel(), kind="stable")[:k]
        if not SAMPLED_BY_SCORE:
            return top
        return top[np.argsort(-accumulated[top], kind="stable")]

    def _row_of(self, parent: int) -> int:
        return self.row * self.settings.num_beams + parent

    def _finish(self, parents, new_tokens, scores, stops, length) -> None:
        """Among the best num_beams candidates, those that stop join the finished hypotheses
        (unless the finished ones can no longer change); keep the best num_beams."""
        s = self.settings
        if not self._can_improve():
            return
        penalised = scores / np.float32(length**s.length_penalty)  # float32, as torch divides
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
            order = np.argsort([-h.score for h in merged], kind="stable")
            self.finished = [merged[i] for i in order[: s.num_beams]]

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
        best_possible = self.running_scores[0] / np.float32(best_length**s.length_penalty)
        full = len(self.finished) == s.num_beams
        worst = min(h.score for h in self.finished) if full else np.float32(_MASK)
        self.improvable = self.improvable and bool(best_possible > worst)

    def _close(self) -> None:
        if self.open:
            self.open = False
            self.cohort.num_open -= 1
            self.cohort.num_steps = max(self.cohort.num_steps, self.num_steps)

    def _cohort_done(self) -> bool:
        return self.cohort.num_open == 0 and self.num_steps >= self.cohort.num_steps
