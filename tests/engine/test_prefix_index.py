"""The prefix cache's index (cache/prefix_index.py): the hash chain over whole blocks, the longest
cached prefix that ends on a checkpoint, references, and least-recently-used eviction of
unreferenced leaves together with their checkpoints."""
from __future__ import annotations

import pytest

from deepinfer_core.cache.prefix_index import PrefixIndex, block_keys, root_key

BS = 4
ROOT = root_key("tiny", "float32", True, None)


def chain(index: PrefixIndex, keys, blocks, checkpoints=()):
    parent = None
    nodes = []
    for i, (key, block) in enumerate(zip(keys, blocks)):
        parent = index.insert(parent, key, block)
        nodes.append(parent)
        if i in checkpoints:
            assert index.set_checkpoint(parent, 100 + i) is None
    return nodes


def test_the_chain_covers_whole_blocks_and_everything_before_them():
    keys = block_keys(ROOT, list(range(10)), BS)
    assert len(keys) == 2                                    # the partial third block has no key
    assert block_keys(ROOT, list(range(8)), BS) == keys
    changed = block_keys(ROOT, [99] + list(range(1, 10)), BS)
    assert changed[0] != keys[0] and changed[1] != keys[1]   # block 1's key depends on block 0
    assert block_keys(root_key("tiny", "bfloat16", True, None), list(range(8)), BS) != keys
    assert block_keys(root_key("tiny", "float32", True, "tenant-b"), list(range(8)), BS) != keys


def test_a_hit_ends_on_the_deepest_checkpoint_of_the_cached_prefix():
    index = PrefixIndex()
    keys = block_keys(ROOT, list(range(16)), BS)
    nodes = chain(index, keys[:3], [7, 8, 9], checkpoints={0, 1})
    hit = index.match(keys)
    assert hit.nodes == nodes[:2] and hit.checkpoint == 101 and hit.num_blocks == 2
    other = block_keys(ROOT, list(range(4)) + [50] * 12, BS)          # diverges in block 1
    assert index.match(other).nodes == nodes[:1] and index.match(other).checkpoint == 100
    bare = PrefixIndex()
    chain(bare, keys[:3], [1, 2, 3])
    assert bare.match(keys).checkpoint is None and bare.match(keys).num_blocks == 0


def test_inserting_a_cached_block_again_keeps_the_first_and_a_second_checkpoint_is_returned():
    index = PrefixIndex()
    key = block_keys(ROOT, list(range(4)), BS)[0]
    first = index.insert(None, key, 5)
    assert index.insert(None, key, 6) is first and first.block == 5
    assert index.set_checkpoint(first, 11) is None
    assert index.set_checkpoint(first, 12) == 12 and first.checkpoint == 11


def test_eviction_takes_unreferenced_leaves_oldest_first_with_their_checkpoints():
    index = PrefixIndex()
    a = chain(index, block_keys(ROOT, list(range(12)), BS), [1, 2, 3], checkpoints={2})
    b = chain(index, block_keys(ROOT, [9] * 8, BS), [4, 5])
    index.acquire(a)
    index.release(a)                          # used after b: b's leaf goes first
    index.acquire(b[:1])                      # b's first block is held
    assert index.evict(1) == ([5], [])
    assert index.evict(10) == ([3, 2, 1], [102])      # a's leaf, then its parents
    assert set(index.nodes) == {b[0].key}
    index.release(b[:1])
    assert index.evict(10) == ([4], [])
    with pytest.raises(RuntimeError, match="released more than acquired"):
        index.release(b[:1])


def test_the_checkpoint_least_recently_kept_or_restored_goes_first_but_never_a_pinned_one():
    """A conversation's earlier checkpoint, passed through on its path (held), goes before a
    shared prefix's junction that new requests restore from; a slot a restore still reads stays."""
    index = PrefixIndex()
    path = chain(index, block_keys(ROOT, list(range(16)), BS), [1, 2, 3, 4], checkpoints={0, 2})
    junction, earlier = path[0], path[2]
    later = path[3]
    assert index.set_checkpoint(later, 103) is None        # the conversation's newest
    index.acquire(path)                                    # its next turn runs through all of it
    index.use_checkpoint(junction)                         # a new request restored the junction
    assert index.evict_checkpoint() == 102 and earlier.checkpoint is None
    assert index.evict_checkpoint(pinned={103}) == 100 and junction.checkpoint is None
    assert index.evict_checkpoint(pinned={103}) is None and later.checkpoint == 103
    assert [n.block for n in path if n.refs] == [1, 2, 3, 4]     # the blocks stay cached


def test_eviction_order_survives_reuse_and_the_leaf_heap_stays_bounded():
    """Blocks used again go after those left alone; thousands of acquire/release cycles leave the
    index's heap of evictable leaves within a constant of its size."""
    index = PrefixIndex()
    a = chain(index, block_keys(ROOT, list(range(8)), BS), [1, 2])
    b = chain(index, block_keys(ROOT, [7] * 8, BS), [3, 4])
    for _ in range(2000):
        index.acquire(a)
        index.release(a)                      # a used again and again: b is older
    assert len(index._leaves) <= 2 * len(index.nodes) + 64
    assert index.evict(3) == ([4, 3, 2], [])
    assert index.evict(3) == ([1], []) and not index.nodes
