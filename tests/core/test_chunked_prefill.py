"""Prefill of T tokens equals prefill of P tokens followed by T-P single-token steps from our state
cache (float32, QAT off), for P on and off the compressor block boundaries (4, 128) and past the
16-token window; and arbitrary chunkings agree too."""
from __future__ import annotations

import pytest
import torch

from oracle_utils import Ours, max_rel_err

TOL = 1e-4
T = 264   # two HCA blocks close inside the run (positions 127 and 255)


@pytest.fixture(scope="module")
def ours(tiny_ckpt_dir):
    return Ours(tiny_ckpt_dir)


@pytest.fixture(scope="module")
def reference(ours):
    ids = torch.randint(2, 129280, (T,), generator=torch.Generator().manual_seed(5)).tolist()
    return ids, ours.logits(ids)


@pytest.mark.parametrize("P", [1, 3, 4, 5, 15, 16, 17, 127, 128, 129, 255, 256, 257])
def test_prefill_then_single_steps_equals_full_prefill(ours, reference, P):
    """30 single steps after P cross several ratio-4 boundaries and the whole window; the model is
    causal, so the reference for the first P+30 tokens is a prefix of the full prefill."""
    ids, full = reference
    n = min(T, P + 30)
    got = ours.logits(ids[:n], chunks=[P] + [1] * (n - P))
    err = max_rel_err(got, full[:n])
    assert err.max() <= TOL, f"P={P}: max relative error {err.max():.2e} at position {int(err.argmax())}"


@pytest.mark.parametrize("chunks", [[3] * 88, [7] * 37 + [5], [4] * 66, [128, 128, 8], [1, 130, 2, 131]])
def test_any_chunking_equals_full_prefill(ours, reference, chunks):
    ids, full = reference
    assert sum(chunks) == T
    err = max_rel_err(ours.logits(ids, chunks=chunks), full)
    assert err.max() <= TOL, f"chunks {chunks[:4]}...: max relative error {err.max():.2e}"
