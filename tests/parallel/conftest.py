"""Shared by the gloo tests: spawn `world` ranks of a test module's worker and collect what each wrote."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(worker: Callable, world: int, out_dir: Path, deadline_s: float, *args) -> tuple[list, list]:
    """worker(rank, world, port, *args, out_dir) on `world` spawned ranks; returns (each rank's
    out_dir/rank{r}.pt or None, exit codes). Ranks still running after `deadline_s` are killed and fail
    the test: a hang must never stall the suite."""
    out_dir.mkdir(exist_ok=True)
    ctx = mp.spawn(worker, args=(world, _free_port(), *args, str(out_dir)), nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    for proc in ctx.processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(ctx.processes) if proc.is_alive()]
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert not hung, f"ranks {hung} of {world} still running after {deadline_s} s ({args})"
    results = [torch.load(out_dir / f"rank{r}.pt") if (out_dir / f"rank{r}.pt").exists() else None
               for r in range(world)]
    return results, [proc.exitcode for proc in ctx.processes]


@pytest.fixture(scope="session")
def run_ranks() -> Callable[..., tuple[list, list]]:
    return _run_ranks
