"""State slots of a hybrid model: each running sequence's place in its linear-attention layers'
state pools (the Gated DeltaNet layers of Qwen3-Next / Qwen3.5 keep a convolution state and a
recurrent state per sequence instead of paged K/V).

A sequence takes a slot when it is first scheduled (``BlockManager.allocate``) and gives it
back whenever it gives back its blocks: finished, aborted, dropped from a beam group, or
preempted (it is then recomputed from scratch, its first chunk starting from a zero state). A
fork (a follower of a prompt, a beam chosen twice) takes a slot of its own and records a copy
``(source, destination)``. The device makes a step's copies before its forward; the copies a
step takes are those recorded before it was scheduled (``take_copies``): a follower forked
while its leader's last prompt chunk is being scheduled needs the state that chunk leaves, so
its copy runs before the next step's forward, the first that may write either slot again. A
beam forks when its group's step is collected, which the engine does before it schedules the
next (``ScheduledBatch.feeds_next_step``): its copy runs before that next step.

There are ``max_num_seqs`` slots: admission reserves that many sequences for a request's
possible forks (``Sequence.num_seq_slots``), and a beam group drops the members it leaves
before it forks the ones it keeps, so no more sequences than that ever hold a slot.

With ``snapshots`` (prefix caching, ``engine.state_snapshots``) a sequence's slot is also
copied into a snapshot at a cached block boundary (``save``, a copy one step later like a
fork's), and a sequence resuming after a prefix-cache hit gets the snapshot copied into its
slot (``restore``) before the step that computes its first chunk: restores follow the copies
that step takes.
"""

from __future__ import annotations

from hf_paged.engine.sequence import Sequence
from hf_paged.engine.state_snapshots import StateSnapshots


class StateSlots:
    """A free list of ``num_slots`` slot numbers and the fork copies not yet taken.
    ``slot_bytes``: device memory one slot takes over every linear layer (for ``stats``);
    ``snapshots``: the snapshot slots, numbered after these (None: no prefix caching)."""

    def __init__(self, num_slots: int, slot_bytes: int = 0,
                 snapshots: StateSnapshots | None = None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {num_slots!r}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest first
        self.copies: list[tuple[int, int]] = []  # fork copies (source, destination), in order
        self.snapshots = snapshots
        self.restores: list[tuple[int, int]] = []  # snapshot -> slot, for the step scheduled

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    def take(self, seq: Sequence) -> bool:
        """Give ``seq`` a slot unless it holds one; False when none is free."""
        if seq.state_slot >= 0:
            return True
        if not self.free_slots:
            return False
        seq.state_slot = self.free_slots.pop()
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` a slot holding a copy of ``parent``'s state (once the copy runs)."""
        if parent.state_slot < 0:
            raise RuntimeError(f"sequence {parent.seq_id} is forked without a state slot")
        if not self.take(child):
            raise RuntimeError(f"no free state slot for a fork of sequence {parent.seq_id}: "
                               f"more than {self.num_slots} sequences would hold one")
        self.copies.append((parent.state_slot, child.state_slot))

    def free(self, seq: Sequence) -> None:
        """Give back ``seq``'s slot, if it holds one. A fork's copy into it still to come is
        harmless: the slot's next sequence starts from zero, or restores a snapshot or is a
        fork, whose copy comes later. A restore into it (a step that failed to launch) goes:
        it would follow a later fork's copy."""
        slot = seq.state_slot
        if slot >= 0:
            self.free_slots.append(slot)
            seq.state_slot = -1
            if self.restores:
                self.restores = [r for r in self.restores if r[1] != slot]

    def save(self, seq: Sequence, block_hash: int) -> None:
        """Snapshot ``seq``'s state, after the block named ``block_hash`` once the step being
        scheduled has run (unless a snapshot of it exists, or no slot can be had)."""
        slot = self.snapshots.take(block_hash)
        if slot is not None:
            self.copies.append((seq.state_slot, slot))

    def restore(self, seq: Sequence, block_hash: int) -> None:
        """Start ``seq`` from the snapshot after the block named ``block_hash``."""
        self.restores.append((self.snapshots.use(block_hash), seq.state_slot))

    def take_copies(self, count: int) -> list[tuple[int, int]]:
        """The first ``count`` copies recorded (those before the step being scheduled), then
        the restores of the sequences it resumes."""
        copies = self.copies[:count] + self.restores
        del self.copies[:count]
        self.restores = []
        return copies
