"""xgrammar's view of a DeepInfer tokenizer: each token id's bytes, over the model's vocabulary.

Added tokens (BOS/EOS, the chat-format and tool-call markers, the placeholders) are control tokens:
they get an empty entry, which xgrammar treats as special and never allows inside a grammar, so a
JSON string cannot swallow `<｜tool▁call▁begin｜>`. Stop tokens are given per request to the matcher.
Ids past the tokenizer (the model's padded vocabulary) are special too.

Built once per (tokenizer file, model vocabulary); xgrammar decodes the byte-level vocabulary, which
takes about a second for V4's 129,280 tokens.
"""
from __future__ import annotations

import json
import threading
from typing import Any

_lock = threading.Lock()
_infos: dict[tuple, Any] = {}


def tokenizer_key(tokenizer: Any, vocab_size: int) -> tuple:
    """Identifies a tokenizer's vocabulary without hashing it: its file and that file's stamp."""
    path = getattr(tokenizer, "path", None)
    if path is not None:
        file = path / "tokenizer.json"
        try:
            st = file.stat()
            return str(file.resolve()), st.st_size, st.st_mtime_ns, vocab_size
        except OSError:
            pass
    return "object", id(tokenizer.backend), vocab_size


def _vocab_type(backend: Any):
    """Byte-level BPE (V4), byte-fallback (SentencePiece-style) or raw, from the decoder."""
    import xgrammar as xgr

    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _prepends_space(backend: Any) -> bool:
    """Metaspace tokenizers that prepend "▁" to the first word (xgrammar's add_prefix_space)."""
    cfg = json.loads(backend.to_str())
    stack = [cfg.get("pre_tokenizer") or {}, cfg.get("normalizer") or {}]
    while stack:
        node = stack.pop()
        stack.extend(node.get("pretokenizers", []) or [])
        stack.extend(node.get("normalizers", []) or [])
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") != "never":
            return True
        if node.get("type") == "Prepend":
            return True
    return False


def build_tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_id: int | None):
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx in backend.get_added_tokens_decoder():
        if idx < vocab_size:
            encoded[idx] = ""                      # a control token: never grammar text
    stop = [eos_token_id] if eos_token_id is not None else None
    return xgr.TokenizerInfo(encoded, _vocab_type(backend), vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=_prepends_space(backend))


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_id: int | None):
    """The cached TokenizerInfo of this tokenizer and vocabulary (built on first use)."""
    key = tokenizer_key(tokenizer, vocab_size) + (eos_token_id,)
    with _lock:
        info = _infos.get(key)
        if info is None:
            info = _infos[key] = build_tokenizer_info(tokenizer, vocab_size, eos_token_id)
        return info
