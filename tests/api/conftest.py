"""Fixtures for the API tests: a fake ModelRunner with scripted logits and a tiny word tokenizer."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.cache.block_allocator import BlockAllocator
from deepinfer_core.cache.budget import CacheRequest
from deepinfer_core.ops.sampler import Sampler

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
    """Implements the runner contract (deepinfer_core/contracts.py EngineRunner) with the portable
    sampler, no logits processors and a plain block counter for a cache:
    logits[i] = fn(all tokens fed to the sequence up to position i)."""

    device = "cpu"
    sampler = Sampler()
    logits_processors: list = []
    scheduler_policy = None          # first come, first served
    profile_tokens: int | None = None
    checkpoint_slots = 0                 # set by allocate_cache
    dtype = torch.float32

    def __init__(self, fn: Callable[[list[int]], torch.Tensor] = random_logits, vocab: int = VOCAB,
                 max_pos: int = 4096, eos: int = EOS, max_slots: int = 1024):
        self.fn = fn
        self.model_config = SimpleNamespace(vocab_size=vocab, eos_token_id=eos, bos_token_id=BOS,
                                            max_position_embeddings=max_pos)
        self.calls: list[tuple[int, bool]] = []   # (tokens fed, all rows' logits) per sequence chunk
        self.seqs: list[FakeSeq] = []             # one per binding of a slot, in order
        self.last_token = torch.zeros(max_slots, dtype=torch.long)
        self._in_slot: dict[int, FakeSeq] = {}
        self._cache: tuple | None = None
        self.cache: SimpleNamespace | None = None

    def allocate_cache(self, request: CacheRequest) -> SimpleNamespace:
        """A block counter of the size asked for (every sequence at max_model_len unless
        num_blocks; prefix-cache checkpoints in extra slots), the same one while the request is
        unchanged."""
        per_seq = -(-request.max_model_len // 128)
        shape = (request.num_blocks or request.num_slots * per_seq,
                 request.num_slots + request.checkpoint_slots)
        self.checkpoint_slots = request.checkpoint_slots
        if self._cache is None or self._cache[0] != shape:
            self.cache = SimpleNamespace(allocator=BlockAllocator(*shape),
                                         layout=SimpleNamespace(block_size=128))
            self._cache = (shape, self.cache)
        return self._cache[1]

    def make_speculator(self) -> None:
        return None

    def execute(self, batch) -> torch.Tensor:
        """A slot's state is the tokens fed to it; prefix-cache checkpoints copy them."""
        up = batch.updates
        for src, dst in up.saves:
            self._in_slot[dst] = FakeSeq(list(self._in_slot[src].tokens))
        for slot in up.bound_slots:
            self._in_slot[slot] = FakeSeq()
            self.seqs.append(self._in_slot[slot])
        for src, dst in up.restores:
            self._in_slot[dst].tokens = list(self._in_slot[src].tokens)
        wanted, rows, off = set(batch.logit_rows), [], 0
        for slot, start, n in zip(batch.slots, batch.starts, batch.lens):
            seq = self._in_slot[slot]
            assert len(seq.tokens) == start and n > 0
            assert start + n <= self.model_config.max_position_embeddings
            all_rows = all(off + i in wanted for i in range(n))
            self.calls.append((n, all_rows and n > 1))
            for i in range(n):
                t = batch.ids[off + i]
                seq.tokens.append(int(self.last_token[-1 - t]) if t < 0 else t)
                if off + i in wanted:
                    rows.append(self.fn(list(seq.tokens)).float())
            off += n
        if not rows:
            return torch.empty(0, self.model_config.vocab_size)
        return torch.stack(rows)


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
