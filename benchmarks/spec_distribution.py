"""Sampled speculative decoding is lossless in distribution: the first two tokens of a
fixed prompt, drawn with MTP speculation over many seeds, follow the target's own distribution.

    python benchmarks/spec_distribution.py [--runs 20000] [--control-runs 5000] [--drafts 1]
    python benchmarks/spec_distribution.py --dspark [--device cuda]

--dspark draws through the engine itself (`LLM.generate`, one seeded request per run) with the trained
DSpark drafter (the bundled model's DSpark variant, gamma 5: token 2 verifies its first draft), and
writes spec_distribution_<device>_dspark.json; the control then patches the engine's verifier.

Bundled trained tiny model, float32, CPU, T=1 (the full softmax). Token 1 comes from the prefill's
sampler, token 2 from verification (the MTP draft accepted with min(1, p/q), else the correction
from norm(max(0, p - q))). Expected counts are exact: p(t1) from the prompt's logits, p(t2 | t1) from
one target forward per distinct t1. Pearson chi-square over the (t1, t2) cells with an expected count
of at least 5 (the rest pooled into one cell); the test passes at significance 0.01. A control run
with a broken verifier that accepts every draft (so token 2 follows the drafter, not the target)
shows the test can fail. Writes benchmarks/results/spec_distribution_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.api.tokenizer import load_tokenizer
from deepinfer_core.cache.budget import CacheRequest
from deepinfer_core.runner.model_runner import ModelRunner
from deepinfer_core.speculative import reference_loop
from deepinfer_core.speculative.reference_loop import speculative_generate
from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint

PROMPT = "HAMLET.\nTo be, or not to be,"
SIGNIFICANCE = 0.01


def chi_square(counts: Counter, expected: dict, total: int) -> dict:
    """Pearson chi-square of observed `counts` against expected probabilities (cells with an expected
    count under 5 pooled); p-value from the regularised upper incomplete gamma function."""
    big = {c: p * total for c, p in expected.items() if p * total >= 5}
    rest_exp = total - sum(big.values())
    rest_obs = total - sum(counts[c] for c in big)
    stat = sum((counts[c] - e) ** 2 / e for c, e in big.items())
    cells = len(big)
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    df = cells - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return dict(chi2=stat, df=df, p_value=p_value, passes=p_value > SIGNIFICANCE)


@contextmanager
def broken_verifier(module):
    """The control: `module.verify` replaced by one that accepts every draft (so the token after a
    draft follows the drafter, not the target) while the block runs."""
    original = module.verify

    def accept_everything(target_logits, num_drafts, *args, **kw):
        verdict = original(target_logits, num_drafts, *args, **kw)
        verdict.accepted = list(num_drafts)            # broken on purpose: every draft passes
        return verdict

    module.verify = accept_everything
    try:
        yield
    finally:
        module.verify = original


def draw_engine(llm, prompt: list[int], runs: int, batch: int, first_seed: int = 0) -> Counter:
    """The first two tokens of `runs` seeded requests through LLM.generate, `batch` requests a call.
    max_tokens is 3: a verify step always adds a token of its own, so with only token 2 left to
    generate it could accept no draft (token 2 would be plain target sampling, a test of nothing);
    with 3, token 2 is draft 1 accepted with min(1, p/q) or the correction."""
    pairs: Counter = Counter()
    for first in range(0, runs, batch):
        n = min(batch, runs - first)
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=first_seed + s)
                  for s in range(first, first + n)]
        outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params, use_tqdm=False)
        pairs.update(tuple(o.outputs[0].token_ids[:2]) for o in outs)
        print(f"  {first + n} / {runs} runs", flush=True)
    return pairs


def dspark_rows(a: argparse.Namespace, tmp: str) -> tuple[dict, float, dict]:
    """(rows, seconds, drafting stats) of the engine run with the DSpark drafter and its control."""
    from deepinfer_core import LLM
    from deepinfer_core.speculative import engine_step
    from deepinfer_core.tools.trained_model import DSPARK_ARTIFACT
    ckpt = make_trained_checkpoint(Path(tmp) / "dspark", ARTIFACT, drafter=DSPARK_ARTIFACT)
    llm = LLM(model=str(ckpt), dtype="float32", device=a.device, num_speculative_tokens=5, max_num_seqs=a.batch,
              max_model_len=64)
    prompt = llm.tokenizer.encode(PROMPT)
    t0 = time.perf_counter()
    spec = draw_engine(llm, prompt, a.runs, a.batch, a.first_seed)
    seconds = time.perf_counter() - t0
    stats = dict(verify_steps=llm.engine.spec_metrics.num_steps, accepted=llm.engine.spec_metrics.num_accepted_tokens)
    with broken_verifier(engine_step):
        broken = draw_engine(llm, prompt, a.control_runs, a.batch, a.first_seed)
    runner = llm.runner
    truth = exact(runner, prompt, 5 / max(a.runs, a.control_runs))
    rows = {"speculative (DSpark, gamma 5, through the engine)": chi_square(spec, truth, a.runs),
            "control: a verifier that accepts every draft": chi_square(broken, truth, a.control_runs)}
    return rows, seconds, stats


def draw(runner, prompt: list[int], runs: int, k: int, batch: int) -> Counter:
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    pairs: Counter = Counter()
    for first in range(0, runs, batch):
        n = min(batch, runs - first)
        res = speculative_generate(runner, [prompt] * n, [params] * n, k, seeds=list(range(first, first + n)))
        pairs.update(tuple(t) for t in res.token_ids)
        print(f"  {first + n} / {runs} runs", flush=True)
    return pairs


@torch.no_grad()
def target_probs(runner, ids: list[int]) -> torch.Tensor:
    """The target's next-token distribution after `ids` (T=1: the plain softmax), float64."""
    st = runner.new_sequence()
    try:
        return torch.softmax(runner.forward(st, ids).double(), -1)[0]
    finally:
        runner.release(st)


