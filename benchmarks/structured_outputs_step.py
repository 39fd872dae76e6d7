"""End-to-end cost of structured outputs in the engine: decode steps of 64 constrained requests
against the same 64 requests unconstrained, through `LLM.generate` on the tiny V4 model (real
129,280-token vocabulary, random weights; CUDA graphs and the nvidia backend on a GPU).

The tiny model's step is short (a few ms), so the extra time per step it shows is what the engine
exposes of the mask work (the host fill overlaps the forward; accepting tokens does not). That
extra is compared with the 43-layer-equivalent b64 decode step of the sweep
(benchmarks/results/sweep_NVIDIA_H200.json), where the forward is ~10x longer and hides more.

    python benchmarks/structured_outputs_step.py [--batch 64] [--tokens 96] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint

from structured_outputs_mask import RESULTS, full_step_ms

# Grammars a random model cannot finish within the run: every row stays constrained every step.
GRAMMARS = {
    "regex": {"schema_type": "regex", "schema": "[a-z ]{2000}"},
    "json": {"schema_type": "json", "schema": {"type": "array", "items": {"type": "string"}}},
}


def step_ms(llm, prompts, params) -> tuple[float, int]:
    """Median time between consecutive tokens of a request (= one decode step), over all requests."""
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    gaps = [b - a for o in outs for a, b in zip(o.metrics.token_times[4:], o.metrics.token_times[5:])]
    return statistics.median(gaps) * 1e3, min(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ckpt = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    opts = dict(gpu_memory_utilization=0.2) if a.device == "cuda" else {}
    llm = LLM(model=str(ckpt), dtype=a.dtype, device=a.device, max_num_seqs=max(a.batch, 8), **opts)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 100000, (16,), generator=g).tolist() for _ in range(a.batch)]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=a.tokens, ignore_eos=True) for i in range(a.batch)]
    step_ms(llm, prompts, free)                                   # warm-up: graphs, kernels
    rows = []
    for name, so in GRAMMARS.items():
        cons = [SamplingParams(temperature=1.0, seed=i, max_tokens=a.tokens, so_args=so) for i in range(a.batch)]
        step_ms(llm, prompts, cons)                                 # warm-up: compile, buffers
        base, n_free = step_ms(llm, prompts, free)
        t0 = time.perf_counter()
        with_so, n_so = step_ms(llm, prompts, cons)
        rows.append({"grammar": name, "step_ms_unconstrained": base, "step_ms_constrained": with_so,
                     "extra_ms": with_so - base, "tokens_min": n_so, "wall_s": time.perf_counter() - t0})
    full, src = full_step_ms(a.batch) if a.device == "cuda" else (None, "not compared (CPU)")
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"\nengine decode step, tiny model ({a.dtype}, {dev}), batch {a.batch}, {a.tokens} tokens; "
          f"43-layer-equivalent step: {full} ms ({src})")
    print("grammar | unconstrained ms | constrained ms | extra ms | extra % of 43-layer step")
    for r in rows:
        if full:
            r["extra_pct_of_full_step"] = 100 * r["extra_ms"] / full
        print(f"{r['grammar']} | {r['step_ms_unconstrained']:.3f} | {r['step_ms_constrained']:.3f} | "
              f"{r['extra_ms']:.3f} | {r.get('extra_pct_of_full_step', float('nan')):.2f}")
    path = Path(a.out) if a.out else RESULTS / f"structured_step_{dev.replace(' ', '_')}.json"
    path.write_text(json.dumps({"schema": "deepinfer-structured-step/1", "device": dev, "dtype": a.dtype,
                                "batch": a.batch, "tokens": a.tokens, "full_step_ms": full, "full_step_source": src,
                                "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
