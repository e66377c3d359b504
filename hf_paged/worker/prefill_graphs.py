"""CUDA graphs of prefill steps, so that a step does not wait for hundreds of kernel launches
from Python (a 1,024-token prefill of Qwen3-0.6B is about 3 ms of kernels in 15 ms of eager
launches on a slow host; an 8,192-token step, 18 ms of kernels in 18-24 ms of launches).

One graph per token bucket (powers of two from 32 up to ``max_tokens``), each for up to a
number of sequences that grows with it (``seq_capacity``: from 8 to ``max_seqs``; a step with
more sequences than its tokens' bucket holds takes a larger one), over views of one int32
input buffer laid out as ids, pending-token rows (``src``), positions and slots (a bucket's
worth each), then ``cu_seqlens`` (capacity + 1), context lengths (capacity), a hybrid model's
state slots and has-initial-state flags (capacity each), logits rows (at least ``max_rows``:
a step verifying draft tokens draws at several positions of a sequence), then the block
tables (capacity full-width rows). A step replays the smallest bucket holding
it, padded: tokens past its own belong to no sequence (attention skips them, their slot is -1
so nothing is stored, and every other operation works row by row), sequences past its own are
empty (a hybrid model's state slot -1: its linear layers keep nothing of them), and surplus
logits rows read row 0. Padded sequences and logits rows are not free
(attention's programs, the LM head's rows), hence capacities that grow with the bucket: a lone
prompt's bucket stays small, while a full step budget holds every running sequence (a prefill
chunk shares its step with each running sequence's decode row). Attention runs its general
kernel, right for any mix of prefill chunks and one-token rows. A graph ends at the rank's
slice of the logits; the gather (tensor parallelism) and the float32 cast follow the replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch

from hf_paged.cuda_graphs import capture_graphs, graph_buffers
from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.step import StepInputs

# (ids, src, positions, metadata, logits rows) -> (this rank's logits slice of those rows,)
PrefillStep = Callable[..., tuple[torch.Tensor]]

_MIN_TOKENS = 32
_MIN_SEQS = 8
_TOKENS_PER_SEQ = 32  # a bucket holds up to bucket // 32 sequences (at least _MIN_SEQS)
_TOKEN_FIELDS = 4  # ids, src, positions, slots
_TOKEN_PADDING = np.array([0, -1, 0, -1], np.int32)[:, None]  # no store, no pending token


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from ``_MIN_TOKENS`` below ``max_tokens``, then ``max_tokens``."""
    buckets = []
    size = _MIN_TOKENS
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_tokens]


