"""`DataParallelLLM`: `data_parallel_size` engine processes on one host, attention data parallel and
the routed experts sharded over them (MoE expert parallelism), CPU ranks over gloo.

The front end (this process) parses and tokenizes the prompts, derives each request's seed exactly as
`LLM.generate` does (so a seeded or greedy request gives the same tokens on any rank), spreads the
requests over the ranks by load and collects the `RequestOutput`s back in the caller's order. Each
rank (`dp_worker.py`) runs its own engine over its requests; all ranks step in lockstep so that the
EP collectives pair up.

Assignment: each request to the rank with the least load (waiting + running tokens as the ranks report
them, plus the prompt tokens x n sent since), lowest rank on ties. `generate` on an idle engine therefore
places its requests exactly as `assign_ranks` does: deterministic, and a rank may get none (it then only
serves the others' MoE rows). With prefix caching on (and more than one rank), a request goes
instead to the rank that was sent the longest prefix of its prompt, when that rank's load is within
a slack of the least (dp_router.py); `reset_prefix_cache` resets every rank's cache (dp_online.py).

Online use (the server): `add_request` / `abort_request` / `step` / `has_unfinished_requests`, as the
in-process Engine (dp_online.py); `generate` is a client of the same interface.

Failure: a rank that dies (killed, crashed) or reports an error (a dead peer's `EPCommError`, a load
failure) ends the whole engine: the other ranks are terminated and one RuntimeError names the rank
that failed first (a rank that died without a word is the root cause; its peers' errors follow it).
The front end polls the processes while it waits, and the ranks' collectives time out after
`timeout_s`, so nothing waits forever. Start-up (rank_start.py): spawn imports the program's main
module in every rank, so a program read from stdin is refused before anything starts, and a rank that
dies before its own code runs is reported with the exception its start-up output ended with.

`LLM(model, data_parallel_size=N, enable_expert_parallel=True, ...)`, the CLI's `--data-parallel-size`
and `DataParallelLLM(...)` directly all run this engine (the options: engine_config.py ParallelOptions).

Launch: this process spawns the N ranks on its host (launcher='spawn'), or, with launcher='torchrun',
each rank is a torchrun process (any number of nodes): global rank 0's is this front end (it spawns rank
0's engine only), every other rank's runs its engine inside the constructor and exits (torchrun.py).

One rank (`engine_process=True`, e.g. `deepinfer serve --engine-process`): the engine moved out of the caller's
process onto whatever device it would have used, every option as in process; the vote and the
collectives vanish (a world of one has no process group), what remains is the command queue and the
report pipe. Measured slower than the in-process engine thread behind the server on the H200 so far (the
performance page, docs/performance.md).

Speculative decoding with the checkpoint's MTP block (`num_speculative_tokens > 0`; unset = 0 here): a
rank's step still launches at most one forward through the main, expert-parallel layers (the verify
forward); the MTP block drafts with its own, local experts, so the lockstep pairing holds (dp_worker.py).
With `enable_mtp_varlen` every rank profiles its step-time table with the same forwards at start-up and
all schedule with the elementwise maximum of the ranks' tables (`shared_varlen_policy`). A DSpark
checkpoint's drafter pairs the same way (its stages are the mtp.* blocks, with all their experts).

GPU ranks (device 'cuda'): rank r runs on GPU r, the EP group is an NCCL group (NVLink multicast off:
NCCL_NVLS_ENABLE=0 unless set), the vote and other control traffic stay on a gloo twin. Under expert
parallelism the ranks run eagerly (the variable exchange reads sizes on the host, which a CUDA graph
cannot hold), unless `enable_ep_cuda_graphs`: decode graphs then hold the fixed-size exchange
(ep_padded.py) and the ranks agree on each step's bucket (step_vote.py). Prefill and decode are not
voted on: this engine mixes them in one step, and eager forwards pair whatever their kind.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch.multiprocessing as mp

from ..api.inputs import parse_prompts, per_request_params, resolve_model_dir
from ..api.outputs import InvalidRequestError, RequestOutput
from ..api.sampling_params import SamplingParams
from ..api.tokenizer import load_tokenizer
from ..config import ModelConfig
from ..engine_config import EngineConfig
from ..ops.sampler import mix_seed
from .dp_config import (
    DEFAULT_TIMEOUT_S,
    GPU_TIMEOUT_S,
    collective_timeout,
    detect_platform,
    rank_config,
)
from .dp_messages import EXIT_TEST_HOOK, RankRequest, WorkerSpec
from .dp_online import OnlineFrontEnd
from .dp_worker import worker_main
from .rank_start import StartupOutput, check_spawnable
from .reports import ReportReceiver
from .torchrun import CONNECTION_LOST, ConnSender, FrontEnd, host_cores, run_rank, torchrun_env

log = logging.getLogger("deepinfer.dp")

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
    if code == CONNECTION_LOST:            # a rank in another torchrun process
        return "connection lost"
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "the test hook's exit" if code == EXIT_TEST_HOOK else f"exit code {code}"


def _death(code: int | None, start_cause: str) -> str:
    """'died (exit code 1)', or 'died during start-up (exit code 1): FileNotFoundError: ...'."""
    if start_cause:
        return f"died during start-up ({_exit_text(code)}): {start_cause}"
    return f"died ({_exit_text(code)})"


class DataParallelLLM(OnlineFrontEnd):
    """`LLM`'s `generate` over `data_parallel_size` engine processes (one GPU each over NCCL, or CPU ranks
    over gloo).

    `LLM(model, data_parallel_size=N, ...)` builds one of these (`from_config`); direct use takes the same
    options by name, with `enable_expert_parallel` defaulting to True here (shard the routed experts over
    the ranks, each loading only its own slots; False replicates them and the ranks share only the
    lockstep vote). `num_redundant_experts`: extra physical slots (replicas), rounded up so every rank gets
    as many; `enable_eplb` and its window/interval go to the ranks in `config.parallel`. Every option
    applies to every rank (each rank has its own state cache of that size).
    Use as a context manager or call `close()`: the ranks are processes. With `launcher='torchrun'` each
    torchrun process constructs it: on global rank 0 it is the front end, on every other rank the
    constructor runs that rank's engine until the front end stops it, then raises SystemExit(0) (the
    code after it runs on rank 0 only; torchrun.py)."""

    def __init__(self, model: str | None = None, data_parallel_size: int = 2,
                 enable_expert_parallel: bool | None = None, timeout_s: float | None = None, **options: Any):
        if enable_expert_parallel is None:      # the point of DP here is EP: on unless there is one rank
            enable_expert_parallel = not (isinstance(data_parallel_size, int) and data_parallel_size == 1)
        config = EngineConfig.from_options(model=model, data_parallel_size=data_parallel_size,
                                           enable_expert_parallel=enable_expert_parallel, **options)
        self._init(config, timeout_s)

    @classmethod
    def from_config(cls, config: EngineConfig, timeout_s: float | None = None) -> DataParallelLLM:
        """The engine `LLM(..., data_parallel_size=N)` runs on: `config` as `EngineConfig.from_options`
        resolved it (its data_parallel_size is the number of ranks)."""
        self = cls.__new__(cls)
        self._init(config, timeout_s)
        return self

    def _init(self, config: EngineConfig, timeout_s: float | None) -> None:
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}; allowed: a number of seconds > 0, or None (= "
                             f"{DEFAULT_TIMEOUT_S:g} on CPU ranks, {GPU_TIMEOUT_S:g} on GPU ranks)")
        torchrun = self._torchrun = None
        if config.parallel.launcher == "torchrun":
            torchrun = self._torchrun = torchrun_env(os.environ, config.parallel.data_parallel_size)
            if torchrun.rank != 0:       # this process runs one rank's engine (the front end's spec), then exits
                device = config.model.device or detect_platform().device_type
                run_rank(torchrun, timeout_s or collective_timeout(device))
        par = config.parallel
        check_spawnable(f"data_parallel_size={par.data_parallel_size}" if par.data_parallel_size > 1
                        else "engine_process=True")      # before anything is loaded or spawned
        config = rank_config(config, torchrun.local_world_size if torchrun else None)
        timeout_s = timeout_s or collective_timeout(config.model.device)
        if config.model.model is None:
            from ..tools.bundled_model import bundled_tiny_model_dir
            config = config.replace(model=str(bundled_tiny_model_dir()))
        self.model_dir = resolve_model_dir(config.model.model)
        self.model_config = ModelConfig.from_file(self.model_dir)
        # max_model_len resolved as LLM resolves it (the ranks' LLMs resolve it again, to the same value)
        self.config = config.with_model_limit(self.model_config.max_position_embeddings)
        self.world = config.parallel.data_parallel_size
        self.device = config.model.device or detect_platform().device_type   # where the ranks' engines run
        self.tokenizer = load_tokenizer(self.model_dir, config.model.tokenizer)
        self._request_counter = 0
        self._exit_at: tuple[int, int] | None = None      # test hook: (rank, lockstep iteration)
        self._failed: str | None = None
        self._procs: list[Any] = []
        self._startup: list[StartupOutput] = []     # spawned ranks' output until their code runs
        self._started = False                       # every rank said "ready"
        self._init_online()
        self._start(timeout_s)

    # ---- processes -----------------------------------------------------------------------------
    def _start(self, timeout_s: float) -> None:
        """Spawn this host's ranks (all, or under torchrun rank 0 only: the others connect, torchrun.py)."""
        ctx = mp.get_context("spawn")
        torchrun = self._torchrun
        front = None if torchrun is None else FrontEnd(torchrun, timeout_s)     # listening before rank 0 starts
        spawned = self.world if torchrun is None else 1
        init = f"tcp://127.0.0.1:{_free_port()}" if torchrun is None else "env://"
        threads = max(1, host_cores() // (torchrun.local_world_size if torchrun else self.world))   # shared cores
        self._results = ReportReceiver(ctx, spawned)
        self._commands = [ctx.Queue() for _ in range(spawned)]
        self._procs = []
        for rank in range(spawned):
            spec = self._spec(rank, torchrun.local_rank if torchrun else rank, threads, init, timeout_s)
            output = StartupOutput()
            with output.capture() as stderr:
                args = (spec, self._commands[rank], self._results.senders[rank], stderr)
                proc = ctx.Process(target=worker_main, args=args, name=f"deepinfer-dp{rank}",
                                   daemon=True)
                proc.start()
            self._procs.append(proc)
            self._startup.append(output)
        self._results.started()
        if front is not None:
            try:
                make_spec = partial(self._spec, init=init, timeout_s=timeout_s)
                remotes = front.connect(make_spec, self._check_alive, timeout_s)
            except BaseException:
                self._kill()
                raise
            for remote in remotes:
                self._commands.append(ConnSender(remote.conn))
                self._procs.append(remote)
                self._results.add(remote.conn, remote.lost)
        self._on_ready(self._wait("ready"))
        self._started = True
        log.info("data parallel: %d ranks ready (enable_expert_parallel=%s, enable_eplb=%s)", self.world,
                 self.config.parallel.enable_expert_parallel, self.config.parallel.enable_eplb)

    def _spec(self, rank: int, local_rank: int, threads: int, init: str, timeout_s: float) -> WorkerSpec:
        par = self.config.parallel
        return WorkerSpec(rank, self.world, init, str(self.model_dir), self.config, par.enable_expert_parallel,
                          par.num_redundant_experts, timeout_s, threads, local_rank)

    def _wait(self, kind: str) -> dict[int, tuple]:
        """One `kind` message from every rank; a rank's error or death raises (see `_fail`)."""
        got: dict[int, tuple] = {}
        while len(got) < self.world:
            try:
                msg = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if self.dead_ranks():
                    self._fail({})
                continue
            if msg[0] == "error":
                self._fail({msg[1]: msg[2]})
            if msg[0] != kind:
                raise RuntimeError(f"DataParallelLLM: rank {msg[1]} sent {msg[0]!r} while {kind!r} was expected")
            got[msg[1]] = msg
        return got

    def dead_ranks(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if p.exitcode is not None]

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
        causes = {r: self._start_cause(r) for r in silent}
        if silent:        # died without a word: killed or crashed, the root cause of its peers' errors
            first = silent[0]
            death = _death(codes[first], causes[first])
            head = f"data-parallel rank {first} of {self.world} {death}"
        else:
            first = min(errors)
            head = f"data-parallel rank {first} of {self.world} failed: {errors[first]}"
        others = [f"rank {r}: {e}" for r, e in sorted(errors.items()) if r != first]
        for r in silent[1:]:      # the same start-up cause as the first's is not repeated
            same = causes[r] and causes[r] == causes[first]
            others.append(f"rank {r} {_death(codes[r], 'the same' if same else causes[r])}")
        self._failed = head
        raise RuntimeError(f"DataParallelLLM: {head}; the engine has stopped (every rank terminated)"
                           + ("".join(f"\n  {o}" for o in others) if others else "")) from None

    def _start_cause(self, rank: int) -> str:
        """The exception a spawned rank's start-up output ended with (until every rank is ready)."""
        return "" if self._started or rank >= len(self._startup) else self._startup[rank].cause()

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
        while any(p.exitcode is None for p in self._procs) and time.monotonic() < deadline:
            try:                         # read on: a rank blocked writing its last reports must get out
                self._results.get(timeout=0.05)
            except queue.Empty:
                pass
        self._kill()
        self._results.close()
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
        InvalidRequestError after the others finished). A client of the online interface (dp_online.py):
        every request is added at once (one command per rank, placed by load in input order), then
        stepped until the ranks are idle; `last_stats` holds that run's per-rank statistics."""
        self._check_running()
        if self.has_unfinished_requests():
            raise RuntimeError("DataParallelLLM.generate: online requests are in flight (add_request); "
                               "generate needs the engine to itself")
        parsed = parse_prompts(prompts, prompt_token_ids)
        params = per_request_params(sampling_params, len(parsed))
        errors: dict[int, ValueError] = {}
        index: dict[str, int] = {}
        requests: list[RankRequest] = []
        for i, (entry, p) in enumerate(zip(parsed, params)):
            try:
                requests.append(self._request(i, entry, p))
                index[requests[-1].request_id] = i
            except (ValueError, TypeError) as e:
                errors[i] = e
        self._request_counter += len(parsed)
        ranks = self.choose_ranks(requests)
        exit_at, self._exit_at = self._exit_at, None
        if exit_at is not None:        # uncounted: armed before the run the adds start
            self._commands[exit_at[0]].put(("exit_at", exit_at[1]))
        self._dispatch({rank: [r for r, k in zip(requests, ranks) if k == rank] for rank in sorted(set(ranks))})
        outputs: list[Any] = [None] * len(parsed)
        while self.has_unfinished_requests():
            for out in self.step():
                i = index[out.request_id]
                if isinstance(out, ValueError):
                    errors[i] = ValueError(f"generate: prompt {i} is invalid: {out}")
                elif out.finished:
                    reason = self.refused.pop(out.request_id, None)
                    if reason is not None:
                        errors[i] = ValueError(f"request {i}: {reason}")
                    else:
                        outputs[i] = out
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
        text, ids, salt = entry
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(f"generate: prompt {i} is text but the checkpoint has no tokenizer files; "
                                 "pass prompt_token_ids or tokenizer=...")
            ids = self.tokenizer.encode(text)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"generate: sampling_params[{i}] must be a SamplingParams")
        counter = self._request_counter + i
        seed = params.seed if params.seed is not None else mix_seed(self.config.model.seed, counter)
        return RankRequest(str(counter), text, list(ids), params, seed, stream=False, cache_salt=salt)
