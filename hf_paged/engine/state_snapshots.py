"""Prefix caching for a hybrid model: snapshots of the linear-attention layers' state at
cached block boundaries.

A cached block holds the full-attention layers' K/V of a prefix; resuming after it also needs
the linear layers' state after that prefix. A snapshot is that state, in a slot of the state
pools past the running sequences' (``first_slot`` on), named by the hash of the prefix's last
block (``BlockManager``'s chained hash). A prompt's prefill stops (the scheduler ends a chunk
there) and snapshots its state at up to two block boundaries (``BlockManager.state_stop``):
the end of the longest prefix of it the cache held at admission when no snapshot kept the
state there (where it parts from an earlier prompt: a shared system prompt's end, so that
the second request sharing it pays for the snapshot and the third on resume there), and the
end of its last full block before its last token (the longest prefix the cache could serve
the same prompt again, or a conversation's next turn). The sequence's slot is copied into
the snapshot's before the next step, like a fork's copy. A hit resumes from the last cached
block that has a snapshot: the snapshot is copied into the sequence's slot before the step
that computes its first chunk. A snapshot goes when its block leaves the prefix cache
(evicted, or unpublished), or, the least recently used first, when a new one needs its slot:
each hit makes its snapshot the most recently used, so a prefix many requests share outlives
the prompts' own. Other block boundaries (a chunk's end, say) are not kept: each snapshot is
as large as a running sequence's state, and one at a boundary no second prompt reached would
only push out one that serves.

A snapshot taken while a step is scheduled is filled before the next step runs, so it serves
hits from the next ``schedule`` on (``publish``); a waiting prompt it would serve more of
than the published ones waits for that step (``BlockManager.awaits_state``), so prompts
added together that share a prefix compute it twice, not each.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """``num_snapshots`` snapshot slots from ``first_slot``; which block hash each serves."""

    def __init__(self, first_slot: int, num_snapshots: int):
        if num_snapshots < 1:
            raise ValueError(f"num_snapshots must be positive, got {num_snapshots!r}")
        self.num_snapshots = num_snapshots
        self.free_slots = list(range(first_slot + num_snapshots - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # serving hits, LRU first
        self.pending: dict[int, int] = {}  # taken while this step is scheduled

    @property
    def num_used(self) -> int:
        return self.num_snapshots - len(self.free_slots)

    def has(self, block_hash: int) -> bool:
        """Whether a snapshot after the block named ``block_hash`` serves hits."""
        return block_hash in self.by_hash

    def use(self, block_hash: int) -> int:
        """The slot of a snapshot a hit resumes from (now the most recently used)."""
        self.by_hash.move_to_end(block_hash)
        return self.by_hash[block_hash]

    def take(self, block_hash: int) -> int | None:
        """A slot for a new snapshot after ``block_hash`` (the least recently used snapshot
        gives its up when none is free); None when there is one already, or no slot."""
        if block_hash in self.by_hash or block_hash in self.pending:
            return None
        if not self.free_slots and self.by_hash:
            self.free_slots.append(self.by_hash.popitem(last=False)[1])
        if not self.free_slots:
            return None
        slot = self.pending[block_hash] = self.free_slots.pop()
        return slot

    def drop(self, block_hash: int) -> None:
        """The block named ``block_hash`` left the prefix cache: so does its snapshot."""
        slot = self.by_hash.pop(block_hash, None)
        if slot is None:
            slot = self.pending.pop(block_hash, None)
        if slot is not None:
            self.free_slots.append(slot)

    def publish(self) -> None:
        """The snapshots taken while the last step was scheduled are filled before the next
        runs: they serve hits from now on."""
        self.by_hash.update(self.pending)
        self.pending.clear()
