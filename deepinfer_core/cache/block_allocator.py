"""Free lists for the state cache: state slots (one per resident sequence: window rings and
compressor tails) and paged blocks (128 positions of compressed rows and indexer keys in every
layer). Plain Python ints, so the scheduler can own it without touching tensors. A prefix cache
over the allocator registers itself (`cached`): what only it holds is in use, yet reclaimable."""
from __future__ import annotations

from typing import Protocol


class Reclaimable(Protocol):
    def reset(self) -> bool:
        """Free every block and slot only this holder holds; True when it then holds none."""


class CacheFullError(RuntimeError):
    """The allocator has fewer free blocks or slots than asked for."""


class BlockAllocator:
    def __init__(self, num_blocks: int, num_slots: int):
        if num_blocks < 1 or num_slots < 1:
            raise ValueError(f"state cache needs >= 1 block and >= 1 slot, got num_blocks={num_blocks}, "
                             f"num_slots={num_slots}")
        self.num_blocks, self.num_slots = num_blocks, num_slots
        # pop() from the end: low ids first, which keeps small runs inside the first pages
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._block_used = [False] * num_blocks
        self._slot_used = [False] * num_slots
        self.cached: Reclaimable | None = None   # the prefix cache over these blocks, if any

    # ---- blocks ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_blocks)

    def allocate_blocks(self, n: int) -> list[int]:
        if n > len(self._free_blocks):
            raise CacheFullError(f"state cache: {n} blocks wanted, {len(self._free_blocks)} free")
        out = [self._free_blocks.pop() for _ in range(n)]
        for b in out:
            self._block_used[b] = True
        return out

    def free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._block_used[b]:
                raise RuntimeError(f"state cache: block {b} freed twice")
            self._block_used[b] = False
            self._free_blocks.append(b)

    # ---- slots -------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise CacheFullError("state cache: no free state slot")
        s = self._free_slots.pop()
        self._slot_used[s] = True
        return s

    def free_slot(self, slot: int) -> None:
        if not self._slot_used[slot]:
            raise RuntimeError(f"state cache: slot {slot} freed twice")
        self._slot_used[slot] = False
        self._free_slots.append(slot)

    @property
    def empty(self) -> bool:
        return self.num_used_blocks == 0 and self.num_used_slots == 0

    def reclaim(self) -> bool:
        """Free what only the prefix cache holds (cached blocks and checkpoints no sequence holds);
        True when nothing is then in use. A leak check: a sequence's leaked block stays in use."""
        if self.cached is not None:
            self.cached.reset()
        return self.empty
