"""Expert placement (parallel/expert_map.py) and EPLB (parallel/eplb.py): the initial slot map, map
consistency against plain-Python oracles, replica-choice uniformity, the two policies on synthetic
skewed loads (Zipf, per-step hot experts, very skewed hash-style layers) at ep 2/4/8 with 0/16/32
redundant experts, hand-computed plans, the statistics window and the rearrangement schedule.

Loads are built from torch.rand/randperm with fixed generators and evaluated by summing (the plans run
on one thread), so nothing depends on BLAS or the thread count; the comments give the measured values."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from deepinfer_core.parallel.eplb import (
    ExpertLoadStats,
    imbalance,
    rank_load,
    rebalance,
    rebalance_simple,
    should_rearrange,
)
from deepinfer_core.parallel.expert_map import ExpertPlacement, choose_physical, padded_redundant

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from eplb_balance import E, hot_load, v4_like_load, zipf_load  # noqa: E402

SUITES = {"zipf": lambda: zipf_load(32, 4, 1.0, 1), "hot": lambda: hot_load(32, 4, 2),
          "v4_like": lambda: v4_like_load(32, 5, 3)}


def objective(load: torch.Tensor, placement: ExpertPlacement, ep: int) -> float:
    """What the deepinfer policy minimises: the sum over steps and layers of the maximum rank load."""
    return rank_load(load, placement, ep).amax(-1).sum().item()


# ---- placement and maps ---------------------------------------------------------------------------------
@pytest.mark.parametrize("experts,ep,redundant,padded", [
    (256, 1, 0, 0), (256, 2, 0, 0), (256, 4, 32, 32), (256, 6, 0, 2), (256, 8, 20, 24), (256, 12, 32, 32),
    (8, 3, 0, 1), (4, 8, 0, 4)])
def test_initial_placement(experts, ep, redundant, padded):
    assert padded_redundant(experts, ep, redundant) == padded
    p = ExpertPlacement.initial(3, experts, ep, redundant)
    slots = experts + padded
    assert (p.num_layers, p.num_experts, p.num_slots, p.num_redundant) == (3, experts, slots, padded)
    for layer in range(3):      # slot s < E holds s, spare slot E + i holds i mod E
        assert p.phys_to_log[layer].tolist() == [s if s < experts else (s - experts) % experts
                                                 for s in range(slots)]
    assert p.phys_to_log.dtype == p.log_to_phys.dtype == p.log_count.dtype == torch.int32
    per_rank = slots // ep
    assert [list(p.slots_of_rank(r, ep)) for r in range(ep)] == [
        list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep)]
    _assert_consistent(p)


def _random_phys_to_log(layers: int, experts: int, slots: int, seed: int) -> torch.Tensor:
    """Each expert once plus random extra replicas, shuffled over the slots."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(layers):
        ids = torch.cat([torch.arange(experts), torch.randint(0, experts, (slots - experts,), generator=g)])
        rows.append(ids[torch.randperm(slots, generator=g)])
    return torch.stack(rows).to(torch.int32)


def _assert_consistent(p: ExpertPlacement) -> None:
    """Plain-Python oracle: log_to_phys lists exactly the slots of each expert, ascending, then -1."""
    for layer in range(p.num_layers):
        p2l = p.phys_to_log[layer].tolist()
        for e in range(p.num_experts):
            slots = [s for s, x in enumerate(p2l) if x == e]
            assert len(slots) >= 1
            assert p.log_count[layer, e].item() == len(slots)
            assert p.log_to_phys[layer, e].tolist() == slots + [-1] * (p.num_redundant + 1 - len(slots))


@pytest.mark.parametrize("experts,slots", [(16, 16), (16, 24), (5, 12), (1, 4)])
def test_maps_from_phys_to_log_match_the_oracle(experts, slots):
    _assert_consistent(ExpertPlacement.from_phys_to_log(_random_phys_to_log(3, experts, slots, seed=slots), experts))


def test_placements_compare_by_value():
    a = ExpertPlacement.initial(2, 8, 2, 2)
    assert a.equals(ExpertPlacement.initial(2, 8, 2, 2))
    assert not a.equals(ExpertPlacement.from_phys_to_log(a.phys_to_log.flip(1).contiguous(), 8))


# ---- replica choice -------------------------------------------------------------------------------------
def test_replica_choice_follows_the_formula():
    p = ExpertPlacement.from_phys_to_log(_random_phys_to_log(2, 8, 20, seed=7), 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, 8, (50, 3), generator=g)
    rows = torch.randint(0, 200_000, (50,), generator=g)        # large rows: row * 23333 > 2**31
    got = choose_physical(ids, rows, 3, p, layer=1)
    for t in range(50):
        for k in range(3):
            e = ids[t, k].item()
            want = -1 if e < 0 else p.log_to_phys[1, e, (3 + rows[t].item() * 23333) % p.log_count[1, e].item()]
            assert got[t, k].item() == want


