"""Replay `fp4_moe_bench.py`'s seeded data on the CPU under Triton's interpreter for chosen tokens of
one batch: the fused MoE of each token alone, routed experts re-encoded to FP8 and kept FP4, compared
bit for bit. The interpreter has no MMA operand layouts, so a token that differs compiled but not here
differs by the compiled kernels' rounding, not by the decode's values.

    python benchmarks/fp4_moe_replay.py --batch 256 --tokens 35,38,180     # ~15 min, ~10 GB of RAM

(The whole V4-Flash layer's 256 experts are generated as the bench generates them, on the CPU.)
"""
from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported (through the kernels)

import torch  # noqa: E402
from deepinfer_kernels.moe import fused_moe, route_topk  # noqa: E402
from fp4_moe_bench import random_experts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256", help="the bench's batches, in its order (seeds advance)")
    ap.add_argument("--batch", type=int, default=256, help="the batch whose tokens are replayed")
    ap.add_argument("--tokens", default="35,38,180")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--spread", type=int, default=4)
    a = ap.parse_args()
    E, D, I, K = a.experts, a.hidden, a.inter, a.topk
    t0 = time.time()
    gen = torch.Generator().manual_seed(0)                     # as fp4_moe_bench.main
    forms = random_experts(E, D, I, a.spread, gen, "cpu")
    print(f"experts generated in {time.time() - t0:.0f} s", flush=True)
    x = ids = rw = None
    for T in (int(b) for b in a.batches.split(",")):
        x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
        ids, rw = route_topk(torch.randn(T, E, generator=gen), K, bias=torch.zeros(E), renormalize=True,
                             routed_scale=2.5, shared_expert=True)
        if T == a.batch:
            break
    else:
        raise SystemExit(f"fp4_moe_replay: --batch {a.batch} is not one of --batches {a.batches}")
    for t in (int(s) for s in a.tokens.split(",")):
        outs = {}
        for form in ("fp8", "fp4"):
            w13, s13, w2, s2 = forms[form]
            outs[form] = fused_moe(x[t:t + 1], ids[t:t + 1], rw[t:t + 1], w13, s13, w2, s2, n_clamped=E,
                                   swiglu_limit=10.0, quant_in=True, quant_mid=True, compute_dtype=torch.bfloat16,
                                   shared_last=True)
        diff = (outs["fp8"].float() - outs["fp4"].float()).abs().max().item()
        print(f"b{a.batch} token {t} experts {ids[t].tolist()}: FP4 == FP8 {torch.equal(outs['fp8'], outs['fp4'])}"
              f" (max diff {diff:.3g}; {time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
