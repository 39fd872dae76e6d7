"""Host lists to device tensors, and device tensors to the host, without stalling the host.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream
to drain: one hidden host sync per call, which serialises the host with every kernel queued before.
Staging through pinned memory makes the copy asynchronous (torch's pinned-memory cache keeps the
staging buffer alive until the copy has run).
"""
from __future__ import annotations

from typing import Sequence

import torch


def _staged(values: Sequence, dtype: torch.dtype, device) -> torch.Tensor:
    """The values on the host, in pinned memory when they are headed for an accelerator."""
    host = torch.tensor(values, dtype=dtype)
    return host if torch.device(device).type == "cpu" else host.pin_memory()


def to_device(values: Sequence, dtype: torch.dtype, device) -> torch.Tensor:
    host = _staged(values, dtype, device)
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values: Sequence) -> None:
    """`dst.copy_(values)` from a host list, asynchronously on an accelerator."""
    dst.copy_(_staged(values, dst.dtype, dst.device).view(dst.shape), non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` that completes asynchronously (pinned): read it after the step's event."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
