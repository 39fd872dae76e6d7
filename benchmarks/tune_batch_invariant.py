"""Tile choices of the batch-invariant mode on a GPU: every variant is a fixed configuration (so each is
batch invariant); this measures which is fastest on the sweep's 4-layer V4-Flash-width model.

    python benchmarks/tune_batch_invariant.py [--layers 4] [--out benchmarks/results/tune_batch_invariant_<gpu>.json]

Decode: CUDA-graph step at b1/b64/b256, context 4k. Prefill: eager forward over 4k tokens. The variant
names say what differs from the shipped constants (fp8_gemm.INVARIANT_CONFIG, moe.invariant_moe_config,
dense_gemm.INVARIANT_CONFIG, the sparse attention's prefill tiles). Each variant pins one tile set for
every batch (the first design); the shipped mode now switches within row-equivalent families
(benchmarks/tile_equivalence.py), which this script does not model.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_model import (bench_config, build_random_model, cache_layout, decode_states, finish_model,  # noqa: E402
                         load_base_config, prefill_cache, random_ids)
from sweep_timing import Clock, cuda_graph_timing  # noqa: E402

import deepinfer_kernels.dense_gemm as dg  # noqa: E402
import deepinfer_kernels.fp8_gemm as fg  # noqa: E402
import deepinfer_kernels.moe as km  # noqa: E402
from deepinfer_core.model import ForwardBatch  # noqa: E402

MOE = {"moe64": dict(block_m1=64, block_m2=64, block_n2=128, num_warps1=8, num_stages1=3, num_warps2=8, num_stages2=3),
       "moe32": dict(block_m1=32, block_m2=32, block_n2=64, num_warps1=8, num_stages1=3, num_warps2=4, num_stages2=4),
       "moe16": dict(block_m1=16, block_m2=16, block_n2=64, num_warps1=4, num_stages1=4, num_warps2=4, num_stages2=4)}
FP8 = {"fp8_64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
       "fp8_32": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4),
       "fp8_16": dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)}
DENSE = {"dense64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
         "dense32x128": dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
         "dense16x64": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)}
VARIANTS = [("moe64", "fp8_64", "dense64"), ("moe32", "fp8_64", "dense64"), ("moe16", "fp8_64", "dense64"),
            ("moe32", "fp8_32", "dense64"), ("moe32", "fp8_16", "dense64"), ("moe32", "fp8_32", "dense32x128"),
            ("moe32", "fp8_32", "dense16x64")]


def apply(moe: str, fp8: str, dense: str) -> None:
    km.invariant_moe_config = lambda *args, _c=MOE[moe], **kw: dict(_c)
    fg.INVARIANT_CONFIG.clear()
    fg.INVARIANT_CONFIG.update(FP8[fp8])
    dg.INVARIANT_CONFIG.clear()
    dg.INVARIANT_CONFIG.update(DENSE[dense])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    base, _ = load_base_config()
    built = build_random_model(bench_config(base, a.layers), "cuda", batch_invariant=True)
    finish_model(built)
    model, clock = built.model, Clock("cuda")
    layout = cache_layout(built.cfg, built.ctx.torch_dtype, built.ctx.simulate_qat)
    rows = []
    with torch.no_grad():
        decode = {}
        for b in (1, 64, 256):
            cache, states = decode_states(layout, b, 4096, "cuda")
            decode[b] = (cache, ForwardBatch.build([[t] for t in random_ids(b, built.cfg.vocab_size, b)], states, "cuda"))
        pcache = prefill_cache(layout, 4096, "cuda")
        ids = random_ids(4096, built.cfg.vocab_size, 1)
        for v in VARIANTS:
            apply(*v)
            row = {"variant": "+".join(v)}
            for b, (_, batch) in decode.items():
                row[f"decode_b{b}_ms"] = cuda_graph_timing(model, batch, clock, reps=10).median_ms
            st = {}
            t = clock.time(lambda: model(ForwardBatch.build([ids], [st["s"]], "cuda")),
                           lambda: st.__setitem__("s", pcache.bind(0, list(range(pcache.num_blocks)))), 1, 3, 10.0)
            row["prefill_4k_ms"] = t.median_ms
            rows.append(row)
            print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "results" / f"tune_batch_invariant_{gpu}.json"
    out.write_text(json.dumps({"gpu": gpu, "layers": a.layers, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
