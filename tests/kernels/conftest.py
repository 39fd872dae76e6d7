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


@pytest.fixture(params=["close", pytest.param("bitwise", marks=pytest.mark.gpu)])
def rows_match(request, kdev):
    """`rows_match(got, want)` for a row computed alone and the same row inside a larger launch.

    "bitwise" (marked gpu): the compiled kernels' guarantee, asserted on a CUDA GPU. "close": what
    the interpreter can promise on any host. There tl.dot is NumPy's matmul, whose rounding depends
    on the host's BLAS kernel (OpenBLAS picks one per CPU: Haswell and Zen round a row differently
    when its neighbours change, SkylakeX does not), so rows agree to rounding only."""
    if request.param == "bitwise":
        assert kdev == "cuda", "bitwise row invariance is asserted on the compiled kernels: needs a CUDA GPU"

        def match(got: torch.Tensor, want: torch.Tensor) -> None:
            assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max():.3g}"
    else:
        def match(got: torch.Tensor, want: torch.Tensor) -> None:
            torch.testing.assert_close(got.cpu(), want.cpu())      # torch's per-dtype tolerances
    return match
