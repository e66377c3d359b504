"""Paged attention: decode (with and without split-K), prefill, chunked prefill, mixed batches."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.attention import paged_attention
from hf_paged.modeling.attention import decode_order
from tests.kernels.conftest import DEVICE, HALF, assert_close


def paged_batch(seq_lens, q_lens, heads, kv_heads, head_dim, page, dtype, seed=0, shared=0):
    """Random queries and a paged cache holding each sequence's context in shuffled blocks.

    Unused cache slots are NaN, so any read past a context poisons the output; padded
    sequences (``seq_len == 0``) have all-zero block-table rows. The first ``shared`` blocks
    of every sequence are the first sequence's (a shared prompt).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    caches = [torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype)
              for _ in range(2)]
    tables = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen).int()
    for b, n in enumerate(blocks):
        tables[b, :n], ids = ids[:n], ids[n:]
    tables[:, :shared] = tables[0, :shared]
    slots = torch.cat([tables[b, torch.arange(n) // page] * page + torch.arange(n) % page
                       for b, n in enumerate(seq_lens)])
    kv = torch.randn(2, len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    reference.store_kv(kv[0], kv[1], caches[0], caches[1], slots)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(dtype)
    args = query, *caches, cu, torch.tensor(seq_lens, dtype=torch.int32), tables
    return [t.to(DEVICE) for t in args]


def check(seq_lens, q_lens, heads, kv_heads, head_dim, page, dtype=torch.float32, shared=0,
          **hints):
    """Triton against the float32 reference; ``shared``: blocks shared by every sequence, whose
    tokens go to the kernel as ``shared_prefix`` when the hints name none."""
    query, k_cache, v_cache, cu, lens, tables = paged_batch(
        seq_lens, q_lens, heads, kv_heads, head_dim, page, dtype, shared=shared)
    scale = head_dim**-0.5
    if shared:
        hints.setdefault("shared_prefix", shared * page)
        hints["shared_prefix"] = torch.tensor([hints["shared_prefix"]], dtype=torch.int32,
                                              device=DEVICE)
    out = paged_attention(query, k_cache, v_cache, cu, lens, tables, scale, **hints)
    # The reference in float32, without the padded sequences (it has no answer for them).
    real = torch.tensor(seq_lens) > 0
    rows = real.repeat_interleave(torch.tensor(q_lens)).to(DEVICE)
    real_cu = torch.tensor([0, *torch.tensor(q_lens)[real].cumsum(0).tolist()], dtype=torch.int32)
    expected = reference.paged_attention(
        query[rows].float(), k_cache.float(), v_cache.float(), real_cu.to(DEVICE),
        lens[real.to(DEVICE)], tables[real.to(DEVICE)], scale)
    assert_close(out[rows], expected)
    assert out[~rows].isfinite().all()


DECODE_LENS = [1, 7, 8, 9, 33, 70]  # inside, at and across block boundaries


@pytest.mark.parametrize("page,group", [(8, 1), (16, 2), (32, 4)])
@pytest.mark.parametrize("num_splits", [1, 3, None])  # None: the automatic split-K policy
def test_decode(page, group, num_splits):
    n = len(DECODE_LENS)
    check(DECODE_LENS, [1] * n, 2 * group, 2, 32, page, max_query_len=1, num_splits=num_splits)


def test_decode_half_precision_odd_head_dim():
    check(DECODE_LENS, [1] * len(DECODE_LENS), 4, 2, 48, 16, HALF, max_query_len=1, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padded_graph_rows(num_splits):
    # A CUDA-graph batch: padded rows have seq_len 0 and block-table rows of zeros.
    check([0, 12, 0, 40, 0], [1] * 5, 4, 2, 32, 8, max_query_len=1, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shared_len", [None, 16])
def test_decode_programs_in_longest_first_order(num_splits, shared_len):
    # Programs started longest context first (from ORDERED_MIN_SEQS sequences) still write
    # each sequence's own rows; padded rows (context 0) last.
    lens = [40, 129, 0, 17, 300, 0] * 3
    order = torch.from_numpy(decode_order(lens)).to(DEVICE)
    hints = {} if shared_len is None else {"shared": 1, "shared_prefix": shared_len}
    check(lens, [1] * len(lens), 4, 2, 32, 16, max_query_len=1, num_splits=num_splits,
          order=order, **hints)


@pytest.mark.parametrize("shared_len", [None, 16])
def test_decode_over_column_major_block_tables(shared_len):
    # A decode graph's tables: column-major (entries of one sequence ``bs`` apart), in batch
    # order and (18 sequences) longest first.
    lens = [40, 129, 0, 17, 300, 0] * 3
    query, k_cache, v_cache, cu, seq_lens, tables = paged_batch(
        lens, [1] * len(lens), 4, 2, 32, 16, torch.float32, shared=1)
    columns = tables.t().contiguous().t()
    assert columns.stride() == (1, len(lens))
    hints = {} if shared_len is None else {
        "shared_prefix": torch.tensor([shared_len], dtype=torch.int32, device=DEVICE)}
    for order in (None, torch.from_numpy(decode_order(lens)).to(DEVICE)):
        args = query, k_cache, v_cache, cu, seq_lens
        out = paged_attention(*args, columns, 0.25, max_query_len=1, order=order, **hints)
        expected = paged_attention(*args, tables, 0.25, max_query_len=1, **hints)
        real = (seq_lens > 0)
        assert torch.equal(out[real], expected[real])


def test_decode_order_is_longest_first_and_stable():
    assert decode_order([3, 9, 0, 9]).tolist() == [1, 3, 0, 2]
    assert decode_order([]).tolist() == []


@pytest.mark.parametrize("shared_len", [0, 128, 150])  # 150: rounded down to whole key tiles
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_decode_cascade_over_shared_prefix(shared_len, num_splits, dtype):
    # 10 blocks of 16 shared; the shortest sequence has one key of its own; a padded row
    lens = [161, 129, 170, 230, 151, 300, 0]
    check(lens, [1] * len(lens), 8, 2, 32, 16, dtype, shared=10, max_query_len=1,
          num_splits=num_splits, shared_prefix=shared_len)


LONG_LENS = [1, 63, 64, 65, 200, 300]  # inside, at and across blocks of 64 and 128


@pytest.mark.parametrize("page", [64, 128])  # key tiles of 64 lie within one cache block
@pytest.mark.parametrize("num_splits", [1, None])
def test_decode_with_tiles_within_blocks(page, num_splits):
    n = len(LONG_LENS)
    check(LONG_LENS, [1] * n, 4, 2, 32, page, max_query_len=1, num_splits=num_splits)
    # A shared first block (every context longer) and a padded row
    lens = [length + page for length in LONG_LENS] + [0]
    check(lens, [1] * (n + 1), 4, 2, 32, page, HALF, shared=1, max_query_len=1,
          num_splits=num_splits)


@pytest.mark.parametrize("page", [64, 128])
def test_prefill_and_chunks_with_tiles_within_blocks(page):
    check(LONG_LENS, LONG_LENS, 4, 2, 32, page)
    check(LONG_LENS, [1, 30, 1, 65, 7, 150], 8, 2, 32, page, HALF)


@pytest.mark.parametrize("page,group", [(8, 4), (16, 1), (32, 2)])
def test_prefill_whole_prompts(page, group):
    lens = [3, 17, 70]
    check(lens, lens, 2 * group, 2, 32, page)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_chunked_prefill_mixed_with_decode(num_splits, dtype):
    # Chunks that start mid-context (cached prefix) beside decode rows and whole prompts.
    seq_lens, q_lens = [40, 9, 75, 33, 5], [13, 1, 70, 1, 5]
    check(seq_lens, q_lens, 4, 2, 64, 16, dtype, num_splits=num_splits)


def test_prefill_graph_padding_leaves_the_real_rows_alone():
    """A prefill graph's layout: NaN query rows past the last sequence's, owned by none, and
    empty trailing sequences. The real rows equal those of the unpadded call."""
    query, k_cache, v_cache, cu, lens, tables = paged_batch(
        [40, 9, 75], [13, 1, 30], 4, 2, 32, 16, torch.float32)
    scale = 32**-0.5
    expected = paged_attention(query, k_cache, v_cache, cu, lens, tables, scale,
                               max_query_len=30)
    nan_rows = torch.full((20, *query.shape[1:]), float("nan"), device=DEVICE)
    padded = paged_attention(
        torch.cat([query, nan_rows]), k_cache, v_cache, torch.cat([cu, cu[-1:].repeat(2)]),
        torch.cat([lens, lens.new_zeros(2)]), torch.cat([tables, torch.zeros_like(tables[:2])]),
        scale, max_query_len=64)
    assert torch.equal(padded[: len(query)], expected)


def test_prefill_without_hint_handles_decode_batch():
    check(DECODE_LENS, [1] * len(DECODE_LENS), 4, 2, 32, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_decode_real_shapes(batch):
    lens = torch.randint(900, 1100, (batch,)).tolist()
    check(lens, [1] * batch, 16, 8, 128, 16, torch.bfloat16, max_query_len=1)


@pytest.mark.gpu
def test_decode_cascade_real_shapes():
    lens = torch.randint(2100, 2300, (128,)).tolist()
    check(lens, [1] * 128, 16, 8, 128, 16, torch.bfloat16, shared=128, max_query_len=1)


@pytest.mark.gpu
def test_chunked_prefill_real_shapes():
    seq_lens, q_lens = [1000, 700, 1024, 513], [512, 700, 1, 257]
    check(seq_lens, q_lens, 32, 8, 128, 16, torch.bfloat16)


@pytest.mark.gpu
def test_decode_cuda_graph_replay():
    """Captured once, replayed on new contexts: no host sync, no value-dependent shapes."""
    batch, width = 8, 80
    query, k_cache, v_cache, cu, lens, tables = paged_batch(
        [1000] * batch, [1] * batch, 16, 8, 128, 16, torch.bfloat16)
    static_lens, static_tables = torch.zeros_like(lens), torch.zeros_like(tables[:, :width])
    run = lambda: paged_attention(  # noqa: E731
        query, k_cache, v_cache, cu, static_lens, static_tables, 0.1, max_query_len=1)
    torch.cuda.synchronize()
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in range(2):
        new_lens = torch.randint(1, 1001, (batch,), generator=torch.Generator().manual_seed(seed))
        new_lens[0] = 0  # a padded row
        static_lens.copy_(new_lens)
        static_tables.copy_(tables[:, :width])
        graph.replay()
        expected = paged_attention(query, k_cache, v_cache, cu, static_lens, static_tables, 0.1)
        assert_close(out, expected)
