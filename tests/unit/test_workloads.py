"""Benchmark warm-ups mirror the measured workload's shape without reusing its prompts."""

from __future__ import annotations

from benchmarks.workloads import _common_prefix_len, w1, w3, warmup_requests


def test_warmup_shares_a_fresh_prefix_as_long_as_the_workload():
    work = w3(num_requests=6, prefix_len=300, unique_len=20)
    warm = warmup_requests(work)
    assert [len(p) for p in warm.prompts] == [len(p) for p in work.prompts]
    assert _common_prefix_len(work.prompts) == _common_prefix_len(warm.prompts) == 300
    assert warm.prompts[0][:300] != work.prompts[0][:300]


def test_warmup_of_unrelated_prompts_shares_nothing():
    assert _common_prefix_len(warmup_requests(w1().head(16)).prompts) == 0
