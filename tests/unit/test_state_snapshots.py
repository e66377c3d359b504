"""Prefix caching for a hybrid model, on the host: state snapshots at cached block boundaries
(taken, published a step later, used, evicted least recently used first, dropped with their
blocks), prefill chunks ending where snapshots are taken (a prompt's last full block, the end
of a cached prefix it shares), prompts waiting a step for a snapshot being filled, and hits
resuming from the last snapshot, checked step by step against the fake device of
``test_state_slots``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.engine.sequence import Sequence
from hf_paged.engine.state_snapshots import StateSnapshots
from hf_paged.sampling_params import SamplingParams
from tests.unit.test_scheduler import fake_tokens, run_to_end, run_with_groups
from tests.unit.test_state_slots import FakeDevice, ToyGroup, assert_no_snapshot_leaks, hybrid


def seq(tokens, new=3) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_new_tokens=new))


def test_snapshots_serve_from_the_next_step_and_the_least_recently_used_goes_first():
    snaps = StateSnapshots(first_slot=8, num_snapshots=2)
    assert snaps.take(101) == 8 and not snaps.has(101)  # filled by the next step
    assert snaps.take(101) is None  # one per block
    snaps.publish()
    assert snaps.has(101) and snaps.take(101) is None
    assert snaps.take(102) == 9
    assert snaps.take(103) == 8 and not snaps.has(101)  # none free: 101 gives its slot up
    assert snaps.take(104) is None  # the others are still being filled
    snaps.publish()
    assert snaps.use(102) == 9  # 102 is now the most recently used
    assert snaps.take(105) == 8 and not snaps.has(103) and snaps.has(102)
    snaps.drop(105)  # its block left the cache before the snapshot was published
    snaps.drop(102)
    snaps.drop(555)  # none: nothing happens
    assert snaps.num_used == 0 and sorted(snaps.free_slots) == [8, 9]
    with pytest.raises(ValueError, match="num_snapshots"):
        StateSnapshots(0, 0)


def test_a_prompt_prefills_to_its_snapshot_boundary_then_a_second_resumes_there():
    sched = hybrid(block_size=4, snapshots=2)
    device = FakeDevice(sched)
    first = seq(range(14))
    sched.add(first)
    batch = sched.schedule()
    assert batch.num_tokens == [12]  # up to the end of the last full block before token 14
    device(batch.plan())
    sched.postprocess(batch, [])
    batch = sched.schedule()
    assert batch.num_tokens == [2] and batch.state_copies == [(0, 8)]  # the snapshot fills
    device(batch.plan())
    sched.postprocess(batch, fake_tokens(batch))
    run_to_end(sched, device=device)
    second = seq([*range(12), 50, 51, 52])  # shares three blocks with the first prompt
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached_tokens == 12 and batch.starts == [12] and batch.num_tokens == [3]
    assert batch.state_copies == [(8, second.state_slot)]
    assert batch.plan().has_initial_state == [True]
    device(batch.plan())
    sched.postprocess(batch, fake_tokens(batch))
    run_to_end(sched, device=device)
    assert device.num_resumed == 1 and sched.prefix_cache_hits == 12


def test_hits_stop_at_the_last_block_with_a_snapshot():
    sched = hybrid(block_size=4, snapshots=2)
    sched.add(seq(range(12), new=1))  # three blocks cached, a snapshot after the second
    run_to_end(sched, device=FakeDevice(sched))
    assert len(sched.block_manager.match_prefix(seq(range(20)))) == 2
    none = hybrid(block_size=4)
    none.add(seq(range(12), new=1))
    run_to_end(none)
    assert none.block_manager.match_prefix(seq(range(20))) == []  # no snapshots: no hits


def test_a_snapshot_leaves_the_cache_with_its_block():
    sched = hybrid(num_blocks=6, block_size=4, snapshots=2)
    first = seq(range(9), new=1)
    sched.add(first)
    run_to_end(sched, device=FakeDevice(sched))
    snaps = sched.block_manager.state_slots.snapshots
    assert snaps.has(first.block_hashes[1])
    sched.add(seq(range(100, 121), new=1))  # 6 blocks: every cached block is evicted
    run_to_end(sched, device=FakeDevice(sched))
    assert not snaps.has(first.block_hashes[1]) and snaps.num_used == 1  # the new one's


def test_a_prompt_waits_a_step_for_the_snapshot_it_would_resume_from():
    sched = hybrid(block_size=4, snapshots=2)
    first, second, third = seq(range(14)), seq(range(14)), seq(range(100, 105))
    for s in (first, second, third):
        sched.add(s)
    device = FakeDevice(sched)
    batch = sched.schedule()  # the first's snapshot after 12 tokens is not filled yet
    assert batch.seqs == [first] and list(sched.waiting) == [second, third]
    device(batch.plan())
    sched.postprocess(batch, [])
    batch = sched.schedule()  # filled: the second resumes there, the third comes along
    assert batch.seqs == [first, second, third] and second.num_cached_tokens == 12
    device(batch.plan())
    sched.postprocess(batch, fake_tokens(batch))
    run_to_end(sched, device=device)
    assert device.num_resumed == 1


def test_a_slot_is_saved_before_a_restore_rewrites_it():
    sched = hybrid(block_size=4, snapshots=2)
    device = FakeDevice(sched)
    x, y = [1] * 9, [2] * 13
    sched.add(seq(x, new=1))
    run_to_end(sched, device=device)  # a snapshot after x's eight tokens, in slot 8
    a = seq(y)
    sched.add(a)
    batch = sched.schedule()  # a prefills to 12 in slot 0: saved into slot 9 next step
    device(batch.plan())
    sched.abort(a)  # slot 0 is free again
    b = seq(x[:8] + [3, 3])
    sched.add(b)
    batch = sched.schedule()
    assert b.state_slot == 0 and batch.state_copies == [(0, 9), (8, 0)]
    device(batch.plan())
    sched.postprocess(batch, fake_tokens(batch))
    run_to_end(sched, device=device)
    d = seq(y[:12] + [4])  # resumes from slot 9: a's state, not x's
    sched.add(d)
    run_to_end(sched, device=device)
    assert d.num_cached_tokens == 12


@settings(max_examples=30, deadline=None)
@given(
    prefixes=st.lists(st.integers(0, 2), min_size=2, max_size=8),
    lengths=st.lists(st.integers(1, 30), min_size=8, max_size=8),
    num_blocks=st.integers(14, 40),
    budget=st.integers(4, 48),
    snapshots=st.integers(1, 4),
    group=st.booleans(),
)
def test_shared_prefixes_resume_from_snapshots_through_preemption_and_eviction(
        prefixes, lengths, num_blocks, budget, snapshots, group):
    sched = hybrid(num_blocks, 4, 6, budget, snapshots=snapshots)
    stems = [[(7 * p + t) % 13 for t in range(24)] for p in range(3)]
    for p, n in zip(prefixes, lengths):
        s = seq(stems[p][:n] + [(n + t) % 11 for t in range(n % 7 + 1)], new=4)
        if group:
            ToyGroup(s, width=2, length=4)
        sched.add(s)
    device = FakeDevice(sched)
    (run_with_groups if group else run_to_end)(sched, device=device)
    slots = sched.block_manager.state_slots
    assert slots.num_free == slots.num_slots and not slots.restores
    assert sched.block_manager.num_free_blocks == num_blocks
    assert_no_snapshot_leaks(sched)
    if sched.prefix_cache_hits:
        assert device.num_resumed


@pytest.mark.parametrize("shared_blocks", [1, 2])
def test_requests_sharing_a_system_prompt_resume_from_its_end(shared_blocks):
    """The second request sharing only a prefix with the first stops there and snapshots it;
    from the third on every one resumes there, and LRU keeps that snapshot, which each hit
    uses, over the prompts' own."""
    sched = hybrid(block_size=4, snapshots=2)
    device = FakeDevice(sched)
    system = [100 + t for t in range(4 * shared_blocks)]
    first = seq(system + [1] * 11)  # snapshots after its own last full block only
    sched.add(first)
    run_to_end(sched, device=device)
    second = seq(system + [2] * 6)
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached_tokens == 0 and batch.num_tokens == [len(system)]
    device(batch.plan())
    sched.postprocess(batch, [])
    run_to_end(sched, device=device)
    snaps = sched.block_manager.state_slots.snapshots
    shared = second.block_hashes[shared_blocks - 1]
    assert snaps.has(shared)
    later = [seq(system + [3 + i] * (5 + i)) for i in range(4)]
    for s in later:
        sched.add(s)
        run_to_end(sched, device=device)
        assert s.num_cached_tokens == len(system) and snaps.has(shared)
    assert device.num_resumed == len(later)
    assert sched.prefix_cache_hits == len(later) * len(system)


