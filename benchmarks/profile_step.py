"""Where the time of one step goes: GPU kernel time by kernel family for decode and prefill shapes of
the sweep's model (4-layer V4-Flash width, random FP8 weights), from torch.profiler.

Kernel times are summed per kernel name and grouped into families (attention, indexer, MoE GEMMs,
FP8 linear GEMMs, mHC, LM head, elementwise torch ops, ...), with the step's wall time from a CUDA
graph replay beside them so launch gaps show as the difference.

    python benchmarks/profile_step.py [--decode 1x4k,64x4k,256x4k] [--prefill 4k] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import sizes  # noqa: E402
from sweep_model import (  # noqa: E402
    bench_config,
    build_random_model,
    cache_layout,
    decode_states,
    default_expert_dtype,
    finish_model,
    load_base_config,
    prefill_cache,
    random_ids,
    use_cuda_core_moe,
)
from sweep_timing import Clock, cuda_graph_timing  # noqa: E402

from deepinfer_core.model import ForwardBatch  # noqa: E402

FAMILIES = [   # (family, regex on the kernel name), first match wins
    ("sparse attention", r"_attn|attention|_merge_split"),
    ("indexer", r"_score|_select|indexer"),
    ("compressor + state writes", r"_pool|compress|_write_rows|_tails|_ring"),
    ("MoE routing/schedule", r"route|_schedule|sort|radix"),
    # _decode_kernel: FP4 experts decoded to FP8 a chunk at a time (prefill)
    ("MoE GEMMs + combine", r"_moe|_w13|_w2|_gemv|combine|_decode_kernel"),
    ("FP8 linear GEMM", r"_fp8_gemm|_w8a16|_sum_splits|_act_quant"),
    ("mHC", r"_mhc|_mix|_coeff|_collapse|_post"),
    ("fused norm / RoPE / quant", r"_norm_rope|_rms_norm|_rope_inplace"),
    ("cuBLAS GEMM (bf16/fp32: wo_a, compressor, gate, LM head)", r"gemm|sgemm|cutlass|cublas|Kernel2|splitKreduce|nvjet"),
    ("torch elementwise / reductions", r"elementwise|reduce|vectorized|index|cat|copy|fill|softmax|where"),
]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.IGNORECASE):
            return fam
    return "other"


def profile(fn, reps: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """Per-step GPU microseconds by family and by kernel name (top entries), averaged over reps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof
    fn()
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t and ev.key and not ev.key.startswith("ProfilerStep"):
            by_name[ev.key] += t / reps
    by_family: dict[str, float] = defaultdict(float)
    for name, t in by_name.items():
        by_family[family(name)] += t
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:15])
    other = {k: v for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if family(k) == "other"}
    top.update({f"[other] {k}": v for k, v in list(other.items())[:8]})
    return dict(sorted(by_family.items(), key=lambda kv: -kv[1])), top


