"""Tokenizer: a thin wrapper over an HF `tokenizers.Tokenizer` read from `tokenizer.json`.

Special tokens (BOS/EOS) come from `tokenizer_config.json`. No BOS is added automatically: the
DeepSeek-V4 `tokenizer_config.json` sets `add_bos_token: false` (the chat template writes
`<｜begin▁of▁sentence｜>` itself), and `encode` follows that flag. Special-token text inside a prompt
is still recognised as the special token.

Incremental (streaming) detokenisation is left to the engine; `decode` works on full id lists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as an AddedToken dict.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class Tokenizer:
    """Encode/decode with a checkpoint's tokenizer. Build it with `Tokenizer.from_path`."""

    def __init__(self, backend: Any, config: dict[str, Any] | None = None, path: Path | None = None):
        self.backend = backend                  # tokenizers.Tokenizer
        self.config = dict(config or {})
        self.path = path
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        max_len = self.config.get("model_max_length")
        self.model_max_length = int(max_len) if isinstance(max_len, (int, float)) else None

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from a directory holding tokenizer.json (+ tokenizer_config.json) or from the file."""
        from tokenizers import (
            Tokenizer as HFTokenizer,  # lazy: keep `import deepinfer_core` light
        )

        path = Path(path).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} at {path}")
        config: dict[str, Any] = {}
        config_file = file.parent / TOKENIZER_CONFIG_FILE
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        return cls(HFTokenizer.from_file(str(file)), config, file.parent)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ---- public ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is prepended only if tokenizer_config says add_bos_token."""
        # The HF post-processor is bypassed so that tokenizer_config.json alone decides about BOS.
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    return (Path(directory) / TOKENIZER_FILE).is_file()


def load_tokenizer(model_dir: str | os.PathLike | None, tokenizer: Any = None) -> Tokenizer | None:
    """The tokenizer named by `tokenizer` (a `Tokenizer`, a path, or a repo id in the local HF cache),
    else the one in `model_dir`; None when the checkpoint has no tokenizer files."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is not None:
        if not isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(f"tokenizer must be a path, a repo id or a Tokenizer, "
                            f"got {type(tokenizer).__name__}")
        path = Path(tokenizer).expanduser()
        if not path.exists():
            path = _resolve_repo(str(tokenizer))
        try:
            return Tokenizer.from_path(path)
        except FileNotFoundError as e:
            raise ValueError(f"tokenizer={str(tokenizer)!r}: {e}") from None
    if model_dir is not None and has_tokenizer_files(model_dir):
        return Tokenizer.from_path(model_dir)
    return None


def _resolve_repo(name: str) -> Path:
    try:
        from ..model.weights import resolve_model_path
        return Path(resolve_model_path(name))
    except Exception as e:  # any lookup failure means the same thing to the user
        raise ValueError(f"tokenizer={name!r} is neither an existing path nor a repo id in the local "
                         f"HF cache ({e})") from None
