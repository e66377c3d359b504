"""Block manager invariants under random interleavings (hypothesis state machine, with forks,
copy-on-write and truncation), plus the prefix-cache, eviction-order and fork rules checked
directly."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.sequence import Sequence
from hf_paged.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(max_new_tokens=8)


def admit(bm: BlockManager, tokens: list[int]) -> Sequence | None:
    seq = Sequence(tokens, PARAMS)
    hits = bm.match_prefix(seq)
    if not bm.allocate(seq, len(tokens) - len(hits) * BS, hits):
        return None
    seq.num_computed_tokens = len(tokens)
    seq.num_cached_tokens = len(hits) * BS
    return seq


def fork(bm: BlockManager, parent: Sequence) -> Sequence:
    child = parent.fork()
    bm.fork(parent, child)
    return child


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the block manager as the scheduler does and keeps a model of the device cache
    (the token each slot holds), so a missed or misdirected copy-on-write shows up as a
    sequence reading another's tokens."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BS)
        self.live: list[Sequence] = []
        self.cache: dict[int, list] = {}  # block id -> the token in each slot

    def write(self, seq: Sequence, start: int) -> None:
        """The device's side of a step: copy-on-write copies, then the new tokens' slots."""
        for src, dst in self.bm.take_copies():
            self.cache[dst] = list(self.cache[src])
        for p in range(start, len(seq.token_ids)):
            block = self.cache.setdefault(seq.block_table[p // BS], [None] * BS)
            block[p % BS] = seq.token_ids[p]

    # Prompts drawn from a small alphabet and shared stems so prefix hits are frequent.
    @rule(stem=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def add(self, stem, tail):
        seq = admit(self.bm, stem + tail)
        if seq is not None:
            self.write(seq, seq.num_cached_tokens)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), token=st.integers(0, 3))
    def append_token(self, i, token):
        seq = self.live[i % len(self.live)]
        seq.token_ids.append(token)
        if self.bm.allocate(seq, 1):
            seq.num_computed_tokens += 1
            self.write(seq, seq.num_computed_tokens - 1)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        self.live.append(fork(self.bm, self.live[i % len(self.live)]))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), drop=st.integers(1, 6))
    def truncate(self, i, drop):
        """Rejected draft tokens: the sequence keeps its first tokens only."""
        seq = self.live[i % len(self.live)]
        keep = max(1, seq.num_computed_tokens - drop)
        del seq.token_ids[keep:]
        self.bm.truncate(seq, keep)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.bm.free(self.live.pop(i % len(self.live)))

    @invariant()
    def blocks_are_accounted_for(self):
        bm = self.bm
        refs = [0] * bm.num_blocks
        for seq in self.live:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
            for b in seq.block_table:
                refs[b] += 1
        free = set(bm.free_uncached) | set(bm.evictable)
        assert len(bm.free_uncached) + len(bm.evictable) == len(free)  # no block listed twice
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id]
            assert (block.ref_count == 0) == (block.block_id in free)
        assert bm.num_shared_blocks == sum(r > 1 for r in refs)
        assert bm.num_blocks_saved == sum(max(r - 1, 0) for r in refs)
        for h, b in bm.hash_to_block.items():
            assert bm.blocks[b].hash == h
        assert all(bm.blocks[b].hash is not None for b in bm.evictable)
        assert all(bm.blocks[b].hash is None for b in bm.free_uncached)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                assert self.cache[seq.block_table[p // BS]][p % BS] == seq.token_ids[p]

    @invariant()
    def cached_contents_match(self):
        for seq in self.live:
            for i, b in enumerate(seq.block_table):
                block = self.bm.blocks[b]
                if block.hash is not None:  # (a shared block cut short reads as a prefix)
                    mine = tuple(seq.token_ids[i * BS : (i + 1) * BS])
                    assert block.key[1][: len(mine)] == mine

    @invariant()
    def published_blocks_hold_what_their_hash_names(self):
        for b in self.bm.hash_to_block.values():
            assert tuple(self.cache[b]) == self.bm.blocks[b].key[1]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                            deadline=None)


def test_prefix_hit_reuses_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = admit(bm, list(range(12)))
    b = Sequence(list(range(12)), PARAMS)
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]  # the third block holds the last token: recomputed
    bm.free(a)
    assert bm.num_cached_blocks == 3


def test_eviction_takes_unused_first_then_lru_later_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old = admit(bm, list(range(8)))
    old_table = list(old.block_table)
    bm.free(old)
    new = admit(bm, [9] * 16)  # takes the four never-used blocks
    assert set(new.block_table).isdisjoint(old_table)
    assert bm.num_cached_blocks == 2
    more = Sequence([7] * 4, PARAMS)
    assert bm.allocate(more, 4)
    assert more.block_table == [old_table[1]]  # the later block goes first
    assert bm.match_prefix(Sequence(list(range(8)) + [0], PARAMS)) == old_table[:1]


def test_hit_on_evictable_block_revives_it():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = admit(bm, list(range(9)))
    table = list(a.block_table)
    bm.free(a)
    b = admit(bm, list(range(9)))
    assert b.block_table[:2] == table[:2]
    assert b.num_computed_tokens == 9
    assert bm.num_cached_blocks == 0


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = Sequence(list(range(12)), PARAMS)
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_same_tokens_different_parent_do_not_match():
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    other = Sequence([3, 3, 3, 3, 2, 2, 2, 2, 0], PARAMS)
    assert bm.match_prefix(other) == []


def test_block_ending_in_a_pending_token_is_published_once_known():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = admit(bm, list(range(7)))  # blocks 0-3 and 4-6 (partial)
    seq.num_pending = 1  # token 7, filling the second block, was sampled on the device
    assert bm.allocate(seq, 1)
    seq.num_computed_tokens = 8
    assert len(bm.hash_to_block) == 1  # its last token's value is unknown: not published
    seq.token_ids.append(7)
    seq.num_pending = 0
    assert bm.allocate(seq, 1)
    assert len(bm.hash_to_block) == 2


def test_fork_shares_blocks_and_a_write_copies_the_partial_last_one():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = admit(bm, list(range(6)))  # a full block and a half-filled one
    child = fork(bm, parent)
    assert child.block_table == parent.block_table
    assert (bm.num_shared_blocks, bm.num_blocks_saved) == (2, 2)
    table = list(parent.block_table)
    child.token_ids.append(9)
    assert bm.allocate(child, 1)
    assert child.block_table[0] == table[0] and child.block_table[1] != table[1]
    assert bm.take_copies() == [(table[1], child.block_table[1])]
    parent.token_ids.append(8)
    assert bm.allocate(parent, 1)  # the last holder writes in place
    assert parent.block_table == table and bm.take_copies() == []
    assert (bm.num_shared_blocks, bm.num_blocks_saved) == (1, 1)
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8 and bm.num_shared_blocks == bm.num_blocks_saved == 0


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(num_blocks=2, block_size=BS)
    parent = admit(bm, list(range(6)))
    child = fork(bm, parent)
    child.token_ids.append(9)
    assert not bm.allocate(child, 1)
    assert child.block_table == parent.block_table and bm.take_copies() == []
