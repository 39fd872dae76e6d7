"""Incremental detokenization: the text of a growing completion, one small decode per step.

Why: re-decoding a completion's whole token list at every step (to check stop strings or to stream
text) costs O(n) per token, O(n^2) per completion, on the engine's host path. `IncrementalDetokenizer`
decodes only a short window of recent tokens per `append` and still yields, exactly, what one full
`tokenizer.decode(ids, skip_special_tokens=...)` gives.

Why the window technique is exact here. The DeepSeek-V4 `tokenizer.json` has a plain ByteLevel decoder
(no Strip/Replace/cleanup step): `decode` drops skipped special tokens, maps every other token to its
bytes (an added token such as `<｜User｜>` to its UTF-8 content), joins the bytes and decodes them as
UTF-8 with each maximal invalid subsequence replaced by U+FFFD (checked against `decode` on random
sequences over the whole vocabulary, special and added tokens included). Consequences:
  * decode(a + b) == decode(a) + decode(b) whenever a's bytes end on a complete character, so the
    text of the tokens before such a boundary is final;
  * a partial character at the end shows as exactly one trailing U+FFFD and everything before it is
    final; appending bytes only rewrites that last character. So the text up to a trailing U+FFFD is
    emitted and that one character is held back until a later token decides it (or `finish`).
Word-joining decoders (WordPiece/WordLevel, as in the engine's test tokenizer) instead put a separator
before every token but the first of a decode; keeping at least one already-emitted token in front of
the new ones as context (the prefix/read-offsets technique) makes the difference of two window decodes
exact for them too. Skipped special tokens are dropped from the window before decoding: `decode` does
the same, and it keeps them from being the (empty) context.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
_CONTEXT = 2        # tokens kept in front of the next new ones once the text is complete
_MAX_PENDING = 16   # tokens held behind an unfinished character before the window is split
_SPLIT_KEEP = 4     # tokens kept after such a split: a partial UTF-8 char (<= 3 bytes) is within 3

_special_cache: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _special_ids(tokenizer: Any) -> frozenset[int] | None:
    """The ids `decode(..., skip_special_tokens=True)` drops, read once per tokenizer from its HF
    backend; None when the tokenizer has no such backend (they are then probed id by id)."""
    try:
        return _special_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    getter = getattr(getattr(tokenizer, "backend", None), "get_added_tokens_decoder", None)
    if getter is None:
        return None
    ids = frozenset(i for i, tok in getter().items() if getattr(tok, "special", False))
    try:
        _special_cache[tokenizer] = ids
    except TypeError:   # not weak-referenceable: recompute next time
        pass
    return ids


class IncrementalDetokenizer:
    """Text of a completion fed token by token, at O(new tokens + a small window) per `append`.

    Contract: after every `append`, `text` is `decode(ids)` of all ids fed so far, minus one trailing
    U+FFFD if there is one (a character not yet complete); the deltas returned by `append` and
    `finish` concatenate to `text`, and after `finish` `text == decode(ids)` exactly.

    `prompt_ids` is accepted for vLLM-style callers but deliberately not used as decode context:
    the engine's final text is `decode(completion ids)`, and with the prompt in front a word-joining
    decoder would add a leading separator (and a prompt ending in a partial UTF-8 character would
    absorb the completion's first bytes), so streamed and final text would disagree.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prompt_ids = prompt_ids
        self._text = ""
        self._parts: list[str] = []     # deltas not yet joined into _text (see `text`)
        self.num_tokens = 0              # ids fed so far (skipped special tokens included)
        self.finished = False
        # window[:_read] is context: tokens whose text is final and emitted. Of decode(window), the
        # first _emitted characters are context, already emitted, or junk (see _split).
        self._window: list[int] = []
        self._read = 0
        self._emitted = 0
        self._held = False                   # the window text ends in a held-back U+FFFD
        self._skipped = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._probed: dict[int, bool] = {}
        self._pending_limit = _MAX_PENDING   # doubled after a failed _split: stay O(1) amortized

    # ---- public ---------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """All text emitted so far. Joined lazily: `self.text += delta` on an attribute copies the
        whole string every step, O(n^2) over a long completion, and most callers only use deltas."""
        if self._parts:
            self._text = "".join([self._text, *self._parts])
            self._parts.clear()
        return self._text

    def append(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text they complete (possibly "", e.g. half a character)."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.append after finish()")
        self.num_tokens += len(token_ids)
        new = [int(t) for t in token_ids if not self._is_skipped(int(t))]
        if not new:
            return ""
        self._window.extend(new)
        window_text = self._decode(self._window)
        held = self._held = window_text.endswith(REPLACEMENT)
        end = len(window_text) - held
        delta = window_text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        if not held:
            self._restart(window_text)
        elif len(self._window) - self._read > self._pending_limit:
            self._split(window_text)
        if delta:
            self._parts.append(delta)
        return delta

    def finish(self) -> str:
        """Flush the held-back character (a partial char stays U+FFFD, as in a full decode)."""
        if self.finished:
            return ""
        self.finished = True
        delta = self._decode(self._window)[self._emitted:] if self._held else ""
        if delta:
            self._parts.append(delta)
        return delta

    # ---- internals ------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _is_skipped(self, t: int) -> bool:
        """Whether the full decode drops `t` (a special token with skip_special_tokens)."""
        if not self.skip_special_tokens:
            return False
        if self._skipped is not None:
            return t in self._skipped
        hit = self._probed.get(t)
        if hit is None:
            hit = self._probed[t] = (self.tokenizer.decode([t], skip_special_tokens=True) == ""
                                     and self.tokenizer.decode([t], skip_special_tokens=False) != "")
        return hit

    def _restart(self, window_text: str) -> None:
        """All text is emitted: restart the window on the last few tokens, which become context.

        The new start must be a boundary the decode splits cleanly at. The old read offset is one (the
        text was complete there); a later start s is taken only if decode(window[s:]) is a non-empty
        suffix of the window text not starting with U+FFFD: then the byte at s is not a continuation
        byte, so every UTF-8 sequence before s has ended (for a word-joining decoder any start works)."""
        start = max(self._read, len(self._window) - _CONTEXT)
        if start > self._read:
            tail = self._decode(self._window[start:])
            if tail and not tail.startswith(REPLACEMENT) and window_text.endswith(tail):
                self._set_window(self._window[start:], len(tail))
                return
        if self._read == 0:
            self._set_window(self._window, len(window_text))
        else:
            window = self._window[self._read:]
            self._set_window(window, len(self._decode(window)))

    def _split(self, window_text: str) -> None:
        """The text has ended in U+FFFD for many tokens (e.g. stray continuation bytes that never
        complete a character): move the window start to j, _SPLIT_KEEP tokens from the end, so that
        the window cannot grow with the length of such a run.

        j may fall inside a character S. Its bytes before j end decode(window[:j]) with exactly one
        U+FFFD (an incomplete prefix) where the full decode has S's one character; its m <= 3 bytes
        after j are continuation bytes that decode(window[j:]) shows as m leading U+FFFD ("junk"),
        after which both decodes agree. So len(window_text) - len(left) is the number r of characters
        after S, and m = len(right) - r. S must have ended before the text's last character (r >= 1),
        else it is the unfinished one and no split is made. Checks that fail mean a decoder that is
        not byte-level: then keep the window (exact, only longer)."""
        j = len(self._window) - _SPLIT_KEEP
        left = self._decode(self._window[:j])
        right = self._decode(self._window[j:])
        r = len(window_text) - len(left)
        m = len(right) - r
        if r < 1 or not 0 <= m <= 3 or right[:m] != REPLACEMENT * m or not window_text.endswith(right[m:]):
            self._pending_limit = 2 * (len(self._window) - self._read)
            return
        # Everything but the held last character is emitted; junk counts as emitted.
        self._window = self._window[j:]
        self._read = 0
        self._emitted = len(right) - 1
        self._pending_limit = _MAX_PENDING

    def _set_window(self, window: list[int], emitted: int) -> None:
        self._window = window
        self._read = len(window)
        self._emitted = emitted
        self._pending_limit = _MAX_PENDING


def find_stop(text: str, stops: Sequence[str], search_from: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after `search_from` (the length of the text
    already searched): each one is looked for from search_from - len(stop) + 1, so one spanning the
    old/new boundary is found and none is reported twice. Returns (position, stop) or None; on a
    tie, the stop listed first. Empty stop strings are ignored (they mark no place)."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
