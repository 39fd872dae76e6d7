"""Shared by the gloo tests: spawn `world` ranks of a test module's worker and collect what each wrote;
the data-parallel engines' greedy workload and its one-process oracle."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_core import LLM, SamplingParams


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


@dataclass(frozen=True)
class DpWorkload:
    """16 greedy prompts x 32 tokens, most growing past one 128-position block; `common`: float32, QAT
    off, batch-invariant GEMMs (the same numbers whatever batch, chunk or rank a prompt lands in);
    `tight`: a 3-block cache and a 64-token step budget (preemption and chunked prefill on every rank)."""

    num_prompts: int = 16
    max_tokens: int = 32
    lengths: tuple[int, ...] = (100, 120, 105, 40, 115, 98, 125, 70)
    common: dict = field(default_factory=lambda: dict(dtype="float32", simulate_qat=False, batch_invariant=True,
                                                      num_speculative_tokens=0))
    tight: dict = field(default_factory=lambda: dict(num_cache_blocks=3, max_num_batched_tokens=64,
                                                     max_num_seqs=8))

    @property
    def greedy(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)

    def prompts(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(5)
        return [torch.randint(2, 129280, (self.lengths[i % len(self.lengths)],), generator=g).tolist()
                for i in range(self.num_prompts)]


@pytest.fixture(scope="session")
def dp_workload() -> DpWorkload:
    return DpWorkload()


@pytest.fixture(scope="session")
def dp_oracle(dp_workload: DpWorkload, tiny_ckpt_dir) -> list[list[int]]:
    """The workload's greedy tokens from plain `LLM.generate` in this process (a roomy cache)."""
    llm = LLM(model=str(tiny_ckpt_dir), **dp_workload.common)
    out = llm.generate(prompt_token_ids=dp_workload.prompts(), sampling_params=dp_workload.greedy, use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]
