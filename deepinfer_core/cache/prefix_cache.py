"""Prefix caching on the hybrid V4 state: the scheduler's side (plain Python; no tensors).

A hit restores a sequence at a block-aligned position H (the block size is a multiple of every
compress ratio, so no compressor window straddles H): its first H / block_size blocks are the cached
ones, shared with every sequence holding them, and the *checkpoint* stored at the H-th position, a
state slot with the window rings, compressor tails, drafter rings and Engram ids of a sequence at H,
is copied into the sequence's own slot (`CacheUpdates.restores`). Its prefill then starts at H, and
computes exactly what a cold prefill computes from there (tests/engine/test_prefix_checkpoint.py).

A checkpoint is taken when a chunk *starts* on a kept boundary: the sequence's slot then holds its
state at that position (every position before it committed; draft rows past it, if any, are
ignored by position as after a rollback), so the copy (`CacheUpdates.saves`) runs before that
step's forward.
The kept boundaries of a sequence (`Sequence.cuts`; a prefill chunk never crosses one):

* the last block boundary before its last prompt token (a hit always leaves one token to compute:
  its logits sample the first output);
* the junction where its prompt leaves the cached tree, so the next request with the same shared
  prefix hits there;
* every `interval` positions of a long prompt (0: none);
* while it decodes, every block boundary a chunk starts on, of which only the newest is kept (on
  finish or preemption: the end of the output; a preempted sequence resumes as a hit).

Checkpoints live in `num_checkpoint_slots` extra state slots, counted in the cache budget.
Eviction is least recently used: when the checkpoint slots run out, the checkpoint least recently
kept or restored from goes (never one the same step copies; a running sequence's path may lose one
it has passed), and when the blocks run out, unreferenced leaf blocks with their checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .block_allocator import BlockAllocator
from .prefix_index import Match, PrefixIndex, block_keys, root_key

# why a lookup hit less than the cached blocks (`PrefixCacheStats.cut_short` keys)
NO_CHECKPOINT = "no_checkpoint"              # blocks cached past the deepest checkpoint
PROMPT_LOGPROBS = "prompt_logprobs"          # the request wants every prompt row's logprobs
CHECKPOINTS_FULL = "checkpoint_slots_full"   # a boundary not kept: all slots copied this step
TOKENS_IN_FLIGHT = "tokens_in_flight"        # a decode boundary not kept: tokens still in flight
CUT_SHORT_REASONS = (NO_CHECKPOINT, PROMPT_LOGPROBS, CHECKPOINTS_FULL, TOKENS_IN_FLIGHT)


@dataclass
class PrefixCacheStats:
    queries: int = 0                  # sequences that looked the cache up when admitted
    hits: int = 0
    query_tokens: int = 0             # their prompt tokens (all that could have been cached)
    hit_tokens: int = 0
    evicted_blocks: int = 0
    evicted_checkpoints: int = 0
    checkpoints_stored: int = 0
    cut_short: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Cached tokens over queried tokens."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def count(self, why: str) -> None:
        self.cut_short[why] = self.cut_short.get(why, 0) + 1


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, num_checkpoint_slots: int,
                 interval: int = 0, salt: tuple = ()):
        """`interval`: 0 or a multiple of `block_size` (EngineConfig checks
        prefix_checkpoint_interval)."""
        self.allocator, self.block_size, self.interval = allocator, block_size, interval
        self.capacity = num_checkpoint_slots
        self.salt = salt                  # what else decides the state (model, dtype, ...)
        self.index = PrefixIndex()
        self.stats = PrefixCacheStats()
        self.num_checkpoints = 0          # checkpoint slots in use
        if allocator.cached is not None:  # an earlier engine's cache over the same blocks
            allocator.cached.reset()
        allocator.cached = self

    # ---- keys ----------------------------------------------------------------------------------
    def keys(self, seq, end: int) -> list[bytes]:
        """The chain keys of the whole blocks of `seq`'s first `end` tokens (kept on `seq`)."""
        have, bs = seq.block_hashes, self.block_size
        n = end // bs
        if len(have) < n:
            prev = have[-1] if have else root_key(*self.salt, seq.request.cache_salt)
            have.extend(block_keys(prev, seq.token_slice(len(have) * bs, n * bs), bs))
        return have[:n]

    # ---- admission -----------------------------------------------------------------------------
    def lookup(self, seq) -> Match:
        """The longest cached prefix of a sequence being admitted (no references taken)."""
        if seq.want_prompt_logprobs:
            return Match([], None)
        return self.index.match(self.keys(seq, seq.num_tokens - 1))

    def admit(self, seq, hit: Match, updates) -> None:
        """Bind a sequence that has its slot to its hit (shared blocks, restored slot; the caller
        acquired the hit's nodes) and plan the boundaries its prefill keeps."""
        bs, end = self.block_size, seq.num_tokens - 1
        st = self.stats
        st.queries += 1
        st.query_tokens += end
        h = 0
        if seq.want_prompt_logprobs:
            st.count(PROMPT_LOGPROBS)
        else:
            if hit.cached > hit.num_blocks:
                st.count(NO_CHECKPOINT)
            if hit.checkpoint is not None:
                seq.prefix_nodes = list(hit.nodes)
                seq.block_ids = [n.block for n in hit.nodes]
                updates.table_writes.extend((seq.slot, i, b) for i, b in enumerate(seq.block_ids))
                updates.restores.append((hit.checkpoint, seq.slot))
                self.index.use_checkpoint(hit.nodes[-1])
                h = hit.num_blocks * bs
                st.hits += 1
                st.hit_tokens += h
        seq.num_computed = seq.first_start = h
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = h            # the first admission's (a resumed one keeps it)
        last = end // bs * bs
        cuts = {last} if last > h else set()
        if h < hit.cached * bs <= last:
            cuts.add(hit.cached * bs)             # where this prompt leaves the cached tree
        if self.interval:
            cuts.update(range((h // self.interval + 1) * self.interval, last, self.interval))
        seq.cuts = sorted(cuts, reverse=True)     # the next one last

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, seq, at: int, updates, decoding: bool = False) -> None:
        """A chunk of `seq` starts at block boundary `at`: cache its blocks before `at` and keep its
        slot as the checkpoint there (unless one exists). `decoding`: replace the sequence's
        previous decode checkpoint, unless another sequence holds it. When its last tokens are
        still on the device (async), the slot is copied now and named once they arrive
        (`settle`)."""
        if seq.num_tokens >= at:
            self._register(seq, at, decoding, None, updates)
            return
        slot = None if seq.unnamed_checkpoint is not None else self._checkpoint_slot(updates)
        if slot is None:
            self.stats.count(TOKENS_IN_FLIGHT if seq.unnamed_checkpoint else CHECKPOINTS_FULL)
            return
        updates.saves.append((seq.slot, slot))
        seq.unnamed_checkpoint = (at, slot, decoding)

    def settle(self, seq, leaving: bool = False) -> None:
        """Name `seq`'s checkpoint copied before its tokens reached the host, once they have (or,
        when it is `leaving` first, drop it)."""
        at, slot, decoding = seq.unnamed_checkpoint
        if seq.num_tokens >= at:
            seq.unnamed_checkpoint = None
            self._register(seq, at, decoding, slot, None)
        elif leaving:
            seq.unnamed_checkpoint = None
            self._free_checkpoint(slot)
            self.stats.count(TOKENS_IN_FLIGHT)

    def _register(self, seq, at: int, decoding: bool, slot: int | None, updates) -> None:
        """Insert `seq`'s blocks before `at` and give the last one a checkpoint: `slot` (already
        copied) or a new one copied now."""
        keys, bs = self.keys(seq, at), self.block_size
        nodes, index = seq.prefix_nodes, self.index
        parent = nodes[-1] if nodes else None
        for i in range(len(nodes), at // bs):
            parent = index.insert(parent, keys[i], seq.block_ids[i])
            index.acquire((parent,))
            nodes.append(parent)
        node = nodes[at // bs - 1]
        if node.checkpoint is not None:
            if slot is not None:
                self._free_checkpoint(slot)            # another sequence kept this one first
        else:
            if slot is None:
                slot = self._checkpoint_slot(updates)
                if slot is None:
                    self.stats.count(CHECKPOINTS_FULL)
                    return
                updates.saves.append((seq.slot, slot))
            self.index.set_checkpoint(node, slot)
            self.stats.checkpoints_stored += 1
        if decoding:
            old, seq.decode_checkpoint = seq.decode_checkpoint, node
            if old is not None and old is not node and old.refs == 1 and old.checkpoint is not None:
                self._free_checkpoint(self.index.drop_checkpoint(old))

    def _free_checkpoint(self, slot: int) -> None:
        self.allocator.free_slot(slot)
        self.num_checkpoints -= 1

    def _checkpoint_slot(self, updates) -> int | None:
        """A slot for a new checkpoint: a free one, or the least recently used checkpoint's, but
        none this step still copies: a restore's source (restores run after the saves) or a save's
        destination (two copies into one slot in one op land in any order on a GPU)."""
        if self.num_checkpoints < self.capacity:
            self.num_checkpoints += 1
            return self.allocator.allocate_slot()
        pinned = {src for src, _ in updates.restores} | {dst for _, dst in updates.saves}
        slot = self.index.evict_checkpoint(pinned)
        self.stats.evicted_checkpoints += slot is not None
        return slot

    # ---- leaving and eviction ------------------------------------------------------------------
    def release(self, seq) -> list[int]:
        """Drop `seq`'s references; returns its blocks the index does not own (the caller frees
        them)."""
        if seq.unnamed_checkpoint is not None:
            self.settle(seq, leaving=True)
        nodes = seq.prefix_nodes
        own = [b for i, b in enumerate(seq.block_ids) if i >= len(nodes) or nodes[i].block != b]
        self.index.release(nodes)
        seq.prefix_nodes, seq.decode_checkpoint = [], None
        return own

    @property
    def num_evictable_blocks(self) -> int:
        return self.index.num_unreferenced

    def evict(self, num_blocks: int) -> None:
        """Free up to `num_blocks` cached blocks no sequence holds (with their checkpoints)."""
        blocks, slots = self.index.evict(num_blocks)
        self.allocator.free_blocks(blocks)
        for s in slots:
            self.allocator.free_slot(s)
        self.num_checkpoints -= len(slots)
        self.stats.evicted_blocks += len(blocks)
        self.stats.evicted_checkpoints += len(slots)

    def reset(self) -> bool:
        """Drop every cached block and checkpoint no sequence holds; True when nothing is left."""
        self.evict(len(self.index.nodes))
        return not self.index.nodes

