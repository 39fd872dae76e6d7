"""Engram's host-side inputs: the compressed vocabulary, n-gram windows and the n-gram hash.

Everything here is a pure function of the checkpoint's `tokenizer.json` and its `engram_*` keys;
the published formulas are those of DeepSeek's Engram demo (`engram_demo_v1.py`), DeepSeek's
engine (`deepinfer` 0.1.0, `v4_modules/engram_metadata.py`) and TileKernels' `engram_hash_ref`
(spec `deepseek_v41.md` §11).

`model/engram.py` (`EngramInputs`) feeds these ids to the Engram layers of a V4.1 model.

Invariants:
* compressed ids are dense, numbered in order of first appearance while scanning ids 0, 1, ...;
  normalised texts and the raw spellings of invalid-UTF-8 pieces share one key space (a byte piece
  spelled `¡` shares the id of the text `¡`), as both published implementations do;
* a row of the hash is `mix_n mod p` plus the head's offset, so it indexes the layer's table of
  `sum(p)` rows; with ids in [0, V) no product overflows int64 (each multiplier is below
  INT64_MAX // V), so the mix is non-negative and floor and truncating modulo agree.
"""
from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

PAD_TOKEN = "<｜▁pad▁｜>"
PAD_TOKEN_ID = 2                 # the published implementations assert this id
LAYER_SEED_STRIDE = 10007        # multipliers of layer l are drawn from rng(seed + 10007 * l)
_INT64_MAX = int(np.iinfo(np.int64).max)
_LONE_SPACE = " "
_COLLAPSE = re.compile(r"[ \t\r\n]+")     # only these four collapse, as the published regex says
# Unicode White_Space (what the tokenizers library's Strip removes; str.strip() would also remove
# U+001C..U+001F, which are not White_Space).
_WHITE_SPACE = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
                "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def normalize_piece(text: str) -> str:
    """The Engram normalisation of one decoded piece (spec §11, tokenizers-library semantics).

    NFKC, NFD, drop every mark (General_Category M: Mn, Mc and Me, the tokenizers library's
    `StripAccents`), lowercase char by char (no final-sigma context), collapse runs of
    space/tab/CR/LF to one space, then strip White_Space unless the result is exactly one space.
    May return "" (the caller then keeps the piece's own text).
    """
    decomposed = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    unmarked = "".join(ch for ch in decomposed if not unicodedata.category(ch).startswith("M"))
    lowered = "".join(ch.lower() for ch in unmarked)
    collapsed = _COLLAPSE.sub(" ", lowered)
    return collapsed if collapsed == _LONE_SPACE else collapsed.strip(_WHITE_SPACE)


def compression_key(decoded: str, raw_spelling: str) -> str:
    """The key a vocabulary id is grouped by: its raw spelling when the decoded text has U+FFFD
    (invalid UTF-8), else its normalised text, or its decoded text when that normalises to ""."""
    if "\ufffd" in decoded:
        return raw_spelling
    return normalize_piece(decoded) or decoded


