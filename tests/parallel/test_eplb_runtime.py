"""EPLB while the engine runs: expert weight moves and
rearrangements inside `DataParallelLLM`'s lockstep loop.

* The transfer plan: every rank receives each expert it needs and lacks exactly once, from a holder,
  spread over the holders.
* Weight moves in one process (a world of one: local copies, swaps) and over gloo at world 2 and 4:
  experts stored as in the checkpoint (FP8 + UE8M0 block scales, FP4 + scales, BF16), each logical
  expert tagged with its own random bytes; after each of several chained random placements every slot
  holds exactly the bytes of its new logical expert, and the counters match the plan.
* Ranks that planned different placements fail instead of moving weights.
* End to end: 16 prompts x 32 greedy tokens through `DataParallelLLM` at DP = 2 and 4 with EP and
  EPLB rearranging every 8 lockstep iterations equal one process's `LLM.generate` token for token
  (float32, QAT off, batch-invariant GEMMs, as test_dp_engine.py), with moves that happened (bytes,
  changed maps, the same maps on every rank) and load recorded on every layer, hash layers included.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from deepinfer_core.parallel.dp_engine import DataParallelLLM
from deepinfer_core.parallel.eplb import should_rearrange
from deepinfer_core.parallel.expert_map import ExpertPlacement
from deepinfer_core.parallel.expert_move import (
    MoveStats,
    move_experts,
    pack_expert,
    plan_transfers,
    unpack_expert,
)

NUM_EXPERTS, NUM_LAYERS = 6, 3
FORMATS = ("fp8", "fp4", "bf16")  # one per layer: every stored form moves
TIMEOUT_S = 60.0


# ---- transfer plan ---------------------------------------------------------------------------------------
def random_p2l(rng: random.Random, num_experts: int, num_slots: int) -> list[int]:
    """A random valid phys_to_log row: every expert once, the spare slots random replicas, shuffled."""
    row = list(range(num_experts)) + [rng.randrange(num_experts) for _ in range(num_slots - num_experts)]
    rng.shuffle(row)
    return row


@pytest.mark.parametrize("ep_size,num_slots", [(2, 6), (2, 8), (4, 8), (4, 12), (3, 9)])
def test_plan_receives_each_missing_expert_once_from_a_holder(ep_size, num_slots):
    rng = random.Random(ep_size * 100 + num_slots)
    per_rank = num_slots // ep_size
    for _ in range(50):
        old, new = random_p2l(rng, NUM_EXPERTS, num_slots), random_p2l(rng, NUM_EXPERTS, num_slots)
        held = [set(old[r * per_rank : (r + 1) * per_rank]) for r in range(ep_size)]
        needed = [set(new[r * per_rank : (r + 1) * per_rank]) for r in range(ep_size)]
        transfers = plan_transfers(old, new, ep_size)
        for r in range(ep_size):
            got = sorted(t.expert for t in transfers if t.dst == r)
            assert got == sorted(needed[r] - held[r])  # each missing expert exactly once, nothing else
        for t in transfers:
            assert t.expert in held[t.src] and t.src != t.dst
        for e in range(NUM_EXPERTS):  # receivers spread evenly over the holders
            served = [sum(1 for t in transfers if t.expert == e and t.src == r) for r in range(ep_size) if e in held[r]]
            assert max(served) - min(served) <= 1, (e, served)
        assert transfers == sorted(transfers)
        assert plan_transfers(old, old, ep_size) == []


# ---- experts stored as in the checkpoint -----------------------------------------------------------------
class StoredExpert(nn.Module):
    """w1/w2/w3 in the checkpoint's storage (what a quantised backend keeps at run time)."""

    def __init__(self, fmt: str):
        super().__init__()
        for name in ("w1", "w2", "w3"):
            lin = nn.Module()
            if fmt == "fp8":
                lin.register_buffer("weight", torch.zeros(64, 256, dtype=torch.float8_e4m3fn))
                lin.register_buffer("scale", torch.zeros(1, 2, dtype=torch.float8_e8m0fnu))
            elif fmt == "fp4":
                lin.register_buffer("weight", torch.zeros(64, 128, dtype=torch.int8))
                lin.register_buffer("scale", torch.zeros(64, 8, dtype=torch.float8_e8m0fnu))
            else:
                lin.register_buffer("weight", torch.zeros(64, 256, dtype=torch.bfloat16))
            setattr(self, name, lin)


