"""Kernel tests run compiled on a CUDA GPU and under Triton's interpreter (TRITON_INTERPRET=1) on
CPU, so CI checks every kernel without a GPU. The variable must be set before triton is imported."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402,F401  (build.sh --test installs it; a missing triton fails, never skips)


@pytest.fixture(scope="session")
def kdev() -> str:
    """Where kernels run: the GPU when there is one, else the interpreter on the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"
