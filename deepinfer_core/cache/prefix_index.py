"""The prefix cache's index: which cached blocks and window checkpoints a prompt can reuse.

A block (`block_size` positions of compressed rows and indexer keys in every layer) is content-
addressed by a hash chain: block k's key hashes block k-1's key and its own token ids, and the
root's key hashes what else decides the state (the model, its dtype and QAT mode, a tenant's
`cache_salt`). A *checkpoint* is a state slot holding a sequence's window rings, compressor tails
and Engram ids at the end of a cached block (`StateCache.copy_slots`); a hit needs one, because
the blocks alone do not hold the window state (`tests/engine/test_prefix_checkpoint.py` shows that
blocks + checkpoint restore a cold run's state exactly).

Nodes form a tree (one child per different next block). A sequence holds references on the nodes
of its prefix; unreferenced leaves are evicted least recently used first, and a node's checkpoint
goes with it, so no checkpoint outlives a block it depends on. Plain Python: the scheduler owns it.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np


def root_key(*salt: object) -> bytes:
    """The chain's start: everything besides the tokens that changes the cached state."""
    return hashlib.sha256(repr(salt).encode()).digest()


def block_keys(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the whole blocks of `token_ids` (a partial last block has none)."""
    keys, key = [], root
    ids = np.asarray(token_ids, dtype=np.int64)
    for k in range(len(ids) // block_size):
        key = hashlib.sha256(key + ids[k * block_size:(k + 1) * block_size].tobytes()).digest()
        keys.append(key)
    return keys


@dataclass(eq=False)
class Node:
    key: bytes
    block: int                          # the cache block holding this block's rows
    parent: Node | None
    depth: int                          # blocks from the root, this one included
    refs: int = 0                       # sequences holding it
    checkpoint: int | None = None       # state slot with the window state at this block's end
    children: dict[bytes, Node] = field(default_factory=dict)
    last_use: int = 0                   # last acquired (blocks: least recently used go first)


@dataclass
class Match:
    nodes: list[Node]                   # the cached prefix, root side first, up to the checkpoint
    checkpoint: int | None              # the slot to restore (None: no hit)
    cached: int = 0                     # blocks cached in all (past the checkpoint too)

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)


class PrefixIndex:
    def __init__(self) -> None:
        self.nodes: dict[bytes, Node] = {}
        self._clock = itertools.count(1)
        self.num_unreferenced = 0       # nodes no sequence holds: the blocks eviction can free
        # the nodes with a checkpoint, least recently kept or restored from first
        self.checkpointed: OrderedDict[Node, None] = OrderedDict()
        # (last_use, tie, node) of every node that became an evictable leaf (unreferenced, no
        # children); an entry that no longer says so is skipped when it comes up
        self._leaves: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()

    def _maybe_leaf(self, node: Node) -> None:
        if node.refs == 0 and not node.children:
            heapq.heappush(self._leaves, (node.last_use, next(self._tie), node))
            if len(self._leaves) > 2 * len(self.nodes) + 64:     # mostly stale: rebuild
                self._leaves = [(n.last_use, next(self._tie), n) for n in self.nodes.values()
                                if n.refs == 0 and not n.children]
                heapq.heapify(self._leaves)

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpointed)

    def match(self, keys: Sequence[bytes]) -> Match:
        """The longest cached prefix of `keys` that ends on a checkpoint (no references taken)."""
        best, path = 0, []
        for key in keys:
            node = self.nodes.get(key)
            if node is None:
                break
            path.append(node)
            if node.checkpoint is not None:
                best = len(path)
        return Match(path[:best], path[best - 1].checkpoint if best else None, len(path))

    def acquire(self, nodes: Sequence[Node]) -> None:
        now = next(self._clock)
        for node in nodes:
            self.num_unreferenced -= node.refs == 0
            node.refs += 1
            node.last_use = now

    def release(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            if node.refs <= 0:
                raise RuntimeError(f"prefix index: block {node.block} released more than acquired")
            node.refs -= 1
            self.num_unreferenced += node.refs == 0
            self._maybe_leaf(node)

    def insert(self, parent: Node | None, key: bytes, block: int) -> Node:
        """Register a full block after `parent` (None: the first block); returns the cached node,
        which may already exist (then `block` stays the caller's to free)."""
        node = self.nodes.get(key)
        if node is None:
            depth = 1 if parent is None else parent.depth + 1
            node = Node(key, block, parent, depth, last_use=next(self._clock))
            self.nodes[key] = node
            self.num_unreferenced += 1
            if parent is not None:
                parent.children[key] = node
            self._maybe_leaf(node)
        return node

    def set_checkpoint(self, node: Node, slot: int) -> int | None:
        """Give `node` the checkpoint in `slot`; when it already has one, `slot` is returned for
        the caller to free (else None)."""
        if node.checkpoint is not None:
            return slot
        node.checkpoint = slot
        self.checkpointed[node] = None
        return None

    def use_checkpoint(self, node: Node) -> None:
        """`node`'s checkpoint was restored from just now."""
        self.checkpointed.move_to_end(node)

    def drop_checkpoint(self, node: Node) -> int:
        """Take `node`'s checkpoint away (its blocks stay); returns its slot."""
        slot, node.checkpoint = node.checkpoint, None
        del self.checkpointed[node]
        return slot

    def evict_checkpoint(self, pinned: Collection[int] = ()) -> int | None:
        """Drop the checkpoint least recently kept or restored from, but none in `pinned` (slots
        the step still copies from or into); its blocks stay cached. A checkpoint inside a path a
        running sequence holds may go: that sequence has its own state, and a conversation's
        earlier turns are passed through, not restored from, so they age while its newest
        checkpoint and a shared prefix's junction, restored from by every new request, stay.
        Returns its slot, or None when every checkpoint is pinned."""
        node = next((n for n in self.checkpointed if n.checkpoint not in pinned), None)
        return None if node is None else self.drop_checkpoint(node)

    def evict(self, num_blocks: int) -> tuple[list[int], list[int]]:
        """Drop up to `num_blocks` unreferenced leaves, least recently used first (a parent becomes
        a leaf once its children are gone); returns (blocks, checkpoint slots) to free."""
        blocks: list[int] = []
        slots: list[int] = []
        heap = self._leaves
        while len(blocks) < num_blocks and heap:
            use, _, node = heapq.heappop(heap)
            if (node.refs or node.children or use != node.last_use
                    or self.nodes.get(node.key) is not node):
                continue                        # held, a parent again, or already evicted
            del self.nodes[node.key]
            self.num_unreferenced -= 1
            blocks.append(node.block)
            if node.checkpoint is not None:
                slots.append(self.drop_checkpoint(node))
            if node.parent is not None:
                del node.parent.children[node.key]
                self._maybe_leaf(node.parent)
        return blocks, slots
