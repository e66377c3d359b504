"""The runner's host-side choice of cascade attention (the kernels are tested in
tests/kernels, the engine with it on a GPU in tests/gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hf_paged.engine.scheduler import ScheduledBatch
from hf_paged.worker.model_runner import ModelRunner


def shared_prefix_len(tables: np.ndarray, starts: list[int], num_tokens=None, backend="triton"):
    n = len(starts)
    batch = ScheduledBatch(seqs=[None] * n, starts=starts, num_tokens=num_tokens or [1] * n,
                           sample=[True] * n)
    runner = SimpleNamespace(config=SimpleNamespace(attention_backend=backend), block_size=16)
    return ModelRunner._shared_prefix_len(runner, batch, tables)


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
    assert shared_prefix_len(tables_sharing(40), [700] * 16, backend="sdpa") == 0
