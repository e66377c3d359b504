"""Benchmark workloads: warm-ups mirror the measured shape without reusing its prompts; the
memory floor counts what must be read."""

from __future__ import annotations

from benchmarks.floor import MemoryCost
from benchmarks.workloads import Workload, w1, w2_decode, w2_ttft, w3, warmup_requests


def test_warmup_shares_a_fresh_prefix_as_long_as_the_workload():
    work = w3(num_requests=6, prefix_len=300, unique_len=20)
    warm = warmup_requests(work)
    assert [len(p) for p in warm.prompts] == [len(p) for p in work.prompts]
    assert work.common_prefix_len() == warm.common_prefix_len() == 300
    assert warm.prompts[0][:300] != work.prompts[0][:300]


def test_warmup_of_unrelated_prompts_shares_nothing():
    assert warmup_requests(w1().head(16)).common_prefix_len() == 0


def test_warmup_prompts_are_never_the_measured_ones():
    """Whatever its seed: a warm-up that drew a workload's own prompts would seed the prefix
    cache with them (W2's streamed first token once measured a cached prompt so)."""
    for work in (w2_ttft(3), w2_decode(3), w1().head(8)):
        measured = {tuple(p[:64]) for p in work.prompts}
        for seed in range(1, 6):
            warm = warmup_requests(work, seed=seed)
            assert not measured & {tuple(p[:64]) for p in warm.prompts}, seed


def test_floor_reads_a_cached_common_prefix_once_a_step():
    cost = MemoryCost(dense_bytes=1000, kv_bytes_per_token=1)
    work = Workload([[1, 2, 3, 4], [1, 2, 3, 9, 9]], [2, 3])
    # Steps 3 x weights; request 0 reads 4 then 5 tokens, request 1 reads 5, 6 then 7.
    assert cost.floor_bytes(work) == 3000 + 9 + 18
    # The shared 3 tokens are read once in each of the 3 steps, not 2 + 3 times.
    assert cost.floor_bytes(work, prefix_caching=True) == 3000 + 9 + 18 - 3 * 2
