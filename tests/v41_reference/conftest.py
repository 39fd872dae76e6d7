"""Fixtures of the V4.1 reference tests: one random tiny V4.1 model (official tensor format,
a small byte-level tokenizer) and one token sequence, shared by the package's test modules."""
from __future__ import annotations

import pytest
import torch

from ._random_weights import SEQ_LEN as T
from ._random_weights import make_random_tensors, make_tokenizer_json, tiny_config
from .engram_ref import compressed_ids, load_tokenizer
from .reference import ReferenceV41


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """The shapes here are tiny: one intra-op thread is as fast and never spins against other
    processes on a busy machine (the thread count is restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def model():
    tok = make_tokenizer_json(512)
    _, v = compressed_ids(load_tokenizer(tok))
    cfg = tiny_config(engram_compressed_vocab_size=v)
    tensors = make_random_tensors(cfg, seed=0)
    return cfg, tensors, tok, ReferenceV41(cfg, tensors, tok)


@pytest.fixture(scope="package")
def ids():
    return torch.randint(3, 512, (T,), generator=torch.Generator().manual_seed(1)).tolist()
