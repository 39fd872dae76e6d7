"""Offline tile tuning of the heavy Triton kernels at V4-Flash sizes on the GPU at hand.

For each kernel and shape, every tile configuration of a small grid is compiled and timed
(`triton.testing.do_bench`: CUDA events, L2 flushed between runs); configurations that do not fit
(shared memory, registers) are recorded as failed. Prints a table per shape, best first, and writes
`benchmarks/results/tune_<GPU>.json`. The chosen tiles are then written into the kernels' own
`tile_config` heuristics by hand (never autotuned inside a served step).

    python benchmarks/tune_kernels.py [--only attention,moe,fp8_gemm,fp8_gemm_mid,pointwise] [--quick] [--tag NAME]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
H, D, WINDOW, TOPK, HIDDEN, INTER, EXPERTS, EXPERT_TOPK = 64, 512, 128, 512, 4096, 2048, 256, 6


def bench(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=5, rep=30))


def grid(**axes):
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())]


# ---- sparse attention --------------------------------------------------------------------------
def attention_inputs(num_seqs: int, new: int, ctx: int, mode: str, dev):
    """num_seqs sequences, each with `new` tokens ending at position ctx-1 (prefill: new = ctx)."""
    g = torch.Generator(device=dev).manual_seed(0)
    T = num_seqs * new
    start = ctx - new
    rpb = 128 // (4 if mode == "csa" else 128)
    blocks = -(-ctx // 128)
    args = dict(
        q=torch.randn(T, H, D, device=dev, generator=g).bfloat16(),
        kv=torch.randn(T, D, device=dev, generator=g).bfloat16(),
        ring=torch.randn(num_seqs, WINDOW + 8, D, device=dev, generator=g).bfloat16(),
        sink=torch.randn(H, device=dev, generator=g), scale=D ** -0.5, window=WINDOW,
        cu_seqlens=torch.arange(0, T + 1, new, device=dev, dtype=torch.int32),
        seq_start=torch.full((num_seqs,), start, device=dev, dtype=torch.int32),
        token_seq=torch.arange(num_seqs, device=dev, dtype=torch.int32).repeat_interleave(new),
        positions=torch.arange(start, ctx, device=dev).repeat(num_seqs),
        slots=torch.arange(num_seqs, device=dev, dtype=torch.int32))
    if mode != "window":
        args.update(comp_rows=torch.randn(num_seqs * blocks, rpb, D, device=dev, generator=g).bfloat16(),
                    block_table=torch.randperm(num_seqs * blocks, device=dev, generator=g).int().view(num_seqs, blocks),
                    comp_ratio=4 if mode == "csa" else 128)
    if mode == "csa":
        vis = ((args["positions"] + 1) // 4).clamp(min=1)
        idx = (torch.rand(T, TOPK, device=dev, generator=g) * vis[:, None]).long()
        args["comp_idx"] = torch.where(torch.arange(TOPK, device=dev)[None, :] < vis[:, None], idx, -1).int()
    return args


def attention_flops(args) -> float:
    pos = args["positions"].float()
    keys = torch.clamp(pos + 1, max=WINDOW)
    if "comp_idx" in args:
        keys = keys + torch.clamp((pos + 1) // 4, max=TOPK)
    elif "comp_rows" in args:
        keys = keys + (pos + 1) // 128
    return float(keys.sum()) * H * D * 4


def tune_attention(dev, quick: bool) -> list[dict]:
    from deepinfer_kernels.sparse_attention import _sparse_attention, tile_config
    shapes = [("prefill 4096 csa", 1, 4096, 4096, "csa"), ("prefill 4096 hca", 1, 4096, 4096, "hca"),
              ("decode b64 c4096 csa", 64, 1, 4096, "csa"), ("decode b256 c4096 csa", 256, 1, 4096, "csa")]
    configs = grid(BLOCK_H=[16, 32, 64], BLOCK_N=[16, 32, 64], num_warps=[4, 8], num_stages=[1, 2, 3])
    if quick:       # around the winners of a first pass (64 heads x 32 keys, 8 warps)
        configs = grid(BLOCK_H=[64], BLOCK_N=[16, 32], num_warps=[8, 16], num_stages=[1, 2, 3])
    out = []
    for name, S, new, ctx, mode in shapes:
        args = attention_inputs(S, new, ctx, mode, dev)
        flops = attention_flops(args)
        default = tile_config(D, H, torch.bfloat16)
        for cfg in [default] + [c for c in configs if c != default]:
            row = dict(kernel="sparse_attention", shape=name, config=cfg, default=cfg == default)
            try:
                ms = bench(lambda: _sparse_attention(**args, config=cfg))
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as exc:          # out of shared memory / registers: not a candidate
                row.update(ms=None, error=type(exc).__name__)
            out.append(row)
    return out


# ---- MoE ------------------------------------------------------------------------------------------
def tune_moe(dev, quick: bool) -> list[dict]:
    from deepinfer_kernels.moe import fused_moe, moe_tile_config
    E1 = EXPERTS + 1
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(E1, 2, INTER, HIDDEN, device=dev, generator=g) * 0.1).to(torch.float8_e4m3fn)
    s13 = torch.rand(E1, 2, INTER // 128, HIDDEN // 128, device=dev, generator=g) * 0.01
    w2 = (torch.randn(E1, HIDDEN, INTER, device=dev, generator=g) * 0.1).to(torch.float8_e4m3fn)
    s2 = torch.rand(E1, HIDDEN // 128, INTER // 128, device=dev, generator=g) * 0.01
    configs = grid(block_m=[16, 32, 64, 128], block_n2=[64, 128], num_warps1=[4, 8], num_warps2=[4, 8],
                   num_stages=[3, 4])
    if quick:
        configs = grid(block_m=[16, 32, 64, 128], block_n2=[64, 128], num_warps1=[4, 8], num_warps2=[8],
                       num_stages=[3])
    out = []
    for T in (1, 64, 256, 4096, 16384):
        x = torch.randn(T, HIDDEN, device=dev, generator=g).bfloat16()
        ids = torch.argsort(torch.rand(T, EXPERTS, device=dev, generator=g), dim=1)[:, :EXPERT_TOPK].int()
        ids = torch.cat([ids, torch.full((T, 1), EXPERTS, device=dev, dtype=torch.int32)], 1)
        rw = torch.rand(T, EXPERT_TOPK + 1, device=dev, generator=g)
        experts_hit = int(torch.unique(ids).numel())
        weight_bytes = experts_hit * 3 * HIDDEN * INTER
        flops = 2 * T * (EXPERT_TOPK + 1) * 3 * HIDDEN * INTER
        default = moe_tile_config(T, EXPERT_TOPK + 1, E1)
        cands = [None] + [dict(block_m1=c["block_m"], block_m2=c["block_m"], block_n2=c["block_n2"],
                               num_warps1=c["num_warps1"], num_stages1=c["num_stages"],
                               num_warps2=c["num_warps2"], num_stages2=c["num_stages"]) for c in configs]
        for cfg in cands:
            use = cfg or default
            row = dict(kernel="fused_moe", shape=f"tokens {T}", config=use, default=cfg is None)
            try:
                ms = bench(lambda: fused_moe(x, ids, rw, w13, s13, w2, s2, n_clamped=EXPERTS, swiglu_limit=10.0,
                                             quant_in=True, quant_mid=True, compute_dtype=torch.bfloat16,
                                             config=use))
                row.update(ms=ms, tflops=flops / ms / 1e9, tb_s=weight_bytes / ms / 1e9)
            except Exception as exc:
                row.update(ms=None, error=type(exc).__name__)
            out.append(row)
    return out


# ---- FP8 GEMM ----------------------------------------------------------------------------------
FP8_LAYERS = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192)}
# the decode-time FP8 linears beside the attention's: the indexer's wq_b and the shared expert
FP8_DECODE_LAYERS = dict(FP8_LAYERS, idx_wq_b=(8192, 1024), shared_w1=(2048, 4096), shared_w2=(4096, 2048))


def tune_fp8_gemm(dev, quick: bool) -> list[dict]:
    """Prefill sizes: tile shapes, no split."""
    configs = grid(BLOCK_M=[64, 128], BLOCK_N=[64, 128], num_warps=[4, 8], num_stages=[3, 4, 5])
    return _time_fp8_gemm(dev, (4096, 16384) if not quick else (4096,), [(c, 1) for c in configs])


def tune_fp8_gemm_mid(dev, quick: bool) -> list[dict]:
    """128-512 rows (large decode batches, short prefill chunks), where the default 128x128 tiles leave
    wq_a 16 and wkv 8 output tiles at 256 rows: tile shapes x split-K counts, timed in CUDA graphs (the
    kernels take 5-50 us, where an eager launch's cost would rank the configs)."""
    configs = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
               for bm, bn, w, s in ((64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 8, 3), (128, 64, 4, 4),
                                    (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 4, 3))]
    splits = (1, 2, 4, 8) if quick else (1, 2, 4, 8, 16)
    return _time_fp8_gemm(dev, (128, 256, 512), [(c, n) for c in configs for n in splits],
                          layers=FP8_DECODE_LAYERS, graph=True)