def exact(runner, prompt: list[int], min_p: float) -> dict:
    """p(t1, t2) of every cell with probability >= min_p (the others are pooled by `chi_square`)."""
    p1 = target_probs(runner, prompt)
    out = {}
    for t1 in torch.nonzero(p1 >= min_p).flatten().tolist():
        p = p1[t1] * target_probs(runner, prompt + [t1])
        out.update({(t1, t2): float(p[t2]) for t2 in torch.nonzero(p >= min_p).flatten().tolist()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20000)
    ap.add_argument("--drafts", type=int, default=1)
    ap.add_argument("--control-runs", type=int, default=5000, help="runs of the broken-verifier control")
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--dspark", action="store_true", help="the trained DSpark drafter, through LLM.generate")
    ap.add_argument("--device", default="cpu", help="with --dspark: cpu or cuda")
    ap.add_argument("--first-seed", type=int, default=0, help="with --dspark: run i uses seed first_seed + i")
    a = ap.parse_args()
    if a.dspark:
        with tempfile.TemporaryDirectory() as tmp:
            rows, seconds, stats = dspark_rows(a, tmp)
        suffix = f"_seed{a.first_seed}" if a.first_seed else ""
        report(rows, Path(__file__).parent / "results" / f"spec_distribution_{a.device}_dspark{suffix}.json",
               dict(prompt=PROMPT, first_seed=a.first_seed, runs=a.runs, control_runs=a.control_runs, drafter="DSpark gamma 5", temperature=1.0,
                    device=a.device, dtype="float32", significance=SIGNIFICANCE, seconds=round(seconds, 1), **stats))
        return
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_trained_checkpoint(Path(tmp) / "ckpt", ARTIFACT)
        prompt = load_tokenizer(ckpt).encode(PROMPT)
        runner = ModelRunner(str(ckpt), dtype="float32", device="cpu", max_backtracking_tokens=a.drafts + 1)
        runner.allocate_cache(CacheRequest(num_slots=a.batch + 2, num_blocks=a.batch + 4))
        t0 = time.perf_counter()
        spec = draw(runner, prompt, a.runs, a.drafts, a.batch)
        seconds = time.perf_counter() - t0
        with broken_verifier(reference_loop):
            broken = draw(runner, prompt, a.control_runs, a.drafts, a.batch)
        truth = exact(runner, prompt, 5 / max(a.runs, a.control_runs))    # expected count >= 5
        verify_all = chi_square(broken, truth, a.control_runs)
        result = chi_square(spec, truth, a.runs)
    rows = {"speculative (MTP-%d)" % a.drafts: result, "control: a verifier that accepts every draft": verify_all}
    report(rows, Path(__file__).parent / "results" / "spec_distribution_cpu.json",
           dict(prompt=PROMPT, runs=a.runs, control_runs=a.control_runs, drafts=a.drafts, temperature=1.0,
                significance=SIGNIFICANCE, seconds=round(seconds, 1)))


def report(rows: dict, out: Path, info: dict) -> None:
    for name, r in rows.items():
        print(f"{name:52} chi2 {r['chi2']:9.1f}  df {r['df']:4d}  p {r['p_value']:.3g}  "
              f"{'matches the target' if r['passes'] else 'differs from the target'} (significance {SIGNIFICANCE})")
    out.write_text(json.dumps(dict(info, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
