"""Programmatic dependent launch (PDL, SM90 and later) for every DeepInfer kernel.

A decode step is a chain of a few hundred small dependent kernels; in a CUDA graph each boundary still
costs the next kernel's launch and ramp-up after the previous one has drained. With PDL the next
kernel is launched while the previous one runs: its programs start, wait in `griddepcontrol.wait`
until the previous kernel has finished and its writes are visible, and only then touch memory
(`benchmarks/pdl_chain.py` measures the saving per boundary).

The contract that keeps this safe: a kernel launched with PDL (`launch_args` on) must call
`pdl_gate(PDL)` in every program before any load or store. Only `prefetch_l2` of memory that no kernel
writes (the weights) may come first: a GEMM then streams its weight slice into L2 while the kernel
before it still runs. Each program then waits for its predecessor's completion, so the guarantee is
transitive down the chain, and a kernel that follows a non-PDL kernel (torch, cuBLAS) waits at once.
`tests/kernels/test_pdl.py` checks that every kernel with a PDL parameter passes the gate before any
memory access.

Opt-in for now (DEEPINFER_PDL=1) until it has been measured and the compiled tests have passed with it
on a GPU; always off under Triton's interpreter, on CPUs and before SM90.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# DEEPINFER_PDL, declared with the other variables in deepinfer_core/envs.py (this package does not
# import the core): the same boolean spellings, the same error for anything else
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")
_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False, "launch_pdl": False}


@triton.jit
def pdl_gate(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one has finished and its writes are visible, then
    let the next kernel launch (its programs wait in their own gate)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 to fetch the 128-byte lines at `ptrs`; nothing is written or waited for."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def requested() -> bool:
    """DEEPINFER_PDL as a bool (unset or empty: off); ValueError naming the variable otherwise."""
    raw = os.environ.get("DEEPINFER_PDL", "").strip()
    if raw.lower() in _TRUE + _FALSE + ("",):
        return raw.lower() in _TRUE
    raise ValueError(f"DEEPINFER_PDL={raw!r} is invalid; allowed: 0, 1, true, false, yes, no")


@functools.lru_cache(maxsize=None)
def _enabled(index: int | None) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not requested():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_args(t: torch.Tensor) -> dict:
    """Launch keyword arguments for a kernel whose tensors live where `t` does: the kernel's PDL
    constexpr and Triton's launch_pdl, both on or both off."""
    return _ON if t.is_cuda and _enabled(t.device.index) else _OFF
