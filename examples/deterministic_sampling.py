"""Deterministic sampling with DeepInfer: one seeded, sampled request alone and inside batches of random
other requests gives the same tokens and bitwise the same logprobs.

    python examples/deterministic_sampling.py                      # bundled tiny model (random weights)
    DEEPINFER_HF_MODEL_DIR=/path/to/DeepSeek-V4-Flash python examples/deterministic_sampling.py

Deterministic sampling = batch invariance (`batch_invariant=True`, or DEEPINFER_BATCH_INVARIANT=1) +
DEEPINFER_ENABLE_MTP_VARLEN=0 (the default) + a seed per request. Pass `--off` to see the logprobs
move with the batch without batch invariance.
"""
from __future__ import annotations

import random
import sys

from offline_inference import model_path

from deepinfer_core import LLM, SamplingParams


def main() -> None:
    invariant = "--off" not in sys.argv
    llm = LLM(model=model_path(), dtype="bfloat16", batch_invariant=invariant)
    tok = llm.get_tokenizer()
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Tell me a story.<｜Assistant｜>")
    mine = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=12, logprobs=1)
    rng = random.Random(0)
    seen = set()
    for batch in (1, 3, 17, 40):
        others = [[rng.randrange(2, llm.vocab_size) for _ in range(rng.randint(1, 90))] for _ in range(batch - 1)]
        at = rng.randrange(batch)
        prompts = others[:at] + [prompt] + others[at:]
        params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 16)) for _ in others]
        params = params[:at] + [mine] + params[at:]
        out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[at].outputs[0]
        lps = tuple(lp.logprob for pos, t in zip(out.logprobs, out.token_ids) for tok_id, lp in pos.items() if tok_id == t)
        seen.add((tuple(out.token_ids), lps))
        print(f"batch of {batch:2} at position {at:2}: tokens {out.token_ids}  first logprob {lps[0]!r}")
    print(f"batch_invariant={invariant}: {len(seen)} distinct output(s) over 4 batches")


if __name__ == "__main__":
    main()
