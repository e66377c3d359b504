"""Row tiles of the LoRA kernels (``kernels.lora``), built on the host: a step's rows grouped
by adapter slot, so that the sequences sharing an adapter share its tiles and read its weights
once a tile, as punica's SGMV groups them. At decode (a row a sequence) 100 sequences on 16
adapters make about 16 tiles, not 100.

A step's tiles are plain int32 data: ``order [T]``, the step's rows grouped by slot (stable:
rows of a slot keep their order, so its rows are those of its sequences, in turn), and
``tiles [3, G]``, each tile's slot (-1: no adapter), its first index in ``order`` and its row
count (up to ``block_m``; 0: a padding tile, idle). Tiles cover every row, those on no adapter
too: the gated variant writes every row's activation. A decode graph holds them in its input
buffer, sized for its batch by ``tile_bound``, and fills them each step from the host without
a sync (``fill_tiles``); an eager step copies them over (``LoraTiles.build``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

# Row tiles: 16 (tl.dot's least) when every run fits one, as at decode; else 64, a prefill
# GEMM's usual height (larger tiles would mostly pad the short groups of a mixed batch).
DECODE_ROWS, PREFILL_ROWS = 16, 64


def tile_rows(max_rows: int) -> int:
    """The tile height for a step whose longest sequence has ``max_rows`` rows."""
    return DECODE_ROWS if max_rows <= DECODE_ROWS else PREFILL_ROWS


def tile_bound(rows: int, num_slots: int, block_m: int) -> int:
    """The most tiles ``rows`` rows on up to ``num_slots`` adapters (and none) may take: each
    group of a slot pads at most one tile, and no tile is empty."""
    return min(rows, rows // block_m + min(num_slots, rows) + 1)


def fill_tiles(order: np.ndarray, tiles: np.ndarray, lens: Sequence[int] | np.ndarray,
               slots: Sequence[int] | np.ndarray, block_m: int) -> int:
    """Write the tiles of sequences of ``lens`` rows on adapter ``slots`` (-1: none) into
    ``order [sum(lens)]`` and ``tiles [3, G]`` (views of a graph's host buffer, or new arrays),
    padding tiles past the last; return how many tiles are used. A ValueError when ``tiles``
    has too few columns."""
    # (a few numpy calls: the host builds a decode graph's tiles every step)
    row_slot = np.repeat(np.asarray(slots, np.int32), lens)
    rows = len(row_slot)
    order[:] = np.argsort(row_slot, kind="stable")
    grouped = row_slot[order]
    # A tile starts where a slot's group does, then every block_m rows of the group.
    new_group = np.ones(rows, bool)
    np.not_equal(grouped[1:], grouped[:-1], out=new_group[1:])
    index = np.arange(rows)
    group_start = np.maximum.accumulate(index * new_group)
    firsts = np.flatnonzero((index - group_start) % block_m == 0)
    used = len(firsts)
    if used > tiles.shape[1]:
        raise ValueError(f"fill_tiles: {used} tiles do not fit tiles' {tiles.shape[1]}")
    tiles[0, :used] = grouped[firsts]
    tiles[1, :used] = firsts
    tiles[2, :used] = np.append(firsts[1:], rows) - firsts
    tiles[0, used:] = -1
    tiles[1:, used:] = 0
    return used


class LoraTiles(NamedTuple):
    """A step's adapter rows as the LoRA kernels take them (``order``, ``tiles``: see the
    module's docstring; int32 on the device) and the tile height, ``block_m``."""

    order: torch.Tensor
    tiles: torch.Tensor
    block_m: int

    @classmethod
    def build(cls, lens: Sequence[int] | np.ndarray, slots: Sequence[int],
              device: torch.device) -> LoraTiles:
        """The tiles of sequences of ``lens`` rows on ``slots``, copied to ``device`` in one
        asynchronous copy (no wait for the step before)."""
        lens = np.asarray(lens, np.int64)
        block_m = tile_rows(int(lens.max(initial=0)))
        rows = int(lens.sum())
        order = np.empty(rows, np.int32)
        tiles = np.empty((3, tile_bound(rows, rows, block_m)), np.int32)
        used = fill_tiles(order, tiles, lens, slots, block_m)
        data = torch.from_numpy(np.concatenate([order, tiles[:, :used].ravel()]))
        data = data.to(device, non_blocking=True)
        return cls(data[:rows], data[rows:].view(3, used), block_m)
