"""Time `fp4_experts.decode_experts` (FP4 experts -> their FP8 re-encoding, the prefill path's decode
pass) on one chunk of V4-Flash experts and report the bytes it moves per second.

    python benchmarks/decode_experts_bench.py [--experts 42] [--reps 10]
"""
from __future__ import annotations

import argparse

import torch
from deepinfer_kernels.fp4_experts import Fp4Experts, decode_experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=42)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    E, D, I = a.experts, a.hidden, a.inter
    codes = torch.randint(0, 256, (E, 2, I, D // 2), dtype=torch.uint8, device="cuda")
    groups = torch.randint(123, 128, (E, 2, I, D // 32), dtype=torch.uint8, device="cuda")
    w = Fp4Experts(codes, groups, torch.empty(0, 2, I, D, dtype=torch.float8_e4m3fn, device="cuda"))
    scales = torch.full((E, 2, I // 128, D // 128), 2.0 ** -5, device="cuda")
    decode_experts(w, scales, 0, E)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.reps):
        decode_experts(w, scales, 0, E)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / a.reps
    moved = codes.numel() + groups.numel() + E * 2 * I * D          # read codes + scale bytes, write e4m3
    print(f"decode_experts: {E} experts' w13 in {ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s moved")


if __name__ == "__main__":
    main()
