"""Deterministic sampling with DeepInfer: one seeded, sampled request alone and inside batches of
random other requests gives the same tokens and bitwise the same logprobs.

    python examples/deterministic_sampling.py                      # bundled tiny model (trained on Shakespeare)
    DEEPINFER_HF_MODEL_DIR=/path/to/DeepSeek-V4-Flash python examples/deterministic_sampling.py

Deterministic sampling = batch invariance (`batch_invariant=True`, or DEEPINFER_BATCH_INVARIANT=1) +
DEEPINFER_ENABLE_MTP_VARLEN=0 (the default) + a seed per request. Pass `--off` to see the logprobs
move with the batch without batch invariance.

Each batch prints the request's tokens and a digest of all its logprobs (every position's top-1 and
sampled entries, to the last bit), with the largest logprob difference from the run alone; the
summary counts the distinct token sequences and the distinct logprob vectors.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import struct

from offline_inference import model_path, run_example

from deepinfer_core import LLM, SamplingParams


def logprobs_digest(logprobs: list[dict]) -> str:
    """12 hex digits identifying every (token id, logprob) entry bit for bit."""
    h = hashlib.sha256()
    for position in logprobs:
        for token_id, lp in sorted(position.items()):
            h.update(struct.pack("<qd", token_id, lp.logprob))
    return h.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--off", action="store_true", help="without batch invariance")
    invariant = not parser.parse_args().off
    llm = LLM(model=model_path(), dtype="bfloat16", batch_invariant=invariant)
    tok = llm.get_tokenizer()
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Tell me a story.<｜Assistant｜>")
    mine = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=12, logprobs=1)
    rng = random.Random(0)
    runs = []   # (tokens, logprobs digest, the sampled tokens' logprobs)
    for batch in (1, 3, 9, 24):
        others = [[rng.randrange(2, llm.vocab_size) for _ in range(rng.randint(1, 60))]
                  for _ in range(batch - 1)]
        at = rng.randrange(batch)
        prompts = others[:at] + [prompt] + others[at:]
        params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 16)) for _ in others]
        params = params[:at] + [mine] + params[at:]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        out = outs[at].outputs[0]
        sampled = [pos[t].logprob for pos, t in zip(out.logprobs, out.token_ids)]
        runs.append((tuple(out.token_ids), logprobs_digest(out.logprobs), sampled))
        tokens, alone = runs[-1][0], runs[0]
        if batch == 1:
            versus = "(the run alone)"
        elif tokens != alone[0]:
            versus = "tokens differ from the run alone"
        else:
            diff = max(abs(a - b) for a, b in zip(sampled, alone[2]))
            versus = f"max |logprob - alone| {diff:.3g}"
        print(f"batch of {batch:2} at position {at:2}: tokens {list(tokens)}  "
              f"logprobs #{runs[-1][1]}  {versus}")
    n_tokens = len({r[0] for r in runs})
    n_logprobs = len({r[1] for r in runs})
    print(f"batch_invariant={invariant}: {n_tokens} distinct token sequence(s) and {n_logprobs} "
          f"distinct logprob vector(s) (bitwise) over {len(runs)} batches")


if __name__ == "__main__":
    run_example(main)
