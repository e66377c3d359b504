"""Scheduler bookkeeping with a fake model: budgets, chunked prefill, preemption, no leaks,
driven as the engine drives it (step N+1 scheduled before step N's tokens come back)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from hf_paged.engine.batch import ScheduledBatch
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Sequence, SequenceGroup, Status
from hf_paged.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=512, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(bm, max_seqs, budget, max_len)


def fake_tokens(batch, eos_at=None) -> list[int]:
    """The fake model's token at position p is (p * 7) % 11 (``eos_at[p]`` where given)."""
    eos_at = eos_at or {}
    positions = [s + n for s, n, smp in zip(batch.starts, batch.num_tokens, batch.sample) if smp]
    return [eos_at.get(p, (p * 7) % 11) for p in positions]


def run_to_end(sched: Scheduler, max_steps=10_000, eos_at=None, device=None):
    """Drive ``sched`` as the engine does; ``device(plan)`` sees each step as it launches."""
    steps, in_flight = [], None
    while sched.has_work() or in_flight:
        batch = sched.schedule()
        assert batch.seqs or in_flight, "a step with work must schedule something"
        if device is not None and batch.seqs:
            device(batch.plan())
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


class ToyGroup(SequenceGroup):
    """Beam-search-shaped bookkeeping without the search: the first member forks until the
    group is ``width`` wide; every member continues with the fake model's token; the group
    ends after ``length`` new tokens."""

    def __init__(self, root, width, length):
        super().__init__(root, width, num_candidates=2)
        self.length = length

    def advance(self):
        members = self.members
        for seq in members:
            assert self.reports[seq.seq_id][1] == [(len(seq) * 7) % 11]
        if members[0].num_new_tokens + 1 >= self.length:
            return []
        choices = [(seq, (len(seq) * 7) % 11) for seq in members]
        return choices[:1] * (self.width - len(members)) + choices


def run_with_groups(sched, max_steps=10_000, device=None):
    """``run_to_end`` where group members report the fake model's token as a candidate, and
    a step with group rows is collected before the next is scheduled (as the engine does)."""
    in_flight, finished = None, []
    while sched.has_work() or in_flight:
        if in_flight and in_flight[2]:  # as the engine: a group's step is collected first
            finished += sched.postprocess(*in_flight)
            in_flight = None
        batch = sched.schedule()
        if device is not None and batch.seqs:
            device(batch.plan())
        assert len(batch.seqs) <= sched.max_num_seqs
        assert len(sched.running) <= sched.num_seq_slots <= sched.max_num_seqs
        if in_flight:
            finished += sched.postprocess(*in_flight)
        tokens = fake_tokens(batch)
        plain = [t for t, s in zip(tokens, (s for s, m in zip(batch.seqs, batch.sample) if m))
                 if s.group is None]
        groups = [(None, [t], None, None) for t, s in
                  zip(tokens, (s for s, m in zip(batch.seqs, batch.sample) if m))
                  if s.group is not None]
        copies = [fake_tokens(ScheduledBatch([batch.seqs[i]], [batch.starts[i]],
                                             [batch.num_tokens[i]], [True]))[0]
                  for i, _ in batch.sample_copies]
        in_flight = (batch, plain + copies, groups) if batch.seqs else None
        max_steps -= 1
        assert max_steps
    return finished


@settings(max_examples=40, deadline=None)
# Two beam members waited for a third whose prefill kept preempting itself for their blocks.
@example(kinds=["plain", "plain", "plain", "forked", "group", "group"], num_blocks=16, budget=4,
         caching=False)
@given(
    kinds=st.lists(st.sampled_from(["plain", "forked", "group"]), min_size=1, max_size=6),
    num_blocks=st.integers(16, 40),
    budget=st.integers(4, 48),
    caching=st.booleans(),
)
def test_forks_and_groups_under_preemption_leak_nothing(kinds, num_blocks, budget, caching):
    sched = make(num_blocks, 4, 6, budget, caching=caching)
    requests = []
    for i, kind in enumerate(kinds):
        params = SamplingParams(max_new_tokens=6)
        seq = Sequence([(i + t) % 5 for t in range(5 + 3 * i)], params)
        if kind == "group":
            ToyGroup(seq, width=3, length=6)
            sched.add(seq)
            requests.append([seq])
        else:
            followers = [Sequence(seq.token_ids, params) for _ in range(2 * (kind == "forked"))]
            sched.add(seq, followers)
            requests.append([seq, *followers])
    finished = run_with_groups(sched)
    assert {s.seq_id for r in requests for s in r} == {s.seq_id for s in finished}
    for request in requests:
        for seq in request:
            history = seq.token_ids[: seq.num_prompt_tokens]
            for t in seq.output_token_ids:
                assert t == (len(history) * 7) % 11
                history.append(t)
    assert sched.block_manager.num_free_blocks == num_blocks
    assert sched.num_seq_slots == 0 and not sched.running and not sched.waiting


