"""Paged KV blocks: block tables, reference counts, prefix cache and LRU eviction.

A full block is named by a chained hash (xxhash of its parent's hash and its token ids), so a
hash names a whole prefix; a chain starts from the sequence's LoRA adapter's id (0: the base
model), so blocks computed under one adapter never serve another. A block whose last user
lets go keeps its hash and contents and joins the evictable LRU; allocation takes never-used
(or hash-less) blocks first, then evicts the least recently used cached block. Every
operation is O(1) per block.

Forked sequences (beams, several samples of one prompt) share their blocks by reference count.
A write into a shared, partly filled last block first copies it (copy-on-write): ``allocate``
gives the writer a private block and records ``(source, destination)`` in ``copies``, which
the scheduler hands to the model runner to copy on the device before the step's forward.

A hybrid model's sequences also hold a state slot (``state_slots``): taken with their first
blocks, forked with them, given back with them. Cached blocks hold the full-attention layers'
K/V of a prefix, but not the linear layers' state after it: a hit resumes after the last
cached block whose state a snapshot kept (``engine.state_snapshots``; ``state_stop`` says where
a prefill stops to take one), and without snapshots the prefix cache serves such a model no
hits.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import xxhash

from hf_paged.engine.sequence import Sequence
from hf_paged.engine.state_slots import StateSlots


def block_hash(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    return xxhash.xxh3_64_intdigest(
        parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    )


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    # (parent hash, tokens): compared on every hit so that a hash collision is never reused.
    key: tuple[int, tuple[int, ...]] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state_slots: StateSlots | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots  # a hybrid model's (None: no linear-attention layers)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.hash_to_block: dict[int, int] = {}
        self.copies: list[tuple[int, int]] = []  # copy-on-write block copies not yet taken
        self.num_shared_blocks = 0  # blocks held by more than one sequence
        self.num_blocks_saved = 0  # sum over blocks of (holders - 1): blocks sharing saves

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``'s full blocks.

        The last token is never served from the cache: its logits are needed. The blocks are
        not taken yet; ``allocate`` takes them. A hybrid model's end at the last block with a
        state snapshot (see the module); where the cache holds more of the prompt than that,
        ``seq.shared_stop`` marks the end of it (``state_stop``).
        """
        slots = self.state_slots
        if not self.enable_prefix_caching or (slots is not None and slots.snapshots is None):
            return []
        self._hash_full_blocks(seq, len(seq) - 1)
        hits = []
        for i, h in enumerate(seq.block_hashes):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].key != self._key(seq, i):
                break
            hits.append(block_id)
        if slots is not None:
            seq.shared_stop = len(hits) * self.block_size
            while hits and not slots.snapshots.has(seq.block_hashes[len(hits) - 1]):
                hits.pop()
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after taking ``cached_blocks``.

        ``cached_blocks`` (from ``match_prefix``, admission only) join the block table and
        count as computed. A hybrid model's sequence also takes a state slot. Returns False,
        changing nothing, when the free blocks (or state slots) do not suffice.
        """
        slots = self.state_slots
        if slots is not None and seq.state_slot < 0 and not slots.num_free:
            return False
        bs = self.block_size
        total = seq.num_computed_tokens + len(cached_blocks) * bs + num_new_tokens
        needed = -(-total // bs) - len(seq.block_table) - len(cached_blocks)
        written = seq.num_computed_tokens // bs  # the block the first new token goes into
        copy = False
        if num_new_tokens and seq.num_computed_tokens % bs:
            block = self.blocks[seq.block_table[written]]
            copy = block.ref_count > 1  # others read it: write into a copy
            if not copy and block.hash is not None:
                # Published under tokens the sequence dropped (``truncate``): a write would
                # change what the hash names, so it stops being published.
                self._unpublish(block)
        if copy:
            if needed + 1 > self.num_free_blocks:
                return False
            self._copy_on_write(seq, written)
        if cached_blocks:
            reviving = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
            if needed > self.num_free_blocks - reviving:
                return False
            for block_id in cached_blocks:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.evictable[block_id]
                self._hold(block)
                seq.block_table.append(block_id)
            seq.num_computed_tokens += len(cached_blocks) * bs
        elif needed > 0 and needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block = self.blocks[self._take_free_block()]
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        known = min(total, len(seq.token_ids))  # a pending token's value is not known yet
        if self.enable_prefix_caching and known // bs > seq.num_published_blocks:
            self._cache_full_blocks(seq, known)
        if slots is not None:
            slots.take(seq)
            if cached_blocks:  # resume from the state after the last cached block
                slots.restore(seq, seq.block_hashes[len(cached_blocks) - 1])
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (a copy of ``parent``'s tokens) ``parent``'s blocks, shared, and a
        state slot that a copy fills with ``parent``'s state."""
        if self.state_slots is not None:
            self.state_slots.fork(parent, child)
        for block_id in parent.block_table:
            self._hold(self.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_published_blocks = parent.num_published_blocks

    def state_stop(self, seq: Sequence, start: int) -> int:
        """Where a hybrid model's prefill of ``seq``, past its first ``start`` tokens, next
        stops to snapshot its state (0: never): at the end of the longest cached prefix it
        matched at admission (``seq.shared_stop``: another prompt's, whose state there no
        snapshot kept), then at the end of its last full block before its last prompt token."""
        slots = self.state_slots
        if slots is None or slots.snapshots is None:
            return 0
        if start < seq.shared_stop:
            return seq.shared_stop
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def awaits_state(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether a hybrid model's snapshot that the step being scheduled fills would serve
        more of ``seq``'s prompt than its ``hits`` (from ``match_prefix``) do: admitted a
        step later, it resumes there instead of computing that prefix again."""
        slots = self.state_slots
        if slots is None or slots.snapshots is None:
            return False
        shared = seq.block_hashes[len(hits):seq.shared_stop // self.block_size]
        return any(h in slots.snapshots.pending for h in shared)

    def save_state(self, seq: Sequence, num_tokens: int) -> None:
        """Snapshot ``seq``'s state after its first ``num_tokens`` tokens (a block boundary,
        computed by the step being scheduled), under the hash of the block they end, while
        the prefix cache names that block."""
        block_hash = seq.block_hashes[num_tokens // self.block_size - 1]
        if block_hash in self.hash_to_block:
            self.state_slots.save(seq, block_hash)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies recorded since the last call, in order."""
        copies, self.copies = self.copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and state slot."""
        if self.state_slots is not None:
            self.state_slots.free(seq)
        self._let_go(seq.block_table)
        seq.block_table = []
        seq.num_published_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the cache of ``seq``'s first ``num_tokens`` tokens only (speculative decoding:
        positions of rejected draft tokens). Blocks past them are released; a kept partial
        last block published under tokens now dropped keeps its contents until the next
        ``allocate`` writes into it, which first copies it (others hold it) or unpublishes it,
        so the prefix cache never names changed contents. ``seq.token_ids`` is the caller's
        to shorten first; the table becomes a new list, so that views of the old one (the
        runner's mirror) see the change."""
        if self.state_slots is not None:
            raise NotImplementedError("a hybrid model's linear-attention state cannot be cut "
                                      "back to fewer tokens (speculative decoding, drafting)")
        keep = self.blocks_needed(num_tokens)
        full = num_tokens // self.block_size
        self._let_go(seq.block_table[keep:])
        seq.block_table = seq.block_table[:keep]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        seq.num_published_blocks = min(seq.num_published_blocks, full)
        del seq.block_hashes[min(full, len(seq.token_ids) // self.block_size):]

    def _let_go(self, block_ids: list[int]) -> None:
        """Release one hold on each block, later blocks first so that they are evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            self._release(block)
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_uncached.appendleft(block_id)
                else:
                    self.evictable[block_id] = None

    def _hold(self, block: Block) -> None:
        block.ref_count += 1
        if block.ref_count > 1:
            self.num_blocks_saved += 1
            self.num_shared_blocks += block.ref_count == 2

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count > 0:
            self.num_blocks_saved -= 1
            self.num_shared_blocks -= block.ref_count == 1

    def _copy_on_write(self, seq: Sequence, i: int) -> None:
        """Replace ``seq``'s shared block ``i`` by a private copy. The table becomes a new list
        so that views of the old one (the runner's mirror) see the change."""
        source = self.blocks[seq.block_table[i]]
        self._release(source)  # others still hold it: it stays allocated
        copy = self.blocks[self._take_free_block()]
        copy.ref_count = 1
        seq.block_table = seq.block_table[:i] + [copy.block_id] + seq.block_table[i + 1 :]
        self.copies.append((source.block_id, copy.block_id))

    def _take_free_block(self) -> int:
        if self.free_uncached:
            return self.free_uncached.popleft()
        block_id, _ = self.evictable.popitem(last=False)
        self._unpublish(self.blocks[block_id])
        return block_id

    def _unpublish(self, block: Block) -> None:
        """Take ``block`` out of the prefix cache (a hybrid model's state snapshot with it)."""
        del self.hash_to_block[block.hash]
        if self.state_slots is not None and self.state_slots.snapshots is not None:
            self.state_slots.snapshots.drop(block.hash)
        block.hash = block.key = None

    def _key(self, seq: Sequence, i: int) -> tuple[int, tuple[int, ...]]:
        # A chain starts from the sequence's salt: its LoRA adapter's id (0: the base model).
        parent = seq.block_hashes[i - 1] if i else seq.prefix_salt
        bs = self.block_size
        return parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def _hash_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.block_hashes`` over the full blocks among its first ``num_tokens``."""
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):
            seq.block_hashes.append(block_hash(*self._key(seq, i)))

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that ``num_tokens`` computed tokens fill. A block whose contents
        another block already publishes stays private and is freed as a plain block."""
        self._hash_full_blocks(seq, num_tokens)
        num_full = num_tokens // self.block_size
        for i in range(seq.num_published_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.key = h, self._key(seq, i)
                self.hash_to_block[h] = block.block_id
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)
