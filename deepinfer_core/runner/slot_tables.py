"""Per-slot step state that lives on the device for the engine's whole life.

* `block_table[slot]`: the block ids of the sequence in that slot (int32, `max_blocks` wide). Written
  only when the scheduler hands a sequence new blocks (`write`), never rebuilt per step; a batch's
  table is a device gather by slot.
* `last_token[slot]`: the newest token sampled for that slot, written by the sampler on the device.
  The next step's input for a sequence whose token the host has not read yet is taken from here,
  so step N+1 can be launched before step N's tokens reach the host.
* `drafts[i, slot]` (speculative decoding): draft i of that slot, written by the drafter on the
  device, so a verify step can be launched before the drafts reach the host.
* `next_start[slot]` (speculative decoding): the position of the sequence's next verify chunk (its
  last token's), written by a verification that ran on the device, so the next verify step can be
  launched before the verdict reaches the host.

An input id below zero names one of these: -1 - slot is `last_token[slot]`, `draft_code(slot, i)`
draft i; `resolve_ids` swaps them on the device.
"""
from __future__ import annotations

import torch

from ..ops.transfer import to_device


class SlotTables:
    def __init__(self, num_slots: int, max_blocks: int, device, num_drafts: int = 0):
        self.device, self.max_blocks, self.num_slots = torch.device(device), max_blocks, num_slots
        self.block_table = torch.zeros(num_slots, max_blocks, dtype=torch.int32, device=device)
        self._tokens = torch.zeros(1 + num_drafts, num_slots, dtype=torch.int64, device=device)
        self.last_token = self._tokens[0]
        self.drafts = self._tokens[1:]           # [num_drafts, slots]
        self.next_start = torch.zeros(num_slots, dtype=torch.int64, device=device)

    def draft_codes(self, slot: int, k: int) -> list[int]:
        """The input ids that stand for drafts 0..k-1 of `slot`."""
        return [-1 - (1 + i) * self.num_slots - slot for i in range(k)]

    def write_drafts(self, slots: torch.Tensor, ids: torch.Tensor) -> bool:
        """drafts[:, slots[r]] = ids[r] ([n, k] on the device); False when k is more than it holds."""
        k = ids.shape[1]
        if k > self.drafts.shape[0]:
            return False
        self.drafts[:k].index_copy_(1, slots, ids.t())
        return True

    def write(self, writes: list[tuple[int, int, int]]) -> None:
        """block_table[slot, column] = block for every (slot, column, block), in one device op."""
        if not writes:
            return
        flat = to_device([v for w in writes for v in w], torch.int64, self.device).view(-1, 3)
        if max(w[1] for w in writes) >= self.max_blocks:
            raise ValueError(f"block table: column {max(w[1] for w in writes)} is beyond the "
                             f"{self.max_blocks} blocks a sequence may hold (max_model_len)")
        self.block_table.index_put_((flat[:, 0], flat[:, 1]), flat[:, 2].to(torch.int32))

    def set_rows(self, slots: list[int], tables: list[list[int]]) -> None:
        """Whole rows from host lists (callers that manage their own states: tests, tools)."""
        self.write([(s, i, b) for s, t in zip(slots, tables) for i, b in enumerate(t)])

    def resolve_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Input ids with the entries below zero swapped for the tokens they name (device-side, no sync)."""
        pending = ids < 0
        return torch.where(pending, self._tokens.view(-1)[(-1 - ids).clamp(min=0)], ids)
