"""Tile constants of the mHC kernels (`deepinfer_kernels.mhc`) at V4-Flash width (hc 4, D 4096,
Sinkhorn 20), timed as a decode step runs them: CUDA-graph replays of `mhc_pre` and `mhc_post` at
several token counts, one row per constant set, each checked against the shipped constants' output.

    python benchmarks/tune_mhc.py [--tokens 1,8,64,256,4096] [--reps 20]

Prints a table (microseconds per call) and writes benchmarks/results/tune_mhc_<gpu>.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch
from deepinfer_kernels import mhc

REPO = pathlib.Path(__file__).resolve().parents[1]
HC, D, ITERS, EPS = 4, 4096, 20, 1e-6
KNOBS = ("SPLIT_K", "BLOCK_K", "BLOCK_T", "EW_BLOCK_T", "COLLAPSE_BLOCK_D", "POST_BLOCK_D", "COEFF_WARPS",
         "FUSE_COEFF")
VARIANTS = [      # the shipped constants first; each other row changes some of them
    {},
    {"SPLIT_K": 256},
    {"SPLIT_K": 128},
    {"SPLIT_K": 256, "BLOCK_K": 32},
    {"SPLIT_K": 512, "BLOCK_K": 128},
    {"BLOCK_T": 8},
    {"BLOCK_T": 32},
    {"COEFF_WARPS": 1},
    {"COEFF_WARPS": 2},
    {"BLOCK_T": 8, "COEFF_WARPS": 1},
    {"FUSE_COEFF": True},
    {"FUSE_COEFF": True, "EW_BLOCK_T": 4, "COLLAPSE_BLOCK_D": 256},
    {"SPLIT_K": 256, "BLOCK_T": 8},
    {"EW_BLOCK_T": 1, "COLLAPSE_BLOCK_D": 1024, "POST_BLOCK_D": 512},
    {"EW_BLOCK_T": 2, "COLLAPSE_BLOCK_D": 512, "POST_BLOCK_D": 256},
    {"EW_BLOCK_T": 4, "COLLAPSE_BLOCK_D": 256, "POST_BLOCK_D": 128},
]


def graph_us(fn, reps: int, calls: int = 20) -> float:
    """Median microseconds per call over `reps` replays of a graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,64,256,4096")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    N = (2 + HC) * HC
    fn = (torch.randn(N, HC * D, generator=gen) * 1e-2).cuda()
    scale, base = torch.rand(3, generator=gen).cuda(), (torch.randn(N, generator=gen) * 0.1).cuda()
    shipped = {k: getattr(mhc, k) for k in KNOBS}
    rows, ref = [], {}
    print(f"{'variant':<58}" + "".join(f"{'pre ' + str(t):>10}{'post ' + str(t):>10}" for t in tokens))
    for change in VARIANTS:
        for k, v in {**shipped, **change}.items():
            setattr(mhc, k, v)
        row = dict(change=change, pre_us={}, post_us={}, max_rel_diff={})
        for T in tokens:
            x = torch.randn(T, HC, D, generator=gen).cuda().bfloat16()
            f = torch.randn(T, D, generator=gen).cuda().bfloat16()
            y, post, comb = mhc.mhc_pre(x, fn, scale, base, HC, ITERS, EPS, EPS)
            out = mhc.mhc_post(f, x, post, comb)
            if not change:
                ref[T] = (x, f, y, out)
            else:
                x, f = ref[T][0], ref[T][1]
                y, post, comb = mhc.mhc_pre(x, fn, scale, base, HC, ITERS, EPS, EPS)
                out = mhc.mhc_post(f, x, post, comb)
            rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in ((y, ref[T][2]), (out, ref[T][3])))
            row["max_rel_diff"][T] = rel
            row["pre_us"][T] = graph_us(lambda: mhc.mhc_pre(x, fn, scale, base, HC, ITERS, EPS, EPS), args.reps)
            row["post_us"][T] = graph_us(lambda: mhc.mhc_post(f, x, post, comb), args.reps)
        rows.append(row)
        name = ", ".join(f"{k}={v}" for k, v in change.items()) or "shipped"
        print(f"{name:<58}" + "".join(f"{row['pre_us'][t]:>10.1f}{row['post_us'][t]:>10.1f}" for t in tokens)
              + f"   max rel diff {max(row['max_rel_diff'].values()):.1e}")
    for k, v in shipped.items():
        setattr(mhc, k, v)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    path = REPO / "benchmarks" / "results" / f"tune_mhc_{gpu}.json"
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), shipped=shipped, rows=rows), indent=1)
                    + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
