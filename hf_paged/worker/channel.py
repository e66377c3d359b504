"""The wire between rank 0 and the other ranks of its tensor-parallel group: rank 0's messages,
broadcast over a gloo group in host memory (so that they cross machines too).

Every message starts with a header of thirteen int64:

    0  kind: STEP, RESULTS, LORA, FORWARD or STOP
    1  n: tokens in the step (``len(ids)``)
    2  b: sequences in the step (``len(seq_lens)``)
    3  r: sampled token rows (``len(logits_rows)``)
    4  w: width of a block-table row (``tables.shape[1]``)
    5  ``max_query_len``
    6  ``graph_bs``
    7  ``shared``
    8  c: copy-on-write block copies (``len(block_copies)``)
    9  ``num_drawn``
    10 l: per-sequence adapter slots (``len(lora_slots)``: b, or 0 when no sequence has one)
    11 s: per-sequence state slots (``len(state_slots)``: b for a hybrid model, else 0)
    12 sc: state-slot copies (``len(state_copies)``)

Entries 1-12 are zero unless the kind is STEP. A STEP's inputs are one flat int64 payload,
in ``StepInputs`` field order: ``ids``, ``src``, ``positions``, ``slots`` (n each),
``cu_seqlens`` (b + 1), ``seq_lens`` (b), ``logits_rows`` (r), ``tables`` (b * w, row-major),
``block_copies`` (2c, pair by pair), ``lora_slots`` (l), ``state_slots`` (s),
``has_initial_state`` (s, as 0 or 1), ``state_copies`` (2sc, pair by pair). Each message is
one broadcast of the header and ``_INLINE`` more int64, which carry the payload when it fits
(decode steps of up to about a hundred sequences); a longer payload follows in a broadcast of
its own. Every broadcast costs a round of gloo's latency between the ranks (on a two-core
machine's loopback: about 330 us for the header and a separate payload, 160-180 for one
message of up to 4,109 int64), and the other ranks start their step only once it has
arrived. Under torchrun
a RESULTS header is followed by one pickled object (``send_object``): rank 0's outcome of
``engine.run``. A LORA header (spawned ranks) is followed by one pickled ``(slot, adapter)``:
the whole adapter, host tensors, or None to unload the slot. A FORWARD header is followed by
one pickled ``ModelCall`` (host tensors): the model call every rank runs. STOP ends a spawned
rank.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hf_paged.step import StepInputs

STEP, RESULTS, STOP, LORA, FORWARD = 1, 2, 3, 4, 5  # message kinds
_HEADER_LEN = 13
_INLINE = 4096  # payload int64 that travel with the header


class StepChannel:
    """Rank 0's side sends, the other ranks' side receives, over ``cpu_group`` (gloo)."""

    def __init__(self, cpu_group: dist.ProcessGroup):
        self.group = cpu_group
        self.message = torch.zeros(_HEADER_LEN + _INLINE, dtype=torch.long)
        self.header, self.inline = self.message[:_HEADER_LEN], self.message[_HEADER_LEN:]

    def send(self, kind: int, inputs: StepInputs | None = None) -> None:
        """Rank 0: a message of ``kind``, with ``inputs`` when it is a STEP."""
        self.header.zero_()
        self.header[0] = kind
        payload = None
        if inputs is not None:
            self.header[1:] = torch.tensor([
                len(inputs.ids), len(inputs.seq_lens), len(inputs.logits_rows),
                inputs.tables.shape[1], inputs.max_query_len, inputs.graph_bs, inputs.shared,
                len(inputs.block_copies), inputs.num_drawn, len(inputs.lora_slots),
                len(inputs.state_slots), len(inputs.state_copies)])
            payload = torch.from_numpy(_flat(inputs))
            if len(payload) <= _INLINE:
                self.inline[: len(payload)] = payload
                payload = None
        self._broadcast(self.message)
        if payload is not None:
            self._broadcast(payload)

    def recv(self) -> tuple[int, StepInputs | None]:
        """The other ranks: rank 0's next message kind, and the step's inputs for a STEP."""
        self._broadcast(self.message)
        (kind, n, b, r, width, max_query_len, graph_bs, shared, c, drawn, lora, states,
         state_copies) = self.header.tolist()
        if kind != STEP:
            return kind, None
        length = (4 * n + 2 * b + 1 + r + b * width + 2 * c + lora + 2 * states
                  + 2 * state_copies)
        if length <= _INLINE:
            payload = self.inline[:length]
        else:
            payload = torch.empty(length, dtype=torch.long)
            self._broadcast(payload)
        parts = np.split(payload.numpy(), np.cumsum(
            [n, n, n, n, b + 1, b, r, b * width, 2 * c, lora, states, states]))
        lists = [p.tolist() for p in parts[:7]]
        tables = parts[7].astype(np.int32).reshape(b, width)
        return kind, StepInputs(*lists[:6], tables, lists[6], max_query_len, graph_bs, shared,
                                _pairs(parts[8]), drawn, parts[9].tolist(), parts[10].tolist(),
                                parts[11].astype(bool).tolist(), _pairs(parts[12]))

    def send_object(self, obj: object) -> None:
        """Rank 0: any picklable object, after a header that announces it."""
        dist.broadcast_object_list([obj], group=self.group, group_src=0)

    def recv_object(self) -> object:
        box = [None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _broadcast(self, x: torch.Tensor) -> None:
        dist.broadcast(x, group=self.group, group_src=0)


def _flat(inputs: StepInputs) -> np.ndarray:
    """A step's inputs as the int64 payload the module docstring lays out."""
    return np.concatenate([
        inputs.ids, inputs.src, inputs.positions, inputs.slots, inputs.cu_seqlens,
        inputs.seq_lens, inputs.logits_rows, inputs.tables.ravel(),
        np.asarray(inputs.block_copies, dtype=np.int64).ravel(),
        np.asarray(inputs.lora_slots, dtype=np.int64),
        np.asarray(inputs.state_slots, dtype=np.int64),
        np.asarray(inputs.has_initial_state, dtype=np.int64),
        np.asarray(inputs.state_copies, dtype=np.int64).ravel()]).astype(np.int64)


def _pairs(flat: np.ndarray) -> list[tuple[int, int]]:
    """(source, destination) pairs sent pair by pair."""
    return [tuple(pair) for pair in flat.reshape(-1, 2).tolist()]
