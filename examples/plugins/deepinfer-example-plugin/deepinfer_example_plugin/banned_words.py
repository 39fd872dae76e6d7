"""A request's banned words: its settings (from SamplingParams.extra_args) and the token matching.

Settings: the extra_args keys that start with `banned_` belong to this plugin.
  banned_words              a list of non-blank strings: the words and phrases to forbid
  banned_words_ignore_case  true: also forbid each one in lower case, in upper case and capitalised
                            (first letter upper, the rest lower); default false
Any other `banned_...` key is an error (a typo must not leave the words allowed).

Matching: each form of a word is tokenized twice, as written and after a space (" thee"), which are
the two ways a tokenizer writes it inside text. A completion must never produce any of these token
sequences: before each token, every sequence whose first tokens are the completion's newest tokens
has its last token masked, and a one-token sequence is masked always. Only the completion's own
tokens count (not the prompt's), and only these exact sequences: the same text spelled with other
tokens is not caught, and banning the token of "the" bans it inside longer words that start with it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "banned_"
WORDS = "banned_words"
IGNORE_CASE = "banned_words_ignore_case"
KEYS = (WORDS, IGNORE_CASE)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class BannedWords:
    """A request's settings, validated."""

    words: tuple[str, ...]
    ignore_case: bool = False

    def forms(self) -> list[str]:
        """Every spelling to forbid, in order, without repeats."""
        out: list[str] = []
        for word in self.words:
            out += [word] if not self.ignore_case else [
                word, word.lower(), word.upper(), word[:1].upper() + word[1:].lower()]
        return list(dict.fromkeys(out))


def requested(extra_args: Any) -> bool:
    """Whether a request's extra_args has keys of this plugin (`banned_...`)."""
    return isinstance(extra_args, Mapping) and any(
        isinstance(k, str) and k.startswith(PREFIX) for k in extra_args)


def parse(extra_args: Mapping[str, Any]) -> BannedWords:
    """The settings in `extra_args`, or a ValueError naming the field and what it allows."""
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(PREFIX)}
    unknown = sorted(set(ours) - set(KEYS))
    if unknown:
        raise ValueError(f"extra_args.{unknown[0]}: unknown key of the banned_words plugin; "
                         f"allowed: {', '.join(KEYS)}")
    if WORDS not in ours:
        raise ValueError(f"extra_args.{WORDS}: missing; {IGNORE_CASE} needs {WORDS}, "
                         f"a list of non-blank strings")
    words = ours[WORDS]
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                       for w in words):
        raise ValueError(f"extra_args.{WORDS}: must be a list of non-blank strings, "
                         f"got {_short(words)}")
    ignore_case = ours.get(IGNORE_CASE, False)
    if ignore_case is not True and ignore_case is not False:
        raise ValueError(f"extra_args.{IGNORE_CASE}: must be true or false, "
                         f"got {_short(ignore_case)}")
    return BannedWords(tuple(words), ignore_case)


def token_sequences(banned: BannedWords, encode: Callable[[str], Sequence[int]],
                    vocab_size: int) -> set[tuple[int, ...]]:
    """The token sequences of every form, as written and after a space. A sequence with an id the
    model cannot produce (>= vocab_size) can never be completed, so it is left out."""
    out = set()
    for form in banned.forms():
        for text in (form, " " + form):
            ids = tuple(int(t) for t in encode(text))
            if ids and all(0 <= t < vocab_size for t in ids):
                out.add(ids)
    return out


class BannedTable:
    """The sequences indexed for the step: the last token of each, keyed by the tokens before it."""

    def __init__(self, sequences: Iterable[tuple[int, ...]]):
        sequences = set(sequences)
        self.always = frozenset(s[0] for s in sequences if len(s) == 1)
        by_prefix: dict[int, dict[tuple[int, ...], set[int]]] = {}
        for s in sequences:
            if len(s) > 1:
                by_prefix.setdefault(len(s) - 1, {}).setdefault(s[:-1], set()).add(s[-1])
        self.by_prefix = {n: {p: frozenset(t) for p, t in d.items()} for n, d in by_prefix.items()}
        self.context = max(by_prefix, default=0)   # the newest tokens a state must keep

    def banned_after(self, history: Sequence[int]) -> set[int]:
        """The tokens that would complete a sequence after `history` (the completion's tokens)."""
        out = set(self.always)
        for n, table in self.by_prefix.items():
            if len(history) >= n:
                out |= table.get(tuple(history[len(history) - n:]), frozenset())
        return out


class BannedState:
    """One completion's state: its newest tokens (as many as the longest sequence needs)."""

    __slots__ = ("history", "table")

    def __init__(self, table: BannedTable):
        self.table = table
        self.history: list[int] = []

    def banned(self) -> set[int]:
        return self.table.banned_after(self.history)

    def accept(self, token: int) -> None:
        self.history.append(token)
        if len(self.history) > self.table.context:
            del self.history[:len(self.history) - self.table.context]

    def draft_masks(self, drafts: Sequence[int]) -> tuple[list[set[int]], int]:
        """Speculative verification: the banned tokens of the row after each prefix of `drafts`,
        up to and including the first draft that is itself banned, and how many drafts come
        before it (all of them when none is). The state is left as it was."""
        history, rows = list(self.history), []
        for j, token in enumerate(drafts):
            rows.append(self.table.banned_after(history))
            if token in rows[-1]:
                return rows, j
            history.append(token)
        rows.append(self.table.banned_after(history))
        return rows, len(drafts)
