"""Speculative decoding through the engine on the bundled trained tiny model, with its MTP
block (MTP-k) and with its trained DSpark drafter (the DSpark variant of the checkpoint): is it
lossless, how many tokens does a verify step commit (acceptance length tau = accepted drafts + 1),
and what does it do to end-to-end speed?

    python benchmarks/spec_acceptance.py [--prompts 32] [--tokens 64] [--drafts 1,3] [--dspark 5]
                                         [--device cuda] [--dtype bfloat16] [--varlen] [--profile]

Held-out prompts (benchmarks/data/heldout_prompts.json: The Tempest / Twelfth Night, never trained
on), batch-invariant ops, all prompts in one `LLM.generate` call per setting. Greedy outputs with
MTP-k are compared token for token with the same engine without speculation; T=1 runs (seed = prompt
index) give tau under sampling. Output tok/s is end to end (generate's wall time, prefill included),
after a warm-up run of the same batch in each sampling mode (so the CUDA graphs of its batch size
are captured before timing). --profile runs each timed generate under cProfile and prints where the
host time went (the tok/s of those runs include the profiler's overhead).
--varlen adds, per k, a run with confidence-scheduled verification (the step-time table profiled on
this machine at start-up; the engine refuses VARLEN with batch invariance, so the policy is installed
directly here, keeping the invariant ops the comparison needs) and writes *_varlen.json.
Prints a table, writes benchmarks/results/spec_acceptance_<device>_<dtype>.json.
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
from deepinfer_core.api.outputs import SpecMetrics
from deepinfer_core.tools.trained_model import (
    ARTIFACT,
    DSPARK_ARTIFACT,
    make_trained_checkpoint,
)

HERE = Path(__file__).parent


def total(outs) -> SpecMetrics:
    """The metrics of every request of one generate call, summed."""
    out = SpecMetrics()
    for o in outs:
        m = o.metrics.spec
        if m is None:
            continue
        out.num_steps += m.num_steps
        out.num_drafted_tokens += m.num_drafted_tokens
        out.num_verified_tokens += m.num_verified_tokens
        out.num_accepted_tokens += m.num_accepted_tokens
        out.accepted_per_position += [0] * (len(m.accepted_per_position) - len(out.accepted_per_position))
        for i, a in enumerate(m.accepted_per_position):
            out.accepted_per_position[i] += a
    return out


def run(llm: LLM, prompts, params, profile: bool = False) -> tuple[list[list[int]], SpecMetrics, float]:
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return [o.outputs[0].token_ids for o in outs], total(outs), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--drafts", default="1,3", help="k values (MTP-k); empty: none")
    ap.add_argument("--dspark", default="", help="gamma values for the DSpark drafter, e.g. 5; empty: none")
    ap.add_argument("--drafter", type=Path, default=DSPARK_ARTIFACT, help="the DSpark drafter artifact")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the nvidia backend when installed)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--varlen", action="store_true", help="also run each k with VARLEN")
    ap.add_argument("--profile", action="store_true", help="cProfile each timed run (prints the top functions)")
    a = ap.parse_args()
    texts = json.loads((HERE / "data" / "heldout_prompts.json").read_text())["prompts"][:a.prompts]
    settings = [("MTP", int(k)) for k in a.drafts.split(",") if k] + [("DSpark", int(g)) for g in a.dspark.split(",") if g]
    options = dict(dtype=a.dtype, device=a.device, batch_invariant=True, max_model_len=512, max_num_seqs=a.prompts)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = {"MTP": str(make_trained_checkpoint(Path(tmp) / "ckpt", ARTIFACT))}
        if any(kind == "DSpark" for kind, _ in settings):
            ckpt["DSpark"] = str(make_trained_checkpoint(Path(tmp) / "dspark", ARTIFACT, drafter=a.drafter))
        runs = [("MTP", 0, False)] + [(kind, k, v) for kind, k in settings for v in ((False, True) if a.varlen else (False,))]
        for kind, k, varlen in runs:
            llm = LLM(model=ckpt[kind], num_speculative_tokens=k, **options)
            if varlen:
                llm.engine.use_varlen(llm.runner.varlen_policy(a.prompts))
            prompts = [llm.tokenizer.encode(t) for t in texts]
            seeds = range(len(prompts))
            sampled = [SamplingParams(temperature=1.0, max_tokens=a.tokens, ignore_eos=True, seed=s) for s in seeds]
            greedy = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
            for name, params in (("greedy", greedy), ("T=1", sampled)):
                run(llm, prompts, params)                                       # warm-up: graphs, kernels
                ids, m, seconds = run(llm, prompts, params, a.profile)
                row = dict(drafter=(f"{kind}-{k}" + (" VARLEN" if varlen else "")) if k else "none", sampling=name, tau=m.acceptance_length,
                           per_position=m.per_position(), verify_steps=m.num_steps,
                           drafted=m.num_drafted_tokens, verified=m.num_verified_tokens,
                           accepted=m.num_accepted_tokens, seconds=round(seconds, 2),
                           output_tok_s=round(len(prompts) * a.tokens / seconds, 1))
                if varlen:
                    row["chosen_lengths"] = list(llm.engine.varlen.chosen)
                if name == "greedy":
                    if k == 0:
                        reference = ids
                    row["identical_to_non_speculative"] = sum(x == y for x, y in zip(ids, reference))
                rows.append(row)
                tau = "-" if row["tau"] is None else f"{row['tau']:.3f}"
                same = (f"{row['identical_to_non_speculative']}/{len(prompts)}" if name == "greedy" else "-")
                print(f"{row['drafter']:16} {name:6} tau {tau:>5}  identical {same:>5}  "
                      f"{row['output_tok_s']:8.1f} tok/s  per position {[round(x, 3) for x in row['per_position']]}",
                      flush=True)
            linear = type(llm.runner.loaded.ops.linear["fp8"]).__name__
            del llm
    out = HERE / "results" / f"spec_acceptance_{a.device}_{a.dtype}{'_varlen' if a.varlen else ''}.json"
    out.write_text(json.dumps(dict(model="bundled trained tiny model", path="LLM.generate", prompts=len(prompts),
                                   tokens=a.tokens, device=a.device, linear=linear, dtype=a.dtype,
                                   batch_invariant=True, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
