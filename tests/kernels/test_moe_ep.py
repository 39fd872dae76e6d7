"""The nvidia backend's MoE on an expert-parallel rank (`NvidiaEPExperts`: route, shared expert and the
received pairs through `expert_outputs`) against `NvidiaMoEMethod.apply` on one process, on tiny layers:

* `fused_moe` is `expert_outputs` + `moe_combine` (the same kernels, the same bits);
* a world of one (group None) without replicas gives `apply`'s bits: every expert tile holds the same
  rows as in the single-process call, and the combine adds shared, then k = 0..K-1 in fp32 as
  `moe_combine` does (hash- and score-routed, QAT on and off, FP8 and FP4-kept experts, bf16, T = 0);
  with replicas an expert's rows split over two slots (other tile neighbours), so close only;
* the fixed-size exchange (`pairs_padded`, decode graphs) gives the variable exchange's bits;
* `slot_modules` are views of the stacked weights: EPLB's byte moves land in the fused tensors;
* two gloo ranks (CPU interpreter only), each with half the experts, give the one-process outputs.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from deepinfer_kernels.fp4_experts import Fp4Experts
from deepinfer_kernels.moe import expert_outputs, fused_moe
from deepinfer_kernels.moe_combine import moe_combine

from deepinfer_core.model.layers import Linear
from deepinfer_core.model.moe import MoE
from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.parallel.ep_comm import dispatch
from deepinfer_core.parallel.ep_moe import EPMoEMethod
from deepinfer_core.parallel.ep_padded import dispatch_padded
from deepinfer_core.parallel.expert_map import ExpertPlacement
from deepinfer_core.parallel.expert_move import move_experts, pack_expert

# the backend is not installed on a CPU build (as in test_moe); spawned ranks import this module too
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
from deepinfer_nvidia.ep_experts import NvidiaEPExperts  # noqa: E402
from deepinfer_nvidia.linear import Fp8LinearMethod  # noqa: E402
from deepinfer_nvidia.moe import NvidiaMoEMethod  # noqa: E402
from test_moe import SMALL, E, K, config, inputs, make_moe, no_host_sync, prepare, rel, tolerance  # noqa: E402

SPAWN_DEADLINE_S = 90.0


def prepare_ep(moe: MoE, placement: ExpertPlacement, qat: bool, fp4: bool = False, dtype=torch.float32,
               ep_rank: int = 0, ep_size: int = 1, group=None, block=(128, 128)) -> MoE:
    """As `load_model` binds an EP rank: the EP method before process_weights (so the nvidia method
    stacks this rank's slots only), then weights processed in model order (the MoE before its linears)."""
    moe.method = EPMoEMethod(NvidiaMoEMethod(SMALL, fp4_experts=fp4), placement, ep_rank, ep_size, group)
    moe.method.shard(moe)
    fp8 = Fp8LinearMethod(dtype, qat, block)
    methods = {"fp8": fp8, "fp4": fp8, "bf16": PortableLinearMethod(dtype, qat)}
    mods = list(moe.modules())
    for m in mods:
        if isinstance(m, Linear):
            m.method = methods[m.fmt]
    for m in mods:
        if isinstance(m, (Linear, MoE)):
            m.method.process_weights(m)
    return moe


def ep_pair(qat: bool, fp4: bool, hash_routed: bool = False, redundant: int = 0, seed: int = 0,
            dtype=torch.float32) -> tuple[MoE, MoE]:
    """(EP world-of-one layer, single-process nvidia layer) from one set of weights."""
    base = make_moe(config(expert_dtype="fp4" if fp4 else "fp8"), hash_routed, seed)
    ep = prepare_ep(copy.deepcopy(base), ExpertPlacement.initial(1, E, 1, redundant), qat, fp4, dtype)
    one = prepare(base, True, qat, dtype, fp4_experts=fp4)
    assert NvidiaMoEMethod.fused(ep) and NvidiaMoEMethod.fused(one)
    assert ep.nv_fused.n_routed == E + redundant and ep.nv_fused.n_fp4 == (E + redundant if fp4 else 0)
    return ep, one


def apply(moe: MoE, x: torch.Tensor, tok: torch.Tensor, kdev: str) -> torch.Tensor:
    moe.to(kdev)
    if isinstance(moe.method, EPMoEMethod):       # a rank routes with maps on its device (as load_model puts them)
        moe.method.placement = moe.method.placement.to(kdev)
    with torch.no_grad():
        return moe.method.apply(moe, x.to(kdev), tok.to(kdev)).cpu()


# ---- the kernel split ------------------------------------------------------------------------------

@pytest.mark.parametrize("qat,fp4", [(True, False), (False, True)])
def test_fused_moe_is_expert_outputs_then_combine(kdev, qat, fp4):
    moe = prepare(make_moe(config(expert_dtype="fp4" if fp4 else "fp8"), False, 1), True, qat, fp4_experts=fp4)
    moe.to(kdev)
    x, tok = inputs(7, 2)
    x, tok = x.to(kdev), tok.to(kdev)
    spec = moe.nv_fused
    with torch.no_grad():
        ids, w = moe.method.route(moe, x, tok)
        w13, w2 = moe.nv_w13, moe.nv_w2
        if fp4:
            w13 = Fp4Experts(moe.nv_w13_codes, moe.nv_w13_groups, w13)
            w2 = Fp4Experts(moe.nv_w2_codes, moe.nv_w2_groups, w2)
        args = (x, ids, w, w13, moe.nv_s13, w2, moe.nv_s2)
        kw = dict(n_clamped=spec.n_routed, swiglu_limit=spec.swiglu_limit, quant_in=spec.quant_in,
                  quant_mid=spec.quant_mid, compute_dtype=spec.compute_dtype, config=SMALL)
        y = expert_outputs(*args, **kw)
        assert y.shape == (7, K + 1, 128) and y.dtype == spec.compute_dtype
        assert torch.equal(fused_moe(*args, **kw), moe_combine(y, x.dtype))
        assert torch.equal(fused_moe(*args, **kw), moe.method.apply(moe, x, tok))


def test_expert_outputs_skip_pairs_held_elsewhere(kdev):
    """Ids -1 (the fixed-size exchange's pairs of other ranks) are computed by no tile; every other
    (row, k) gets the bits of the call without them (each expert's rows, and their order, unchanged)."""
    ep, _ = ep_pair(True, False, seed=3)
    ep.to(kdev)
    x, _ = inputs(9, 4)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, E, (9, K), generator=g, dtype=torch.int32)
    held = torch.rand(9, K, generator=g) < 0.6
    w = torch.rand(9, K, generator=g)
    spec = ep.nv_fused
    kw = dict(n_clamped=spec.n_routed, swiglu_limit=spec.swiglu_limit, quant_in=spec.quant_in,
              quant_mid=spec.quant_mid, compute_dtype=spec.compute_dtype, config=SMALL)
    args = (ep.nv_w13, ep.nv_s13, ep.nv_w2, ep.nv_s2)
    x, ids, w, held = x.to(kdev), ids.to(kdev), w.to(kdev), held.to(kdev)
    full = expert_outputs(x, ids, w, *args, **kw)
    part = expert_outputs(x, torch.where(held, ids, -1), w, *args, **kw)
    assert torch.equal(part[held], full[held])