def seq_capacity(bucket: int, max_seqs: int) -> int:
    """How many sequences the graph of ``bucket`` tokens holds."""
    return min(max_seqs, max(_MIN_SEQS, bucket // _TOKENS_PER_SEQ))


class PrefillGraphs:
    """The prefill graphs of one runner: ``bucket`` picks the graph of a step (0: none fits),
    ``run`` replays it."""

    def __init__(self, step: PrefillStep, gather: Callable[[torch.Tensor], torch.Tensor | None],
                 max_tokens: int, max_seqs: int, width: int, device: torch.device,
                 max_rows: int, states: bool = False):
        self.forward, self.gather = step, gather
        self.max_rows = max_rows
        self.state_fields = 2 if states else 0  # a hybrid model's slots and flags
        self.width = width
        self.buckets = token_buckets(max_tokens)
        self.capacity = {b: seq_capacity(b, max_seqs) for b in self.buckets}
        self.inputs, self.host_inputs = graph_buffers(
            max(self._layout(b)[-1] for b in self.buckets), device)
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, its logits slice)

    def _rows(self, bucket: int) -> int:
        return max(self.max_rows, self.capacity[bucket])

    def _layout(self, bucket: int) -> tuple[int, int, int]:
        """Where the sequence fields start, where the tables start, and the end."""
        s = self.capacity[bucket]
        seqs = _TOKEN_FIELDS * bucket
        tables = seqs + (2 + self.state_fields) * s + 1 + self._rows(bucket)
        return seqs, tables, tables + s * self.width

    def bucket(self, inputs: StepInputs) -> int:
        """The smallest bucket holding the step's tokens, sequences and logits rows (0: none)."""
        if inputs.shared:
            return 0
        seqs, rows = len(inputs.seq_lens), len(inputs.logits_rows)
        for b in self.buckets[bisect.bisect_left(self.buckets, len(inputs.ids)):]:
            if seqs <= self.capacity[b] and rows <= self._rows(b):
                return b
        return 0

    def step(self, bucket: int) -> tuple[torch.Tensor]:
        """The forward over the buffer laid out for ``bucket``: this rank's logits slice of
        every logits row. Captured once per bucket."""
        s = self.capacity[bucket]
        seqs, tables, end = self._layout(bucket)
        ids, src, positions, slots = self.inputs[:seqs].view(_TOKEN_FIELDS, bucket)
        fields = self.inputs[seqs:tables]
        states = self.state_fields > 0
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=fields[: s + 1],
            seq_lens=fields[s + 1 : 2 * s + 1],
            block_tables=self.inputs[tables:end].view(s, self.width),
            max_query_len=bucket,  # not 1: the general attention kernel
            shared_prefix=None,
            state_slots=fields[2 * s + 1 : 3 * s + 1] if states else None,
            has_initial_state=fields[3 * s + 1 : 4 * s + 1] != 0 if states else None,
        )
        rows = (2 + self.state_fields) * s + 1
        return self.forward(ids, src, positions, meta, fields[rows:])

    def steps(self) -> Iterator[tuple[int, Callable[[], tuple]]]:
        """Each bucket and its step, largest first, its inputs laid out for the capture as
        each is yielded."""
        for bucket in reversed(self.buckets):
            self.clear(bucket)
            yield bucket, partial(self.step, bucket)

    def capture(self) -> None:
        self.graphs = capture_graphs(self.steps())

    def clear(self, bucket: int) -> None:
        """Lay out a step of no tokens for ``bucket``: what a capture runs on."""
        host = self.host_inputs[0]
        used = self._fill(host, bucket, [], [], [], [], [0], [], [], None)
        self.inputs[:used].copy_(host[:used])

    def run(self, inputs: StepInputs, bucket: int, flip: int) -> torch.Tensor | None:
        """Fill ``bucket``'s inputs from ``inputs`` (one copy from a pinned twin), replay, and
        return the float32 logits of the sampled rows (rank 0; None elsewhere or when no row
        is sampled)."""
        host = self.host_inputs[flip]
        used = self._fill(host, bucket, inputs.ids, inputs.src, inputs.positions, inputs.slots,
                          inputs.cu_seqlens, inputs.seq_lens, inputs.logits_rows, inputs.tables,
                          inputs.state_slots, inputs.has_initial_state)
        self.inputs[:used].copy_(host[:used], non_blocking=True)
        graph, logits = self.graphs[bucket]
        graph.replay()
        rows = len(inputs.logits_rows)
        return self.gather(logits[:rows]) if rows else None

    def _fill(self, host, bucket, ids, src, positions, slots, cu_seqlens, seq_lens,
              logits_rows, tables, state_slots=(), has_initial=()) -> int:
        """Lay a step out in the host buffer ``host`` (padded to ``bucket`` tokens and
        its capacity of sequences); return how many leading entries the graph reads."""
        x = host.numpy()
        s, n, b, r = self.capacity[bucket], len(ids), len(seq_lens), len(logits_rows)
        seqs, start, _ = self._layout(bucket)
        head = x[:seqs].reshape(_TOKEN_FIELDS, bucket)
        head[:, :n] = (ids, src, positions, slots)
        head[:, n:] = _TOKEN_PADDING
        fields = x[seqs:start]
        fields[: b + 1] = cu_seqlens
        fields[b + 1 : s + 1] = cu_seqlens[-1]  # empty sequences
        fields[s + 1 : s + 1 + b] = seq_lens
        fields[s + 1 + b : 2 * s + 1] = 0
        at = 2 * s + 1
        if self.state_fields:  # empty sequences keep no state
            fields[at : at + b] = state_slots
            fields[at + b : at + s] = -1
            fields[at + s : at + s + b] = has_initial
            fields[at + s + b : at + 2 * s] = 0
            at += 2 * s
        fields[at : at + r] = logits_rows
        fields[at + r :] = 0
        if b:
            x[start : start + b * self.width].reshape(b, self.width)[:, : tables.shape[1]] = tables
        return start + b * self.width
