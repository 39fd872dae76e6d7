"""MTP speculative decoding on the bundled trained tiny model (issue 17): is it lossless, and how many
tokens does a verify step commit (acceptance length tau = accepted drafts + 1)?

    python benchmarks/spec_acceptance.py [--prompts 32] [--tokens 64] [--device cuda]

Held-out prompts (benchmarks/data/heldout_prompts.json: The Tempest / Twelfth Night, never trained
on), float32 with batch-invariant ops (on the CPU unless --device), through the reference loop
(`deepinfer_core.speculative.reference_loop`; the engine's scheduler does not draft yet). Greedy runs
are compared token for token with `LLM.generate` without speculation; T=1 runs (seed = prompt index)
give tau under sampling. Prints a table, writes benchmarks/results/spec_acceptance_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cache.budget import CacheRequest
from deepinfer_core.runner.model_runner import ModelRunner
from deepinfer_core.speculative.reference_loop import speculative_generate
from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--drafts", default="1,3", help="k values (MTP-k)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the nvidia backend when installed)")
    a = ap.parse_args()
    texts = json.loads((HERE / "data" / "heldout_prompts.json").read_text())["prompts"][:a.prompts]
    ks = [int(k) for k in a.drafts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(make_trained_checkpoint(Path(tmp) / "ckpt", ARTIFACT))
        llm = LLM(model=ckpt, dtype="float32", device=a.device, batch_invariant=True, max_model_len=512)
        prompts = [llm.tokenizer.encode(t) for t in texts]
        greedy = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, max_tokens=a.tokens, ignore_eos=True)
        reference = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy,
                                                                   use_tqdm=False)]
        del llm
        runner = ModelRunner(ckpt, dtype="float32", device=a.device, batch_invariant=True,
                             max_backtracking_tokens=max(ks) + 1)
        runner.allocate_cache(CacheRequest(num_slots=len(prompts) + 1, num_blocks=2 * (len(prompts) + 1)))
        rows = []
        for k in ks:
            for name, params in (("greedy", greedy), ("T=1", sampled)):
                t0 = time.perf_counter()
                res = speculative_generate(runner, prompts, [params] * len(prompts), k, seeds=list(range(len(prompts))))
                row = dict(drafter=f"MTP-{k}", sampling=name, tau=res.stats.acceptance_length,
                           per_position=res.stats.per_position(), verify_steps=res.stats.num_steps,
                           seconds=round(time.perf_counter() - t0, 1))
                if name == "greedy":
                    row["identical_to_non_speculative"] = sum(x == y for x, y in zip(res.token_ids, reference))
                rows.append(row)
                print(f"{row['drafter']:6} {name:6} tau {row['tau']:.3f}  per position "
                      f"{[round(x, 3) for x in row['per_position']]}"
                      + (f"  identical to non-speculative: {row['identical_to_non_speculative']}/{len(prompts)}"
                         if name == "greedy" else ""), flush=True)
    out = HERE / "results" / f"spec_acceptance_{a.device}.json"
    out.write_text(json.dumps(dict(model="bundled trained tiny model", prompts=len(prompts), tokens=a.tokens,
                                   device=a.device, linear=type(runner.loaded.ops.linear["fp8"]).__name__,
                                   dtype="float32", batch_invariant=True, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
