"""One V4-Flash MoE layer (256 routed experts, top 6, plus the shared expert; D 4096, I 2048) through
`fused_moe` with the routed experts as the load-time FP8 re-encoding and kept FP4 (`Fp4Experts`),
bf16 + QAT as the engine runs it: time per call (median of CUDA-graph replays, as a decode step runs it;
`--no-graph`: eager calls) and the weight bytes
each form reads, per batch size, with the outputs checked bit for bit between the two forms.

    python benchmarks/fp4_moe_bench.py [--batches 1,8,64,256] [--reps 20]

Prints a table and writes benchmarks/results/fp4_moe_<gpu>.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch
from deepinfer_kernels.fp4_experts import Fp4Experts, to_resident
from deepinfer_kernels.moe import fused_moe, moe_tile_config, route_topk
from roofline import Peaks

from deepinfer_core.ops.quant import e8m0_to_float, fp4_to_fp8_block, quantize_fp8_block

REPO = pathlib.Path(__file__).resolve().parents[1]


def random_experts(E: int, D: int, I: int, spread: int, gen: torch.Generator, dev: str):
    """(FP8 form, FP4 form) of stacked w13 / w2 with random e2m1 codes and group scale bytes spread
    over `spread` binades; the shared expert (last) is FP8 in both."""
    forms: dict[str, list] = {"fp8": [], "fp4": []}
    for rows, (n, k) in (((2,), (I, D)), ((), (D, I))):
        shape = (E, *rows, n)
        codes = torch.randint(0, 256, (*shape, k // 2), generator=gen, dtype=torch.uint8).to(dev)
        groups = torch.randint(127 - spread, 128, (*shape, k // 32), generator=gen, dtype=torch.uint8).to(dev)
        q, s = [], []
        for c, g in zip(codes.view(-1, n, k // 2), groups.view(-1, n, k // 32)):
            qe, se = fp4_to_fp8_block(c.view(torch.int8), g)
            q.append(qe)
            s.append(e8m0_to_float(se))
        shared = [quantize_fp8_block(torch.randn(n, k, generator=gen).to(dev) * k**-0.5) for _ in range(len(q) // E)]
        q += [w for w, _ in shared]
        s += [e8m0_to_float(sc) for _, sc in shared]
        w8 = torch.stack(q).view(E + 1, *rows, n, k)
        s8 = torch.stack(s).view(E + 1, *rows, *s[0].shape)
        forms["fp8"] += [w8, s8]
        forms["fp4"] += [Fp4Experts(*to_resident(codes, groups), w8[E:].contiguous()), s8]
    return forms


def time_call(fn, reps: int, graph: bool) -> float:
    """Median ms of `reps` calls; with `graph`, of CUDA-graph replays of one captured call (the GPU time
    a decode step's graph spends, without this script's launch gaps, which dominate at small batches)."""
    for _ in range(3):
        fn()
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def diagnose(T, x, ids, rw, forms, out, variants, E) -> None:
    """Where FP4 and FP8 outputs differ: repeatability, differing rows, each such token alone, and the
    compiled kernels' registers and spills."""
    label, _, cfg = variants[1]

    def run(form, xs, i, r):
        w13, s13, w2, s2 = forms[form]
        return fused_moe(xs, i, r, w13, s13, w2, s2, n_clamped=E, swiglu_limit=10.0, quant_in=True, quant_mid=True,
                         compute_dtype=torch.bfloat16, shared_last=True, config=cfg)
    a, b = run("fp4", x, ids, rw), run("fp4", x, ids, rw)
    ref = run("fp8", x, ids, rw)
    bad = (a != ref).any(dim=1).nonzero().flatten().tolist()
    diff = (a.float() - ref.float()).abs().max()
    rel = (diff / ref.float().abs().max()).item()
    print(f"  diag b{T}: fp4 repeatable {torch.equal(a, b)}; rows differing {len(bad)}/{T} {bad[:8]}; "
          f"max rel {rel:.2e}")
    for t in bad[:3]:
        one = (x[t:t + 1], ids[t:t + 1], rw[t:t + 1])
        one4, one8 = run("fp4", *one), run("fp8", *one)
        same_expert = [(ids == e).sum().item() for e in ids[t].tolist()]
        print(f"    token {t} alone equal {torch.equal(one4, one8)}; experts {ids[t].tolist()} rows {same_expert}")
    from deepinfer_kernels import moe_gemm

    class NoFusion:               # the same launches with FMA contraction off (is contraction the difference?)
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda **kw: self.fn[grid](**kw, enable_fp_fusion=False)
    saved = moe_gemm._moe_w13_kernel, moe_gemm._moe_w2_kernel
    moe_gemm._moe_w13_kernel, moe_gemm._moe_w2_kernel = NoFusion(saved[0]), NoFusion(saved[1])
    try:
        a, ref = run("fp4", x, ids, rw), run("fp8", x, ids, rw)
        print(f"  diag b{T} without FMA contraction: fp4 == fp8 {torch.equal(a, ref)}")
    finally:
        moe_gemm._moe_w13_kernel, moe_gemm._moe_w2_kernel = saved
    for fn in (moe_gemm._moe_w13_kernel, moe_gemm._moe_w2_kernel):
        try:
            for cache in fn.device_caches.values():
                for k in cache[0].values():
                    print(f"    {k.metadata.name}: regs {k.n_regs} spills {k.n_spills} warps {k.metadata.num_warps}"
                          f" stages {k.metadata.num_stages} shared {k.metadata.shared}")
        except Exception as exc:          # the cache layout is Triton's internals
            print(f"    kernel info unavailable: {exc!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--spread", type=int, default=4, help="binades the group scale bytes span")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--diagnose", action="store_true", help="where the two forms differ; kernel registers/spills")
    ap.add_argument("--swap-ab", action="store_true",
                    help="also time w13 and/or w2 with the operands swapped (swap_ab1/2), FP8 and FP4, each swapped "
                         "FP4 result checked bitwise against the FP8 one with the same tiles")
    ap.add_argument("--gemv-rows", default="1,2,4", help="CUDA-core kernels: rows per program to time")
    ap.add_argument("--gemv-tiles", default="32/32/4,32/32/2,64/64/4,64/64/2,128/128/4",
                    help="CUDA-core kernels: block_n1/block_n2/num_warps[/stages] settings to time (stages: the K "
                         "loop's software pipeline depth, 1 = none)")
    ap.add_argument("--mma-tiles", default="4/1,4/0,2/1",
                    help="mma.sync kernels (moe_mma): num_warps/prefetch (1: load the next block before working "
                         "on the current one, 0: after) settings to time ('' for none)")
    ap.add_argument("--no-graph", action="store_true",
                    help="time eager calls (host launch gaps included) instead of CUDA-graph replays")
    args = ap.parse_args()
    dev, E, D, I, K = "cuda", args.experts, args.hidden, args.inter, args.topk
    peak_bw = Peaks.for_device(torch.cuda.get_device_name()).bw     # FP4 floor: weights at this HBM rate
    gen = torch.Generator().manual_seed(0)
    forms = random_experts(E, D, I, args.spread, gen, dev)
    rows = []
    table = [f"{'batch':>6} {'fp8 tc':>9} {'best fp8':>9} {'best fp4':>9} {'fp4 floor':>9} {'4/8tc':>8} {'active':>7} "
             f"{'fp8 GB/s':>9} {'fp4 GB/s':>9} {'bits':>6}  best fp8 | best fp4 kernels"]
    for T in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(T, D, generator=gen).to(dev, torch.bfloat16)
        ids, rw = route_topk(torch.randn(T, E, generator=gen).to(dev), K, bias=torch.zeros(E, device=dev),
                             renormalize=True, routed_scale=2.5, shared_expert=True)
        active = int(torch.unique(ids).numel())          # experts whose weights a call reads
        out, ms = {}, {}
        base = moe_tile_config(T, K + 1, E + 1, cuda_cores=False)       # the tensor-core tiles
        variants = [("fp8 tc", "fp8", base), ("fp4 tc", "fp4", base)]
        for m in [int(r) for r in args.gemv_rows.split(",")]:
            for tile in args.gemv_tiles.split(","):
                bn1, bn2, w, stages = ([int(v) for v in tile.split("/")] + [1])[:4]
                cfg = dict(gemv_rows=m, block_n1=bn1, block_n2=bn2, num_warps1=w, num_warps2=w, gemv_stages=stages)
                variants += [(f"{form} cc m{m} {tile}", form, cfg) for form in ("fp8", "fp4")]
        for tile in filter(None, args.mma_tiles.split(",")):
            warps, ahead = (int(v) for v in tile.split("/"))
            cfg = dict(mma_warps=warps, mma_prefetch=bool(ahead))
            variants += [(f"{form} mma {tile}", form, cfg) for form in ("fp8", "fp4")]
        if args.swap_ab:          # w13 and w2 with the weights as the dots' first operand, both forms
            for tag, s1, s2 in (("swap", True, True), ("swap1", True, False), ("swap2", False, True)):
                swapped = {**base, "swap_ab1": s1, "swap_ab2": s2}
                variants += [(f"fp8 {tag}", "fp8", swapped), (f"fp4 {tag}", "fp4", swapped)]
        for label, form, cfg in variants:
            w13, s13, w2, s2 = forms[form]

            def call(w13=w13, s13=s13, w2=w2, s2=s2, cfg=cfg):
                return fused_moe(x, ids, rw, w13, s13, w2, s2, n_clamped=E, swiglu_limit=10.0, quant_in=True,
                                 quant_mid=True, compute_dtype=torch.bfloat16, shared_last=True, config=cfg)
            out[label] = call()
            ms[label] = time_call(call, args.reps, graph=not args.no_graph)
        tc = out["fp8 tc"].float()
        rel_tc = {k: ((v.float() - tc).norm() / tc.norm()).item() for k, v in out.items()}
        for label in ms:
            ref = out["fp8" + label[3:]]                    # the FP8 form with the same kernels and tiles
            print(f"  b{T} {label}: {ms[label]:.3f} ms, fp4 = fp8 bits {torch.equal(out[label], ref)}, "
                  f"relative to fp8 tc {rel_tc[label]:.1e}")
        if args.diagnose:
            diagnose(T, x, ids, rw, forms, out, variants, E)
        best8 = min((k for k in ms if k.startswith("fp8")), key=ms.get)
        best4 = min((k for k in ms if k.startswith("fp4")), key=ms.get)
        ms["fp8"], ms["fp4"] = ms["fp8 tc"], ms[best4]
        out["fp8"], out["fp4"] = out["fp8 tc"], out[best4]
        per_expert = 3 * D * I
        fp8_bytes = active * per_expert
        fp4_bytes = (active - 1) * per_expert * (0.5 + 1 / 32) + per_expert      # shared expert stays FP8
        same = torch.equal(out[best4].view(torch.int16), out["fp8" + best4[3:]].view(torch.int16))
        row = dict(batch=T, active_experts=active, fp8_tc_ms=ms["fp8 tc"], fp4_tc_ms=ms["fp4 tc"],
                   best_fp8=best8, best_fp8_ms=ms[best8], best_fp4=best4, fp4_ms=ms[best4],
                   fp4_over_fp8_tc=ms[best4] / ms["fp8 tc"], fp4_over_best_fp8=ms[best4] / ms[best8],
                   fp8_weight_gbps=fp8_bytes / ms[best8] / 1e6, fp4_weight_gbps=fp4_bytes / ms[best4] / 1e6,
                   fp4_floor_ms=fp4_bytes / peak_bw * 1e3, fp4_equals_fp8_same_kernels=same,
                   variants_ms={k: v for k, v in ms.items() if k not in ("fp4", "fp8")},
                   variants_rel_to_fp8_tc={k: rel_tc[k] for k in ms if k not in ("fp4", "fp8")})
        rows.append(row)
        table.append(f"{T:>6} {ms['fp8 tc']:>9.3f} {ms[best8]:>9.3f} {ms[best4]:>9.3f} {row['fp4_floor_ms']:>9.3f} "
                     f"{row['fp4_over_fp8_tc']:>8.2f} {active:>7} {row['fp8_weight_gbps']:>9.0f} "
                     f"{row['fp4_weight_gbps']:>9.0f} {same!s:>6}  {best8[4:]} | {best4[4:]}")
        print(table[-1])
    print("\n".join(table))
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    out_path = REPO / "benchmarks" / "results" / f"fp4_moe_{gpu}.json"
    out_path.write_text(json.dumps(dict(settings=vars(args), device=torch.cuda.get_device_name(),
                                        torch=torch.__version__, rows=rows), indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