# ---- a world of one --------------------------------------------------------------------------------

@pytest.mark.parametrize("hash_routed", [False, True], ids=["score", "hash"])
@pytest.mark.parametrize("qat", [True, False], ids=["qat", "noqat"])
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4kept"])
def test_world_of_one_gives_the_single_process_bits(kdev, hash_routed, qat, fp4):
    ep, one = ep_pair(qat, fp4, hash_routed, seed=10 + 2 * qat + fp4)
    assert isinstance(ep.method.ops, NvidiaEPExperts)
    x, tok = inputs(21, 11)             # > one 16-row tile for the shared expert and some routed ones
    got = apply(ep, x, tok, kdev)
    assert got.shape == (21, 128) and got.dtype == torch.float32
    assert torch.equal(got, apply(one, x, tok, kdev))


@pytest.mark.parametrize("hash_routed", [False, True], ids=["score", "hash"])
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4kept"])
def test_world_of_one_padded_exchange(kdev, hash_routed, fp4):
    """The fixed-size exchange (`padded_exchange`, decode graphs: `pairs_padded`) gives the variable
    exchange's bits: each slot's tiles hold the same rows in the same order."""
    ep, one = ep_pair(True, fp4, hash_routed, seed=30 + fp4)
    x, tok = inputs(21, 31)
    with ep.method.padded_exchange():
        got = apply(ep, x, tok, kdev)
    assert torch.equal(got, apply(ep, x, tok, kdev)) and torch.equal(got, apply(one, x, tok, kdev))


