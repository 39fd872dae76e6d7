"""Expert-parallel MoE inside the tiny DeepSeek-V4 model: DP prompts + EP experts over gloo processes.

Oracle: the same checkpoint in one process with the single-process MoE method (float32,
simulate_qat=False), every prompt in one batch: the logits of every prompt row of a prefill, then of one
greedy decode step. Each spawned world (2 and 4 ranks) gives every rank a contiguous share of the
prompts (data parallel; at world 4 rank 3 has none and runs `idle_forward`, i.e. it only joins each MoE
layer's dispatch/combine with T = 0) and shards the routed experts over all ranks with redundant slots
(replicas), hash layers included; each rank's loader reads only the experts of its own slots.

Bitwise where it can be: with DEEPINFER_BATCH_INVARIANT (batch_invariant=True: every GEMM row-invariant)
the EP logits must equal the oracle's bit for bit (the EP method adds the shared expert and then the
experts in the single-process order). With the plain CPU GEMMs a rank's dense layers see other batch
shapes than the oracle's, so the plain run is compared with a tight tolerance plus equal argmax.
The world of one (group None, no collective) runs in this process and must be bitwise in both modes when
there are no replicas (each expert then sees exactly the oracle's rows).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model import build_model
from deepinfer_core.model.weights import CheckpointError, load_checkpoint
from deepinfer_core.parallel.ep_moe import EPMoEMethod, ExpertShard, idle_forward, prune_remote_experts, shard_experts
from deepinfer_core.parallel.expert_map import ExpertPlacement

PROMPT_LENS = (5, 9, 3, 7, 4, 6)
SPLITS = {2: [3, 3], 4: [2, 2, 2, 0]}   # prompts per rank (contiguous); rank 3 of 4 is idle
TIMEOUT_S = 60.0
SPAWN_DEADLINE_S = 60.0


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def make_runner(ckpt: str, batch_invariant: bool, expert_shard: ExpertShard | None = None):
    from deepinfer_core.runner.model_runner import ModelRunner
    return ModelRunner(ckpt, dtype="float32", simulate_qat=False, device="cpu", batch_invariant=batch_invariant,
                       expert_shard=expert_shard)


def run_prompts(runner, ps: list[list[int]], idle_step=None) -> dict:
    """Prefill `ps` (every row's logits), then one greedy decode step (last-row logits)."""
    if not ps:                      # an idle DP rank: one placeholder MoE pass per forward of the others
        for _ in range(2):
            idle_step()
        return {"prefill": None, "decode": None}
    seqs = [runner.new_sequence() for _ in ps]
    prefill = runner.forward_batch(ps, seqs, all_logits=True)
    last = torch.cumsum(torch.tensor([len(p) for p in ps]), 0) - 1
    nxt = prefill[last].argmax(-1).tolist()
    decode = runner.forward_batch([[t] for t in nxt], seqs)
    for st in seqs:
        runner.release(st)
    return {"prefill": prefill, "decode": decode}


def placement_for(ckpt: str, ep_size: int, redundant: int) -> ExpertPlacement:
    cfg = ModelConfig.from_file(ckpt)
    return ExpertPlacement.initial(cfg.num_hidden_layers, cfg.n_routed_experts, ep_size, redundant)


# ---- spawned ranks --------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, ckpt: str, batch_invariant: bool, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)          # up to four ranks share two cores
    from deepinfer_core.parallel.groups import ParallelLayout, destroy_process_groups, init_process_groups
    code = 0
    try:
        groups = init_process_groups(ParallelLayout.from_env(expert_parallel=True), backend="gloo",
                                     timeout_s=TIMEOUT_S)
        # the loader reads only this rank's experts (replicas: R = world redundant slots)
        shard = ExpertShard(placement_for(ckpt, world, world), rank, world, groups.ep)
        runner = make_runner(ckpt, batch_invariant, shard)
        method = runner.model.layers[0].ffn.method
        lo = sum(SPLITS[world][:rank])
        mine = prompts()[lo:lo + SPLITS[world][rank]]
        result = run_prompts(runner, mine, lambda: idle_forward(runner.model, runner.dtype))
        result["experts_per_layer"] = [len(moe.experts) for moe in (layer.ffn for layer in runner.model.layers)]
        # the fixed-size exchange (decode graphs' ep_padded) on 5 rows per rank: the same bits as the
        # variable exchange (each expert sees the same rows in the same order), hash and score layers
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(5, runner.model_config.hidden_size, generator=g)
        tok = torch.randint(0, 1000, (5,), generator=g)
        result["padded_moe"] = []
        for layer in (runner.model.layers[0], runner.model.layers[-1]):
            moe = layer.ffn
            variable = moe.method.apply(moe, x, tok)
            with moe.method.padded_exchange():
                result["padded_moe"].append((variable, moe.method.apply(moe, x, tok)))
        # a decode graph's padding: with 3 live rows of the 5, rows 3-4 route nowhere, so the live rows
        # and the EPLB counts are those of a 3-row batch
        method.start_load_recording("cpu")
        moe = runner.model.layers[-1].ffn
        three = moe.method.apply(moe, x[:3], tok[:3])
        counts3 = method.take_load_counts()
        with moe.method.padded_exchange(torch.tensor(3)):
            masked = moe.method.apply(moe, x, tok)
        result["masked_moe"] = (three, masked[:3], counts3, method.take_load_counts())
        result["slots_per_rank"] = method.slots_per_rank
    except BaseException as exc:      # report everything; the parent fails with the message
        result = {"error": type(exc).__name__, "message": str(exc)}
        code = 1
    out = Path(out_dir)
    torch.save(result, out / f"rank{rank}.pt.tmp")
    os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")
    if code:
        os._exit(code)                # closed sockets tell the peers; gloo teardown after a failure may abort
    destroy_process_groups(groups)


def spawn(run_ranks, world: int, ckpt: Path, batch_invariant: bool, out_dir: Path) -> list[dict]:
    results, codes = run_ranks(_worker, world, out_dir, SPAWN_DEADLINE_S, str(ckpt), batch_invariant)
    for r, res in enumerate(results):
        assert res is not None and "error" not in res, f"rank {r}: {res}"
    assert codes == [0] * world
    return results


# ---- tests ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[True, False], ids=["invariant", "plain"])
def oracle(request, tiny_ckpt_dir):
    runner = make_runner(str(tiny_ckpt_dir), request.param)
    return request.param, run_prompts(runner, prompts())


def _per_prompt(out: dict, ps: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prefill rows, decode row) of each prompt."""
    bounds = torch.cumsum(torch.tensor([0] + [len(p) for p in ps]), 0).tolist()
    return [(out["prefill"][a:b], out["decode"][i]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def _assert_match(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: max |diff| {(got - want).abs().max().item():.3g} (bitwise expected)"
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}: argmax differs"


@pytest.mark.parametrize("world", [2, 4])
def test_dp_ep_matches_one_process(world, oracle, tiny_ckpt_dir, tmp_path, run_ranks):
    """DP prompts + EP experts (with replicas) at world 2 and 4 (rank 3 of 4 idle) = the one-process
    run: bitwise with batch-invariant GEMMs, else tolerance + equal argmax."""
    batch_invariant, want = oracle
    results = spawn(run_ranks, world, tiny_ckpt_dir, batch_invariant, tmp_path)
    ps = prompts()
    expected = _per_prompt(want, ps)
    for rank, res in enumerate(results):
        slots = (8 + world) // world                     # 8 experts + R = world redundant slots
        assert res["slots_per_rank"] == slots and res["experts_per_layer"] == [slots] * len(res["experts_per_layer"])
        assert len(res["padded_moe"]) == 2
        for variable, padded in res["padded_moe"]:
            assert torch.equal(variable, padded), f"rank {rank}: padded exchange differs"
        three, masked, counts3, counts_masked = res["masked_moe"]
        _assert_match(masked, three, batch_invariant, f"rank {rank}: live rows with padding rows masked")
        assert counts3.sum() > 0 and torch.equal(counts3, counts_masked), f"rank {rank}: padding rows counted"
        lo, n = sum(SPLITS[world][:rank]), SPLITS[world][rank]
        if n == 0:
            assert res["prefill"] is None
            continue
        for i, (pre, dec) in enumerate(_per_prompt(res, ps[lo:lo + n])):
            where = f"world {world} rank {rank} prompt {lo + i}"
            _assert_match(pre, expected[lo + i][0], batch_invariant, f"{where} prefill")
            _assert_match(dec, expected[lo + i][1], batch_invariant, f"{where} decode")


@pytest.mark.parametrize("redundant", [0, 3])
def test_world_of_one(redundant, oracle, tiny_ckpt_dir):
    """The local path (group None): bitwise without replicas in both modes (each expert sees the oracle's
    rows in the oracle's order); with replicas bitwise only with row-invariant GEMMs."""
    batch_invariant, want = oracle
    runner = make_runner(str(tiny_ckpt_dir), batch_invariant,
                         ExpertShard(placement_for(str(tiny_ckpt_dir), 1, redundant), 0, 1))
    assert isinstance(runner.model.layers[0].ffn.method, EPMoEMethod)
    got = run_prompts(runner, prompts())
    exact = batch_invariant or redundant == 0
    _assert_match(got["prefill"], want["prefill"], exact, "prefill")
    _assert_match(got["decode"], want["decode"], exact, "decode")


def test_shard_experts_keeps_own_slots():
    """Rank r keeps phys_to_log[its slots], in slot order; a second replica on one rank is a copy."""
    experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
    phys_to_log = torch.tensor([[0, 1, 2, 3, 1, 1]], dtype=torch.int32)     # slots 4, 5: replicas of 1
    placement = ExpertPlacement.from_phys_to_log(phys_to_log, 4)
    assert list(shard_experts(experts, placement, 0, 0, 2)) == [experts[0], experts[1], experts[2]]
    last = shard_experts(experts, placement, 0, 1, 2)
    assert last[0] is experts[3] and last[1] is experts[1] and last[2] is not experts[1]
    assert torch.equal(last[2].weight, experts[1].weight)
    with pytest.raises(ValueError, match="logical experts per layer"):
        shard_experts(experts[:3], placement, 0, 0, 2)
    with pytest.raises(ValueError, match="EP process group"):
        EPMoEMethod(object(), placement, 0, 2, None)


def test_loader_reads_only_own_experts(tiny_ckpt_dir):
    """An EP rank's model lacks the experts none of its slots hold: the loader skips exactly those
    tensors (never reads them) and loads the others with the same bits as a full load."""
    ckpt = str(tiny_ckpt_dir)
    cfg = ModelConfig.from_file(ckpt)
    full = build_model(cfg, device="meta")
    full_report = load_checkpoint(full, ckpt)
    placement = placement_for(ckpt, 4, 4)                      # 12 slots, 3 per rank; rank 1: logical 3, 4, 5
    model = build_model(cfg, device="meta")
    skip = prune_remote_experts(model, ExpertShard(placement, 1, 4))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        _load_pruned_without_skip(cfg, ckpt)    # the strict loader refuses what the rank lacks
    report = load_checkpoint(model, ckpt, skip=skip)
    per_expert = len(full.layers[0].ffn.experts[0].state_dict())
    remote = cfg.num_hidden_layers * (cfg.n_routed_experts - 3) * per_expert
    assert len(report.skipped) == remote and report.tensors_loaded == full_report.tensors_loaded - remote
    assert report.bytes_loaded < full_report.bytes_loaded
    for layer, full_layer in zip(model.layers, full.layers):
        for e in range(cfg.n_routed_experts):
            got = layer.ffn.experts[e].state_dict()
            if e in (3, 4, 5):
                want = full_layer.ffn.experts[e].state_dict()
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
            else:
                assert not got


def _load_pruned_without_skip(cfg, ckpt: str) -> None:
    model = build_model(cfg, device="meta")
    prune_remote_experts(model, ExpertShard(placement_for(ckpt, 4, 4), 1, 4))
    load_checkpoint(model, ckpt)
