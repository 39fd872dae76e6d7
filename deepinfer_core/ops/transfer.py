"""Host lists to device tensors without stalling the host.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream
to drain: one hidden host sync per call, which serialises the host with every kernel queued before.
Staging through pinned memory makes the copy asynchronous (torch's pinned-memory cache keeps the
staging buffer alive until the copy has run).
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values: Sequence) -> None:
    """`dst.copy_(values)` from a host list, asynchronously on an accelerator."""
    host = torch.tensor(values, dtype=dst.dtype)
    if dst.device.type != "cpu":
        host = host.pin_memory()
    dst.copy_(host.view(dst.shape), non_blocking=True)
