"""A step's inputs from its plan: the host-side choice of cascade attention (the kernels are
tested in tests/kernels, the engine with it on a GPU in tests/gpu), pending tokens and slots."""

from __future__ import annotations

import numpy as np

from hf_paged.step import RowSampling, StepPlan
from hf_paged.worker.inputs import StepPreparer


def row(seq_id: int, history: list[int]) -> RowSampling:
    return RowSampling(seq_id, 0.0, 0, 1.0, 1.0, history, None, None)


def plan(starts, num_tokens, tokens, tables, copies=()) -> StepPlan:
    n = len(starts)
    return StepPlan(list(range(n)), starts, num_tokens, tokens, tables, [True] * n,
                    [row(i, t) for i, t in enumerate(tokens)], list(copies), [],
                    n == sum(num_tokens))


def shared_prefix_len(tables: np.ndarray, starts: list[int], num_tokens=None, cascade=True):
    n = len(starts)
    step = plan(starts, num_tokens or [1] * n, [[]] * n, [[]] * n)
    return StepPreparer(16, 64, cascade)._shared_prefix_len(step, tables)


def tables_sharing(blocks: int, rows: int = 16, width: int = 50) -> np.ndarray:
    tables = np.arange(rows * width, dtype=np.int32).reshape(rows, width) + 1000
    tables[:, :blocks] = np.arange(blocks)
    return tables


def test_whole_shared_blocks_before_every_newest_token():
    assert shared_prefix_len(tables_sharing(40), [700] * 16) == 640
    # A sequence whose newest token sits in block 37 bounds the prefix there.
    assert shared_prefix_len(tables_sharing(40), [700] * 15 + [600]) == 592


def test_one_sequence_parting_early_shortens_the_prefix_for_all():
    tables = tables_sharing(45)
    tables[3, 41] = 7
    assert shared_prefix_len(tables, [800] * 16) == 41 * 16
    tables[3, 2] = 7  # 2 shared blocks x 16 sequences: not worth two more kernels a layer
    assert shared_prefix_len(tables, [800] * 16) == 0


def test_no_cascade_for_small_batches_prefill_or_other_backends():
    assert shared_prefix_len(tables_sharing(40, rows=15), [700] * 15) == 0
    assert shared_prefix_len(tables_sharing(40), [700] * 16, num_tokens=[1] * 15 + [2]) == 0
    assert shared_prefix_len(tables_sharing(40), [700] * 16, cascade=False) == 0


def test_pending_tokens_read_the_last_samples_and_slots_follow_the_tables():
    preparer = StepPreparer(4, 8, cascade=False)
    # Sequence 0 prefills 6 tokens; sequence 1 decodes its pending 5th token.
    step = plan([0, 4], [6, 1], [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], [[3, 5], [9, 2]])
    preparer.sampled([5, 1])  # last step: sequence 1 drew the second token
    inputs = preparer.prepare(step, graph_bs=0)
    assert inputs.ids == [1, 2, 3, 4, 5, 6, 0] and inputs.src == [-1] * 6 + [1]
    assert inputs.positions == [0, 1, 2, 3, 4, 5, 4]
    assert inputs.slots == [12, 13, 14, 15, 20, 21, 8]
    assert inputs.cu_seqlens == [0, 6, 7] and inputs.seq_lens == [6, 5]
    assert inputs.logits_rows == [5, 6] and inputs.num_drawn == 2
    assert inputs.tables.tolist() == [[3, 5], [9, 2]]
