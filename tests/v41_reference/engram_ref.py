"""Engram n-gram memory of the independent DeepSeek-V4.1 reference (test-only).

Three parts, each written from `deepseek_v41.md` §11 as fixed by this package's brief:
tokenizer compression (every vocabulary id -> a compressed id), the per-layer n-gram hash (odd
multipliers from a seeded numpy generator, XOR mixing, distinct primes with offsets), and the
gated update of every mHC stream.
"""
from __future__ import annotations

import math
import os
import re
import unicodedata

import numpy as np
import torch
from tokenizers import Tokenizer

from .ref_ops import rms_norm

INT64_MAX = int(np.iinfo(np.int64).max)
HASH_SEED = 0
LAYER_SEED_PRIME = 10007
# The Unicode White_Space property (what "strip Unicode whitespace" removes at both ends).
UNICODE_WHITESPACE = "".join(
    [chr(c) for c in range(0x09, 0x0E)] + [" ", "\x85", "\xa0", "\u1680"]
    + [chr(c) for c in range(0x2000, 0x200B)] + ["\u2028", "\u2029", "\u202f", "\u205f", "\u3000"])
_WS_RUN = re.compile(r"[ \t\r\n]+")


# ---- tokenizer compression ----------------------------------------------------------------------

def normalise_piece(text: str) -> str:
    """NFKC, NFD, drop marks (category M*), lowercase char by char, collapse runs of
    [ \\t\\r\\n] to one space, strip Unicode whitespace unless the result is exactly " "."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if not unicodedata.category(ch).startswith("M"))
    s = "".join(ch.lower() for ch in s)
    s = _WS_RUN.sub(" ", s)
    return s if s == " " else s.strip(UNICODE_WHITESPACE)


def load_tokenizer(tokenizer_json: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` from JSON text or from a path to `tokenizer.json`."""
    if tokenizer_json.lstrip().startswith("{"):
        return Tokenizer.from_str(tokenizer_json)
    if os.path.isfile(tokenizer_json):
        return Tokenizer.from_file(tokenizer_json)
    raise ValueError("tokenizer_json is neither JSON text nor an existing file")


def compressed_ids(tokenizer: Tokenizer) -> tuple[list[int], int]:
    """`(cid per vocabulary id, compressed vocab size V')`.

    Key of id i: its single-id decode, normalised; the raw vocabulary string when the decode
    holds U+FFFD; the decode itself when normalisation leaves "". Compressed ids are numbered by
    first appearance over ids 0, 1, 2, ...
    """
    key_to_cid: dict[str, int] = {}
    cids = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(i)
        else:
            key = normalise_piece(text) or text
        cids.append(key_to_cid.setdefault(key, len(key_to_cid)))
    return cids, len(key_to_cid)


# ---- hash ---------------------------------------------------------------------------------------

def is_prime(n: int) -> bool:
    """Deterministic trial division (6k +- 1)."""
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def engram_primes(layer_ids: list[int], max_ngram: int, n_heads: int,
                  vocab_sizes: int | list[int]) -> dict[int, list[int]]:
    """Per Engram layer, the head moduli flattened (order n major, head j minor).

    Head j of order n: the smallest prime >= vocab_sizes[n-2] that is above head j-1's prime
    (same layer and order) and not used by any earlier (layer, order, head) in config order.
    """
    sizes = [vocab_sizes] * (max_ngram - 1) if isinstance(vocab_sizes, int) else list(vocab_sizes)
    used: set[int] = set()
    table: dict[int, list[int]] = {}
    for layer in layer_ids:
        primes = []
        for n in range(2, max_ngram + 1):
            candidate = sizes[n - 2]
            for _ in range(n_heads):
                while not is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                primes.append(candidate)
                candidate += 1
        table[layer] = primes
    return table


