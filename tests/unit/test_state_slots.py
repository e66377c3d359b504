"""A hybrid model's state slots on the host: the allocator, the block manager taking, forking and
freeing them with blocks, and the scheduler's steps (admission bound, fork copies a step
later, zero states after preemption, no leaks), checked against a fake device whose slots
record which tokens they hold. Prefix caching over state snapshots: chunks end at the
snapshot boundary, hits resume from the last snapshot, snapshots leave with their blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Sequence
from hf_paged.engine.state_slots import StateSlots
from hf_paged.engine.state_snapshots import StateSnapshots
from hf_paged.sampling_params import SamplingParams
from hf_paged.step import StepPlan
from tests.unit.test_scheduler import ToyGroup, run_to_end, run_with_groups


def seq(tokens=(1, 2, 3, 4, 5), new=4) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_new_tokens=new))


def hybrid(num_blocks=64, block_size=4, max_seqs=8, budget=32, caching=True,
           snapshots=0) -> Scheduler:
    slots = StateSlots(max_seqs, 10, StateSnapshots(max_seqs, snapshots) if snapshots else None)
    return Scheduler(BlockManager(num_blocks, block_size, caching, slots), max_seqs, budget, 512)


class FakeDevice:
    """Slot -> (prompt tokens, tokens computed): what a linear layer's state summarises. Each
    step copies first, then checks that every continued chunk finds a state after exactly the
    tokens before it, of its own prompt, and records the state the chunk leaves."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.states: dict[int, tuple] = {}
        self.num_copies = self.num_resumed = 0

    def __call__(self, plan: StepPlan) -> None:
        slots = plan.state_slots
        assert len(slots) == len(plan.seq_ids) and len(set(slots)) == len(slots)
        assert all(0 <= s < self.sched.block_manager.state_slots.num_slots for s in slots)
        for src, dst in plan.state_copies:
            self.states[dst] = self.states[src]
            self.num_copies += 1
        for slot, initial, start, n, row in zip(slots, plan.has_initial_state, plan.starts,
                                                plan.num_tokens, plan.sampling):
            s = row.request
            assert initial == (start > 0)
            if initial:
                assert self.states[slot] == self.state(s, start)
                self.num_resumed += start == s.num_cached_tokens
            self.states[slot] = self.state(s, start + n)
        held = [s for s in self.sched.running if s.state_slot >= 0]
        snapshots = self.sched.block_manager.state_slots.snapshots
        if snapshots is not None:
            assert set(snapshots.by_hash) | set(snapshots.pending) <= set(
                self.sched.block_manager.hash_to_block)
        assert len({s.state_slot for s in held}) == len(held)
        assert self.sched.block_manager.state_slots.num_used <= self.sched.max_num_seqs


    @staticmethod
    def state(s: Sequence, count: int) -> tuple:
        return tuple(s.token_ids[: min(count, s.num_prompt_tokens)]), count


def test_allocator_takes_frees_and_forks():
    slots = StateSlots(2, slot_bytes=8)
    a, b, c = seq(), seq(), seq()
    assert slots.take(a) and slots.take(a) and a.state_slot == 0  # taking twice keeps it
    slots.fork(a, b)
    assert b.state_slot == 1 and slots.num_used == 2 and not slots.take(c)
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.fork(a, c)
    slots.free(a)
    slots.free(a)  # a second free gives nothing back twice
    assert a.state_slot == -1 and slots.num_free == 1
    with pytest.raises(RuntimeError, match="without a state slot"):
        slots.fork(a, c)
    assert slots.take_copies(0) == [] and slots.take_copies(5) == [(0, 1)] and not slots.copies
    slots.restores = [(7, b.state_slot)]  # a step that failed to launch: b's restore goes too
    slots.free(b)
    assert slots.restores == []
    with pytest.raises(ValueError, match="num_slots"):
        StateSlots(0)


def test_block_manager_takes_slots_with_blocks_and_changes_nothing_when_short():
    bm = BlockManager(8, 4, True, StateSlots(1))
    a, b = seq(), seq()
    assert bm.allocate(a, 5) and a.state_slot == 0
    free = bm.num_free_blocks
    assert not bm.allocate(b, 5)  # no slot left: no blocks taken either
    assert b.block_table == [] and b.state_slot == -1 and bm.num_free_blocks == free
    bm.free(a)
    assert a.state_slot == -1 and bm.state_slots.num_free == 1
    big = BlockManager(1, 4, True, StateSlots(2))
    assert not big.allocate(b, 5) and b.state_slot == -1  # no blocks: no slot taken


