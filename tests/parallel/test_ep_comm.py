"""Expert-parallel dispatch/combine over gloo, in real processes.

Oracle: the MoE sum computed in one process, Σ_k w_k·f_{e_k}(x) with f_e(x) = (e+1)·x, in top-k order.
Each spawned world (2 and 4 ranks) splits the same global batch over its ranks (some ranks get T = 0 or
only a placeholder row), runs several dispatch/combine rounds through the groups `init_process_groups`
builds from torchrun-style variables, and hands its outputs back through files; the parent compares them
with the oracle (exact in fp64) and with the world-of-one local path (bitwise in fp32 and bf16).
The failure tests check that a peer that raises, dies or skips a collective makes the others fail with
`EPCommError` instead of hanging.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
import warnings
from pathlib import Path

import pytest
import torch

from deepinfer_core.parallel.ep_comm import EPCommError, combine, dispatch
from deepinfer_core.parallel.ep_padded import combine_padded, dispatch_padded
from deepinfer_core.parallel.groups import (
    ParallelLayout,
    all_gather_rows,
    destroy_process_groups,
    init_process_groups,
    rendezvous_address,
)

NUM_SLOTS = 16          # physical slots per layer, split over 1, 2 or 4 ranks
TOPK = 4
HIDDEN = 8
NUM_TOKENS = 29
TIMEOUT_S = 60.0        # collective timeout: a hang fails fast
SPAWN_DEADLINE_S = 45.0
SKIP_TIMEOUT_S = 3.0    # the group timeout of the test where a live peer skips a collective

# (name, seed, dtype of x and expert outputs, per-rank token counts by world size); global row 0 is a
# placeholder (no expert), so a rank whose chunk is exactly that row sends nothing
ROUNDS = [
    ("fp64", 1, torch.float64, {2: [11, 18], 4: [7, 0, 13, 9]}),
    ("fp32", 2, torch.float32, {2: [0, 29], 4: [0, 12, 0, 17]}),
    ("placeholder", 3, torch.float32, {2: [1, 28], 4: [1, 10, 10, 8]}),
    ("bf16", 4, torch.bfloat16, {2: [20, 9], 4: [3, 3, 20, 3]}),
    ("all_idle", 5, torch.float32, {2: [0, 0], 4: [0, 0, 0, 0]}),
]


def make_problem(seed: int, dtype: torch.dtype, num_tokens: int = NUM_TOKENS):
    """Global batch: x [N, D], physical slot ids [N, K] (−1 = none), weights [N, K] fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    ids = torch.randint(-1, NUM_SLOTS, (num_tokens, TOPK), generator=g)
    weights = torch.rand(num_tokens, TOPK, generator=g)
    if num_tokens:
        ids[0] = -1                              # placeholder row
    if num_tokens >= 4:
        ids[1] = torch.tensor([3, 0, 2, 1])      # every slot on rank 0 whatever the EP size
        ids[2] = torch.tensor([5, 5, -1, 12])    # the same slot twice, a skipped k
        ids[3] = torch.tensor([15, 14, 13, 12])  # every slot on the last rank
    return x, ids, weights


def expert(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """f_e(x) = (e+1)·x, weighted; the same elementwise ops wherever it runs, so results are bitwise."""
    return weight.to(x.dtype)[:, None] * ((slot + 1).to(x.dtype)[:, None] * x)


def oracle(x, ids, weights) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape[0], HIDDEN, dtype=acc)
    for k in range(TOPK):
        e = ids[:, k]
        out += torch.where((e >= 0)[:, None], expert(x, e, weights[:, k]), 0).to(acc)
    return out