def swap_decode_moe(which: str) -> None:
    """Make the fused MoE's 16-row (decode) tiles swap the operands of w13 and/or w2."""
    from deepinfer_kernels import moe as km
    plain = km.moe_tile_config

    def tiles(*args, **kw):
        cfg = plain(*args, **kw)
        if cfg.get("block_m1") == 16:          # (the CUDA-core configs of smaller batches have no tiles to swap)
            cfg.update(swap_ab1=which in ("w13", "both"), swap_ab2=which in ("w2", "both"))
        return cfg
    km.moe_tile_config = tiles


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None,
                    help="config.json to take the width from (default: the real V4-Flash config in tests/data)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decode", default="1x4k,64x4k,256x4k", help="BATCHxCONTEXT list")
    ap.add_argument("--prefill", default="4k")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--swap-ab", default="", choices=("", "w13", "w2", "both"),
                    help="decode-sized MoE tiles (16 rows) with the named grouped GEMMs' operands swapped")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8"),
                    help="storage of the window and compressed KV rows, as LLM(kv_cache_dtype=...)")
    ap.add_argument("--fp4-experts", action="store_true",
                    help="routed experts built FP4 (as the checkpoint ships them) and kept FP4 (LLM(fp4_experts=True))")
    ap.add_argument("--cuda-core-moe", type=float, default=None, metavar="ROWS",
                    help="fused MoE on its CUDA-core kernels up to ROWS mean rows per expert, either weight form "
                         "(0: tensor cores only; unset: the engine's choice, moe.GEMV_TILES)")
    ap.add_argument("--label", default="", help="suffix of the JSON's name")
    a = ap.parse_args(argv)
    if a.swap_ab:
        swap_decode_moe(a.swap_ab)
    if a.cuda_core_moe is not None:
        use_cuda_core_moe(a.cuda_core_moe)
    base, source = load_base_config(a.config)
    cfg = bench_config(base, a.layers, "fp4" if a.fp4_experts else default_expert_dtype(base))
    built = build_random_model(cfg, "cuda", options=dict(fp4_experts=a.fp4_experts))
    finish_model(built)
    model, layout, clock = built.model, cache_layout(built.cfg, built.ctx.torch_dtype, built.ctx.simulate_qat,
                                                 a.kv_cache_dtype), Clock("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "layers": a.layers, "config_source": source,
              "fp4_experts": a.fp4_experts, "kv_cache_dtype": a.kv_cache_dtype, "cuda_core_moe": a.cuda_core_moe,
              "shapes": []}
    with torch.no_grad():
        for spec in [s for s in a.decode.split(",") if s]:
            b, c = (sizes(x)[0] for x in spec.split("x"))
            cache, states = decode_states(layout, b, c, "cuda")
            toks = [[t] for t in random_ids(b, built.cfg.vocab_size, b + c)]
            batch = ForwardBatch.build(toks, states, "cuda")
            fams, top = profile(lambda: model(batch))
            eager = clock.time(lambda: model(batch), warmup=1, reps=5, max_seconds=10).median_ms
            try:
                wall = cuda_graph_timing(model, batch, clock, reps=10).median_ms
            except Exception as e:          # a forward that cannot be captured (reported, not fatal)
                print(f"[profile] decode b{b} c{c}: no CUDA graph ({type(e).__name__}: {str(e)[:200]})")
                wall = None
            result["shapes"].append({"shape": f"decode b{b} c{c}", "graph_step_ms": wall, "eager_step_ms": eager,
                                     "kernel_us_by_family": fams, "top_kernels_us": top})
            cache = states = batch = None      # freed before the next shape's cache
            torch.cuda.empty_cache()
        for n in sizes(a.prefill):
            cache = prefill_cache(layout, n, "cuda")
            ids = random_ids(n, built.cfg.vocab_size, n)

            def run():
                st = cache.bind(0, list(range(cache.num_blocks)))
                model(ForwardBatch.build([ids], [st], "cuda"))
            fams, top = profile(run, reps=2)
            result["shapes"].append({"shape": f"prefill {n}", "kernel_us_by_family": fams, "top_kernels_us": top})
            cache = None
            torch.cuda.empty_cache()
    for s in result["shapes"]:
        total = sum(s["kernel_us_by_family"].values())
        wall = "".join(f", {what} {s[key]:.3f} ms" for key, what in (("eager_step_ms", "eager step"),
                       ("graph_step_ms", "graph replay")) if s.get(key) is not None)
        print(f"\n{s['shape']}: GPU kernel time {total / 1e3:.3f} ms{wall}")
        for fam, t in s["kernel_us_by_family"].items():
            print(f"  {t / 1e3:9.3f} ms  {100 * t / total:5.1f}%  {fam}")
        print("  top kernels:")
        for k, t in list(s["top_kernels_us"].items())[:8] + [kv for kv in s["top_kernels_us"].items()
                                                              if kv[0].startswith("[other]")]:
            print(f"  {t / 1e3:9.3f} ms  {k[:110]}")
    out = Path(a.out_dir) / f"profile_{result['gpu'].replace(' ', '_')}{a.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
