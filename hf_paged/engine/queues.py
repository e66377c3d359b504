"""The scheduler's queues: waiting, running and parked requests, and the moves between them
that are not scheduling: finishing, forking, dropping, preempting, aborting.

Requests added as followers of a leader share its prompt: when the leader's prompt is
first sampled they are forked from it (sharing its blocks) and each samples its own token from
the same logits row. The members of a ``SequenceGroup`` (beam search) report candidates
instead of sampling; once all have reported, the group's choice forks the members that
continue and frees the others. Admission reserves the most sequences a request may become
(``Sequence.num_seq_slots``) so that forks never exceed ``max_num_seqs``.
"""

from __future__ import annotations

from collections import deque

from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.sequence import Sequence, SequenceGroup, Status


class RequestQueues:
    """Where every request of the engine is, and the slots of ``max_num_seqs`` they hold."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        # Preempted group members that had reported: they need nothing until their group's
        # choice, which sends those that go on to the front of the queue.
        self.parked: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_seq_slots = 0  # of max_num_seqs, reserved by admitted requests
        self.dropped: list[Sequence] = []  # group members freed since the last take_dropped

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def _finish(self, seq: Sequence, finished: list[Sequence]) -> None:
        self._release(seq)
        seq.status = Status.FINISHED
        finished.append(seq)

    def _advance(self, group: SequenceGroup, finished: list[Sequence]) -> None:
        """Apply a group's choice: each chosen member continues with its token (a member
        chosen again is forked first, sharing its blocks); the members not chosen leave."""
        choices = group.advance()
        group.reports = {}
        if not choices:
            for seq in group.members:
                self._drop(seq)
            self.num_seq_slots -= group.width
            group.admitted = False
            root = group.root
            root.status, root.finish_reason = Status.FINISHED, root.finish_reason or "stop"
            finished.append(root)
            return
        # The members not chosen leave first: no more than ``width`` members ever hold blocks
        # and state slots at once (a fork may take the slot one left).
        chosen = {parent.seq_id for parent, _ in choices}
        for seq in group.members:
            if seq.seq_id not in chosen:
                self._drop(seq)
        continuing: set[int] = set()
        members = []
        for parent, token in choices:  # forks first: they copy the parent's tokens
            if parent.seq_id in continuing:
                child = self.fork(parent)
                child.token_ids.append(token)
                members.append(child)
            else:
                continuing.add(parent.seq_id)
                members.append(parent)
        for parent, token in choices:  # a parent continues with its first choice
            if parent.seq_id in continuing:
                continuing.discard(parent.seq_id)
                parent.token_ids.append(token)
        group.members = members
        for seq in reversed(members):
            if seq in self.parked:
                self.parked.remove(seq)
                self.waiting.appendleft(seq)

    def fork(self, parent: Sequence) -> Sequence:
        """A copy of ``parent`` sharing its blocks, next to it in the running or waiting queue."""
        child = parent.fork()
        if parent.status is Status.RUNNING:
            self.block_manager.fork(parent, child)
            self.running.append(child)
        elif parent in self.parked:
            self.parked.append(child)
        else:
            self.waiting.insert(self.waiting.index(parent) + 1, child)
        return child

    def _drop(self, seq: Sequence) -> None:
        """A group member leaves (its group holds the slots)."""
        if seq.status is Status.RUNNING:
            self.block_manager.free(seq)
        elif seq.status is Status.WAITING:
            self._unqueue(seq)
        seq.status = Status.FINISHED
        self.dropped.append(seq)

    def _unqueue(self, seq: Sequence) -> None:
        (self.parked if seq in self.parked else self.waiting).remove(seq)

    def take_dropped(self) -> list[Sequence]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def _release(self, seq: Sequence) -> None:
        """Free a request that stops while running, or take it off the queue if it was
        preempted meanwhile; give back its slots."""
        if seq.status is Status.RUNNING:
            self.block_manager.free(seq)
            self.num_seq_slots -= 1 + len(seq.followers)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, releasing its blocks (a group: all its members)."""
        group = seq.group
        if group is not None:
            for member in group.members:
                if member is not group.root:
                    self._drop(member)
            self.running = [s for s in self.running if s.status is Status.RUNNING]
            if group.admitted:
                self.num_seq_slots -= group.width
                group.admitted = False
            group.members = [group.root]
            seq = group.root
        elif seq.leader is not None:  # a follower not forked yet: in no queue
            seq.leader.followers.remove(seq)
            self.num_seq_slots -= seq.leader.status is Status.RUNNING
            seq.leader, seq.status, seq.finish_reason = None, Status.FINISHED, "abort"
            return
        elif seq.followers:  # the first follower takes the prompt over, from the queue's front
            heir, *rest = seq.followers
            heir.leader, heir.followers = None, rest
            for follower in rest:
                follower.leader = heir
            seq.followers = []
            if seq.status is Status.RUNNING:
                self.num_seq_slots -= 1 + len(rest)
            self.waiting.appendleft(heir)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
            self.num_seq_slots -= seq.group is None
        elif seq.status is Status.WAITING:
            self._unqueue(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def _preempt(self, seq: Sequence, park: bool = False) -> None:
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        if park:
            self.parked.append(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if seq.group is None:  # a group keeps its slots for its members
            self.num_seq_slots -= 1 + len(seq.followers)

    def _preempt_idle_member(self) -> bool:
        """Preempt the latest group member that waits for its group's choice (it is parked),
        when nothing else can run: the request at the queue's head (maybe the member the group
        waits for) needs its blocks."""
        i = self._idle_member_index()
        if i is not None:
            self._preempt(self.running.pop(i), park=True)
        return i is not None

    def _idle_member_index(self, besides: set[int] = frozenset()) -> int | None:
        """Where the latest running group member waiting for its group's choice is, other than
        the sequence ids ``besides`` (those of the batch being built look idle: their chunk
        counts as done)."""
        for i in range(len(self.running) - 1, -1, -1):
            seq = self.running[i]
            if (seq.group is not None and seq.num_computed_tokens == seq.num_tokens
                    and seq.seq_id not in besides):
                return i
        return None
