"""End-to-end batch-invariance check: do the same requests give bitwise the same tokens and logprobs
alone, in batches of other random requests (at shuffled positions), and under other chunked-prefill
sizes?

    python -m deepinfer_batch_invariant.check --model DIR [--dtype bfloat16] [--device cuda] [--json F]

`run_check(llm, ...)` is what the tests call. A run's signature per request is its generated token
ids plus, per generated position, the sampled token's logprob and the top-k (id, logprob) pairs,
compared with `==` on the float32 values (bitwise, as no NaN occurs). The targets mix greedy and
seeded sampled requests (deterministic sampling). Fillers are random prompts with random lengths,
output lengths and sampling settings, so they finish (and leave the batch) at other steps.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

Signature = tuple


@dataclass
class Scenario:
    name: str
    runs: int = 0                      # target requests run
    mismatches: list[int] = field(default_factory=list)   # target indices whose signature differed
    seconds: float = 0.0


@dataclass
class Report:
    batch_invariant: bool
    dtype: str
    device: str
    targets: int
    scenarios: list[Scenario]

    @property
    def all_equal(self) -> bool:
        return not any(s.mismatches for s in self.scenarios)

    def table(self) -> str:
        rows = [f"batch_invariant={self.batch_invariant} dtype={self.dtype} device={self.device} "
                f"targets={self.targets}", f"{'scenario':<26} {'runs':>5} {'differ':>6} {'s':>7}"]
        rows += [f"{s.name:<26} {s.runs:>5} {len(s.mismatches):>6} {s.seconds:>7.1f}" for s in self.scenarios]
        return "\n".join(rows)

    def to_json(self) -> dict[str, Any]:
        return {"batch_invariant": self.batch_invariant, "dtype": self.dtype, "device": self.device,
                "targets": self.targets, "all_equal": self.all_equal,
                "scenarios": [vars(s) for s in self.scenarios]}


def random_prompts(n: int, rng: random.Random, lo: int, hi: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def target_params(n: int, max_tokens: int, logprobs: int):
    """Half greedy, half seeded sampling (temperature 0.8, top-p 0.9, top-k 50)."""
    from deepinfer_core import SamplingParams
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
            if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1000 + i, max_tokens=max_tokens,
                           ignore_eos=True, logprobs=logprobs) for i in range(n)]


def filler_params(rng: random.Random, max_tokens: int):
    from deepinfer_core import SamplingParams
    n = rng.randint(1, max_tokens + 4)
    if rng.random() < 0.5:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return SamplingParams(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([1.0, 0.8]), max_tokens=n,
                          ignore_eos=True, seed=rng.randrange(1 << 30))


def signature(out) -> Signature:
    c = out.outputs[0]
    lps = tuple(tuple(sorted((tok, lp.logprob) for tok, lp in pos.items())) for pos in (c.logprobs or []))
    return tuple(c.token_ids), lps


def _generate(llm, prompts, params) -> list:
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def run_alone(llm, targets, params) -> dict[int, Signature]:
    """Each target in a generate call of its own."""
    return {t: signature(_generate(llm, [targets[t]], [params[t]])[0]) for t in range(len(targets))}


def run_batch(llm, targets, params, placement: list[int | None], fillers, filler_sp) -> dict[int, Signature]:
    """One generate call: `placement[j]` is the target at batch position j (None: the next filler)."""
    prompts, sps, where = [], [], {}
    it = iter(zip(fillers, filler_sp))
    for j, t in enumerate(placement):
        if t is None:
            p, sp = next(it)
        else:
            p, sp, where[t] = targets[t], params[t], j
        prompts.append(p)
        sps.append(sp)
    outs = _generate(llm, prompts, sps)
    return {t: signature(outs[j]) for t, j in where.items()}


def run_check(llm, targets: list[list[int]], *, batch_sizes=(2, 3, 8, 64, 256), chunk_sizes=(1, 5, 64, 512),
              max_tokens: int = 6, logprobs: int = 4, seed: int = 0, filler_len=(1, 120)) -> Report:
    rng = random.Random(seed)
    vocab = int(llm.vocab_size)
    params = target_params(len(targets), max_tokens, logprobs)
    scenarios: list[Scenario] = []

    def record(name: str, got: dict[int, Signature], t0: float) -> None:
        sc = Scenario(name, runs=len(got), seconds=time.perf_counter() - t0)
        sc.mismatches = sorted(t for t, s in got.items() if s != reference[t])
        scenarios.append(sc)

    t0 = time.perf_counter()
    reference = run_alone(llm, targets, params)
    scenarios.append(Scenario("alone (reference)", len(targets), [], time.perf_counter() - t0))
    for n in batch_sizes:
        t0 = time.perf_counter()
        per_batch = max(1, min(len(targets), n // 2))
        got: dict[int, Signature] = {}
        for g in range(0, len(targets), per_batch):
            group = list(range(g, min(g + per_batch, len(targets))))
            placement: list[int | None] = group + [None] * (n - len(group))
            rng.shuffle(placement)
            fillers = random_prompts(n - len(group), rng, *filler_len, vocab)
            got.update(run_batch(llm, targets, params, placement, fillers,
                                 [filler_params(rng, max_tokens) for _ in fillers]))
        record(f"batch of {n}, shuffled", got, t0)
    for c in chunk_sizes:
        t0 = time.perf_counter()
        # the same runner, prefill chunked at c tokens
        chunked = type(llm).from_runner(llm.runner, llm.tokenizer,
                                        config=llm.config.replace(max_num_batched_tokens=c))
        if c < 16:            # tiny chunks: one target at a time, half of them, keeps the step count bounded
            half = max(1, len(targets) // 2)
            got = run_alone(chunked, targets[:half], params[:half])
        else:
            placement = list(range(len(targets))) + [None] * 4
            rng.shuffle(placement)
            fillers = random_prompts(4, rng, *filler_len, vocab)
            got = run_batch(chunked, targets, params, placement, fillers,
                            [filler_params(rng, max_tokens) for _ in fillers])
        record(f"chunked prefill {c}", got, t0)
    ctx = getattr(getattr(llm.runner, "loaded", None), "ctx", None)
    return Report(bool(ctx and ctx.batch_invariant), str(llm.dtype), str(llm.device), len(targets), scenarios)


def repeat_check(llm, runs: int, *, seed: int = 0, batch_range=(1, 48), max_tokens: int = 8,
                 filler_len=(1, 120)) -> dict[str, Any]:
    """`runs` generate calls, each with the same seeded sampled request at a random position among a
    random number of random other requests: how many distinct outputs did it give?"""
    from deepinfer_core import SamplingParams
    rng = random.Random(seed)
    vocab = int(llm.vocab_size)
    target = random_prompts(1, random.Random(seed + 1), 40, 80, vocab)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=12345, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    seen: dict[Signature, int] = {}
    for _ in range(runs):
        n = rng.randint(*batch_range)
        placement: list[int | None] = [0] + [None] * (n - 1)
        rng.shuffle(placement)
        fillers = random_prompts(n - 1, rng, *filler_len, vocab)
        sig = run_batch(llm, [target], [sp], placement, fillers,
                        [filler_params(rng, max_tokens) for _ in fillers])[0]
        seen[sig] = seen.get(sig, 0) + 1
    return {"runs": runs, "distinct_outputs": len(seen), "counts": sorted(seen.values(), reverse=True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_batch_invariant.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--off", action="store_true", help="run with batch invariance off (to see the differences)")
    ap.add_argument("--targets", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=0, help="also run the repeated seeded request N times")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from deepinfer_core import LLM
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, batch_invariant=not args.off, max_num_seqs=256)
    targets = random_prompts(args.targets, random.Random(7), 20, 200, int(llm.vocab_size))
    report = run_check(llm, targets)
    print(report.table())
    out = report.to_json()
    if args.repeat:
        out["repeat"] = repeat_check(llm, args.repeat)
        print(f"repeated seeded request: {out['repeat']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if report.all_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