def run_layer(x, ids, weights, slots_per_rank: int, rank: int, group):
    """dispatch → per-slot expert loop (the grouped-GEMM layout) → combine; returns (out, checks)."""
    res = dispatch(x, ids, weights, slots_per_rank, group)
    counts = res.slot_counts.tolist()
    expert_major = torch.equal(res.local_slot, torch.repeat_interleave(torch.arange(slots_per_rank),
                                                                       res.slot_counts))
    out_rows = torch.empty(res.row_index.numel(), HIDDEN, dtype=x.dtype)
    start = 0
    for local, n in enumerate(counts):
        rows = slice(start, start + n)
        out_rows[rows] = expert(res.x[res.row_index[rows]], torch.full((n,), rank * slots_per_rank + local),
                                res.weights[rows])
        start += n
    out = combine(out_rows, res.handle)
    return out, {"slot_counts": counts, "expert_major": expert_major,
                 "bytes": dataclasses.asdict(res.handle.comm_bytes)}


def run_layer_padded(x, ids, weights, slots_per_rank: int, rank: int, group, rows: int):
    """The same layer over `ep_padded`: this rank's tokens padded to `rows` (the bucket every rank
    agreed on) with rows of no expert; returns (out of the real tokens, slot counts)."""
    pad = rows - x.shape[0]
    res = dispatch_padded(torch.cat([x, x.new_zeros(pad, HIDDEN)]), torch.cat([ids, ids.new_full((pad, TOPK), -1)]),
                          torch.cat([weights, weights.new_zeros(pad, TOPK)]), slots_per_rank, group)
    out = torch.full((*res.local_ids.shape, HIDDEN), float("nan"), dtype=x.dtype)   # unread entries
    row, k = (res.local_ids >= 0).nonzero(as_tuple=True)
    out[row, k] = expert(res.x[row], rank * slots_per_rank + res.local_ids[row, k], res.weights[row, k])
    return combine_padded(out, res.handle)[:x.shape[0]], res.slot_counts.tolist()