def _time_fp8_gemm(dev, rows: tuple[int, ...], candidates: list[tuple[dict, int]], layers: dict = FP8_LAYERS,
                   graph: bool = False) -> list[dict]:
    """Each (tile config, split count) candidate on each V4-Flash linear at each M, the default plan first."""
    import triton.testing
    from deepinfer_kernels.fp8_gemm import _num_sms, fp8_gemm, split_k, tile_config
    from deepinfer_kernels.fp8_quant import act_quant
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for M in rows:
        for lname, (N, K) in layers.items():
            qa, sa = act_quant(torch.randn(M, K, device=dev, generator=g).bfloat16())
            qw = (torch.randn(N, K, device=dev, generator=g) * 0.1).to(torch.float8_e4m3fn)
            sw = torch.rand(N // 128, K // 128, device=dev, generator=g) * 0.01
            default = (tile_config(M), split_k(N, K, tile_config(M), M, _num_sms(dev)))
            ref = fp8_gemm(qa, sa, qw, sw, config=default[0], splits=default[1]).float()
            for cfg, splits in [default] + [c for c in candidates if c != default]:
                row = dict(kernel="fp8_gemm", shape=f"{lname} M={M} N={N} K={K}", config=dict(cfg, splits=splits),
                           default=(cfg, splits) == default)
                try:
                    def run():
                        return fp8_gemm(qa, sa, qw, sw, config=cfg, splits=splits)
                    # each candidate's product against the default plan's (summation order only)
                    err = ((run().float() - ref).abs().max() / ref.abs().max()).item()
                    ms = triton.testing.do_bench_cudagraph(run, rep=20) if graph else bench(run)
                    row.update(ms=ms, tflops=2 * M * N * K / ms / 1e9, rel_err_vs_default=err)
                except Exception as exc:
                    row.update(ms=None, error=type(exc).__name__)
                out.append(row)
    return out


# ---- pointwise glue -----------------------------------------------------------------------------
def tune_pointwise(dev, quick: bool) -> list[dict]:
    """The fused norm/RoPE/quant passes against the portable torch chain (config None), as GB/s of the
    bytes each must move (read once + write once)."""
    from deepinfer_core.model.rope import RotaryTable
    from deepinfer_core.ops.portable_pointwise import PortablePointwise
    from deepinfer_kernels import pointwise as pk
    rope = RotaryTable(64, 10000.0, None, dev)
    inv = rope.inv_freq_on(dev)
    torch_ops = PortablePointwise()
    out = []
    for T in (1, 256, 4096):
        pos = torch.arange(T, device=dev) + 1000
        q = torch.randn(T, H, D, device=dev).bfloat16()
        kv = torch.randn(T, D, device=dev).bfloat16()
        iq = torch.randn(T, 64, 128, device=dev).bfloat16()
        x = torch.randn(T, HIDDEN, device=dev).bfloat16()
        w = torch.rand(D, device=dev).bfloat16()
        wx = torch.rand(HIDDEN, device=dev).bfloat16()
        cases = {
            "q head+rope": (q, lambda c: pk.norm_rope_quant(q, pos, inv, norm="head", **c),
                            lambda: torch_ops.norm_rope_quant(q, pos, rope, norm="head")),
            "kv norm+rope+fp8": (kv, lambda c: pk.norm_rope_quant(kv, pos, inv, norm="weighted", weight=w,
                                                                   quant="fp8_nope", **c),
                                 lambda: torch_ops.norm_rope_quant(kv, pos, rope, norm="weighted", weight=w,
                                                                   quant="fp8_nope")),
            "indexer q rope+hadamard+fp4": (iq, lambda c: pk.norm_rope_quant(iq, pos, inv, quant="hadamard_fp4", **c),
                                            lambda: torch_ops.norm_rope_quant(iq, pos, rope, quant="hadamard_fp4")),
            "inverse rope (in place)": (q, lambda c: pk.rope_inplace(q, pos, inv, inverse=True, **c),
                                        lambda: torch_ops.inverse_rope(q, pos, rope)),
            "rms_norm 4096": (x, lambda c: pk.rms_norm(x, wx, 1e-6, **{k: v for k, v in c.items() if k == "num_warps"}),
                              lambda: torch_ops.rms_norm(x, wx, 1e-6)),
        }
        heads = [1, 2, 4, 8, 16] if not quick else [1, 4, 16]
        for name, (t, fused, portable) in cases.items():
            nbytes = 2 * t.numel() * t.element_size() * (64 / D if name.startswith("inverse") else 1)
            configs = [None, {}] + [dict(block_h=h, num_warps=nw) for h in heads for nw in (2, 4, 8)
                                    if not name.startswith(("kv", "rms"))]
            if name.startswith("rms"):
                configs += [dict(num_warps=nw) for nw in (4, 8, 16)]
            for cfg in configs:
                row = dict(kernel="pointwise", shape=f"{name} T={T}", config=cfg if cfg is not None else "torch",
                           default=cfg == {})
                try:
                    ms = bench(portable if cfg is None else (lambda: fused(cfg)))
                    row.update(ms=ms, tb_s=nbytes / ms / 1e9)
                except Exception as exc:
                    row.update(ms=None, error=type(exc).__name__)
                out.append(row)
    return out


def report(rows: list[dict], top: int = 5) -> None:
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        ok = sorted((r for r in rs if r.get("ms")), key=lambda r: r["ms"])
        default = next((r for r in rs if r["default"]), None)
        base = next((r for r in rs if r["config"] == "torch"), None)
        print(f"\n{rs[0]['kernel']} | {shape} | default {default.get('ms') if default else None} ms "
              + (f"| torch {base.get('ms')} ms " if base else "")
              + f"({sum(1 for r in rs if not r.get('ms'))} configs failed)")
        for r in ok[:top]:
            extra = "".join(f" {k}={r[k]:.1f}" for k in ("tflops", "tb_s") if k in r)
            print(f"  {r['ms']:9.4f} ms{extra}  {r['config']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="attention,moe,fp8_gemm,pointwise", help="also: fp8_gemm_mid")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows: list[dict] = []
    for name, fn in (("attention", tune_attention), ("moe", tune_moe), ("fp8_gemm", tune_fp8_gemm),
                     ("fp8_gemm_mid", tune_fp8_gemm_mid), ("pointwise", tune_pointwise)):
        if name in args.only.split(","):
            t0 = time.time()
            part = fn(dev, args.quick)
            report(part)
            print(f"[{name}: {len(part)} runs in {time.time() - t0:.0f} s]", flush=True)
            rows += part
            write(rows, dev, args.tag)     # after each kernel: a time-limited run keeps what it measured


def write(rows: list[dict], dev, tag: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    gpu = torch.cuda.get_device_name(dev).replace(" ", "_")
    path = RESULTS / f"tune_{gpu}{'_' + tag if tag else ''}.json"
    path.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(dev), rows=rows), indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
