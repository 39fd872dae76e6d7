"""Triton kernels for DeepInfer's NVIDIA backend (SM90 and SM100). Each kernel has a pure-PyTorch
reference in `deepinfer_core` and a test against it (`tests/kernels`, run under TRITON_INTERPRET=1
on CPU in CI and compiled on a GPU with `-m gpu`).

Supported Triton: 3.6 to 3.9, the releases that torch 2.11 to 2.14 bring (3.6.0, 3.7.x, 3.8.x) plus
the newest, which xgrammar pulls in beside a CPU torch (compiled on an H200 with 3.6; every kernel
test under the interpreter with each of 3.6, 3.7.1, 3.8.0 and 3.9.0). pyproject.toml declares the same
range; any other version is refused here, at import, with one message instead of a kernel failing later.
"""
from __future__ import annotations

import re

TRITON_MIN, TRITON_BELOW = (3, 6), (3, 10)
TRITON_REQUIREMENT = "triton>=3.6,<3.10"


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    return major, minor


def check_triton_version(version: str) -> None:
    """ImportError naming the supported range when `version` (triton.__version__) is outside it."""
    if not TRITON_MIN <= _version_tuple(version) < TRITON_BELOW:
        raise ImportError(f"deepinfer-kernels supports {TRITON_REQUIREMENT}, found triton {version}; "
                          f"install a supported one: pip install '{TRITON_REQUIREMENT}'")


try:
    import triton
except ImportError as exc:
    raise ImportError(f"deepinfer-kernels needs {TRITON_REQUIREMENT} (CUDA builds of torch bring it; "
                      f"on a CPU, for TRITON_INTERPRET=1: pip install '{TRITON_REQUIREMENT}')") from exc
check_triton_version(triton.__version__)