# ---- spawned ranks --------------------------------------------------------------------------------------
def _case_rounds(groups, rank: int, world: int, out_dir: Path) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = all_gather_rows(torch.empty(world, 2, dtype=torch.int64), torch.tensor([[rank, world]]),
                                   groups.world)
    result = {"ep_size": torch.distributed.get_world_size(groups.ep), "gathered": gathered,
              "gather_warnings": [str(w.message) for w in caught]}
    for name, seed, dtype, sizes in ROUNDS:
        x, ids, weights = make_problem(seed, dtype, sum(sizes[world]))
        lo = sum(sizes[world][:rank])
        hi = lo + sizes[world][rank]
        out, checks = run_layer(x[lo:hi], ids[lo:hi], weights[lo:hi], NUM_SLOTS // world, rank, groups.ep)
        padded, padded_counts = run_layer_padded(x[lo:hi], ids[lo:hi], weights[lo:hi], NUM_SLOTS // world, rank,
                                                 groups.ep, max(1, *sizes[world]))
        result[name] = {"out": out, **checks, "padded": padded, "padded_counts": padded_counts}
    return result


def _case_failure(groups, rank: int, world: int, out_dir: Path, mode: str) -> dict:
    x, ids, weights = make_problem(7, torch.float32)
    num_slots = NUM_SLOTS // world * world              # 15 slots on 3 ranks
    ids = torch.where(ids >= 0, ids % num_slots, -1)
    ep = groups.ep
    if mode == "skip":
        # a live peer that skips a call is only caught by the timeout: a short one on this group alone
        # (the world's rendezvous keeps the long one, so a slow process start cannot trip it)
        ep = torch.distributed.new_group(list(range(world)), timeout=datetime.timedelta(seconds=SKIP_TIMEOUT_S))
    run_layer(x, ids, weights, NUM_SLOTS // world, rank, ep)    # one good round first
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("injected failure on rank 1")
        if mode == "exit":
            os._exit(3)
        # "skip": stay alive but never join the collective; leave once the others have reported
        deadline = time.monotonic() + SPAWN_DEADLINE_S
        while time.monotonic() < deadline and len(list(out_dir.glob("rank*.pt"))) < world - 1:
            time.sleep(0.2)
        return {"skipped": True}
    start = time.monotonic()
    try:
        run_layer(x, ids, weights, NUM_SLOTS // world, rank, ep)
    except EPCommError as exc:
        return {"error": "EPCommError", "message": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None}


def _worker(rank: int, world: int, port: int, case: str, out_dir: str) -> None:
    # the variables torchrun sets; init_process_groups reads them
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)          # up to four ranks share two cores
    out = Path(out_dir)
    code = 0
    try:
        layout = ParallelLayout.from_env(expert_parallel=True)
        groups = init_process_groups(layout, backend="gloo", timeout_s=TIMEOUT_S)
        if case == "rounds":
            result = _case_rounds(groups, rank, world, out)
        else:
            result = _case_failure(groups, rank, world, out, case)
    except BaseException as exc:        # report everything; the parent decides what was expected
        result = {"error": type(exc).__name__, "message": str(exc)}
        code = 1
    torch.save(result, out / f"rank{rank}.pt.tmp")
    os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")
    if code or case != "rounds":
        # a failed rank leaves at once: its closed sockets are how the peers learn about it; and after a
        # failure the group is broken, where interpreter teardown of gloo may abort instead of exiting
        os._exit(code)
    destroy_process_groups(groups)


# ---- tests ---------------------------------------------------------------------------------------------
def _expected_bytes(ids: torch.Tensor, sizes: list[int], dtype: torch.dtype, world: int) -> list[dict]:
    """T11: payload bytes per rank from the routing table alone."""
    slots_per_rank = NUM_SLOTS // world
    item = torch.empty((), dtype=dtype).element_size()
    row_bytes = HIDDEN * item + TOPK * 4 + TOPK * 4         # row + int32 slots + fp32 weights
    dest = torch.where(ids >= 0, ids // slots_per_rank, -1)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    src = torch.repeat_interleave(torch.arange(world), torch.tensor(sizes))
    expected = []
    for r in range(world):
        mine = dest[bounds[r]:bounds[r + 1]]
        rows = [int((mine == d).any(1).sum()) for d in range(world)]
        pairs_local = int(((dest == r) & (src[:, None] == r)).sum())
        pairs_all = int((dest == r).sum())
        expected.append({"dispatch_remote": (sum(rows) - rows[r]) * row_bytes, "dispatch_local": rows[r] * row_bytes,
                         "combine_remote": (pairs_all - pairs_local) * HIDDEN * item,
                         "combine_local": pairs_local * HIDDEN * item})
    return expected


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _check_groups(ranks: list[dict], world: int) -> None:
    for res in ranks:
        assert res["ep_size"] == world
        assert res["gathered"].tolist() == [[r, world] for r in range(world)]
        assert res["gather_warnings"] == []          # the deprecated all_gather name is never called


def _check_outputs(ranks: list[dict], world: int, name: str, seed: int, dtype: torch.dtype, sizes) -> None:
    x, ids, weights = make_problem(seed, dtype, sum(sizes[world]))
    local, _ = run_layer(x, ids, weights, NUM_SLOTS, 0, None)        # world of one: no group, no collective
    for r in range(world):
        assert ranks[r][name]["out"].shape == (sizes[world][r], HIDDEN), (name, r)
    dist_out = torch.cat([ranks[r][name]["out"] for r in range(world)])
    # exact against the independent oracle (fp64 exact; fp32/bf16: same elementwise ops, same order)
    assert torch.equal(_bits(local), _bits(oracle(x, ids, weights))), name
    # bitwise identical for world 1 and this world with the same routing
    assert torch.equal(_bits(dist_out), _bits(local)), name
    # the fixed-size exchange (ep_padded, every rank padded to the largest share) adds the same bits
    padded = torch.cat([ranks[r][name]["padded"] for r in range(world)])
    assert torch.equal(_bits(padded), _bits(local)), name
    assert all(ranks[r][name]["padded_counts"] == ranks[r][name]["slot_counts"] for r in range(world)), name


def _check_layout_counts_bytes(ranks: list[dict], world: int, name: str, seed: int, dtype: torch.dtype,
                               sizes) -> None:
    _, ids, _ = make_problem(seed, dtype, sum(sizes[world]))
    expected_bytes = _expected_bytes(ids, sizes[world], dtype, world)
    counts = torch.bincount(ids[ids >= 0], minlength=NUM_SLOTS).view(world, -1).tolist()
    for r, res in enumerate(ranks):
        got = res[name]
        assert got["expert_major"], (name, r)
        assert got["slot_counts"] == counts[r], (name, r)        # EPLB receive counts
        assert got["bytes"] == expected_bytes[r], (name, r)
        if sizes[world][r] <= 1:                                  # idle or placeholder only: sends nothing
            assert got["bytes"]["dispatch_remote"] == got["bytes"]["dispatch_local"] == 0, (name, r)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_over_gloo(tmp_path, world, run_ranks):
    """T2/T3/T11 in one spawn per world size (process start dominates the cost): groups from torchrun
    variables; per round, outputs equal the oracle and the world-of-one path bitwise; expert-major
    receive layout, per-slot counts and byte counters equal what the routing table implies."""
    ranks, codes = run_ranks(_worker, world, tmp_path / "rounds", SPAWN_DEADLINE_S, "rounds")
    errors = [f"rank {i}: {r}" for i, r in enumerate(ranks) if r is None or "error" in r]
    assert codes == [0] * world and not errors, (codes, errors)
    _check_groups(ranks, world)
    for name, seed, dtype, sizes in ROUNDS:
        _check_outputs(ranks, world, name, seed, dtype, sizes)
        _check_layout_counts_bytes(ranks, world, name, seed, dtype, sizes)


@pytest.mark.parametrize("mode", ["raise", "exit", "skip"])
def test_failed_peer_fails_the_others_fast(tmp_path, mode, run_ranks):
    """A peer that raises or dies closes its connections (the others fail at once, far inside the 60 s
    timeout); one that stays alive but skips a collective is caught by the group timeout (3 s here)."""
    world = 3
    start = time.monotonic()
    results, codes = run_ranks(_worker, world, tmp_path / mode, SPAWN_DEADLINE_S, mode)
    assert time.monotonic() - start < 30
    survivors = [r for r in range(world) if r != 1]
    for r in survivors:
        res = results[r]
        assert res is not None and res["error"] == "EPCommError", (r, res)
        assert "EP rank" in res["message"] and "same number of times" in res["message"]
        assert res["elapsed"] < (SKIP_TIMEOUT_S + 10 if mode == "skip" else 20), res
    if mode == "raise":
        assert results[1]["message"] == "injected failure on rank 1" and codes[1] == 1
    elif mode == "exit":
        assert results[1] is None and codes[1] == 3
    else:
        assert results[1] == {"skipped": True}


# ---- in-process checks ---------------------------------------------------------------------------------
def test_local_path_handles_empty_batch_and_validates_arguments():
    x, ids, weights = make_problem(9, torch.float32)
    out, checks = run_layer(x[:0], ids[:0], weights[:0], NUM_SLOTS, 0, None)
    assert out.shape == (0, HIDDEN) and checks["slot_counts"] == [0] * NUM_SLOTS
    with pytest.raises(ValueError, match="topk_ids contains 16"):
        dispatch(x, torch.full_like(ids, NUM_SLOTS), weights, NUM_SLOTS)
    with pytest.raises(ValueError, match="topk_weights.shape"):
        dispatch(x, ids, weights[:, :2], NUM_SLOTS)
    with pytest.raises(ValueError, match="slots_per_rank=0"):
        dispatch(x, ids, weights, 0)
    res = dispatch(x, ids, weights, NUM_SLOTS)
    with pytest.raises(ValueError, match="expert_out.shape"):
        combine(res.x, res.handle)


def test_padded_exchange_world_of_one_and_no_host_reads(monkeypatch):
    """ep_padded in a world of one equals the variable path bit for bit, reads nothing on the host (what
    a CUDA graph needs), and refuses outputs of the wrong shape."""
    x, ids, weights = make_problem(11, torch.float32)
    want, checks = run_layer(x, ids, weights, NUM_SLOTS, 0, None)
    reads = []
    for name in ("tolist", "item", "__bool__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name: reads.append(_n) or _o(self, *a))
    res = dispatch_padded(x, ids, weights, NUM_SLOTS)
    got = res.x.new_zeros(*res.local_ids.shape, HIDDEN)
    for k in range(TOPK):
        got[:, k] = torch.where((res.local_ids[:, k] >= 0)[:, None],
                                expert(res.x, res.local_ids[:, k], res.weights[:, k]), 0)
    out = combine_padded(got, res.handle)
    monkeypatch.undo()
    assert reads == []
    assert torch.equal(_bits(out), _bits(want)) and res.slot_counts.tolist() == checks["slot_counts"]
    with pytest.raises(ValueError, match=r"expert_out.shape=\(29, 4\): must be \[W\*B, K, D\]"):
        combine_padded(got[:, :, 0], res.handle)


def test_one_host_read_per_dispatch_combine_pair(monkeypatch):
    """On a GPU every read of a device value on the host stalls the layer until the device catches up:
    a dispatch + combine pair reads once (the sizes and the id check in one copy). Counted here at the
    explicit reads (.tolist / .item / bool); the index lists use sizes the host already has
    (`nonzero_static`, no boolean-mask indexing)."""
    x, ids, weights = make_problem(9, torch.float32)
    ids[0, 1] = -1                         # a masked slot too
    reads = []
    for name in ("tolist", "item", "__bool__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name: reads.append(_n) or _o(self, *a))
    res = dispatch(x, ids, weights, NUM_SLOTS)
    out = combine(res.x[res.row_index] * res.weights[:, None], res.handle)
    monkeypatch.undo()
    assert reads == ["tolist"], reads
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= 0:
                want[t] += weights[t, k] * x[t]
    assert torch.allclose(out, want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0, rank=0, data_parallel_size=1, expert_parallel=True), "world_size=0"),
    (dict(world_size=2, rank=2, data_parallel_size=2, expert_parallel=True), r"rank=2: must be in \[0, 2\)"),
    (dict(world_size=4, rank=0, data_parallel_size=2, expert_parallel=True), "data_parallel_size=2.*allowed value: 4"),
    (dict(world_size=2, rank=0, data_parallel_size=1, expert_parallel=True, tensor_parallel_size=2),
     "tensor_parallel_size=2: allowed values: 1"),
    (dict(world_size=2, rank=0, data_parallel_size=2, expert_parallel=1), "expert_parallel=1: allowed values"),
    (dict(world_size=True, rank=0, data_parallel_size=1, expert_parallel=True), "world_size=True"),
])
def test_parallel_layout_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_parallel_layout_env_and_single_rank_groups():
    layout = ParallelLayout.from_env(env={"RANK": "3", "WORLD_SIZE": "4"})
    assert (layout.ep_size, layout.ep_rank, layout.dp_rank, layout.data_parallel_size) == (4, 3, 3, 4)
    no_ep = ParallelLayout(4, 3, 4, expert_parallel=False)
    assert (no_ep.ep_size, no_ep.ep_rank) == (1, 0)
    assert ParallelLayout.from_env(env={}) == ParallelLayout(1, 0, 1, True)
    with pytest.raises(ValueError, match="WORLD_SIZE='x'"):
        ParallelLayout.from_env(env={"WORLD_SIZE": "x"})
    assert rendezvous_address({}) == "tcp://localhost:23333"
    assert rendezvous_address({"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}) == "tcp://10.0.0.2:29500"
    groups = init_process_groups(ParallelLayout(1, 0, 1, True), backend="gloo", timeout_s=TIMEOUT_S)
    assert (groups.world, groups.cpu, groups.ep) == (None, None, None)      # local path, no torch.distributed
    with pytest.raises(ValueError, match="backend='mpi'"):
        init_process_groups(ParallelLayout(1, 0, 1, True), backend="mpi")
    out = all_gather_rows(torch.empty(1, 3), torch.ones(1, 3), None)
    assert out.tolist() == [[1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="out.shape"):
        all_gather_rows(torch.empty(3), torch.ones(1, 3), None)
