"""FP8 block-scaled GEMM (deepinfer_kernels) at V4-Flash linear shapes on one GPU: time in a CUDA graph
(and eager, launch overhead included), achieved
HBM bandwidth and FP8 FLOP rate against the measured peaks, next to torch's bf16 matmul of the
same shape. Prints a table and writes benchmarks/results/fp8_gemm_<gpu>.json.

    python benchmarks/bench_fp8_gemm.py [--rows 1,16,64,256,4096,16384] [--peak-bw 4.8e12] [--peak-fp8 1.58e15]
        [--promote-every 32|64|128]
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
import triton

from deepinfer_kernels.fp8_gemm import PROMOTE_EVERY, fp8_gemm
from deepinfer_kernels.fp8_quant import act_quant

# (name, N, K) of V4-Flash linears: q_a (4096 -> 1024), q_b (1024 -> 64 x 512), wkv (4096 -> 512),
# wo_b (8 x 1024 -> 4096), shared expert w1 (4096 -> 2048) and w2 (2048 -> 4096)
SHAPES = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("wo_b", 4096, 8192),
          ("w1", 2048, 4096), ("w2", 4096, 2048)]
ROWS = [1, 16, 64, 256, 4096, 16384]


def bench(fn) -> float:
    """Median device time in a CUDA graph: the kernel itself, not Python's ~20-50 us launch cost."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def bench_eager(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak-bw", type=float, default=4.8e12, help="HBM bytes/s (H200 datasheet 4.8e12)")
    ap.add_argument("--peak-fp8", type=float, default=1.58e15, help="FP8 FLOP/s (2x the measured bf16 790e12)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    ap.add_argument("--promote-every", type=int, default=PROMOTE_EVERY, choices=(32, 64, 128),
                    help="channels the FP8 MMAs sum before each fp32 promotion (the kernel's default: "
                    f"{PROMOTE_EVERY})")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = []
    for name, N, K in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        qw = (torch.randn(N, K, device="cuda", generator=g) * 0.05).to(torch.float8_e4m3fn)
        sw = torch.rand(N // 128, K // 128, device="cuda", generator=g) + 0.5
        wb = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16)
        for M in map(int, args.rows.split(",")):
            x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            qa, sa = act_quant(x)
            pa = args.promote_every
            t_gemm = bench(lambda: fp8_gemm(qa, sa, qw, sw, precise_acc=pa))
            t_full = bench(lambda: fp8_gemm(*act_quant(x), qw, sw, precise_acc=pa))
            t_bf16 = bench(lambda: x @ wb.T)
            t_eager = bench_eager(lambda: fp8_gemm(qa, sa, qw, sw, precise_acc=pa))
            moved = N * K + N * K // 16384 * 4 + M * K + M * K // 32 + M * N * 2
            flops = 2 * M * N * K
            floor = max(moved / args.peak_bw, flops / args.peak_fp8)
            rows.append(dict(layer=name, M=M, N=N, K=K, fp8_gemm_us=t_gemm * 1e6, with_quant_us=t_full * 1e6,
                             bf16_matmul_us=t_bf16 * 1e6, eager_launch_us=t_eager * 1e6, hbm_frac=moved / t_gemm / args.peak_bw,
                             fp8_frac=flops / t_gemm / args.peak_fp8, roofline_us=floor * 1e6,
                             x_roofline=t_gemm / floor, speedup_vs_bf16=t_bf16 / t_gemm))
    hdr = f"{'layer':6} {'M':>6} {'N':>6} {'K':>5} {'fp8 us':>9} {'+quant':>9} {'bf16 us':>9} {'eager':>7} {'HBM%':>6} {'FP8%':>6} {'x roof':>7} {'vs bf16':>8}"
    print(hdr)
    for r in rows:
        print(f"{r['layer']:6} {r['M']:6d} {r['N']:6d} {r['K']:5d} {r['fp8_gemm_us']:9.1f} {r['with_quant_us']:9.1f} "
              f"{r['bf16_matmul_us']:9.1f} {r['eager_launch_us']:7.1f} {100 * r['hbm_frac']:6.1f} {100 * r['fp8_frac']:6.1f} "
              f"{r['x_roofline']:7.2f} {r['speedup_vs_bf16']:8.2f}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    out = Path(args.out or Path(__file__).parent / "results" / f"fp8_gemm_{gpu.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=gpu, commit=commit, promote_every=args.promote_every,
                                   peak_bw=args.peak_bw, peak_fp8=args.peak_fp8,
                                   torch=torch.__version__, triton=triton.__version__, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
