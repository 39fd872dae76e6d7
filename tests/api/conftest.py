"""Fixtures for the API tests: a fake ModelRunner with scripted logits and a tiny word tokenizer."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

VOCAB = 32
EOS = 1
BOS = 0
WORDS = ["<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 2)]   # id i <-> WORDS[i]


def random_logits(ctx: list[int]) -> torch.Tensor:
    """Deterministic pseudo-random logits that depend on the whole context."""
    h = 1469598103934665603
    for t in ctx:
        h = ((h ^ (t + 1)) * 1099511628211) & ((1 << 63) - 1)
    g = torch.Generator().manual_seed(h)
    return torch.randn(VOCAB, generator=g) * 2.0


def next_word_logits(ctx: list[int]) -> torch.Tensor:
    """Greedy continues 2, 3, 4, ... (wrapping, never EOS/BOS) with a clear margin."""
    nxt = ctx[-1] + 1 if ctx[-1] + 1 < VOCAB else 2
    nxt = max(nxt, 2)
    logits = torch.linspace(-1.0, 1.0, VOCAB)
    logits[nxt] = 6.0
    return logits


@dataclass
class FakeSeq:
    tokens: list[int] = field(default_factory=list)
    released: bool = False


class FakeRunner:
    """Implements the ModelRunner interface: logits[i] = fn(all tokens fed up to position i)."""

    def __init__(self, fn: Callable[[list[int]], torch.Tensor] = random_logits, vocab: int = VOCAB,
                 max_pos: int = 4096, eos: int = EOS):
        self.fn = fn
        self.model_config = SimpleNamespace(vocab_size=vocab, eos_token_id=eos, bos_token_id=BOS,
                                            max_position_embeddings=max_pos)
        self.calls: list[tuple[int, bool]] = []   # (number of tokens, all_logits) per forward
        self.seqs: list[FakeSeq] = []

    def new_sequence(self) -> FakeSeq:
        seq = FakeSeq()
        self.seqs.append(seq)
        return seq

    def bind_sequence(self, slot: int, block_ids: list[int]) -> FakeSeq:
        return self.new_sequence()

    def forward(self, seq: FakeSeq, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        assert not seq.released and token_ids
        assert len(seq.tokens) + len(token_ids) <= self.model_config.max_position_embeddings
        self.calls.append((len(token_ids), all_logits))
        rows = []
        for t in token_ids:
            seq.tokens.append(t)
            rows.append(self.fn(list(seq.tokens)).float())
        out = torch.stack(rows)
        return out if all_logits else out[-1:]

    def forward_batch(self, token_ids: list[list[int]], seqs: list[FakeSeq], all_logits: bool = False,
                      logit_modes: list[str] | None = None) -> torch.Tensor:
        """The batched interface the engine uses: rows per sequence by mode ("all"/"last"/"none")."""
        modes = logit_modes or ["all" if all_logits else "last"] * len(seqs)
        outs = []
        for toks, seq, mode in zip(token_ids, seqs, modes):
            out = self.forward(seq, toks, all_logits=mode == "all")
            outs.append(out[:0] if mode == "none" else out)
        return torch.cat(outs)

    def release(self, seq: FakeSeq) -> None:
        seq.released = True

    @property
    def live(self) -> int:
        return sum(not s.released for s in self.seqs)


def write_tokenizer(directory, add_bos: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()      # joins words with spaces
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    config = {"add_bos_token": add_bos, "bos_token": {"__type": "AddedToken", "content": "<s>"},
              "eos_token": "</s>", "model_max_length": 4096}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def tok_dir(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    write_tokenizer(d)
    return d


@pytest.fixture
def make_llm(tok_dir):
    """make_llm(fn=..., tokenizer=True, **LLM options) -> (llm, runner)."""
    from deepinfer_core.api.llm import LLM

    def make(fn=random_logits, tokenizer: bool = True, max_pos: int = 4096, **kw):
        runner = FakeRunner(fn, max_pos=max_pos)
        llm = LLM.from_runner(runner, tokenizer=tok_dir if tokenizer else None, **kw)
        return llm, runner

    return make


@pytest.fixture
def fake():
    """The helpers above, for tests (conftest modules are not imported by name)."""
    return SimpleNamespace(VOCAB=VOCAB, EOS=EOS, BOS=BOS, WORDS=WORDS, FakeRunner=FakeRunner,
                           random_logits=random_logits, next_word_logits=next_word_logits,
                           write_tokenizer=write_tokenizer)
