"""The LoRA kernels' row tiles, built on the host: every row in exactly one tile, a tile's rows
all of its slot and in the step's order, at most ``block_m`` of them, as few tiles as the
groups allow; padding tiles idle; a decode graph's bound never too small."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_paged.kernels.lora_tiles import (
    DECODE_ROWS,
    PREFILL_ROWS,
    LoraTiles,
    fill_tiles,
    tile_bound,
    tile_rows,
)


def tiles_of(lens: list[int], slots: list[int], block_m: int, width: int | None = None
             ) -> tuple[np.ndarray, np.ndarray, int]:
    rows = sum(lens)
    order = np.empty(rows, np.int32)
    tiles = np.empty((3, rows if width is None else width), np.int32)
    used = fill_tiles(order, tiles, lens, slots, block_m)
    return order, tiles, used


def check_tiles(lens: list[int], slots: list[int], order: np.ndarray, tiles: np.ndarray,
                used: int, block_m: int) -> None:
    """Every row once, of its slot, rows of a slot ascending; a tile short only at its
    group's end; padding tiles idle."""
    row_slot = np.repeat(slots, lens)
    assert sorted(order.tolist()) == list(range(sum(lens)))
    seen: dict[int, list[int]] = {}
    for slot, first, count in tiles[:, :used].T.tolist():
        rows = order[first:first + count].tolist()
        assert 0 < count <= block_m and all(row_slot[r] == slot for r in rows)
        seen.setdefault(slot, []).append(count)
        assert rows == sorted(rows)
    for slot, counts in seen.items():
        assert sum(counts) == int((row_slot == slot).sum())
        assert all(c == block_m for c in counts[:-1])  # one short tile a group at most
    assert (tiles[0, used:] == -1).all() and (tiles[2, used:] == 0).all()


def test_decode_rows_grouped_by_adapter():
    """100 sequences on 16 adapters (every seventh on none): 17 tiles, not 100."""
    slots = [-1 if i % 7 == 6 else i % 16 for i in range(100)]
    order, tiles, used = tiles_of([1] * 100, slots, DECODE_ROWS, width=40)
    assert used == 17
    check_tiles([1] * 100, slots, order, tiles, used, DECODE_ROWS)


def test_prefill_runs_split_and_shared():
    """A long run in tiles of 64, its slot's other sequences after it; a slot's short runs
    share a tile; runs of no rows take none."""
    lens, slots = [150, 3, 0, 20, 1, 40], [2, 0, 1, 2, -1, 0]
    order, tiles, used = tiles_of(lens, slots, PREFILL_ROWS)
    check_tiles(lens, slots, order, tiles, used, PREFILL_ROWS)
    assert tiles[:, :used].T.tolist() == [[-1, 0, 1], [0, 1, 43], [2, 44, 64], [2, 108, 64],
                                          [2, 172, 42]]


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_within_the_graph_bound(seed):
    """A decode graph's tiles for any slots of its rows (padding rows on none) fit its bound."""
    rng = np.random.default_rng(seed)
    for bs in (1, 2, 8, 16, 48, 256):
        for num_slots in (1, 4, 16, 64):
            slots = rng.integers(-1, num_slots, bs).tolist()
            order, tiles, used = tiles_of([1] * bs, slots, DECODE_ROWS,
                                          width=tile_bound(bs, num_slots, DECODE_ROWS))
            check_tiles([1] * bs, slots, order, tiles, used, DECODE_ROWS)


def test_the_bound_is_reached():
    """Every slot a row short of a whole tile, the padding rows too: the bound is tight."""
    slots = [s for s in range(-1, 3) for _ in range(17)]
    assert tiles_of([1] * 68, slots, DECODE_ROWS)[2] == tile_bound(68, 3, DECODE_ROWS) == 8


def test_refuses_too_few_tiles():
    with pytest.raises(ValueError, match="fill_tiles: 3 tiles do not fit tiles' 2"):
        tiles_of([1] * 3, [0, 1, 2], DECODE_ROWS, width=2)


def test_build_copies_the_used_tiles():
    built = LoraTiles.build([1, 30, 2], [1, 0, 1], torch.device("cpu"))
    assert built.block_m == tile_rows(30) == PREFILL_ROWS and tile_rows(16) == DECODE_ROWS
    assert built.order.dtype == built.tiles.dtype == torch.int32
    assert built.order.tolist() == [*range(1, 31), 0, 31, 32]
    assert built.tiles.tolist() == [[0, 1], [0, 30], [30, 3]]
    empty = LoraTiles.build([], [], torch.device("cpu"))
    assert empty.order.shape == (0,) and empty.tiles.shape == (3, 0)
