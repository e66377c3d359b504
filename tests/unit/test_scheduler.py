"""Scheduler bookkeeping with a fake model: budgets, chunked prefill, preemption, no leaks,
driven as the engine drives it (step N+1 scheduled before step N's tokens come back)."""

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


def fake_tokens(batch, eos_at=None) -> list[int]:
    """The fake model's token at position p is (p * 7) % 11 (``eos_at[p]`` where given)."""
    eos_at = eos_at or {}
    positions = [s + n for s, n, smp in zip(batch.starts, batch.num_tokens, batch.sample) if smp]
    return [eos_at.get(p, (p * 7) % 11) for p in positions]


def run_to_end(sched: Scheduler, max_steps=10_000, eos_at=None):
    steps, in_flight = [], None
    while sched.has_work() or in_flight:
        batch = sched.schedule()
        assert batch.seqs or in_flight, "a step with work must schedule something"
        if in_flight:
            sched.postprocess(*in_flight)
        in_flight = (batch, fake_tokens(batch, eos_at)) if batch.seqs else None
        steps.append(batch)
        assert len(steps) < max_steps
    return steps


def test_chunked_prefill_shares_steps_with_decode():
    sched = make(budget=8)
    short = Sequence([1, 2, 3], SamplingParams(max_new_tokens=10))
    sched.add(short)
    run_step = sched.schedule()
    sched.postprocess(run_step, [5])
    assert short.num_pending == 0 and short.token_ids == [1, 2, 3, 5]
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


def test_stop_at_eos_drops_the_token_computed_meanwhile():
    sched = make()
    seq = Sequence([1, 2, 3], SamplingParams(max_new_tokens=10, eos_token_ids=(99,)))
    sched.add(seq)
    steps = run_to_end(sched, eos_at={4: 99})  # the second new token is the EOS
    assert seq.output_token_ids == [(3 * 7) % 11, 99] and seq.finish_reason == "stop"
    assert len(steps) == 4  # prefill, two decodes (the second one wasted), an empty step
    assert sched.block_manager.num_free_blocks == 64 and not sched.running


def test_last_token_by_length_is_not_computed():
    sched = make()
    seq = Sequence([1, 2, 3], SamplingParams(max_new_tokens=3))
    sched.add(seq)
    steps = run_to_end(sched)
    assert [b.num_tokens for b in steps] == [[3], [1], [1], []]
    assert seq.num_new_tokens == 3 and seq.finish_reason == "length"


def test_preempted_request_stopping_in_flight_leaves_the_queue():
    sched = make(num_blocks=4, block_size=4, max_seqs=2, budget=64, caching=False)
    a = Sequence([1] * 8, SamplingParams(max_new_tokens=8))
    b = Sequence([2] * 8, SamplingParams(max_new_tokens=8, eos_token_ids=(99,)))
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # both admitted, 2 blocks each, both sample a pending token
    second = sched.schedule()  # a needs a third block: b, admitted last, is preempted
    assert second.seqs == [a] and list(sched.waiting) == [b] and b.num_pending == 1
    assert sched.postprocess(first, [0, 99]) == [b]  # b's pending token was its EOS
    assert not sched.waiting and b.is_finished and b.output_token_ids == [99]