@pytest.mark.parametrize("count", [2, 3, 5, 7])
def test_consecutive_rows_cycle_through_all_replicas(count):
    # 23333 is prime, so count consecutive rows hit each of an expert's count replicas exactly once.
    p = ExpertPlacement.initial(1, 4, 1, 4 * (count - 1))
    for ep_rank in range(4):
        rows = torch.arange(count * 50)
        phys = choose_physical(torch.zeros(count * 50, 1, dtype=torch.int64), rows, ep_rank, p, 0)
        hits = torch.bincount(phys.flatten(), minlength=p.num_slots)
        assert hits[p.log_to_phys[0, 0, :count]].tolist() == [50] * count


def test_two_replicas_share_an_expert_evenly_under_random_routing():
    p = ExpertPlacement.initial(1, 64, 4, 64)            # every expert twice, the replicas on different ranks
    g = torch.Generator().manual_seed(1)
    tokens = 50_000
    ids = torch.rand(tokens, 64, generator=g).argsort(-1)[:, :6]    # top-6 of 64, uniform
    for ep_rank in range(4):
        hits = torch.bincount(choose_physical(ids, torch.arange(tokens), ep_rank, p, 0).flatten(), minlength=128)
        share = hits[p.log_to_phys[0, :, 0].long()] / (hits[:64] + hits[64:])
        assert (share - 0.5).abs().max() < 0.04, share
        ranks = hits.view(4, 32).sum(1).double()
        assert ranks.max() / ranks.mean() < 1.03


def test_masked_rows_stay_masked():
    p = ExpertPlacement.initial(1, 4, 2, 4)
    phys = choose_physical(torch.tensor([[-1, 2], [1, -1]]), torch.tensor([0, 1]), 0, p, 0)
    assert phys.tolist() == [[-1, 2], [5, -1]]


