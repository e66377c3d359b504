"""Scheduler bookkeeping with a fake model: budgets, chunked prefill, preemption, no leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Sequence, Status
from hf_paged.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=512, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(bm, max_seqs, budget, max_len)


def fake_token(seq: Sequence) -> int:
    return (len(seq) * 7) % 11  # deterministic in the sequence's own history


def run_to_end(sched: Scheduler, max_steps=10_000):
    steps = []
    while sched.has_work():
        batch = sched.schedule()
        assert batch.seqs, "a step with work must schedule something"
        steps.append(batch)
        sampled = [fake_token(s) for s, smp in zip(batch.seqs, batch.sample) if smp]
        sched.postprocess(batch, sampled)
        assert len(steps) < max_steps
    return steps


def test_chunked_prefill_shares_steps_with_decode():
    sched = make(budget=8)
    short = Sequence([1, 2, 3], SamplingParams(max_new_tokens=10))
    sched.add(short)
    run_step = sched.schedule()
    sched.postprocess(run_step, [5])
    long = Sequence(list(range(30)), SamplingParams(max_new_tokens=2))
    sched.add(long)
    batch = sched.schedule()
    assert batch.seqs == [short, long] and batch.num_tokens == [1, 7]
    assert batch.sample == [True, False]


def test_preemption_recomputes_and_everyone_finishes():
    sched = make(num_blocks=10, block_size=4, max_seqs=4, budget=64)
    seqs = [Sequence([i] * 9, SamplingParams(max_new_tokens=20)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert sched.num_preemptions > 0
    assert all(s.status is Status.FINISHED and s.num_new_tokens == 20 for s in seqs)
    assert sched.block_manager.num_free_blocks == 10


def test_most_recently_admitted_is_preempted_first():
    sched = make(num_blocks=6, block_size=4, max_seqs=4, budget=64, caching=False)
    a, b = (Sequence([i] * 8, SamplingParams(max_new_tokens=16)) for i in (1, 2))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # both admitted: 2 blocks each
    sched.postprocess(batch, [0, 0])
    for _ in range(8):  # a and b grow until the six blocks no longer suffice
        batch = sched.schedule()
        sched.postprocess(batch, [0] * sum(batch.sample))
        if sched.num_preemptions:
            break
    assert sched.num_preemptions == 1
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.block_table == []


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    new=st.lists(st.integers(1, 12), min_size=10, max_size=10),
    num_blocks=st.integers(14, 40),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
)
def test_random_workloads_respect_limits_and_leak_nothing(
    lengths, new, num_blocks, budget, max_seqs, caching
):
    sched = make(num_blocks, 4, max_seqs, budget, caching=caching)
    seqs = [Sequence([t % 5 for t in range(n)], SamplingParams(max_new_tokens=k))
            for n, k in zip(lengths, new)]
    for s in seqs:
        sched.add(s)
    for batch in run_to_end(sched):
        assert sum(batch.num_tokens) <= budget
        assert len(batch.seqs) <= max_seqs
    for s, k in zip(seqs, new):
        assert s.num_new_tokens == k
        # The generated tokens are what the fake model says, preemptions or not.
        history = s.token_ids[: s.num_prompt_tokens]
        for t in s.output_token_ids:
            assert t == (len(history) * 7) % 11
            history.append(t)
    assert sched.block_manager.num_free_blocks == num_blocks