@dataclass(frozen=True)
class CompressedVocab:
    """`old2new[id]`: the compressed id of tokenizer id `id` (int64); `size`: compressed ids."""

    old2new: torch.Tensor
    size: int

    @property
    def pad_id(self) -> int:
        """The compressed id of the PAD token (raw id 2): the n-gram window's filler."""
        return int(self.old2new[PAD_TOKEN_ID])

    def compress(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Tokenizer ids -> compressed ids (int64, same shape)."""
        return self.old2new[token_ids.long()]


def _tokenizer_path(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"Engram tokenizer compression needs tokenizer.json: {file!r} "
                         "does not exist")
    return file


def compress_tokenizer(path: str | os.PathLike[str]) -> CompressedVocab:
    """Build the Engram compressed vocabulary from a checkpoint directory or its `tokenizer.json`.

    Follows the published `CompressedTokenizer` lookup table: decode every id alone (special tokens
    kept), key it with `compression_key`, and number the distinct keys in order of first appearance.
    Raises ValueError when the file is missing or `<｜▁pad▁｜>` is not id 2.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(_tokenizer_path(path))
    pad = tokenizer.token_to_id(PAD_TOKEN)
    if pad != PAD_TOKEN_ID:
        raise ValueError(f"Engram needs the PAD token {PAD_TOKEN!r} at id {PAD_TOKEN_ID}; "
                         f"this tokenizer.json has it at {pad!r}")
    ids: dict[str, int] = {}
    table = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        decoded = tokenizer.decode([token_id], skip_special_tokens=False)
        raw = tokenizer.id_to_token(token_id)
        key = compression_key(decoded, decoded if raw is None else raw)
        table.append(ids.setdefault(key, len(ids)))
    return CompressedVocab(old2new=torch.tensor(table, dtype=torch.int64), size=len(ids))


def ngram_token_ids(compressed: torch.Tensor, positions: torch.Tensor, max_ngram: int,
                    pad_id: int) -> torch.Tensor:
    """`out[q, r] = compressed[positions[q] - r]` for r < max_ngram; before 0: `pad_id`.

    `compressed`: one sequence's compressed ids (1-D, covering every position asked for);
    `positions`: the queried positions (1-D). Returns int64 `[len(positions), max_ngram]` (spec §11
    inputs; the published demo's left-padded shifts).
    """
    back = positions.long().unsqueeze(1) - torch.arange(max_ngram, dtype=torch.int64)
    gathered = compressed.long()[back.clamp_min(0)]
    return torch.where(back >= 0, gathered, torch.full_like(gathered, pad_id))


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the first 13 primes as witnesses)."""
    if n < 2:
        return False
    witnesses = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in witnesses:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in witnesses:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_table_sizes(layer_ids: Sequence[int], max_ngram: int, n_heads: int,
                       engram_vocab_size: int | Sequence[int]) -> list[list[list[int]]]:
    """Per layer, per n-gram order n = 2..max_ngram, per head: the prime table size `p`.

    The published search: for each layer (config order), each n and each head, the smallest prime
    >= that n's `engram_vocab_size` that is above the previous head's prime of the same n and not
    used by any earlier layer, order or head. `engram_vocab_size`: one int or one per order.
    """
    orders = max_ngram - 1
    sizes = ([int(engram_vocab_size)] * orders if isinstance(engram_vocab_size, int)
             else [int(v) for v in engram_vocab_size])
    if len(sizes) != orders:
        raise ValueError(f"engram_vocab_size: {len(sizes)} values for {orders} n-gram orders "
                         f"(engram_max_ngram_size={max_ngram}); give one int or one per order")
    used: set[int] = set()
    out = []
    for _ in layer_ids:
        per_order = []
        for start in sizes:
            heads = []
            candidate = start
            for _ in range(n_heads):
                while not is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
                candidate += 1
            per_order.append(heads)
        out.append(per_order)
    return out


def engram_multipliers(layer_ids: Sequence[int], max_ngram: int, vocab_size: int,
                       seed: int = 0) -> torch.Tensor:
    """Odd per-layer multipliers `[len(layer_ids), max_ngram]` int64, drawn as the demo draws them.

    `numpy.random.default_rng(seed + 10007 * layer).integers(0, max(1, (INT64_MAX // V) // 2),
    size=max_ngram, dtype=int64) * 2 + 1` with V the (compressed) token vocabulary size.
    """
    bound = max(1, (_INT64_MAX // int(vocab_size)) // 2)
    rows = [np.random.default_rng(int(seed + LAYER_SEED_STRIDE * int(layer)))
            .integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1 for layer in layer_ids]
    return torch.from_numpy(np.stack(rows))


@dataclass(frozen=True)
class EngramHash:
    """The Engram n-gram hash of every Engram layer (spec §11; demo `NgramHashMapping`).

    `multipliers` `[L, N]`, `table_sizes` `[L, N-1, H]` (primes) and `offsets` `[L, (N-1)*H]`
    (exclusive prefix sums of the flattened sizes), all int64; N = max n-gram size, H = heads.
    """

    layer_ids: tuple[int, ...]
    multipliers: torch.Tensor
    table_sizes: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def build(cls, layer_ids: Sequence[int], max_ngram: int, n_heads: int,
              engram_vocab_size: int | Sequence[int], token_vocab_size: int,
              seed: int = 0) -> EngramHash:
        """`token_vocab_size`: the compressed vocabulary size (the text vocabulary when compression
        is off); `engram_vocab_size`: the config key, the lower bound of the primes."""
        if max_ngram < 2 or n_heads < 1 or not layer_ids:
            raise ValueError(f"Engram hash needs engram_max_ngram_size >= 2 (got {max_ngram}), "
                             f"engram_n_heads >= 1 (got {n_heads}) and engram_layer_ids "
                             f"(got {list(layer_ids)})")
        sizes = torch.tensor(engram_table_sizes(layer_ids, max_ngram, n_heads, engram_vocab_size),
                             dtype=torch.int64)
        flat = sizes.flatten(1)
        offsets = torch.cumsum(flat, dim=1) - flat
        return cls(tuple(int(x) for x in layer_ids),
                   engram_multipliers(layer_ids, max_ngram, token_vocab_size, seed), sizes, offsets)

    @property
    def rows_per_token(self) -> int:
        return self.offsets.shape[1]

    def __call__(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """`ngram_ids` `[T, N]` (`ngram_token_ids` output: column k = the token k steps back) ->
        table rows `[L, T, (N-1)*H]` int64, order n-gram major, head minor, offsets added.

        Per layer: `mix_n = XOR_{k<n} tok[k] * mult[k]` (int64), row = `mix_n mod p_j`."""
        n = self.multipliers.shape[1]
        products = ngram_ids.long().unsqueeze(0) * self.multipliers.unsqueeze(1)    # [L, T, N]
        mix = products[:, :, 0]
        rows = []
        for order in range(1, n):
            mix = torch.bitwise_xor(mix, products[:, :, order])
            rows.append(torch.remainder(mix.unsqueeze(-1), self.table_sizes[:, None, order - 1, :]))
        return torch.cat(rows, dim=-1) + self.offsets.unsqueeze(1)