def test_admission_never_runs_more_sequences_than_slots():
    bm = BlockManager(64, 4, False, StateSlots(2))
    sched = Scheduler(bm, 4, 64, 512)  # max_num_seqs would allow four
    seqs = [seq(new=3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    steps = run_to_end(sched, device=FakeDevice(sched))
    assert steps[0].seqs == seqs[:2] and all(len(batch.seqs) <= 2 for batch in steps)
    assert all(s.num_new_tokens == 3 for s in seqs) and bm.state_slots.num_free == 2


def test_a_state_is_never_cut_back():
    bm = BlockManager(8, 4, True, StateSlots(1))
    a = seq()
    bm.allocate(a, 5)
    with pytest.raises(NotImplementedError, match="cannot be cut back"):
        bm.truncate(a, 2)


def test_hybrid_models_never_hit_the_prefix_cache():
    sched = hybrid()
    first = seq(range(12), new=1)
    sched.add(first)
    run_to_end(sched)
    assert sched.block_manager.num_cached_blocks > 0  # the blocks are published all the same
    again = seq(range(12), new=1)
    assert sched.block_manager.match_prefix(again) == []
    sched.add(again)
    run_to_end(sched, device=FakeDevice(sched))
    assert again.num_cached_tokens == 0 and sched.prefix_cache_hits == 0


def test_followers_copy_the_leaders_state_one_step_later():
    sched = hybrid()
    leader, *followers = (seq(range(6), new=3) for _ in range(3))
    sched.add(leader, followers)
    device = FakeDevice(sched)
    first = sched.schedule()
    device(first.plan())
    # Forked while the leader's last prompt chunk is scheduled: copied before the next step.
    assert first.state_copies == [] and len(sched.block_manager.state_slots.copies) == 2
    sched.postprocess(first, [7, 8, 9])
    second = sched.schedule()
    assert second.state_copies == [(leader.state_slot, f.state_slot) for f in followers]
    device(second.plan())
    assert second.plan().has_initial_state == [True] * 3


def test_copies_wait_for_a_step_that_runs():
    sched = hybrid()
    leader, follower = seq(range(6), new=1), seq(range(6), new=1)
    sched.add(leader, [follower])
    sched.postprocess(sched.schedule(), [7, 8])  # both finish by length at their first token
    assert not sched.schedule().seqs  # no step: the copy is not taken (nor needed)
    late = seq()
    sched.add(late)
    batch = sched.schedule()
    assert len(batch.state_copies) == 1  # harmless: late starts from zero in any slot
    assert batch.plan().has_initial_state == [False]


def test_preempted_sequences_restart_from_a_zero_state_and_slots_never_leak():
    sched = hybrid(num_blocks=10, block_size=4, max_seqs=4, budget=64)
    seqs = [seq([i] * 9, new=20) for i in range(4)]
    for s in seqs:
        sched.add(s)
    device = FakeDevice(sched)
    run_to_end(sched, device=device)
    assert sched.num_preemptions > 0
    assert sched.block_manager.state_slots.num_free == 4 and all(s.state_slot == -1 for s in seqs)


@settings(max_examples=30, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["plain", "forked", "group"]), min_size=1, max_size=6),
    num_blocks=st.integers(16, 40),
    budget=st.integers(4, 48),
    aborted=st.integers(-1, 5),
    snapshots=st.integers(0, 3),
)
def test_forks_groups_preemptions_and_aborts_keep_every_state(kinds, num_blocks, budget,
                                                               aborted, snapshots):
    """With snapshots, prompt i is a prefix of prompt i + 3: prefills stop where they part."""
    sched = hybrid(num_blocks, 4, 6, budget, caching=bool(snapshots), snapshots=snapshots)
    requests = []
    for i, kind in enumerate(kinds):
        params = SamplingParams(max_new_tokens=6)
        s = Sequence([(i % 3 + t) % 5 for t in range(5 + 3 * i)], params)
        if kind == "group":
            ToyGroup(s, width=3, length=6)
            sched.add(s)
        else:
            sched.add(s, [Sequence(s.token_ids, params) for _ in range(2 * (kind == "forked"))])
        requests.append(s)
    if 0 <= aborted < len(requests):
        sched.abort(requests[aborted])
    device = FakeDevice(sched)
    run_with_groups(sched, device=device)
    slots = sched.block_manager.state_slots
    assert slots.num_free == slots.num_slots == 6
    assert sched.block_manager.num_free_blocks == num_blocks
    if snapshots:
        assert_no_snapshot_leaks(sched)


def assert_no_snapshot_leaks(sched: Scheduler) -> None:
    """Every snapshot slot is free or serves a block the prefix cache still names."""
    snaps = sched.block_manager.state_slots.snapshots
    assert not snaps.pending and set(snaps.by_hash) <= set(sched.block_manager.hash_to_block)
    first = sched.block_manager.state_slots.num_slots
    assert sorted(snaps.free_slots + list(snaps.by_hash.values())) == list(
        range(first, first + snaps.num_snapshots))
