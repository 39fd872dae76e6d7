"""Shared fixtures: one tiny DeepSeek-V4 checkpoint (real tokenizer, official tensor format) per
test session, built once and reused read-only by every test that needs a model on disk; and the
real V4-Flash data files kept in tests/data (see the README there)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

V4_FLASH_DATA = Path(__file__).resolve().parent / "data" / "deepseek-v4-flash"


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory) -> Path:
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v4_ckpt"), seed=0)


@pytest.fixture(scope="session")
def v4_flash_dir() -> Path:
    """tests/data/deepseek-v4-flash: the real config.json and the chat renderer's golden cases."""
    return V4_FLASH_DATA


@pytest.fixture(scope="session")
def v4_flash_config(v4_flash_dir) -> dict:
    """The real DeepSeek-V4-Flash config.json, as published."""
    return json.loads((v4_flash_dir / "config.json").read_text())
