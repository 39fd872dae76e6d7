"""The online interface of the data-parallel engine (the front end's side; the ranks' side is
dp_worker.py `RankLoop`): the same add / abort / step / has_unfinished_requests calls as the in-process
`Engine`, so the server's engine thread (serve/engine_loop.py) and `DataParallelLLM.generate` drive it
alike. One thread calls these methods (the engine thread, or generate's caller).

Placement: a request goes to the rank with the least load, load = waiting + running tokens as the rank
last reported it (after each iteration) plus the tokens of requests sent to it since that report (prompt
tokens x n), lowest rank on ties (each rank has a scheduler of its own). With prefix caching on
and more than one rank: to the rank that was sent the longest prefix of its prompt, when that
rank's load allows (dp_router.py).

Prefix-cache reset (`reset_prefix_cache`): an uncounted command to every rank, which each applies
between two engine steps (an idle rank at once, without starting a run) and answers with a
ResetReport; outputs that arrive while the front end waits for the answers wait for the next `step`.

Runs and wakes: a rank blocks on its command queue while idle; a counted command starts a run, and the
run's lockstep vote needs every rank, so the first command sent to an idle system also wakes every other
rank. All ranks leave a run at the same vote and each sends an IdleReport with the number of counted
commands it applied; a command sent meanwhile (after its rank's last drain) is then still unread, and
its rank will start the next run on it, so the front end wakes the other ranks for that run. The system
counts as running (`has_unfinished_requests`) until those reports are in: the caller keeps calling
`step`, so the final gauges and run statistics arrive, and an idle system costs no CPU anywhere.

Outputs: each rank sends its finished step's RequestOutputs (deltas for streamed requests; without their
prompt ids, put back here, and with `metrics` only on a request's last output); `step`
returns them with `RequestInvalid` items for requests a rank refused at submission (the ValueError the
in-process `add_request` would have raised, delivered a step later).
"""

from __future__ import annotations

import queue
from typing import Any

from ..api.sampling_params import SamplingParams
from ..ops.sampler import mix_seed
from .dp_messages import (
    RESET_PREFIX_CACHE,
    IdleReport,
    RankRequest,
    RankStats,
    ResetReport,
    StepReport,
)
from .dp_router import PrefixRouter

POLL_S = 0.1  # longest wait of one `step` (then the caller drains its own commands) and liveness poll