def engram_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """Odd int64 multipliers `2 * U[0, (INT64_MAX // V') // 2) + 1` from
    `default_rng(seed + 10007 * layer_id)`."""
    rng = np.random.default_rng(HASH_SEED + LAYER_SEED_PRIME * layer_id)
    high = (INT64_MAX // compressed_vocab) // 2
    return rng.integers(0, high, size=max_ngram, dtype=np.int64) * 2 + 1


def ngram_tokens(cids: np.ndarray, pad_cid: int, max_ngram: int) -> np.ndarray:
    """`tok[p, k] = cids[p - k]` for k < max_ngram, `pad_cid` before position 0."""
    t = cids.shape[0]
    tok = np.full((t, max_ngram), pad_cid, dtype=np.int64)
    for k in range(max_ngram):
        tok[k:, k] = cids[: t - k]
    return tok


def engram_rows(cids: np.ndarray, pad_cid: int, multipliers: np.ndarray,
                primes: list[int], n_heads: int) -> np.ndarray:
    """Embedding-table rows `[T, (N-1) * n_heads]` (columns n major, head minor):
    `(XOR_{k<n} tok[p, k] * mult[k]) mod prime(n, j) + offset(n, j)`."""
    max_ngram = multipliers.shape[0]
    tok = ngram_tokens(cids, pad_cid, max_ngram)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(primes, dtype=np.int64))[:-1]])
    columns = []
    for n in range(2, max_ngram + 1):
        mix = tok[:, 0] * multipliers[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, tok[:, k] * multipliers[k])
        for j in range(n_heads):
            col = (n - 2) * n_heads + j
            columns.append(mix % primes[col] + offsets[col])
    return np.stack(columns, axis=1)


# ---- module -------------------------------------------------------------------------------------

class EngramTables:
    """Everything the Engram layers of one model need besides weights: compressed ids, the pad's
    compressed id, and per-layer multipliers and primes."""

    def __init__(self, cfg: dict, tokenizer_json: str):
        self.layer_ids = list(cfg["engram_layer_ids"])
        self.max_ngram = cfg["engram_max_ngram_size"]
        self.n_heads = cfg["engram_n_heads"]
        cids, self.compressed_vocab = compressed_ids(load_tokenizer(tokenizer_json))
        self.cids = np.asarray(cids, dtype=np.int64)
        self.pad_cid = int(self.cids[cfg.get("engram_pad_token_id", 2)])
        self.primes = engram_primes(self.layer_ids, self.max_ngram, self.n_heads,
                                    cfg["engram_vocab_size"])
        self.multipliers = {layer: engram_multipliers(layer, self.max_ngram,
                                                      self.compressed_vocab)
                            for layer in self.layer_ids}

    def rows(self, layer: int, token_ids: list[int]) -> torch.Tensor:
        """Table rows `[T, (N-1) * n_heads]` of `layer` for a token sequence."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.cids.shape[0]):
            raise ValueError("token id outside the tokenizer vocabulary")
        rows = engram_rows(self.cids[ids], self.pad_cid, self.multipliers[layer],
                           self.primes[layer], self.n_heads)
        return torch.from_numpy(rows)


def engram_update(trunk: torch.Tensor, rows: torch.Tensor, w: dict[str, torch.Tensor],
                  eps: float) -> torch.Tensor:
    """Gate the Engram value into every stream: `trunk [T, m, D]`, `rows [T, K]`, `w` holds
    `embed`, `wkv`, `q_weight`, `k_weight` (float32).

    kv = wkv(concat of the K embedding rows) = [key_0 | ... | key_{m-1} | value];
    `g_i = sigmoid(sign(d) sqrt(max(|d|, 1e-6)))` with
    `d = <RMSNorm(key_i) k_weight[i], RMSNorm(R_i) q_weight[i]> / sqrt(D)`; `R_i += g_i v`.
    """
    t, m, d = trunk.shape
    kv = w["embed"][rows].reshape(t, -1) @ w["wkv"].T
    keys, value = kv[:, : m * d].view(t, m, d), kv[:, m * d:]
    a = rms_norm(keys, None, eps) * w["k_weight"]
    b = rms_norm(trunk, None, eps) * w["q_weight"]
    dot = (a * b).sum(-1) / math.sqrt(d)
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    return trunk + gate[:, :, None] * value[:, None, :]