def test_followers_share_the_prefilled_prompt():
    sched = make(block_size=4)
    params = SamplingParams(max_new_tokens=3)
    leader, *followers = (Sequence(list(range(6)), params) for _ in range(3))
    sched.add(leader, followers)
    first = sched.schedule()
    assert first.seqs == [leader] and first.num_tokens == [6]
    assert first.sample_copies == [(0, followers[0]), (0, followers[1])]
    assert all(f.block_table == leader.block_table for f in followers)
    sched.postprocess(first, [7, 8, 9])
    assert [s.output_token_ids for s in (leader, *followers)] == [[7], [8], [9]]
    second = sched.schedule()  # each writes its token into the shared half-filled block
    assert len(second.block_copies) == 2 and sched.block_manager.num_shared_blocks == 1


def test_aborts_of_followers_leaders_and_groups_leak_nothing():
    sched = make(num_blocks=32, block_size=4, max_seqs=8)
    params = SamplingParams(max_new_tokens=5)
    leader, first, second = (Sequence(list(range(6)), params) for _ in range(3))
    sched.add(leader, [first, second])
    root = Sequence([1, 2, 3, 4, 5], params)
    ToyGroup(root, width=3, length=5)
    sched.add(root)
    sched.abort(first)  # a follower before its fork: gone, the others unaffected
    sched.abort(leader)  # the leader before the fork: its follower takes the prompt over
    assert list(sched.waiting) == [second, root] and second.followers == []
    for _ in range(3):  # prefill, then the group forks its beams; then it is aborted
        batch = sched.schedule()
        tokens = fake_tokens(batch)
        rows = [s for s, m in zip(batch.seqs, batch.sample) if m]
        sched.postprocess(batch, [t for t, s in zip(tokens, rows) if s.group is None],
                          [(None, [t], None, None) for t, s in zip(tokens, rows) if s.group])
    assert len(root.group.members) == 3
    sched.abort(root)
    assert root.is_finished and all(m.is_finished for m in sched.take_dropped())
    run_with_groups(sched)
    assert second.num_new_tokens == 5 and first.finish_reason == leader.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == 32 and sched.num_seq_slots == 0


class KeepFirstDraft:
    """A ``Verifier`` that keeps one draft of each verified step (whatever was drawn) and
    records what it was asked."""

    def __init__(self):
        self.adopted, self.verified = [], []

    def adopt(self, seq):
        self.adopted.append(seq)

    def needs_tokens(self, seq, num_running):
        return True

    def verify(self, seq, drafts, drawn):
        self.verified.append((list(drafts), list(drawn)))
        return [drafts[0], drawn[1]]


def test_speculation_only_through_the_verifier():
    """The scheduler drives drafts with any ``Verifier``: it verifies them in one chunk, keeps
    what ``verify`` returns and gives back the cache of the rest."""
    verifier = KeepFirstDraft()
    bm = BlockManager(64, 4, True)
    sched = Scheduler(bm, 8, 32, 512, verifier)
    seq = Sequence([1, 2, 3], SamplingParams(max_new_tokens=10))
    sched.add(seq)
    assert verifier.adopted == [seq]
    first = sched.schedule()
    assert first.feeds_next_step  # its next step may draft: collected before scheduling on
    sched.postprocess(first, [4])
    seq.draft_token_ids = [7, 8, 9]
    batch = sched.schedule()
    assert batch.num_tokens == [4] and batch.num_draft_tokens == [3]
    sched.postprocess(batch, [7, 5, 6, 0])
    assert verifier.verified == [([7, 8, 9], [7, 5, 6, 0])]
    assert seq.token_ids == [1, 2, 3, 4, 7, 5] and seq.draft_token_ids == []
    assert seq.num_computed_tokens == 5 and seq.num_pending == 0
    assert len(seq.block_table) == bm.blocks_needed(5)
