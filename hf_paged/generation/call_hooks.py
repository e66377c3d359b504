"""One generate() call's processors, stopping criteria and recorded scores, for all its rows.

transformers' loop holds the call's rows as one ``input_ids`` batch: each step appends every
row's token (``pad`` once a row is done), runs the logits processors over the batch and calls
every stopping criterion once with ``(input_ids[B, L], scores)`` (``scores`` None, or with
``output_scores`` the tuple of the steps' processed scores), reading back a bool tensor of B.
The engine samples each row whenever it is scheduled, so ``CallHooks`` rebuilds that view:
processors run on the device over the call's batch as each row samples, and the criteria run
once per step (column) of the call, as soon as every row has delivered that column's token or
finished, in column order, so that state a criterion keeps per row lines up. A row the
criteria stop keeps its tokens up to that column (under asynchronous scheduling it may already
hold one more, which is dropped, as after EOS).
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from hf_paged.device_copy import to_device
from hf_paged.engine.sequence import Sequence
from hf_paged.generation.settings import Resolved
from hf_paged.sampling_params import RequestHooks

# transformers' own criteria that read neither ``scores`` nor the device of ``input_ids``:
# they run on the host copy of the batch, with no device round trip.
HOST_CRITERIA = (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria)


class CallHooks(RequestHooks):
    """``input_ids`` is the call's batch as transformers' loop holds it, on the device: the
    left-padded prompt rows, then each row's new tokens, appended on the device as they are
    sampled. Processors run on it batched over the call, with no host round trip; rows
    sampling at different lengths (chunked prefill can stagger them) run as one batch per
    length. Criteria read a host copy kept from the delivered tokens (on the caller's device
    for user criteria), and ``scores`` as transformers' sampling loop passes them: None, or
    with ``output_scores`` the tuple of every step's processed scores so far.

    When the caller wants per-step ``scores`` or ``logits``, the call runs in lockstep as
    transformers' loop does: a row that is done keeps running on ``pad`` (its scores are
    still computed), no row computes a step before the criteria have seen the previous one,
    and every row stops once all are done.
    """

    def __init__(self, resolved: Resolved, rest, criteria: StoppingCriteriaList, pad: int,
                 record_scores: bool, record_logits: bool):
        self.rest = rest
        self.pad = pad
        self.prompt_ids = resolved.input_ids
        self.caller_device = resolved.device
        self.width = resolved.input_ids.shape[1]
        self.max_new_tokens = resolved.max_new_tokens
        self.input_ids: torch.Tensor | None = None  # on the device, from ``attach`` on
        self.lockstep = record_scores or record_logits
        self.needs_history = self.lockstep  # ``process`` reads the done flags
        # With no processors left and nothing recorded, ``process`` leaves logits alone: the
        # rows may verify draft tokens (the criteria see the kept tokens column by column).
        self.processes_logits = bool(rest) or self.lockstep
        self.record_scores, self.record_logits = record_scores, record_logits
        batch = self.prompt_ids.shape[0]
        self.host_criteria = StoppingCriteriaList(c for c in criteria if type(c) in HOST_CRITERIA)
        self.device_criteria = StoppingCriteriaList(c for c in criteria
                                                    if type(c) not in HOST_CRITERIA)
        self.host_ids = torch.full((batch, self.width + self.max_new_tokens), pad,
                                   dtype=torch.long)
        self.host_ids[:, : self.width] = self.prompt_ids
        self.seqs: list[Sequence] = []  # by row, set once the requests are queued
        self.rows: dict[int, int] = {}
        self.delivered = [0] * batch  # new tokens of each row copied into ``host_ids``
        self.checked = 0  # columns the criteria have seen
        self.early_stops: list[tuple[Sequence, int]] = []
        self.done = [False] * batch
        self.closed_rows: set[int] = set()  # finished rows whose tail is reset to ``pad``
        self.score_steps: list[torch.Tensor] = []  # [B, V] a step, for user criteria
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def attach(self, seqs: list[Sequence], device: torch.device) -> None:
        """The call's requests, one per row in row order (a request may hold new tokens
        already: a row continued from its first token), and the engine's device. The device
        batch is made here, outside the engine's inference mode, so that the host may edit it."""
        self.input_ids = self.host_ids.to(device, copy=True)
        self.seqs = list(seqs)
        self.rows = {s.seq_id: row for row, s in enumerate(seqs)}
        self._deliver(seqs)
        self.early_stops = self._check_ready()  # returned with the first tokens delivered

    def _deliver(self, seqs: list[Sequence]) -> None:
        """Copy the requests' new tokens into the host batch."""
        for seq in seqs:
            row = self.rows[seq.seq_id]
            new = seq.token_ids[seq.num_prompt_tokens + self.delivered[row]:]
            start = self.width + self.delivered[row]
            self.host_ids[row, start: start + len(new)] = torch.tensor(new, dtype=torch.long)
            self.delivered[row] += len(new)

    def _positions(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """Each request's row, and the column its token being sampled takes."""
        rows = [self.rows[s.seq_id] for s in seqs]
        # ``num_tokens`` already counts the token this step samples.
        cols = [self.width + s.num_tokens - 1 - s.num_prompt_tokens for s in seqs]
        return rows, cols

    def may_compute(self, seq: Sequence) -> bool:
        # In lockstep a row samples a step only after the criteria saw the one before it.
        return not self.lockstep or seq.num_new_tokens <= self.checked

    def process(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        rows, cols = self._positions(seqs)
        scores = logits.clone() if self.lockstep else logits
        if self.rest:
            by_length: dict[int, list[int]] = {}
            for i, col in enumerate(cols):
                by_length.setdefault(col, []).append(i)
            for col, members in by_length.items():
                index = to_device(members, logits.device)
                at = to_device([rows[i] for i in members], logits.device)
                full = logits.new_zeros(len(self.done), logits.shape[1])
                full[at] = logits[index]
                scores[index] = self.rest(self.input_ids[:, :col], full)[at]
        if self.lockstep:
            for i, row in enumerate(rows):
                if self.record_logits:
                    self.logits[row].append(logits[i].to("cpu", copy=True))
                if self.record_scores:
                    self.scores[row].append(scores[i].to("cpu", copy=True))
                if self.done[row]:  # transformers feeds finished rows the pad token
                    scores[i] = float("-inf")
                    scores[i, self.pad] = 0.0
        return scores

    def shared_state(self) -> tuple:
        """What this call's copy on another rank needs for the same outputs (under torchrun
        only rank 0 samples; the engine sends this to the others)."""
        return self.scores, self.logits

    def load_shared_state(self, state: tuple) -> None:
        self.scores, self.logits = state

    def record(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        rows, cols = self._positions(seqs)
        at = to_device(rows, tokens.device), to_device(cols, tokens.device)
        self.input_ids[at] = tokens

    def on_tokens(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        self._deliver(seqs)
        stops, self.early_stops = self.early_stops + self._check_ready(), []
        for row, seq in enumerate(self.seqs):
            if seq.is_finished and row not in self.closed_rows:
                self._close_row(row, seq.num_new_tokens)
        return stops

    def _check_ready(self) -> list[tuple[Sequence, int]]:
        """The criteria over every step all rows have delivered, in order."""
        stops = []
        while self.checked < self.max_new_tokens and self._column_ready(self.checked):
            stops += self._check(self.checked)
            self.checked += 1
        return stops

    def _column_ready(self, col: int) -> bool:
        """Every row delivered step ``col`` or is over, and some row delivered it."""
        over = [self.delivered[r] <= col and (s.is_finished or (self.done[r] and not self.lockstep))
                for r, s in enumerate(self.seqs)]
        return all(self.delivered[r] > col or over[r] for r in range(len(self.seqs))) and not all(
            over)

    def _check(self, col: int) -> list[tuple[Sequence, int]]:
        """The criteria over the batch at step ``col``; the requests that stop there."""
        ids = self.host_ids[:, : self.width + col + 1]
        done = torch.zeros(len(self.done), dtype=torch.bool)
        if self.host_criteria:
            done |= self.host_criteria(ids, None).cpu()
        if self.device_criteria:
            scores = None
            if self.record_scores:  # every row ran every step so far: lockstep
                step = torch.stack([self.scores[r][col] for r in range(len(self.done))])
                self.score_steps.append(step.to(self.caller_device))
                scores = tuple(self.score_steps)
            done |= self.device_criteria(ids.to(self.caller_device), scores).cpu()
        newly = [r for r, stop in enumerate(done.tolist()) if stop and not self.done[r]]
        for r in newly:
            self.done[r] = True
        if self.lockstep:
            if not all(self.done):
                return []
            newly = range(len(self.done))
        stops = []
        for r in newly:
            seq = self.seqs[r]
            if seq.num_new_tokens > col + 1 or not seq.is_finished:
                stops.append((seq, col + 1))
                self.delivered[r] = min(self.delivered[r], col + 1)
                self._close_row(r, col + 1)
        return stops

    def _close_row(self, row: int, kept: int) -> None:
        """After a row is over, both copies of the batch hold ``pad`` as transformers' does."""
        self.closed_rows.add(row)
        self.host_ids[row, self.width + kept:] = self.pad
        self.input_ids[row, self.width + kept:] = self.pad