def expert_tag(layer: int, expert: int, nbytes: int) -> torch.Tensor:
    """Random bytes of one logical expert (any bit pattern: NaN fp8 codes too, so nothing may convert)."""
    g = torch.Generator().manual_seed(1000 * layer + expert)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def make_layers(placement: ExpertPlacement, ep_rank: int, ep_size: int) -> list[nn.Module]:
    layers = []
    for layer, fmt in enumerate(FORMATS):
        moe = nn.Module()
        moe.layer_id = layer
        slots = placement.slots_of_rank(ep_rank, ep_size)
        moe.experts = nn.ModuleList(StoredExpert(fmt) for _ in slots)
        nbytes = pack_expert(moe.experts[0]).numel()
        for j, s in enumerate(slots):
            unpack_expert(moe.experts[j], expert_tag(layer, int(placement.phys_to_log[layer, s]), nbytes))
        layers.append(moe)
    return layers


def slots_match_tags(layers, placement: ExpertPlacement, ep_rank: int, ep_size: int) -> list[tuple[int, int]]:
    """(layer, slot) whose bytes are not its logical expert's tag (empty = all right)."""
    bad = []
    for moe in layers:
        for j, s in enumerate(placement.slots_of_rank(ep_rank, ep_size)):
            data = pack_expert(moe.experts[j])
            if not torch.equal(
                data, expert_tag(moe.layer_id, int(placement.phys_to_log[moe.layer_id, s]), data.numel())
            ):
                bad.append((moe.layer_id, s))
    return bad


def placements(seed: int, num_slots: int, count: int) -> list[ExpertPlacement]:
    """The initial placement, then `count` random ones (the same on every rank: seeded)."""
    rng = random.Random(seed)
    initial = [s % NUM_EXPERTS for s in range(num_slots)]  # the load-time layout
    out = [ExpertPlacement.from_phys_to_log(torch.tensor([initial] * NUM_LAYERS), NUM_EXPERTS)]
    for _ in range(count):
        rows = [random_p2l(rng, NUM_EXPERTS, num_slots) for _ in range(NUM_LAYERS)]
        if len(out) == 2:
            rows[1] = out[-1].phys_to_log[1].tolist()  # one layer unchanged: it must not move
        out.append(ExpertPlacement.from_phys_to_log(torch.tensor(rows), NUM_EXPERTS))
    return out


def test_world_of_one_moves_are_local_copies_with_swaps():
    chain = placements(3, 9, 4)
    layers = make_layers(chain[0], 0, 1)
    for old, new in zip(chain, chain[1:]):
        moves = move_experts(layers, old, new, 0, 1, None)
        assert slots_match_tags(layers, new, 0, 1) == []
        assert moves.experts_received == moves.bytes_sent == 0
        changed = int((old.phys_to_log != new.phys_to_log).sum())
        assert moves.slots_changed == moves.local_copies == changed > 0


def test_move_refuses_a_mismatched_group():
    chain = placements(4, 6, 1)
    with pytest.raises(ValueError, match="EP rank 1 of 2"):
        move_experts(make_layers(chain[0], 0, 1), chain[0], chain[1], 1, 2, None)


# ---- gloo ranks ------------------------------------------------------------------------------------------
def _moves_worker(rank: int, world: int, port: int, num_slots: int, out_dir: str) -> None:
    from deepinfer_core.parallel.eplb_runtime import _check_same_plan
    from deepinfer_core.parallel.groups import ParallelLayout, destroy_process_groups, init_process_groups

    layout = ParallelLayout(world_size=world, rank=rank, data_parallel_size=world, expert_parallel=True)
    groups = init_process_groups(layout, init_method=f"tcp://127.0.0.1:{port}", timeout_s=TIMEOUT_S, env={})
    chain = placements(7, num_slots, 3)
    layers = make_layers(chain[0], rank, world)
    result = {"rounds": []}
    for old, new in zip(chain, chain[1:]):
        moves = move_experts(layers, old, new, rank, world, groups.ep)
        result["rounds"].append({"bad": slots_match_tags(layers, new, rank, world), "moves": dataclasses.asdict(moves)})
    # a rank that planned something else: every rank refuses before any weight moves
    diverged = chain[1] if rank == world - 1 else chain[2]
    try:
        _check_same_plan(diverged, groups.cpu)
        result["diverged"] = None
    except RuntimeError as exc:
        result["diverged"] = str(exc)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    destroy_process_groups(groups)


