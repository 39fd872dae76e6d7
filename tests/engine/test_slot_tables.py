"""The per-slot device tables (runner/slot_tables.py): block rows, the last token and the drafts of
each slot, and the negative input ids that name them (a step launched before the host knows them)."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.runner.slot_tables import SlotTables


def test_codes_name_the_last_token_and_each_draft_of_a_slot():
    tables = SlotTables(num_slots=4, max_blocks=2, device="cpu", num_drafts=3)
    tables.last_token.copy_(torch.tensor([10, 11, 12, 13]))
    assert tables.write_drafts(torch.tensor([2, 0]), torch.tensor([[20, 21, 22], [0, 1, 2]]))
    ids = torch.tensor([5, -1 - 2, *tables.draft_codes(2, 3), -1 - 0, *tables.draft_codes(0, 2), 7])
    assert tables.resolve_ids(ids).tolist() == [5, 12, 20, 21, 22, 10, 0, 1, 7]
    # slots not written keep their drafts; a write of fewer drafts leaves the later rows as they were
    assert tables.write_drafts(torch.tensor([2]), torch.tensor([[30]]))
    assert tables.resolve_ids(torch.tensor(tables.draft_codes(2, 3))).tolist() == [30, 21, 22]


def test_more_drafts_than_the_tables_hold_stay_on_the_host():
    tables = SlotTables(num_slots=2, max_blocks=1, device="cpu", num_drafts=1)
    assert not tables.write_drafts(torch.tensor([0]), torch.tensor([[1, 2]]))
    assert tables.drafts.tolist() == [[0, 0]]


def test_block_rows_beyond_the_table_are_an_error():
    tables = SlotTables(num_slots=2, max_blocks=2, device="cpu")
    tables.write([(1, 0, 7), (1, 1, 8)])
    assert tables.block_table.tolist() == [[0, 0], [7, 8]]
    with pytest.raises(ValueError, match="column 2 is beyond"):
        tables.write([(0, 2, 9)])
