"""`DataParallelLLM`: `data_parallel_size` engine processes on one host, attention data parallel and
the routed experts sharded over them (MoE expert parallelism), CPU ranks over gloo.

The front end (this process) parses and tokenizes the prompts, derives each request's seed exactly as
`LLM.generate` does (so a seeded or greedy request gives the same tokens on any rank), spreads the
requests over the ranks by load and collects the `RequestOutput`s back in the caller's order. Each
rank (`dp_worker.py`) runs its own engine over its requests; all ranks step in lockstep so that the
EP collectives pair up (spec parallelism.md §3.1).

Assignment: requests in input order, each to the rank with the fewest prompt tokens assigned so far
(x n completions), lowest rank on ties: deterministic, and a rank may get none (it then only serves
the others' MoE rows).

Failure: a rank that dies (killed, crashed) or reports an error (a dead peer's `EPCommError`, a load
failure) ends the whole engine: the other ranks are terminated and one RuntimeError names the rank
that failed first (a rank that died without a word is the root cause; its peers' errors follow it).
The front end polls the processes while it waits, and the ranks' collectives time out after
`timeout_s`, so nothing waits forever.

Not here yet: GPU ranks (nccl, one device per rank), speculative decoding (its verify steps need a
vote on the MoE call count), the step-type vote of §3.1(b) (each rank schedules prefill and decode
freely; lockstep only pairs the forwards), EPLB rearrangement, and the `data_parallel_size` option of
`LLM(...)`, the CLI and the server (EngineConfig still allows only 1).
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as mp

from ..api.llm import _resolve_model, parse_prompts, per_request_params
from ..api.outputs import InvalidRequestError, RequestOutput
from ..api.sampling_params import SamplingParams
from ..api.tokenizer import load_tokenizer
from ..engine_config import EngineConfig
from ..ops.sampler import mix_seed
from .dp_worker import EXIT_TEST_HOOK, RankRequest, RankResult, RankStats, WorkerSpec, worker_main

log = logging.getLogger("deepinfer.dp")

DEFAULT_TIMEOUT_S = 60.0       # gloo collective timeout of the ranks (a hung peer fails after this)
POLL_S = 0.1                   # how often the front end checks that the ranks are alive
GRACE_S = 5.0                  # after a failure: how long the peers get to report theirs
STOP_S = 10.0                  # close(): how long the ranks get to leave before they are killed


def assign_ranks(loads: Sequence[int], world: int) -> list[int]:
    """Rank of each request: the one with the fewest tokens assigned so far, lowest rank on ties."""
    assigned = [0] * world
    out = []
    for n in loads:
        r = min(range(world), key=lambda k: (assigned[k], k))
        assigned[r] += n
        out.append(r)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "the test hook's exit" if code == EXIT_TEST_HOOK else f"exit code {code}"


class DataParallelLLM:
    """`LLM`'s `generate` over `data_parallel_size` engine processes (CPU, gloo).

    `expert_parallel`: shard the routed experts over the ranks (each rank loads only its own slots);
    False replicates them (the ranks then share only the lockstep vote). `num_redundant_experts`: extra
    physical slots (replicas), rounded up so every rank gets as many. `options`: `EngineConfig` options by
    name, as for `LLM(...)`, applied to every rank (each rank has its own state cache of that size).
    Use as a context manager or call `close()`: the ranks are processes."""

    def __init__(self, model: str | None = None, data_parallel_size: int = 2, expert_parallel: bool = True,
                 num_redundant_experts: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S, **options: Any):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={data_parallel_size!r}: must be an int >= 1")
        if not isinstance(expert_parallel, bool):
            raise ValueError(f"expert_parallel={expert_parallel!r}: allowed values: True, False")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0 seconds")
        if options.get("device", "cpu") not in (None, "cpu"):
            raise ValueError(f"device={options['device']!r}: DataParallelLLM runs CPU ranks over gloo only so far; "
                             "allowed: 'cpu'")
        if options.get("num_speculative_tokens") not in (None, 0):
            raise ValueError(f"num_speculative_tokens={options['num_speculative_tokens']!r}: speculative decoding "
                             "is not supported with data parallelism yet (its verify steps would need a vote on "
                             "the MoE call count); allowed: 0")
        options = {**options, "device": "cpu", "num_speculative_tokens": 0}
        config = EngineConfig.from_options(model=model, **options)
        if config.model.model is None:
            from ..tools.bundled_model import bundled_tiny_model_dir
            config = config.replace(model=str(bundled_tiny_model_dir()))
        self.model_dir = _resolve_model(config.model.model)
        self.config, self.world = config, data_parallel_size
        self.tokenizer = load_tokenizer(self.model_dir, config.model.tokenizer)
        self.last_stats: list[RankStats] = []
        self._request_counter = 0
        self._exit_at: tuple[int, int] | None = None      # test hook: (rank, lockstep iteration)
        self._failed: str | None = None
        self._start(expert_parallel, num_redundant_experts, timeout_s)

    # ---- processes -----------------------------------------------------------------------------
    def _start(self, expert_parallel: bool, num_redundant: int, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // self.world)          # the ranks share this host's cores
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(self.world)]
        self._procs = []
        for rank in range(self.world):
            spec = WorkerSpec(rank, self.world, init, str(self.model_dir), self.config, expert_parallel,
                              num_redundant, timeout_s, threads)
            proc = ctx.Process(target=worker_main, args=(spec, self._commands[rank], self._results),
                               name=f"deepinfer-dp{rank}", daemon=True)
            proc.start()
            self._procs.append(proc)
        self._wait("ready")
        log.info("data parallel: %d ranks ready (expert_parallel=%s)", self.world, expert_parallel)

    def _wait(self, kind: str) -> dict[int, tuple]:
        """One `kind` message from every rank; a rank's error or death raises (see `_fail`)."""
        got: dict[int, tuple] = {}
        while len(got) < self.world:
            try:
                msg = self._results.get(timeout=POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    self._fail({})
                continue
            if msg[0] == "error":
                self._fail({msg[1]: msg[2]})
            if msg[0] != kind:
                raise RuntimeError(f"DataParallelLLM: rank {msg[1]} sent {msg[0]!r} while {kind!r} was expected")
            got[msg[1]] = msg
        return got

    def _fail(self, errors: dict[int, str]) -> None:
        """Collect what the ranks say for GRACE_S, stop them all, raise one RuntimeError."""
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            try:
                msg = self._results.get(timeout=POLL_S)
                if msg[0] == "error":
                    errors.setdefault(msg[1], msg[2])
            except queue.Empty:
                if all(p.exitcode is not None for p in self._procs):
                    break
        self._drain(errors)      # what the last ranks said just before they exited
        codes = {r: p.exitcode for r, p in enumerate(self._procs)}
        self._kill()
        silent = [r for r, c in codes.items() if c is not None and r not in errors]
        if silent:        # died without a word: killed or crashed, the root cause of its peers' errors
            first = silent[0]
            head = f"data-parallel rank {first} of {self.world} died ({_exit_text(codes[first])})"
        else:
            first = min(errors)
            head = f"data-parallel rank {first} of {self.world} failed: {errors[first]}"
        others = [f"rank {r}: {e}" for r, e in sorted(errors.items()) if r != first]
        others += [f"rank {r} died ({_exit_text(codes[r])})" for r in silent if r != first]
        self._failed = head
        raise RuntimeError(f"DataParallelLLM: {head}; the engine has stopped (every rank terminated)"
                           + ("".join(f"\n  {o}" for o in others) if others else ""))

    def _drain(self, errors: dict[int, str]) -> None:
        while True:
            try:
                msg = self._results.get(timeout=POLL_S)
            except queue.Empty:
                return
            if msg[0] == "error":
                errors.setdefault(msg[1], msg[2])

    def _kill(self) -> None:
        for q in self._commands:
            q.cancel_join_thread()       # a command a dead rank never read must not block our exit
        for p in self._procs:
            if p.exitcode is None:
                p.kill()
        for p in self._procs:
            p.join(STOP_S)

    def close(self) -> None:
        """Stop the ranks (they leave their process groups); those that do not leave in time are killed."""
        if not getattr(self, "_procs", None):
            return
        for q, p in zip(self._commands, self._procs):
            if p.exitcode is None:
                q.put(("stop",))
        deadline = time.monotonic() + STOP_S
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        self._procs = []

    def __enter__(self) -> DataParallelLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:      # interpreter shutdown: the daemonic ranks die with this process anyway
            pass

    # ---- generate ------------------------------------------------------------------------------
    def generate(self, prompts: Any = None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Any = None) -> list[RequestOutput] | list[str]:
        """As `LLM.generate`: one RequestOutput per prompt in input order (bad requests: an
        InvalidRequestError after the others finished). No progress bar: the outputs arrive when every
        rank is done."""
        if self._failed is not None or not self._procs:
            raise RuntimeError(f"DataParallelLLM: the engine has stopped ({self._failed or 'closed'})")
        parsed = parse_prompts(prompts, prompt_token_ids)
        params = per_request_params(sampling_params, len(parsed))
        errors: dict[int, ValueError] = {}
        requests: list[RankRequest] = []
        for i, (entry, p) in enumerate(zip(parsed, params)):
            try:
                requests.append(self._request(i, entry, p))
            except (ValueError, TypeError) as e:
                errors[i] = e
        self._request_counter += len(parsed)
        ranks = assign_ranks([len(r.prompt_token_ids) * r.params.n for r in requests], self.world)
        exit_at, self._exit_at = self._exit_at, None
        for rank, q in enumerate(self._commands):
            mine = [r for r, k in zip(requests, ranks) if k == rank]
            hook = (exit_at[1],) if exit_at is not None and exit_at[0] == rank else ()
            q.put(("generate", mine, *hook))
        done = self._wait("done")
        outputs: list[Any] = [None] * len(parsed)
        self.last_stats = []
        for rank in range(self.world):
            res: RankResult = done[rank][2]
            self.last_stats.append(res.stats)
            for i, out in res.outputs.items():
                outputs[i] = out
            for i, text in res.errors.items():
                errors[i] = ValueError(text)
        if self.config.decode_sequence:
            outputs = [None if o is None else o.outputs[0].text for o in outputs]
        if errors:
            raise InvalidRequestError(errors, outputs)
        return outputs

    def _request(self, i: int, entry: Any, params: SamplingParams) -> RankRequest:
        """The request as `LLM._submit` would add it: ids tokenized here, the seed and id from the
        same counter, so the outputs do not depend on which rank runs it."""
        if isinstance(entry, ValueError):
            raise entry
        text, ids = entry
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(f"generate: prompt {i} is text but the checkpoint has no tokenizer files; "
                                 "pass prompt_token_ids or tokenizer=...")
            ids = self.tokenizer.encode(text)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"generate: sampling_params[{i}] must be a SamplingParams")
        counter = self._request_counter + i
        seed = params.seed if params.seed is not None else mix_seed(self.config.model.seed, counter)
        return RankRequest(i, str(counter), text, list(ids), params, seed)
