"""CUDA graphs of decode steps: one per batch size of a ladder (1, 2, 4, 8, then every 16 up to
the largest), captured at start-up over static input buffers. A decode batch replays the
smallest graph that fits, padded with rows whose slot is -1 (not stored), whose context is
empty and which are greedy. Sizes from ``cascade_min_seqs`` up have a second graph with
cascade attention, replayed when the batch's sequences all start with the same cache blocks
(a prompt shared through the prefix cache). Once LoRA adapters are loaded, each size also has a
graph whose projections add each row's adapter delta (``capture_adapters``), replayed for a
batch with any row on an adapter; the base model's batches keep the graphs without them.

The inputs of a graph of size ``bs`` are views of one int32 buffer laid out as the shared
prefix length (one entry), then ids, pending-token rows (``src``), positions, slots, context
lengths, each row's temperature, top-k, top-p and min-p (floats as their bit patterns), its
state slot (a hybrid model's linear-attention state; -1: padding, or no such layers), its
LoRA adapter's slot (-1: none) and the rows longest context first (decode attention's launch
order; ``bs`` each), then the block tables, column-major (``bs`` entries per block index, up
to the full width), so a replay fills a pinned host buffer and sends it in a single copy of
the columns the batch uses: at 256 rows and a 40,960-token model length the full width was
2.6 MB a step. The layouts of different sizes overlap. A graph also draws the next tokens
(greedy rows keep the argmax), so sampling costs no launches outside it; under tensor
parallelism it stops at the rank's logits slice instead, gathered on rank 0 after the replay,
and rank 0 samples outside the graph.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import numpy as np
import torch

from hf_paged.cuda_graphs import capture_graphs, graph_buffers
from hf_paged.modeling.attention import AttentionMetadata, decode_order
from hf_paged.step import StepInputs

# (ids, src, positions, metadata, temperature, top-k, top-p, min-p) -> the graph's outputs
DecodeStep = Callable[..., tuple[torch.Tensor, ...]]
# (the graph's outputs, rows used) -> (float32 logits on rank 0 or None, drawn tokens or None)
DecodeOutputs = Callable[[tuple, int], tuple]

# per row: ids, src, positions, slots, context lengths, temperature, top-k, top-p, min-p,
# state slot, adapter slot, order
_FIELDS = 12
_ORDER = _FIELDS - 1  # the order row comes last: padding rows take their own index
_ONE_BITS = int(np.array(1.0, np.float32).view(np.int32))  # top_p = 1.0 as int32 bits
# Padding rows' fields before the order: no pending token, no store, empty context, greedy,
# no state slot, no adapter.
_PADDING = np.array([0, -1, 0, -1, 0, 0, 0, _ONE_BITS, 0, -1, -1], np.int32)[:, None]
_ADAPTER = _ORDER - 1
_STATE = _ADAPTER - 1
# (cu_seqlens, adapter slots, max_rows) -> a context in which the projections add the rows'
# adapter deltas (``LoraSlots.rows``)
LoraRows = Callable[[torch.Tensor, torch.Tensor, int], AbstractContextManager]


class DecodeGraphs:
    """The decode graphs of one runner: ``batch_size`` picks a batch's graph (0: none fits),
    ``run`` replays it."""

    def __init__(self, step: DecodeStep, outputs: DecodeOutputs, samples: bool, max_bs: int,
                 width: int, device: torch.device, cascade_min_seqs: int,
                 lora_rows: LoraRows | None = None, states: bool = False):
        self.forward, self.outputs, self.lora_rows = step, outputs, lora_rows
        self.samples = samples  # the step draws tokens (one rank): the rows' settings go in
        # A hybrid model's: each row's state slot goes in, every row continues its state.
        self.initial = torch.ones(max_bs, dtype=torch.bool, device=device) if states else None
        self.sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
        self.sizes.append(max_bs)
        self.cascade_min_seqs = cascade_min_seqs
        self.width = width
        self.inputs, self.host_inputs = graph_buffers(1 + max_bs * (_FIELDS + self.width), device)
        # Every tensor a graph reads must live as long as the graph: kept here.
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.rows = np.arange(max_bs, dtype=np.int32)
        self.graphs: dict[tuple[int, bool, bool], tuple] = {}  # -> (graph, *its outputs)
        self.with_adapters = False  # whether the graphs adding adapter deltas are captured

    def batch_size(self, is_decode: bool, num_seqs: int, adapters: bool = False) -> int:
        """The graph size for a batch (0: none fits; ``adapters``: a row on an adapter, whose
        graphs may not be captured)."""
        if not is_decode or (adapters and not self.with_adapters):
            return 0
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else 0

    def keys(self, adapters: bool = False) -> list[tuple[int, bool, bool]]:
        """Every graph (``adapters``: of those adding adapter deltas), largest first (the
        smaller ones reuse its memory pool)."""
        return [(bs, cascade, adapters) for bs in reversed(self.sizes)
                for cascade in ((False, True) if bs >= self.cascade_min_seqs else (False,))]

    def step(self, bs: int, cascade: bool, adapters: bool = False) -> tuple[torch.Tensor, ...]:
        """The decode step over the buffer laid out for ``bs`` rows. Captured once per key."""
        (ids, src, positions, slots, seq_lens, temperature, top_k, top_p, min_p, state, lora,
         order) = self.inputs[1 : 1 + _FIELDS * bs].view(_FIELDS, bs)
        states = self.initial is not None
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=self.cu_seqlens[: bs + 1],
            seq_lens=seq_lens,
            block_tables=self.inputs[1 + _FIELDS * bs : 1 + bs * (_FIELDS + self.width)].view(
                self.width, bs).t(),
            max_query_len=1,
            shared_prefix=self.inputs[:1] if cascade else None,
            decode_order=order,
            state_slots=state if states else None,
            has_initial_state=self.initial[:bs] if states else None,
        )
        rows = self.lora_rows(meta.cu_seqlens_q, lora, 1) if adapters else nullcontext()
        with rows:
            return self.forward(ids, src, positions, meta, temperature.view(torch.float32),
                                top_k, top_p.view(torch.float32), min_p.view(torch.float32))

    def clear(self, bs: int) -> None:
        """Lay out a batch of padding rows only for ``bs``: what a capture runs on."""
        self.inputs.zero_()  # the larger graphs' layouts overlap this one's rows
        fields = self.inputs[1 : 1 + _FIELDS * bs].view(_FIELDS, bs)
        fields[1].fill_(-1)
        fields[3].fill_(-1)  # nothing stored while capturing
        fields[_STATE].fill_(-1)
        fields[_ADAPTER].fill_(-1)
        fields[_ORDER].copy_(torch.arange(bs))

    def steps(self, adapters: bool = False
              ) -> Iterator[tuple[tuple[int, bool, bool], Callable[[], tuple]]]:
        """Each graph's key and step, largest first, its inputs laid out for the capture as
        each is yielded."""
        for key in self.keys(adapters):
            self.clear(key[0])
            yield key, partial(self.step, *key)

    def capture(self) -> None:
        self.graphs = capture_graphs(self.steps())

    def capture_adapters(self) -> None:
        """Capture the graphs that add adapter deltas (the stacks exist: an adapter loaded)."""
        self.graphs |= capture_graphs(self.steps(adapters=True))
        self.with_adapters = True

    def run(self, inputs: StepInputs, settings: tuple | None, flip: int):
        """Replay graph ``inputs.graph_bs`` (the cascade one when ``inputs.shared`` is set)
        over the batch's rows, each drawing with its ``settings`` (the sampler's
        ``kernel_settings``) when the graph samples; return ``outputs``' answer."""
        n, bs = len(inputs.ids), inputs.graph_bs
        # This twin's last copy belonged to the step before last, whose tokens were collected.
        host_inputs = self.host_inputs[flip]
        host = host_inputs.numpy()
        host[0] = inputs.shared
        head = host[1 : 1 + _FIELDS * bs].reshape(_FIELDS, bs)
        head[:5, :n] = (inputs.ids, inputs.src, inputs.positions, inputs.slots, inputs.seq_lens)
        adapters = on_adapters(inputs.lora_slots)
        head[_ADAPTER, :n] = inputs.lora_slots if adapters else -1
        head[_STATE, :n] = inputs.state_slots or -1
        if self.samples:
            temperature, top_k, top_p, min_p = settings
            head[5, :n] = temperature.view(np.int32)
            head[6, :n] = top_k
            head[7, :n] = top_p.view(np.int32)
            head[8, :n] = min_p.view(np.int32)
        head[:_ORDER, n:] = _PADDING
        head[_ORDER, :n] = decode_order(inputs.seq_lens)
        head[_ORDER, n:] = self.rows[n:bs]  # empty: last
        tables = inputs.tables
        used = 1 + bs * (_FIELDS + tables.shape[1])
        host[1 + _FIELDS * bs : used].reshape(-1, bs)[:, :n] = tables.T
        self.inputs[:used].copy_(host_inputs[:used], non_blocking=True)
        graph, *outputs = self.graphs[bs, bool(inputs.shared), adapters]
        graph.replay()
        return self.outputs(tuple(outputs), n)


def on_adapters(lora_slots: list[int]) -> bool:
    """Whether any sequence of a step runs on a LoRA adapter."""
    return any(slot >= 0 for slot in lora_slots)
