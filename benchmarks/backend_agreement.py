"""How closely the GPU paths agree with the CPU backend on the tiny model: max relative logit error
per prompt position and argmax agreement, for {float32, bfloat16} x {QAT simulation on, off} x
{portable ops on CUDA, nvidia backend}. Prints a table, writes benchmarks/results/backend_agreement.json.

    python benchmarks/backend_agreement.py      # on a GPU machine with deepinfer-nvidia-sm100 installed
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from deepinfer_core.plugins import get_plugin_manager
from deepinfer_core.runner.model_runner import ModelRunner
from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint


def logits(ckpt, ids, dtype, device, qat, backend_on=True):
    if backend_on:
        os.environ.pop("DEEPINFER_DISABLE_PLUGINS", None)
    else:
        os.environ["DEEPINFER_DISABLE_PLUGINS"] = "nvidia"
    get_plugin_manager(refresh=True)
    runner = ModelRunner(ckpt, dtype=dtype, simulate_qat=qat, device=device)
    state = runner.new_sequence()
    out = runner.forward(state, ids, all_logits=True).float().cpu()
    methods = sorted({type(m.method).__name__ for m in runner.model.modules() if getattr(m, "fmt", None) == "fp8"})
    return out, methods


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--mma-sync-tiles", action="store_true",
                    help="force 16-row FP8 GEMM tiles (mma.sync, fp32-exact sums) instead of wgmma tiles, to "
                         "separate the FP8 tensor cores' short accumulator from everything else")
    args = ap.parse_args()
    if args.mma_sync_tiles:
        import deepinfer_kernels.fp8_gemm as g
        g.tile_config = lambda M: dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    ckpt = make_tiny_checkpoint(Path(tempfile.mkdtemp()), seed=0)
    ids = torch.randint(2, 129280, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    rows = []
    for qat in (False, True):
        for dtype in ("float32", "bfloat16"):
            ref, _ = logits(ckpt, ids, dtype, "cpu", qat)
            for backend_on in (False, True):
                out, methods = logits(ckpt, ids, dtype, "cuda", qat, backend_on)
                err = (out - ref).abs().amax(-1) / ref.abs().amax(-1)
                rows.append(dict(dtype=dtype, simulate_qat=qat, path="nvidia" if backend_on else "portable-cuda",
                                 linear=methods, first_pos_err=float(err[0]), median_err=float(err.median()),
                                 max_err=float(err.max()), argmax_agree=float((out.argmax(-1) == ref.argmax(-1)).float().mean())))
    print(f"{'dtype':9} {'QAT':5} {'path':14} {'err@0':>9} {'median':>9} {'max':>9} {'argmax=':>8}")
    for r in rows:
        print(f"{r['dtype']:9} {str(r['simulate_qat']):5} {r['path']:14} {r['first_pos_err']:9.2e} "
              f"{r['median_err']:9.2e} {r['max_err']:9.2e} {r['argmax_agree']:8.3f}")
    out = Path(__file__).parent / "results" / ("backend_agreement" + ("_mma_sync" if args.mma_sync_tiles else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), prompt_len=len(ids),
                                   mma_sync_tiles=args.mma_sync_tiles, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
