"""End-to-end speed of MTP speculative decoding on the bundled trained tiny model: output tok/s of
`LLM.generate` per concurrency, without speculation and with MTP-k, with tau beside it.

    python benchmarks/spec_speed.py [--device cuda] [--drafts 1,3,5] [--concurrency 1,16,64]
                                    [--tokens 128] [--profile CONCURRENCY]

Held-out prompts (benchmarks/data/heldout_prompts.json, repeated to fill the concurrency), greedy,
`ignore_eos`, bf16 on CUDA (float32 on the CPU), CUDA graphs on. Each setting runs once to warm up
(kernels, the drafter's graphs), then is timed. `--profile C` prints the top host functions
(cProfile) of one MTP-k call at concurrency C. Writes benchmarks/results/spec_speed_<device>.json.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafts", default="1,3")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", type=int, default=0, metavar="CONCURRENCY",
                    help="print the top host functions (cProfile) of one MTP-k call at this concurrency")
    a = ap.parse_args()
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    texts = json.loads((HERE / "data" / "heldout_prompts.json").read_text())["prompts"]
    conc = [int(c) for c in a.concurrency.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(make_trained_checkpoint(Path(tmp) / "ckpt", ARTIFACT))
        for k in [0] + [int(k) for k in a.drafts.split(",")]:
            llm = LLM(model=ckpt, dtype=dtype, device=a.device, num_speculative_tokens=k, max_model_len=512)
            prompts = [llm.tokenizer.encode(t) for t in texts]
            for c in conc:
                batch = [prompts[i % len(prompts)] for i in range(c)]
                llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)     # warm-up
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                steps = sum(o.metrics.spec.num_steps for o in outs) if k else None
                acc = sum(o.metrics.spec.num_accepted_tokens for o in outs) if k else None
                row = dict(drafter=f"MTP-{k}" if k else "none", concurrency=c, seconds=round(seconds, 3),
                           output_tok_s=round(c * a.tokens / seconds, 1),
                           tau=round((acc + steps) / steps, 3) if steps else None)
                rows.append(row)
                print(f"{row['drafter']:6} concurrency {c:4}: {row['output_tok_s']:9.1f} tok/s  tau {row['tau']}",
                      flush=True)
            if a.profile and k:
                prof = cProfile.Profile()
                prof.enable()
                llm.generate(prompt_token_ids=[prompts[i % len(prompts)] for i in range(a.profile)],
                             sampling_params=params, use_tqdm=False)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            del llm
    base = {r["concurrency"]: r["output_tok_s"] for r in rows if r["drafter"] == "none"}
    for r in rows:
        r["speedup"] = round(r["output_tok_s"] / base[r["concurrency"]], 3)
    out = HERE / "results" / f"spec_speed_{a.device}.json"
    out.write_text(json.dumps(dict(model="bundled trained tiny model", device=a.device, dtype=dtype,
                                   tokens=a.tokens, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
