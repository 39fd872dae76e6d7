"""Shared fixtures: one tiny DeepSeek-V4 checkpoint (real tokenizer, official tensor format) per
test session, built once and reused read-only by every test that needs a model on disk."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory) -> Path:
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v4_ckpt"), seed=0)
