"""The example plugin through `LLM.generate`, run by test_example_plugin.py in a subprocess whose
PYTHONPATH holds the installed example; prints one JSON object for the test to check.

On the bundled tiny model (LLM() with no model), float32 and batch-invariant: an engine that drafts
(MTP-3, so the banned requests' verify rows go through `mask_drafts`) and one that does not, whose
greedy tokens must agree token for token.
"""
from __future__ import annotations

import json
from functools import partial

from plugin_cases import PROMPTS, choose_word, sequences

from deepinfer_core import LLM, InvalidRequestError, SamplingParams

TOKENS = 16
OPTIONS = {"dtype": "float32", "batch_invariant": True, "max_model_len": 256}
GRAMMAR = {"schema_type": "regex", "schema": "[a-z ]+"}
BAD = [  # (what, extra_args, so_args): each refused at submission
    ("not_a_list", {"banned_words": "thee"}, None),
    ("unknown_key", {"banned_words": ["thee"], "banned_word": ["thou"]}, None),
    ("with_so_args", {"banned_words": ["thee"]}, GRAMMAR),
]


def params(extra: dict | None = None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True, **kw},
                          extra_args=extra)


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def main() -> None:
    spec = LLM(num_speculative_tokens=3, **OPTIONS)
    encode = partial(spec.get_tokenizer().encode, add_special_tokens=False)
    before = spec.generate(PROMPTS, params(), use_tqdm=False)
    first = before[0].outputs[0]
    word = choose_word(first.text, first.token_ids, encode)
    banned = params({"banned_words": [word]})
    # one batch: the banned request, two plain ones, and a sampled n=3 request with the ban
    sampled = params({"banned_words": [word]}, temperature=1.0, seed=0, n=3)
    after = spec.generate(PROMPTS + PROMPTS[:1], [banned, params(), params(), sampled],
                          use_tqdm=False)
    plain_engine = LLM(num_speculative_tokens=0, **OPTIONS)
    reference = plain_engine.generate(PROMPTS[:1], banned, use_tqdm=False)
    try:   # the bad requests beside a good one, in one call
        spec.generate(PROMPTS[:1] * (len(BAD) + 1),
                      [params(extra, so_args=so) for _, extra, so in BAD] + [params(max_tokens=4)],
                      use_tqdm=False)
        refused = None
    except InvalidRequestError as e:
        refused = {"errors": {BAD[i][0]: str(err) for i, err in e.errors.items()},
                   "good": tokens(e.outputs[-1])}
    print(json.dumps({
        "word": word, "sequences": sequences(word, encode),
        "before": {"text": [o.outputs[0].text for o in before],
                   "tokens": [tokens(o) for o in before]},
        "after": {"text": [o.outputs[0].text for o in after[:3]],
                  "tokens": [tokens(o) for o in after[:3]],
                  "drafted": after[0].metrics.spec.num_drafted_tokens,
                  "accepted": after[0].metrics.spec.num_accepted_tokens},
        "sampled": tokens(after[3]),
        "reference": tokens(reference[0]),
        "refused": refused,
    }))


if __name__ == "__main__":
    main()