class RequestInvalid(ValueError):
    """A rank refused a request at submission (bad prompt or parameters); the text is the engine's."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


# Gauges that are not sums over the ranks: (ratio, numerator, denominator), recomputed from the sums.
_RATIOS = (
    ("deepinfer_cache_usage_ratio", "deepinfer_cache_used_blocks", "deepinfer_cache_total_blocks"),
    ("deepinfer_prefix_cache_hit_rate", "deepinfer_prefix_cache_hit_tokens_total",
     "deepinfer_prefix_cache_query_tokens_total"),
)


class OnlineFrontEnd:
    """Mixed into DataParallelLLM, which provides world, config, _commands, _results, _procs, _failed
    and _fail (raises one RuntimeError naming the failed rank, after stopping every rank),
    dead_ranks(), and passes the ranks' "ready" messages to `_on_ready`."""

    def _init_online(self) -> None:
        w = self.world
        self._sent = [0] * w  # counted commands sent to each rank
        self._consumed = [0] * w  # ... applied by it, as last reported
        self._load = [0] * w  # its waiting + running tokens, as last reported
        self._unreported: list[list[tuple[int, int]]] = [[] for _ in range(w)]  # (command number, tokens)
        self._rank_gauges: list[dict[str, float]] = [{} for _ in range(w)]
        self._running = False  # a run is on, or the ranks' idle reports are not all in
        self._idle: dict[int, dict[int, IdleReport]] = {}  # run -> rank -> its report
        # request id -> (rank, prompt token ids), until finished, refused or aborted; the ranks send their
        # outputs without the prompt ids (per step, per request, they would dominate the pickled bytes)
        self._live: dict[str, tuple[int, list[int]]] = {}
        self._ready: list[Any] = []  # outputs read while waiting for something else
        self._seed_counter = 0  # default seeds, as the in-process engine counts its requests
        self.refused: dict[str, str] = {}  # request id -> why its constraint never became ready (as Engine)
        self.last_stats: list[RankStats] = []
        self._router: PrefixRouter | None = None  # placement by prefix too (`_on_ready`)
        self._resets: dict[int, bool] = {}  # rank -> its answer to the reset being waited for

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        seed: int | None = None,
        stream: bool = True,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request on a rank (`choose_ranks`). Checked here: the id and the params' type;
        the rank's engine checks the rest (`cache_salt` too: prefix caching shares prompts only
        between requests with the same salt, on one rank) and a refusal comes back from `step` as
        a RequestInvalid."""
        self._check_running()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"add_request: request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._live:
            raise ValueError(f"add_request: request_id {request_id!r} is already in the engine")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
        request = self.resolve_request(request_id, prompt, list(prompt_token_ids), params, seed, stream,
                                       cache_salt)
        rank = self.choose_ranks([request])[0]
        self._dispatch({rank: [request]})

    def resolve_request(
        self,
        request_id: str,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
        seed: int | None,
        stream: bool,
        cache_salt: str | None,
    ) -> RankRequest:
        """The seed as the in-process engine derives it (params.seed, else the engine seed mixed with a
        request counter), so a request's tokens do not depend on its rank."""
        counter, self._seed_counter = self._seed_counter, self._seed_counter + 1
        if seed is None:
            seed = params.seed if params.seed is not None else mix_seed(self.config.model.seed, counter)
        return RankRequest(request_id, prompt, ids, params, seed, stream, cache_salt)

    def abort_request(self, request_id: str) -> None:
        """Forwarded to the request's rank, which frees its slot and blocks; no output follows."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            raise ValueError(f"abort_request: no request {request_id!r} in the engine")
        rank = entry[0]
        self._check_running()
        self._dispatch({rank: None}, ("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._live) or self._running or bool(self._ready)

    def reset_prefix_cache(self) -> bool:
        """Every rank runs `Engine.reset_prefix_cache()` between two of its steps; True only when
        every rank's cache is then empty (False also when prefix caching is off). The router
        forgets what it sent where. Outputs that arrive meanwhile come from the next `step`."""
        self._check_running()
        for q in self._commands:
            q.put((RESET_PREFIX_CACHE,))
        while len(self._resets) < self.world:
            try:
                self._handle(self._results.get(timeout=POLL_S))
            except queue.Empty:
                self._check_alive()
        answers, self._resets = self._resets, {}
        if self._router is not None:
            self._router.clear()
        return all(answers.values())

    def step(self) -> list[Any]:
        """The outputs the ranks sent since the last call (RequestOutputs, RequestInvalids): waits for
        the next report up to POLL_S (a rank's death raises RuntimeError), then takes what else is there."""
        self._check_running()
        got = False
        try:
            msg = self._results.get(timeout=POLL_S)
            self._handle(msg)
            got = True
        except queue.Empty:
            self._check_alive()
        while got:
            try:
                self._handle(self._results.get_nowait())
            except queue.Empty:
                break
        out, self._ready = self._ready, []
        return out

    # ---- placement -----------------------------------------------------------------------------
    def loads(self) -> list[int]:
        """Each rank's load: reported waiting + running tokens, plus what was sent to it since."""
        return [
            self._load[r] + sum(t for n, t in self._unreported[r] if n > self._consumed[r]) for r in range(self.world)
        ]

    def choose_ranks(self, requests: list[RankRequest]) -> list[int]:
        """The rank of each request, in order, each counted before the next (prompt tokens x n): the
        router's choice (prefix caching on), else the least loaded, lowest rank on ties."""
        loads, out = self.loads(), []
        for request in requests:
            if self._router is not None:
                r = self._router.place(request, loads)
            else:
                r = min(range(self.world), key=lambda k: (loads[k], k))
            loads[r] += len(request.prompt_token_ids) * request.params.n
            out.append(r)
        return out

    def _dispatch(self, adds: dict[int, list[RankRequest] | None], command: tuple | None = None) -> None:
        """Send ("add", requests) to each rank in `adds` (or `command` when its value is None); when no
        run is on, every other rank gets a wake so that the run's votes pair up."""
        for rank, requests in adds.items():
            self._send(
                rank,
                command if requests is None else ("add", requests),
                sum(len(r.prompt_token_ids) * r.params.n for r in requests or ()),
            )
            for r in requests or ():
                self._live[r.request_id] = (rank, r.prompt_token_ids)
        if not self._running:
            for rank in range(self.world):
                if rank not in adds:
                    self._send(rank, ("wake",))
            self._running = True

    def _send(self, rank: int, command: tuple, tokens: int = 0) -> None:
        self._commands[rank].put(command)
        self._sent[rank] += 1
        if tokens:
            self._unreported[rank].append((self._sent[rank], tokens))

    # ---- reports -------------------------------------------------------------------------------
    def _on_ready(self, ready: dict[int, tuple]) -> None:
        """Every rank's ("ready", rank, gauges, PrefixKeying or None): its first gauges, and with
        prefix caching on and more than one rank the router (one keying: one config on all)."""
        for rank, msg in ready.items():
            self._rank_gauges[rank] = msg[2]
        keying = ready[0][3]
        if self.world > 1 and keying is not None:
            self._router = PrefixRouter(keying, self.world)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "error":
            self._fail({msg[1]: msg[2]})
        if kind == "step":
            self._on_step(msg[1])
        elif kind == "idle":
            self._on_idle(msg[1])
        elif kind == "reset":
            self._on_reset(msg[1])
        else:
            raise RuntimeError(f"DataParallelLLM: a rank sent {kind!r} while running")

    def _note(self, rank: int, load: int, consumed: int, gauges: dict[str, float]) -> None:
        self._load[rank], self._consumed[rank], self._rank_gauges[rank] = load, consumed, gauges
        self._unreported[rank] = [(n, t) for n, t in self._unreported[rank] if n > consumed]

    def _on_step(self, rep: StepReport) -> None:
        self._note(rep.rank, rep.load, rep.consumed, rep.gauges)
        for rid, text in rep.invalid.items():
            if self._live.pop(rid, None) is not None:
                self._ready.append(RequestInvalid(rid, text))
        for out in rep.outputs:
            entry = self._live.get(out.request_id)
            if entry is None:  # aborted meanwhile: nothing follows an abort
                continue
            out.prompt_token_ids = entry[1]
            if out.finished:
                del self._live[out.request_id]
                if out.request_id in rep.refused:
                    self.refused[out.request_id] = rep.refused[out.request_id]
            self._ready.append(out)

    def _on_reset(self, rep: ResetReport) -> None:
        self._rank_gauges[rep.rank] = rep.gauges
        self._resets[rep.rank] = rep.reset

    def _on_idle(self, rep: IdleReport) -> None:
        self._note(rep.rank, rep.load, rep.consumed, rep.gauges)
        reports = self._idle.setdefault(rep.run, {})
        reports[rep.rank] = rep
        if len(reports) < self.world:
            return
        del self._idle[rep.run]
        self.last_stats = [reports[r].stats for r in range(self.world)]
        unread = [self._sent[r] > self._consumed[r] for r in range(self.world)]
        if any(unread):  # sent after its rank's last drain: that rank starts the next run on it
            for r in range(self.world):
                if not unread[r]:
                    self._send(r, ("wake",))
        else:
            self._running = False

    # ---- health --------------------------------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        """The server's gauges summed over the ranks (the ratios recomputed from the sums)."""
        total: dict[str, float] = {}
        for g in self._rank_gauges:
            for k, v in g.items():
                total[k] = total.get(k, 0) + v
        for ratio, num, den in _RATIOS:
            if den in total:
                total[ratio] = total[num] / max(1, total[den])
        return total

    def rank_gauges(self) -> list[dict[str, float]]:
        """Each rank's gauges as it last reported them (each dict is replaced whole, never mutated)."""
        return list(self._rank_gauges)

    def health_error(self) -> str | None:
        """Why the engine cannot serve (a rank died or failed), or None; safe from any thread."""
        if self._failed is not None or not self._procs:
            return f"the data-parallel engine has stopped ({self._failed or 'closed'})"
        dead = self.dead_ranks()
        return f"data-parallel rank {dead[0]} of {self.world} died" if dead else None

    def _check_running(self) -> None:
        if self._failed is not None or not self._procs:
            raise RuntimeError(f"DataParallelLLM: the engine has stopped ({self._failed or 'closed'})")
        self._check_alive()

    def _check_alive(self) -> None:
        if self.dead_ranks():
            self._fail({})
