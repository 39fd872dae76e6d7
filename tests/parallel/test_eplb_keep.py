"""EPLB's move-aware layout (parallel/eplb_keep.py): the policy's bins laid over the current placement
keep every step's rank loads and the replica counts exactly, never move more expert copies than the
plan as it came (fewer on skewed synthetic loads), keep a rank's kept experts in their slots, and give
back the current placement for a plan that only permutes it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.parallel.eplb import rank_load, rebalance, rebalance_simple
from deepinfer_core.parallel.eplb_keep import keep_in_place
from deepinfer_core.parallel.expert_map import ExpertPlacement

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from eplb_balance import E  # noqa: E402
from eplb_moves import rearrangements, rewritten_slots, transfers  # noqa: E402


@pytest.mark.parametrize("policy", [rebalance, rebalance_simple], ids=["deepinfer", "eplb_global"])
@pytest.mark.parametrize("ep,redundant", [(2, 0), (4, 16), (8, 32)])
def test_same_balance_and_fewer_moves_over_a_run_of_rearrangements(policy, ep, redundant):
    """Three windows of different skewed loads, each planned from the placement the last one left
    (benchmarks/eplb_moves.py prints the counts)."""
    plain_moves = kept_moves = 0
    for window, current, plan, kept in rearrangements(policy, ep, redundant):
        assert torch.equal(kept.log_count, plan.log_count)
        # every step's rank loads are the plan's, in some rank order (summed over the slots in another order)
        assert torch.allclose(rank_load(window, kept, ep).sort(-1).values, rank_load(window, plan, ep).sort(-1).values,
                              rtol=1e-12, atol=0)
        moved, plain = transfers(current, kept, ep), transfers(current, plan, ep)
        assert moved <= plain and rewritten_slots(current, kept) <= rewritten_slots(current, plan)
        plain_moves, kept_moves = plain_moves + plain, kept_moves + moved
    assert kept_moves < plain_moves, (kept_moves, plain_moves)


def test_a_plan_that_only_permutes_the_placement_moves_nothing():
    """Rank blocks swapped and slots reordered inside each rank: the current placement comes back."""
    ep = 4
    old = ExpertPlacement.initial(2, E, ep, 16)
    per = old.num_slots // ep
    new_rows = []
    for row in old.phys_to_log.tolist():
        blocks = [row[r * per:(r + 1) * per] for r in (2, 0, 3, 1)]
        new_rows.append([e for b in blocks for e in sorted(b, reverse=True)])
    new = ExpertPlacement.from_phys_to_log(torch.tensor(new_rows, dtype=torch.int32), E)
    assert transfers(old, new, ep) > 0
    assert keep_in_place(old, new, ep).equals(old)
    assert keep_in_place(old, old, ep).equals(old)


def test_kept_experts_stay_in_their_slots():
    """Bins [1 3 4] and [0 2 5] over ranks holding [0 1 2] and [3 4 5]: rank 0 keeps 0 and 2 in slots 0 and
    2 and 5 takes the freed slot 1; rank 1 keeps 3 and 4 in place and 1 takes slot 5."""
    old = ExpertPlacement.from_phys_to_log(torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32), 6)
    new = ExpertPlacement.from_phys_to_log(torch.tensor([[1, 3, 4, 0, 2, 5]], dtype=torch.int32), 6)
    assert keep_in_place(old, new, 2).phys_to_log.tolist() == [[0, 5, 2, 3, 4, 1]]
    # the bins [1 3 4] and [0 2 5]: rank 1 already holds 3 and 4, rank 0 holds 0 and 2
    assert transfers(old, keep_in_place(old, new, 2), 2) == 2 < transfers(old, new, 2) == 4


def test_mismatched_placements_are_refused():
    a = ExpertPlacement.initial(2, 8, 2, 0)
    with pytest.raises(ValueError, match="the same layers, slots and experts"):
        keep_in_place(a, ExpertPlacement.initial(2, 8, 2, 2), 2)
    with pytest.raises(ValueError, match="ep_size=3"):
        keep_in_place(a, a, 3)