# ---- policies -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suite", sorted(SUITES))
@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("redundant", [0, 16, 32])
def test_policies_on_skewed_loads(suite, ep, redundant):
    load = SUITES[suite]()
    slots = E + redundant
    layers = load.shape[1]
    initial = ExpertPlacement.initial(layers, E, ep, redundant)
    plan = rebalance(load, slots, slots // ep)
    simple = rebalance_simple(load, slots, slots // ep)
    before = imbalance(rank_load(load, initial, ep))
    after = imbalance(rank_load(load, plan, ep))
    assert objective(load, plan, ep) <= objective(load, initial, ep)
    assert after <= before
    # Within 10% of the mean where placement can get there. It cannot when one unreplicated expert alone
    # exceeds 1.1 x a rank's mean load (R = 0, the hottest Zipf experts at ep 8), nor for the per-step
    # hot experts at ep 8: one hot expert plus its rank's 31 ordinary ones is already ~1.12 x the mean
    # at every step, and which experts are hot changes every step (measured 1.125-1.153). The closest
    # case asserted below 1.10 is v4_like ep 4 R 0 (1.091: its hottest hash expert is 69% of a rank).
    hottest = load.amax(-1).sum() / (load.sum(-1) / ep).sum()
    if redundant == 0 and hottest > 1.10:
        assert after < before
    elif suite == "hot" and ep == 8:
        assert after < 1.16
    else:
        assert after < 1.10, (before, after)
    # deepinfer plans on per-step maxima, simple on window totals: deepinfer wins on its objective
    # (by 0.1-11%), except at R = 0 where it can lose slightly (here zipf ep 8: 0.2%; up to 0.9% on other
    # loads): its packing's "lowest rank on score ties" fills rank 0 up to the running peak where packing
    # by totals spreads the load.
    ratio = objective(load, plan, ep) / objective(load, simple, ep)
    assert ratio <= (1.0 if redundant else 1.01), ratio


def test_full_size_plan_is_fast_and_deterministic():
    load = v4_like_load(100, 43, seed=5)        # V4-Flash: 43 layers, 256 experts, 288 slots, ep 8
    start = time.perf_counter()
    plan = rebalance(load, 288, 36)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, elapsed
    assert plan.equals(rebalance(load.clone(), 288, 36))
    assert plan.equals(rebalance(load.to(torch.float32), 288, 36))     # counts: exact in float32
    assert rebalance_simple(load, 288, 36).equals(rebalance_simple(load, 288, 36))
    _assert_consistent(ExpertPlacement(plan.phys_to_log[:2], plan.log_to_phys[:2], plan.log_count[:2]))
    assert imbalance(rank_load(load, plan, 8)) < 1.10


def test_replication_follows_step_bottlenecks_not_totals():
    # Totals [9, 9, 10] make simple replicate expert 2; expert 2 is never a step's maximum, so deepinfer
    # replicates expert 1 (with the 1e-4 * id tie-break, relieving step 1 beats relieving step 0).
    load = torch.tensor([[[9.0, 0.0, 5.0]], [[0.0, 9.0, 5.0]]], dtype=torch.float64)
    assert rebalance(load, 4, 2).log_count.tolist() == [[1, 2, 1]]
    assert rebalance_simple(load, 4, 2).log_count.tolist() == [[1, 1, 2]]


def test_hand_computed_plan():
    # Replicate: expert 0 (12 tokens) gets both spare slots -> three replicas of 4. Pack, in the order
    # 3, 2, 1 (4 + 1e-4 * id), then 0, 0, 0: 3 -> rank 0 (tie), 2 -> rank 1, 1 -> rank 1, 0 -> rank 0,
    # 0 -> rank 0 (tie), 0 -> rank 1 (rank 0 full). Both ranks carry 12.
    load = torch.tensor([[[12.0, 4.0, 4.0, 4.0]]], dtype=torch.float64)
    plan = rebalance(load, 6, 3)
    assert plan.phys_to_log.tolist() == [[3, 0, 0, 2, 1, 0]]
    assert plan.log_to_phys.tolist() == [[[1, 2, 5], [4, -1, -1], [3, -1, -1], [0, -1, -1]]]
    assert rank_load(load, plan, 2).tolist() == [[[12.0, 12.0]]]


def test_one_slot_per_rank_and_no_spare_slots():
    load = zipf_load(4, 2, 1.0, seed=9, pairs=512)[:, :, :16]
    plan = rebalance(load, 24, 1)
    assert plan.log_count.sum(1).tolist() == [24, 24]
    assert rebalance(load, 16, 4).log_count.eq(1).all()


# ---- statistics window and schedule ---------------------------------------------------------------------
def test_stats_ring_keeps_the_last_steps_oldest_first():
    stats = ExpertLoadStats(ExpertPlacement.initial(2, 4, 2, 0), window=3)
    assert stats.counts().shape == (0, 2, 4)
    assert stats.balance(None, 2) == stats.balance(stats.placement, 2) == 1.0
    for step in range(5):
        stats.record(0, torch.tensor([[step % 4, -1], [step % 4, 3]]))
        stats.record_counts(torch.full((2, 4), step))
        stats.end_step()
        window = stats.counts()
        assert window.shape[0] == min(step + 1, 3)
        assert window[:, 1, 0].tolist() == list(range(max(0, step - 2), step + 1))
    assert stats.counts()[:, 0].tolist() == [[2, 2, 4, 3], [3, 3, 3, 6], [6, 4, 4, 5]]


def test_stats_logical_load_and_balance_by_hand():
    placement = ExpertPlacement.from_phys_to_log(torch.tensor([[0, 1, 0, 2]], dtype=torch.int32), 3)
    stats = ExpertLoadStats(placement, window=4)
    stats.record_counts(torch.tensor([[3, 1, 2, 2]]))      # ranks (slots 0-1, 2-3): 4, 4
    stats.end_step()
    stats.record(0, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))  # ranks 8, 0
    stats.end_step()
    assert stats.logical_load().tolist() == [[[5.0, 1.0, 2.0]], [[4.0, 4.0, 0.0]]]
    assert stats.balance(None, 2) == pytest.approx((4 + 8) / (4 + 4))
    assert stats.balance(None, 4) == pytest.approx((3 + 4) / (2 + 2))
    # Under [[1, 2], [0, 0]] expert 0 is split evenly: steps give ranks (3, 5) and (4, 4).
    other = ExpertPlacement.from_phys_to_log(torch.tensor([[1, 2, 0, 0]], dtype=torch.int32), 3)
    assert stats.balance(other, 2) == pytest.approx((5 + 4) / (4 + 4))
    stats.set_placement(other)
    assert stats.steps == 0 and stats.counts().shape[0] == 0


def test_rearrangement_schedule():
    assert not any(should_rearrange(s, 0) for s in range(1000))
    assert [s for s in range(400) if should_rearrange(s, 100)] == [25, 125, 225, 325]
    assert [s for s in range(10) if should_rearrange(s, 3)] == [1, 4, 7]
    assert [s for s in range(4) if should_rearrange(s, 1)] == [1, 2, 3]


def test_end_to_end_routing_plan_and_measured_balance():
    # Route real top-6 selections (Gumbel top-k over skewed logits) through the replica choice, plan from
    # the recorded window, route the same tokens again: the measured balance matches the plan's estimate.
    g = torch.Generator().manual_seed(11)
    steps, layers, tokens, ep = 6, 2, 2048, 4
    logits = -1.0 * torch.log(torch.arange(1, E + 1, dtype=torch.float64))[torch.randperm(E, generator=g)]
    gumbel = -torch.log(-torch.log(torch.rand(steps, layers, tokens, E, generator=g, dtype=torch.float64)))
    ids = (logits + gumbel).topk(6, dim=-1).indices
    stats = ExpertLoadStats(ExpertPlacement.initial(layers, E, ep, 16), window=steps)

    def route() -> None:
        for t in range(steps):
            for layer in range(layers):
                phys = choose_physical(ids[t, layer], torch.arange(tokens), t % ep, stats.placement, layer)
                stats.record(layer, phys)
            stats.end_step()

    route()
    before = stats.balance(None, ep)
    plan = rebalance(stats.logical_load(), 272, 68)
    predicted = stats.balance(plan, ep)
    stats.set_placement(plan)
    route()
    assert before > 1.3 and stats.balance(None, ep) < 1.10
    assert stats.balance(None, ep) == pytest.approx(predicted, abs=0.02)


# ---- bad inputs -----------------------------------------------------------------------------------------
def test_bad_inputs_name_the_field():
    p = ExpertPlacement.initial(2, 8, 2, 0)
    cases = [
        (lambda: ExpertPlacement.initial(0, 8, 2, 0), "num_layers"),
        (lambda: ExpertPlacement.initial(1, 0, 2, 0), "num_experts"),
        (lambda: ExpertPlacement.initial(1, 8, 0, 0), "ep_size"),
        (lambda: ExpertPlacement.initial(1, 8, 2, -1), "num_redundant"),
        (lambda: ExpertPlacement.from_phys_to_log(torch.tensor([[0, 1, 1]]), 3), "phys_to_log.*expert 2"),
        (lambda: ExpertPlacement.from_phys_to_log(torch.tensor([[0, 1, 3]]), 3), "phys_to_log holds 3"),
        (lambda: ExpertPlacement.from_phys_to_log(torch.tensor([0.0, 1.0]), 2), "phys_to_log"),
        (lambda: ExpertPlacement(p.phys_to_log.long(), p.log_to_phys, p.log_count), "phys_to_log.*int32"),
        (lambda: ExpertPlacement(p.phys_to_log, p.log_to_phys, p.log_count[:, :4]), "log_count"),
        (lambda: ExpertPlacement(p.phys_to_log, p.log_to_phys, p.log_count * 2), "log_count"),
        (lambda: ExpertPlacement(p.phys_to_log, p.log_to_phys.flip(1), p.log_count), "log_to_phys"),
        (lambda: p.slots_of_rank(2, 2), "rank"),
        (lambda: p.slots_of_rank(0, 3), "ep_size"),
        (lambda: choose_physical(torch.zeros(2, 1, dtype=torch.int64), torch.arange(2), 0, p, 2), "layer"),
        (lambda: choose_physical(torch.zeros(2, 1, dtype=torch.int64), torch.arange(3), 0, p, 0), "rows"),
        (lambda: choose_physical(torch.zeros(2, dtype=torch.int64), torch.arange(2), 0, p, 0), "logical_ids"),
        (lambda: rebalance(torch.ones(2, 8), 8, 4), "load"),
        (lambda: rebalance(-torch.ones(1, 1, 8), 8, 4), "load"),
        (lambda: rebalance(torch.ones(1, 1, 8), 6, 3), "num_slots"),
        (lambda: rebalance_simple(torch.ones(1, 1, 8), 10, 4), "num_slots"),
        (lambda: rebalance(torch.ones(1, 1, 8), 8, 0), "slots_per_rank"),
        (lambda: rank_load(torch.ones(1, 3, 8), p, 2), "load"),
        (lambda: ExpertLoadStats(p, window=0), "window"),
        (lambda: ExpertLoadStats(p, 2).record(0, torch.tensor([8])), "physical_ids"),
        (lambda: ExpertLoadStats(p, 2).record(2, torch.tensor([0])), "layer"),
        (lambda: ExpertLoadStats(p, 2).record_counts(torch.ones(2, 4, dtype=torch.int64)), "counts"),
        (lambda: ExpertLoadStats(p, 2).set_placement(ExpertPlacement.initial(2, 8, 2, 2)), "placement"),
        (lambda: should_rearrange(-1, 4), "step"),
        (lambda: should_rearrange(3, -4), "interval"),
    ]
    for call, field in cases:
        with pytest.raises(ValueError, match=field):
            call()