@pytest.mark.parametrize("world,num_slots", [(2, 8), (4, 12)])
def test_moves_over_gloo_are_bit_exact(run_ranks, tmp_path, world, num_slots):
    results, codes = run_ranks(_moves_worker, world, tmp_path, 45.0, num_slots)
    assert codes == [0] * world, codes
    chain = placements(7, num_slots, 3)
    for i, (old, new) in enumerate(zip(chain, chain[1:])):
        rounds = [r["rounds"][i] for r in results]
        assert all(r["bad"] == [] for r in rounds), [r["bad"] for r in rounds]
        total = MoveStats()
        for r in rounds:
            total.add(MoveStats(**r["moves"]))
        transfers = [
            t
            for layer in range(NUM_LAYERS)
            for t in plan_transfers(old.phys_to_log[layer].tolist(), new.phys_to_log[layer].tolist(), world)
        ]
        assert total.experts_received == total.experts_sent == len(transfers) > 0
        assert total.bytes_received == total.bytes_sent > 0
        unchanged = int(sum(torch.equal(old.phys_to_log[k], new.phys_to_log[k]) for k in range(NUM_LAYERS)))
        assert all(r["moves"]["layers_changed"] == NUM_LAYERS - unchanged for r in rounds)
        assert unchanged >= (i == 1)  # the second move keeps layer 1's maps (`placements`)
    assert all("planned different placements (first in layer 0)" in r["diverged"] for r in results)


# ---- end to end: DataParallelLLM with EPLB ----------------------------------------------------------------
INTERVAL = 8


# two ranks under -m slow: four ranks with four redundant slots cover the same path in CI
@pytest.mark.parametrize("world,redundant", [pytest.param(2, 2, marks=pytest.mark.slow), (4, 4)])
def test_dp_eplb_rearranges_while_generating_and_matches_one_process(dp_oracle, dp_workload, tiny_ckpt_dir, world,
                                                                     redundant):
    w = dp_workload
    with DataParallelLLM(
        str(tiny_ckpt_dir),
        data_parallel_size=world,
        num_redundant_experts=redundant,
        enable_eplb=True,
        eplb_window_size=INTERVAL,
        eplb_step_interval=INTERVAL,
        eplb_stat_interval=INTERVAL,
        timeout_s=TIMEOUT_S,
        **w.common,
        **w.tight,
    ) as llm:
        out = llm.generate(prompt_token_ids=w.prompts(), sampling_params=w.greedy)
        assert [o.outputs[0].token_ids for o in out] == dp_oracle
        stats = llm.last_stats
        num_layers, num_experts = llm.model_config.num_hidden_layers, llm.model_config.n_routed_experts
    iterations = stats[0].iterations
    expected = sum(should_rearrange(i, INTERVAL) for i in range(1, iterations + 1))
    assert expected >= 3 and all(s.eplb_rearrangements == expected for s in stats), stats
    assert sum(s.eplb_bytes_sent for s in stats) == sum(s.eplb_bytes_received for s in stats) > 0
    assert sum(s.eplb_experts_sent for s in stats) == sum(s.eplb_experts_received for s in stats) > 0
    # every rank switched to the same maps each time, and they are not the load-time ones
    assert all(s.eplb_placements == stats[0].eplb_placements for s in stats)
    num_slots = num_experts + redundant
    initial = [[s % num_experts for s in range(num_slots)]] * num_layers
    assert len(stats[0].eplb_placements) == expected
    assert all(p != initial for p in stats[0].eplb_placements)
    assert sum(s.eplb_layers_changed for s in stats) > 0
    # load recorded on every layer (hash-routed 0-2 too): each token's top-k pairs once per layer
    per_layer = [sum(s.eplb_layer_pairs[k] for s in stats) for k in range(num_layers)]
    assert len(set(per_layer)) == 1 and per_layer[0] > 0, per_layer
    # balance telemetry every INTERVAL iterations: the same readings on every rank, each >= 1
    readings = stats[0].eplb_moe_lb
    assert len(readings) == iterations // INTERVAL and all(s.eplb_moe_lb == readings for s in stats), stats
    assert all(1.0 <= r <= world for r in readings), readings