def test_world_of_one_bf16(kdev):
    """bf16 activations and compute: y in bf16, the fp32 sums cast to bf16 by torch (EP) and by
    `moe_combine`'s round-to-nearest-even (one process): the same bits."""
    ep, one = ep_pair(True, False, seed=12, dtype=torch.bfloat16)
    x, tok = inputs(9, 13, torch.bfloat16)
    got = apply(ep, x, tok, kdev)
    assert got.dtype == torch.bfloat16 and torch.equal(got, apply(one, x, tok, kdev))


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4kept"])
def test_world_of_one_with_replicas(kdev, fp4):
    """Two spare slots replicate experts 0 and 1: their tokens alternate between two slots, so a row's
    tile neighbours change (bitwise only with row-invariant GEMMs: the compiled kernels)."""
    ep, one = ep_pair(True, fp4, redundant=2, seed=14)
    x, tok = inputs(21, 15)
    got, want = apply(ep, x, tok, kdev), apply(one, x, tok, kdev)
    if kdev == "cuda":
        assert torch.equal(got, want)
    else:       # the interpreter's numpy dot may round a row by its neighbours (conftest `rows_match`)
        assert rel(got, want) < tolerance(kdev)


def test_idle_rank_returns_no_rows(kdev):
    ep, _ = ep_pair(True, True, seed=16)
    x, tok = inputs(0, 17)
    got = apply(ep, x, tok, kdev)
    assert got.shape == (0, 128) and got.dtype == torch.float32


def test_unfused_layer_keeps_the_portable_sum_order(kdev):
    """A bf16 model: the nvidia method keeps the portable fallback; its EP route is sorted by expert id
    (the portable loop's order of additions), so the world of one is bitwise the portable method's."""
    base = make_moe(config(fp8=False), False, 18)
    ep = prepare_ep(copy.deepcopy(base), ExpertPlacement.initial(1, E, 1, 0), True)
    one = prepare(base, True, True)
    assert not NvidiaMoEMethod.fused(ep) and isinstance(ep.method.ops, NvidiaEPExperts)
    x, tok = inputs(9, 19)
    with torch.no_grad():
        weights, idx = ep.method.ops.route(ep, x, tok)
    assert (idx.diff(dim=1) > 0).all()
    assert torch.equal(apply(ep, x, tok, kdev), apply(one, x, tok, kdev))
    assert ep.method.slot_modules(ep) is ep.experts


def test_seam_has_no_host_sync(kdev):
    """route, shared, pairs and pairs_padded add no host synchronisation (the variable dispatch's own
    size exchange aside)."""
    ep, _ = ep_pair(True, False, seed=20)
    ep.to(kdev)
    x, tok = inputs(5, 21)
    x, tok = x.to(kdev), tok.to(kdev)
    ops = ep.method.ops
    with torch.no_grad():
        with no_host_sync(kdev):
            weights, idx = ops.route(ep, x, tok)
            shared = ops.shared(ep, x)
        res = dispatch(x, idx, weights, E)                  # world of one, identity placement
        res_padded = dispatch_padded(x, idx, weights, E)
        with no_host_sync(kdev):
            out = ops.pairs(ep, res)
            out_padded = ops.pairs_padded(ep, res_padded)
    assert weights.shape == idx.shape == (5, K) and idx.dtype == torch.int64
    assert shared.shape == (5, 128) and shared.dtype == torch.float32
    assert out.shape == (5 * K, 128) and out_padded.shape == (5, K, 128)


# ---- slot modules (EPLB) ---------------------------------------------------------------------------

