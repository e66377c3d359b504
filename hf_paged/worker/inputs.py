"""A step's plan -> its ``StepInputs``: flat token ids, positions and cache slots, per-sequence
metadata and block-table rows, built with plain ints for the one-token (decode) rows, since
this runs on the host every step.

Tokens the last step sampled are still on the device when the next step is prepared: such a
token gets id 0 here and ``src`` names its row in the last step's samples (-1 everywhere
else). Block tables live as rows of one int32 array, updated incrementally, so that a step
copies only new block ids instead of rebuilding every table. ``device_metadata`` turns an
eager step's inputs into the ``AttentionMetadata`` on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.device_copy import to_device
from hf_paged.modeling.attention import AttentionMetadata, decode_order
from hf_paged.step import StepInputs, StepPlan

# Cascade attention (kernels.attention) pays two more kernels a layer to read a shared prefix
# once per tile of sequences instead of once per sequence: worth it from this many sequences
# times shared tokens and this many sequences (the smallest graph with a cascade twin).
CASCADE_MIN_TOKENS = 1 << 13
CASCADE_MIN_SEQS = 16


class BlockTableMirror:
    """Block tables of live sequences as rows of one int32 array."""

    def __init__(self, width: int):
        self.rows = np.zeros((0, width), dtype=np.int32)
        self.free_rows: list[int] = []
        # seq_id -> [row, number of entries synced, the block_table list they came from]
        self.state: dict[int, list] = {}

    def gather(self, seq_ids: list[int], tables: list[list[int]]) -> np.ndarray:
        index, width = [], 1
        for seq_id, table in zip(seq_ids, tables):
            state = self.state.get(seq_id)
            if state is None:
                state = self.state[seq_id] = [self._take_row(), 0, table]
            if state[2] is not table:  # preemption gave the sequence a new table
                state[1], state[2] = 0, table
            if len(table) > state[1]:
                self.rows[state[0], state[1] : len(table)] = table[state[1] :]
                state[1] = len(table)
            index.append(state[0])
            width = max(width, len(table))
        return self.rows[index, :width]

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            state = self.state.pop(seq_id, None)
            if state is not None:
                self.free_rows.append(state[0])

    def _take_row(self) -> int:
        if not self.free_rows:
            old, width = self.rows.shape
            self.rows = np.vstack([self.rows, np.zeros((max(old, 64), width), np.int32)])
            self.free_rows = list(range(len(self.rows) - 1, old - 1, -1))
        return self.free_rows.pop()


class StepPreparer:
    """Rank 0's host-side view of the device: block-table rows and, for each sequence that
    sampled in the last step, its row among that step's samples."""

    def __init__(self, block_size: int, max_blocks_per_seq: int, cascade: bool):
        self.block_size = block_size
        self.block_tables = BlockTableMirror(max_blocks_per_seq)
        self.cascade = cascade  # the attention backend has cascade attention
        self.last_rows: dict[int, int] = {}

    def prepare(self, plan: StepPlan, graph_bs: int) -> StepInputs:
        """The inputs of ``plan``, for the decode graph of ``graph_bs`` rows (0: none)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        src: list[int] = []
        cu_seqlens, seq_lens, logits_rows = [0], [], []
        drafts = plan.num_draft_tokens or [0] * len(plan.seq_ids)
        for seq_id, tokens, table, start, n, sample, num_drafts in zip(
                plan.seq_ids, plan.token_ids, plan.block_tables, plan.starts, plan.num_tokens,
                plan.sample, drafts):
            end = start + n
            if n == 1:
                if start < len(tokens):
                    input_ids.append(tokens[start])
                    src.append(-1)
                else:  # only the newest token can be pending, and only in a one-token chunk
                    input_ids.append(0)
                    src.append(self.last_rows[seq_id])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(tokens[start:end])
                src.extend([-1] * n)
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            cu_seqlens.append(cu_seqlens[-1] + n)
            seq_lens.append(end)
            if num_drafts:  # a verifying sequence draws at its newest token and each draft
                logits_rows.extend(range(cu_seqlens[-1] - 1 - num_drafts, cu_seqlens[-1]))
            elif sample:
                logits_rows.append(cu_seqlens[-1] - 1)
        tables = self.block_tables.gather(plan.seq_ids, plan.block_tables)
        drawn = sum(1 for row, m in zip(plan.sampling, plan.sample)
                    if m and row.candidates is None)
        # The host reads a verifying step's tokens before it schedules the next: none pend.
        pending = 0 if any(drafts) else drawn + len(plan.sample_copies)
        return StepInputs(
            input_ids, src, positions, slots, cu_seqlens, seq_lens, tables, logits_rows,
            max(plan.num_tokens), graph_bs, self._shared_prefix_len(plan, tables),
            plan.block_copies, pending, plan.lora_slots, plan.state_slots,
            plan.has_initial_state, plan.state_copies,
        )

    def sampled(self, seq_ids: list[int]) -> None:
        """The sequences whose tokens the step just launched drew, in sample order."""
        self.last_rows = {seq_id: row for row, seq_id in enumerate(seq_ids)}

    def release(self, seq_ids: list[int]) -> None:
        self.block_tables.release(seq_ids)

    def _shared_prefix_len(self, plan: StepPlan, tables: np.ndarray) -> int:
        """Leading context tokens that every sequence of a decode batch holds in the same
        blocks, when enough for cascade attention (0 otherwise)."""
        if not self.cascade or not plan.is_decode or len(plan.seq_ids) < CASCADE_MIN_SEQS:
            return 0
        # Whole blocks before each sequence's newest token (a mirror row may be stale after).
        limit = min(min(plan.starts) // self.block_size, tables.shape[1])
        same = (tables[:, :limit] == tables[:1, :limit]).all(axis=0)
        shared = (limit if same.all() else int(same.argmin())) * self.block_size
        return shared if len(plan.seq_ids) * shared >= CASCADE_MIN_TOKENS else 0


def device_metadata(inputs: StepInputs, device: torch.device) -> AttentionMetadata:
    """An eager step's metadata, copied to ``device`` without a sync."""
    slots = inputs.state_slots
    return AttentionMetadata(
        slot_mapping=to_device(inputs.slots, device),
        cu_seqlens_q=to_device(inputs.cu_seqlens, device, torch.int32),
        seq_lens=to_device(inputs.seq_lens, device, torch.int32),
        block_tables=torch.from_numpy(inputs.tables).to(device, non_blocking=True),
        max_query_len=inputs.max_query_len,
        shared_prefix=to_device([inputs.shared], device, torch.int32) if inputs.shared else None,
        decode_order=to_device(decode_order(inputs.seq_lens), device, torch.int32)
        if inputs.max_query_len == 1 else None,
        state_slots=to_device(slots, device, torch.int32) if slots else None,
        has_initial_state=to_device(inputs.has_initial_state, device, torch.bool)
        if slots else None,
    )
