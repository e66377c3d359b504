"""Logits as order-preserving int32 keys, read a tile (or several) at a time, and the
interval searches over keys that sampling's thresholds come from."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_key(x):
    """The order-preserving int32 image of float32 ``x`` (sign-magnitude to two's complement)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def tile(row_ptr, start, vocab, BLOCK_V: tl.constexpr):
    """Indices, validity, logits and keys of one tile of the row."""
    idx = start + tl.arange(0, BLOCK_V)
    ok = idx < vocab
    x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
    return idx, ok, x, to_key(x)


@triton.jit
def tiles(row_ptr, start, vocab, BLOCK_V: tl.constexpr, DEPTH: tl.constexpr):
    """``tile`` for ``DEPTH`` consecutive tiles at once, one a row (lane ``l`` of every row is
    column ``l`` of its tile): the passes that keep per-lane maxima wait on memory once per
    ``DEPTH`` tiles (a one-row pass over 37 tiles is bound by their round trips)."""
    idx = start + tl.arange(0, DEPTH)[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    ok = idx < vocab
    x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
    return idx, ok, x, to_key(x)


@triton.jit
def probe_keys(lo, hi, PROBES: tl.constexpr):
    """``PROBES`` increasing keys in ``(lo, hi]``, the last one ``hi``."""
    steps = tl.arange(0, PROBES).to(tl.int64) + 1
    return lo + ((hi - lo) * steps + PROBES - 1) // PROBES


@triton.jit
def narrow(lo, hi, probes, below):
    """The interval after one pass: ``hi`` the smallest probe where the test holds (``below``),
    ``lo`` the largest where it fails."""
    hi = tl.min(tl.where(below, probes, hi), axis=0)
    lo = tl.max(tl.where(below, lo, probes), axis=0)
    return lo, hi


@triton.jit
def kth_key(keys, k, PROBES: tl.constexpr):
    """The ``k``-th largest of the int32 ``keys`` (a 1-D register tensor holding at least ``k``
    real keys; fillers at ``-2**31`` never count)."""
    lo = tl.full([], -(2**31) - 1, tl.int64)
    hi = tl.full([], 2**31 - 1, tl.int64)
    while hi - lo > 1:
        probes = probe_keys(lo, hi, PROBES)
        above = tl.sum((keys[None, :] > probes[:, None].to(tl.int32)).to(tl.int32), axis=1)
        lo, hi = narrow(lo, hi, probes, above < k)
    return hi