@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4kept"])
def test_slot_modules_are_views_of_the_stacks(fp4):
    ep, _ = ep_pair(True, fp4, redundant=1, seed=22)
    modules_before = len(list(ep.modules()))
    mods = ep.method.slot_modules(ep)
    assert len(mods) == E + 1 and mods is not ep.method.slot_modules(ep)      # fresh per call
    assert len(list(ep.modules())) == modules_before                            # not registered on the MoE
    want = ["s13", "s2", "w13_codes", "w13_groups", "w2_codes", "w2_groups"] if fp4 else ["s13", "s2", "w13", "w2"]
    stacks = dict(s13=ep.nv_s13, s2=ep.nv_s2)
    if fp4:
        stacks.update(w13_codes=ep.nv_w13_codes, w13_groups=ep.nv_w13_groups, w2_codes=ep.nv_w2_codes,
                      w2_groups=ep.nv_w2_groups)
    else:
        stacks.update(w13=ep.nv_w13, w2=ep.nv_w2)
    for j, m in enumerate(mods):
        tensors = dict(m.named_buffers())
        assert sorted(tensors) == want and not list(m.parameters())
        for name, t in tensors.items():
            assert t.is_contiguous() and t.data_ptr() == stacks[name][j].data_ptr()
            assert t.shape == stacks[name].shape[1:]
    before = ep.nv_s13[2].clone()
    mods[2].s13.mul_(2)                                     # a write through the view lands in the stack
    assert torch.equal(ep.nv_s13[2], before * 2) and torch.equal(ep.nv_s13[1], mods[1].s13)


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4kept"])
def test_eplb_move_rewrites_the_fused_slot(kdev, fp4):
    """Placement [0 1 2 3 | 0] -> [0 1 2 3 | 1]: `move_experts` packs slot 1 and unpacks it onto slot 4
    through the slot views; the layer then computes exactly what a layer loaded with the new placement
    computes (and not what it computed with the old weights under the new maps)."""
    old = ExpertPlacement.initial(1, E, 1, 1)
    new = ExpertPlacement.from_phys_to_log(torch.tensor([[0, 1, 2, 3, 1]], dtype=torch.int32), E)
    base = make_moe(config(expert_dtype="fp4" if fp4 else "fp8"), False, 24)
    moved = prepare_ep(copy.deepcopy(base), old.clone(), True, fp4)     # its maps change below, not `old`
    loaded = prepare_ep(base, new, True, fp4)
    x, tok = inputs(21, 25)
    moved.method.placement.copy_(new)                       # routing by the new maps, slot 4 still expert 0
    stale = apply(moved, x, tok, kdev)
    stats = move_experts([moved], old, new, 0, 1, None, moved.method.slot_modules)
    assert stats.slots_changed == 1 and stats.local_copies == 1
    slots = moved.method.slot_modules(moved)
    assert torch.equal(pack_expert(slots[4]), pack_expert(slots[1]))
    # `apply` moved `moved` to kdev, `loaded` is still on the CPU
    assert torch.equal(pack_expert(slots[4]).cpu(), pack_expert(loaded.method.slot_modules(loaded)[4]))
    got = apply(moved, x, tok, kdev)
    assert torch.equal(got, apply(loaded, x, tok, kdev)) and not torch.equal(got, stale)


# ---- two gloo ranks --------------------------------------------------------------------------------

ROWS = (13, 8)          # tokens of rank 0, rank 1


def _worker(rank: int, world: int, port: int, qat: bool, fp4: bool, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result: dict = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        base = make_moe(config(expert_dtype="fp4" if fp4 else "fp8"), True, 26)
        placement = ExpertPlacement.initial(1, E, world, 0)             # rank r: experts 2r, 2r + 1
        moe = prepare_ep(base, placement, qat, fp4, ep_rank=rank, ep_size=world, group=dist.group.WORLD)
        x, tok = inputs(sum(ROWS), 27)
        lo, n = sum(ROWS[:rank]), ROWS[rank]
        result = dict(out=apply(moe, x[lo:lo + n], tok[lo:lo + n], "cpu"), slots=moe.nv_fused.n_routed)
        pad = max(ROWS) - n             # the fixed-size exchange: every rank passes the same rows
        with moe.method.padded_exchange():
            padded = apply(moe, torch.cat([x[lo:lo + n], x.new_zeros(pad, x.shape[1])]),
                           torch.cat([tok[lo:lo + n], tok.new_zeros(pad)]), "cpu")
        result["padded"] = padded[:n]
    except BaseException as exc:        # the parent fails with the message
        result = dict(error=f"{type(exc).__name__}: {exc}")
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_ranks():
    """tests/parallel/conftest.py's spawner (a fixture there, so loaded from its file here)."""
    path = Path(__file__).resolve().parents[1] / "parallel" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_parallel_conftest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module._run_ranks


@pytest.mark.parametrize("qat,fp4", [(True, True), (False, False)], ids=["qat-fp4kept", "noqat-fp8"])
def test_two_gloo_ranks_match_one_process(kdev, tmp_path, qat, fp4):
    if kdev == "cuda":
        pytest.skip("gloo ranks run the CPU interpreter (GPU EP ranks: tests/parallel/test_dp_gpu_ranks.py)")
    results, codes = _run_ranks()(_worker, 2, tmp_path, SPAWN_DEADLINE_S, qat, fp4)
    for r, res in enumerate(results):
        assert res is not None and "error" not in res, f"rank {r}: {res}"
        assert res["slots"] == E // 2
    assert codes == [0, 0]
    one = prepare(make_moe(config(expert_dtype="fp4" if fp4 else "fp8"), True, 26), True, qat, fp4_experts=fp4)
    x, tok = inputs(sum(ROWS), 27)
    want = apply(one, x, tok, "cpu")
    got = torch.cat([res["out"] for res in results])
    padded = torch.cat([res["padded"] for res in results])
    # the routed rows meet as in one process (rank 0's tokens first), but each rank's shared-expert tile
    # holds only its own tokens (and the padded exchange adds rank 1's padding rows to some slots'
    # tiles): close, as the interpreter's dot may round a row by its neighbours
    assert got.shape == padded.shape == want.shape
    assert rel(got, want) < tolerance(kdev) and rel(padded, want) < tolerance(kdev)
