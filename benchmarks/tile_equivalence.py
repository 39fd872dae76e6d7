"""Which tile configurations of our GEMM and attention kernels compute a row with the same bits?

Batch-invariant mode needs a row's result not to depend on the batch. One fixed tile per kernel
guarantees it but costs speed (decode wants narrow row tiles, prefill wide ones). Two tile shapes
that run the same MMA instruction over the same K order round every output identically; whether
they do is a property of the hardware and the compiler, so this measures it: each kernel runs the
same inputs under every candidate configuration and the groups of bitwise-equal configurations are
printed (and written as JSON). Run on the GPU whose kernels you want to pick from:

    python benchmarks/tile_equivalence.py [--out benchmarks/results/tile_equivalence_<gpu>.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer_kernels.dense_gemm import dense_gemm
import deepinfer_kernels.dense_gemm as dg
from deepinfer_kernels.fp8_gemm import fp8_gemm, w8a16_gemm
from deepinfer_kernels.fp8_quant import act_quant
from deepinfer_kernels.moe import fused_moe, moe_tile_config
from deepinfer_kernels.moe_routing import route_topk

FP8 = {"m16n64": dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4),
       "m32n64": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4),
       "m64n64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
       "m128n128w8": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
       "m64n128w4": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)}
DENSE = {"m16n64": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
         "m64n64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
         "m128n128w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
         "m32n128": dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)}


def groups(outs: dict[str, torch.Tensor]) -> list[list[str]]:
    out: list[list[str]] = []
    for name, t in outs.items():
        for g in out:
            if torch.equal(outs[g[0]], t):
                g.append(name)
                break
        else:
            out.append([name])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda"
    res: dict[str, list[list[str]]] = {}
    M, K, N = 192, 4096, 1024
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=dev) * 0.05).to(torch.float8_e4m3fn)
    sw = torch.rand(N // 128, K // 128, device=dev) + 0.5
    qa, sa = act_quant(x)
    res["fp8_gemm"] = groups({k: fp8_gemm(qa, sa, w, sw, out_dtype=torch.float32, config=c, splits=1)
                              for k, c in FP8.items()})
    res["w8a16_gemm bf16"] = groups({k: w8a16_gemm(x, w, sw, out_dtype=torch.float32, config=c)
                                     for k, c in FP8.items()})
    wb = (torch.randn(N, K, device=dev) * 0.05).bfloat16()
    saved = dict(dg.INVARIANT_CONFIG)
    outs = {}
    for k, c in DENSE.items():
        dg.INVARIANT_CONFIG.clear()
        dg.INVARIANT_CONFIG.update(c)
        outs[k] = dense_gemm(x, wb, torch.float32)
    dg.INVARIANT_CONFIG.clear()
    dg.INVARIANT_CONFIG.update(saved)
    res["dense_gemm bf16 (split-K per N, K)"] = groups(outs)

    # fused MoE at V4-Flash width: 256 routed experts + shared, top-6
    E, D, I, T = 257, 4096, 2048, 512
    w13 = (torch.randn(E, 2, I, D, device=dev) * 0.03).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2, I // 128, D // 128, device=dev) + 0.5
    w2 = (torch.randn(E, D, I, device=dev) * 0.03).to(torch.float8_e4m3fn)
    s2 = torch.rand(E, D // 128, I // 128, device=dev) + 0.5
    xm = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ids, rw = route_topk(torch.randn(T, E - 1, device=dev), 6, bias=torch.zeros(E - 1, device=dev), renormalize=True,
                         routed_scale=1.5, shared_expert=True)
    cfgs = {f"rows{r}": moe_tile_config(r, 1, 1) for r in (8, 32, 1 << 20)}
    res["fused_moe (QAT)"] = groups({k: fused_moe(xm, ids, rw, w13, s13, w2, s2, n_clamped=E - 1, swiglu_limit=10.0,
                                                  quant_in=True, quant_mid=True, compute_dtype=torch.bfloat16,
                                                  config=c) for k, c in cfgs.items()})
    # sparse attention, CSA decode at V4-Flash width: 64 heads x 512, window 128, top-512 of 500 rows
    import deepinfer_kernels.sparse_attention as sa
    S, H, Dh, pos = 32, 64, 512, 2000
    i32 = dict(device=dev, dtype=torch.int32)
    args = dict(q=torch.randn(S, H, Dh, device=dev, dtype=torch.bfloat16), kv=torch.randn(S, Dh, device=dev, dtype=torch.bfloat16),
                ring=torch.randn(S, 128, Dh, device=dev, dtype=torch.bfloat16), sink=torch.randn(H, device=dev),
                scale=Dh ** -0.5, window=128, cu_seqlens=torch.arange(S + 1, **i32), seq_start=torch.full((S,), pos, **i32),
                token_seq=torch.arange(S, **i32), positions=torch.full((S,), pos, device=dev, dtype=torch.int64),
                slots=torch.arange(S, **i32), comp_rows=torch.randn(S * 16, 32, Dh, device=dev, dtype=torch.bfloat16),
                block_table=torch.arange(S * 16, **i32).view(S, 16), comp_ratio=4,
                comp_idx=torch.cat([torch.stack([torch.randperm(500, device=dev) for _ in range(S)]).int(),
                                    torch.full((S, 12), -1, **i32)], 1))
    att = {"h16n32w4": dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2),
           "h64n32w8": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),
           "h32n32w4": dict(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=2)}
    res["sparse_attention bf16 (one split)"] = groups({k: sa._sparse_attention(**args, split=False, config=c)
                                                      for k, c in att.items()})
    for k, v in res.items():
        print(f"{k:<36} bitwise-equal groups: {v}")
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "results" / f"tile_equivalence_{gpu}.json"
    out.write_text(json.dumps({"gpu": gpu, "capability": list(torch.cuda.get_device_capability()), "groups": res},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