def test_prompts_admitted_together_snapshot_their_shared_prefix_once():
    """The first of prompts sharing a prefix with a finished one stops there to snapshot it;
    the others wait a step and resume from it."""
    sched = hybrid(block_size=4, snapshots=4)
    device = FakeDevice(sched)
    system = list(range(100, 108))
    sched.add(seq(system + [1] * 9, new=1))
    run_to_end(sched, device=device)
    together = [seq(system + [2 + i] * 7) for i in range(3)]
    for s in together:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == together[:1] and batch.num_tokens == [8]
    assert len(sched.block_manager.state_slots.snapshots.pending) == 1
    device(batch.plan())
    sched.postprocess(batch, [])
    run_to_end(sched, device=device)
    assert [s.num_cached_tokens for s in together] == [0, 8, 8] and device.num_resumed == 2


def test_a_shared_prefix_snapshot_leaves_with_its_block():
    sched = hybrid(num_blocks=8, block_size=4, snapshots=2)
    device = FakeDevice(sched)
    system = list(range(100, 108))
    for tail in ([1] * 9, [2] * 2):
        last = seq(system + tail, new=1)
        sched.add(last)
        run_to_end(sched, device=device)
    snaps = sched.block_manager.state_slots.snapshots
    shared = last.block_hashes[1]
    assert snaps.has(shared) and snaps.num_used == 2  # the first prompt's own and this one
    sched.add(seq(range(200, 229), new=1))  # 8 blocks: every cached block is evicted
    run_to_end(sched, device=device)
    assert shared not in sched.block_manager.hash_to_block
    assert not snaps.has(shared) and snaps.num_used == 1  # the new prompt's own
    assert sorted(snaps.free_slots + list(snaps.by_hash.values())) == [8, 9]


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 14), st.integers(1, 9)),
                      min_size=1, max_size=8),
    budget=st.integers(4, 48),
)
def test_hits_resume_at_every_prefix_two_prompts_shared(requests, budget):
    """Requests one after another, memory to spare: each resumes from the longest prefix of
    full blocks that an earlier prompt's prefill stopped at, and stops itself at the end of
    its longest cached prefix and of its last full block before its last token."""
    bs = 4
    sched = hybrid(256, bs, 6, budget, snapshots=64)
    device = FakeDevice(sched)
    stems = [[(5 * p + t) % 9 for t in range(16)] for p in range(3)]
    cached: set[tuple] = set()  # token prefixes of the published blocks
    stopped: set[tuple] = set()  # token prefixes a prefill stopped and snapshotted at
    for i, (p, shared, tail) in enumerate(requests):
        prompt = stems[p][:shared] + [20 + i] * tail
        s = seq(prompt, new=1)
        sched.add(s)
        run_to_end(sched, device=device)
        ends = range(bs, len(prompt), bs)  # block ends before the last token
        matched = max((b for b in ends if tuple(prompt[:b]) in cached), default=0)
        hit = max((b for b in ends if b <= matched and tuple(prompt[:b]) in stopped),
                  default=0)
        assert s.num_cached_tokens == hit
        stopped |= {tuple(prompt[:b]) for b in (matched, (len(prompt) - 1) // bs * bs)
                    if b > hit}
        cached |= {tuple(prompt[:b]) for b in range(bs, len(prompt) + 1, bs)}
    assert sched.block_manager.state_slots.snapshots.num_used == len(stopped)
