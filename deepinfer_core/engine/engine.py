"""The long-lived online engine: `add_request`, `abort_request`, `step`, `has_unfinished_requests`.

One step: schedule -> launch (forward + sampling, queued on the device) -> post-process the
previous step (tokens, logprobs, stop checks, constraint advances, freeing finished sequences).
Policy lives in the scheduler, tensors in the step executor and the runner; this file only moves
plain data between them and keeps the per-request records.

Zero-overhead scheduling (async, on by default): step N+1 is launched before the host has read
step N's tokens; their copy to the host completes on an event while the device computes N+1, and
post-processing overlaps it. A sequence that stops at step N has already been planned into step
N+1; that extra token is dropped. A sequence whose grammar needs its last token on the host skips
one step instead of stalling the others. Tokens come from the counter-based RNG keyed by
(seed, position), so the outputs are the same with the overlap on or off.

Speculative decoding (a `speculator`, speculative/engine_step.py): the next step's positions depend
on how many drafts this one accepted. A step of greedy verify chunks that needs no host work per
token is verified and drafted on the device (speculative/device_verdict.py), and the next verify
step is launched at the device's positions before the host reads that verdict
(`Scheduler.schedule_blind`); the verdict is committed after that launch (`_commit`). Otherwise a
step is launched only after the previous one's verdict. With async scheduling the steps still
overlap the host: step() verifies and drafts step N (the host
reads the accepted counts: the one sync; the new drafts stay on the device, named by code), commits
what the scheduler needs (positions, tokens in flight, the next drafts), launches step N+1, and only
then post-processes step N (tokens, stops, logprobs, outputs) while the device runs N+1. A verify
step appends the accepted drafts and the token verification adds, stopping at the first stop, as
decoding them one by one would.

Requests may be added and aborted between any two steps; an abort frees the request's slots and
blocks at once (a token of it still in flight is dropped when it lands).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..api.outputs import RequestMetrics, RequestOutput, SpecMetrics, timestamp
from ..api.sampling_params import SamplingParams
from ..contracts import StepRunner, TokenSampler
from ..ops.sampler import mix_seed
from .constraints import attach_constraint
from .output_processor import (
    advance_constraint,
    append_token,
    finalize_text,
    logprobs_entry,
    start_detokenizer,
)
from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from .sequence import Request, SeqStatus, Sequence
from .speculation import SpeculativeSteps
from .step_executor import HostLogprobs, InFlight, StepExecutor

log = logging.getLogger(__name__)
CONSTRAINT_POLL_SECONDS = 0.05     # nothing to run but grammars compiling: wait this long per step


def completion_seed(base_seed: int, index: int) -> int:
    """Seed of completion `index` of a request: the request seed itself for the first one, so n=1
    and the first of n>1 completions agree."""
    return base_seed if index == 0 else mix_seed(base_seed, index)


@dataclass(eq=False)
class _Tracked:
    request: Request
    seqs: list[Sequence]
    unfinished: int


class Engine(SpeculativeSteps):
    def __init__(self, runner: StepRunner, sampler: TokenSampler, scheduler: Scheduler, tokenizer: Any, *,
                 max_model_len: int, async_scheduling: bool, seed: int = 0,
                 logits_processors: list | None = None, speculator: Any = None):
        cfg = runner.model_config
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.eos_token_id, self.vocab_size = cfg.eos_token_id, int(cfg.vocab_size)
        self.max_model_len, self.seed = max_model_len, seed
        self.async_scheduling = bool(async_scheduling)
        self.logits_processors = list(logits_processors or [])
        self.executor = StepExecutor(runner, sampler, self.eos_token_id, self.vocab_size,
                                     scheduler.blocks.allocator.num_slots, speculator)
        self.spec_metrics = SpecMetrics() if speculator is not None else None   # over every request
        self.varlen = None                 # VARLEN's policy (use_varlen), None: verify every draft
        self.acceptance_log: list[tuple[list[float], int]] | None = None   # record_acceptance
        self._requests: dict[str, _Tracked] = {}
        self._in_flight: InFlight | None = None
        self._touched: dict[str, _Tracked] = {}       # requests with news for the next step() result
        self._next_seq_id = 0
        self._last_commit: float | None = None        # when the previous speculative step committed (VARLEN)
        self._counter = 0                             # requests added (default seeds)
        self.num_steps = 0
        self.num_verified_on_device = 0    # steps verified and drafted without the host (device_verdict.py)
        self.num_blind_launches = 0        # of those, launched before the previous verdict was read
        self.num_dropped_tokens = 0        # sampled for a sequence that had already stopped (async)
        self.refused: dict[str, str] = {}  # request id -> why its constraint never became ready

    # ---- the online interface ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, seed: int | None = None, stream: bool = True,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Validate and queue a request (a ValueError naming the problem leaves the engine as it
        was). `stream`: step() reports its new tokens (and text) every step; else only when done.
        `seed` overrides the default per-request seed (params.seed, else derived from the engine's
        seed and a request counter). `arrival_time`: a `timestamp()` reading (its clock).
        `cache_salt`: prefix caching shares cached prompts only between requests with the same salt."""
        arrival = timestamp() if arrival_time is None else arrival_time
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"add_request: request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"add_request: request_id {request_id!r} is already in the engine")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
        params.validate()      # again: a SamplingParams may have been changed after construction
        ids = self._check_prompt(prompt_token_ids)
        self._check_params(params)
        # Last: a grammar starts compiling here, so only for a request that is otherwise valid.
        constraint = attach_constraint(self.logits_processors, params, tokenizer=self.tokenizer,
                                       vocab_size=self.vocab_size, eos_token_id=self.eos_token_id)
        counter, self._counter = self._counter, self._counter + 1
        if seed is None:
            seed = params.seed if params.seed is not None else mix_seed(self.seed, counter)
        req = Request(request_id, prompt, ids, params, seed, RequestMetrics(arrival_time=arrival),
                      constraint, stream, cache_salt)
        seqs = self._sequences(req)
        for s in seqs:
            self.scheduler.check_fits(s)         # refuse before anything runs
        for s in seqs:
            start_detokenizer(s, self.tokenizer)
            self.scheduler.add(s)
        self._requests[request_id] = _Tracked(req, seqs, len(seqs))

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: its slots and blocks are free when this returns; no output follows."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            raise ValueError(f"abort_request: no request {request_id!r} in the engine")
        self._touched.pop(request_id, None)
        for s in tracked.seqs:
            if not s.finished:
                self.scheduler.finish(s)
                s.finish_reason = "abort"

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no running request holds; True when the cache is then empty
        (False also when prefix caching is off)."""
        prefix = self.scheduler.prefix
        return prefix is not None and prefix.reset()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Plan and launch one step, post-process the previous one (async) or this one (sync);
        returns one RequestOutput per request with news: streamed requests get their deltas,
        the others their whole output once finished."""
        self._refuse_failed_constraints()
        previous = self._in_flight
        if previous is not None and previous.spec_inputs is not None:
            self._speculate(previous)              # its verdict and drafts, before planning the next step
        blind = None
        if previous is not None and previous.verdict_pending:
            if self.async_scheduling:              # the next verify step at the device's positions
                blind = self.scheduler.schedule_blind(previous.chunks, self.executor.speculator.num_drafts,
                                                      self.executor.runner.slot_tables.draft_codes,
                                                      self.executor.verifies_on_device)
            if blind is None:
                self._commit(previous)             # the plan needs the verdict
        out = SchedulerOutput(blind) if blind is not None else self.scheduler.schedule()
        if not out.chunks:
            self._last_commit = None
            if previous is not None:
                self._in_flight = None
                self._process(previous)
            else:
                self._idle()
            return self._outputs()
        self._mark_scheduled(out.admitted)
        self._drafts_as_ids(out.chunks, constrained_only=True)   # a grammar masks verify rows through them
        on_device = self._verifies_on_device(out.chunks)
        if blind is not None and not on_device:      # schedule_blind checked the shape: cannot happen
            raise RuntimeError("a step planned at the device's positions cannot be verified on the device")
        step = self.executor.launch(out.chunks, self.scheduler.blocks.updates.take(), previous,
                                    on_device=on_device, blind=blind is not None)
        self.num_steps += 1
        self.num_verified_on_device += on_device
        self.num_blind_launches += blind is not None
        if blind is not None:
            self._commit(previous, successor=step)
        if not self.async_scheduling:
            if step.spec_inputs is not None:
                self._speculate(step)
            elif step.verdict_pending:
                self._commit(step)
            self._process(step)
        else:
            self._in_flight = step
            if previous is not None:
                self._process(previous)
        return self._outputs()

    def abort_all(self) -> None:
        """After a failure: drop every request so the cache's slots and blocks return."""
        self._in_flight = None
        for rid in list(self._requests):
            self.abort_request(rid)

    # ---- admission -----------------------------------------------------------------------------
    def _check_prompt(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of int, "
                             f"got {type(ids).__name__}")
        if not ids:
            raise ValueError("the prompt is empty; a prompt needs at least one token")
        # the common case at C speed (a 6,000-id prompt: 0.4 ms instead of 0.8); the loop below
        # finds the first bad id for the message
        if not (set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < self.vocab_size):
            for pos, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"token id {t!r} at position {pos} of the prompt is outside "
                                     f"[0, vocab_size={self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        return list(ids)

    def _check_params(self, params: SamplingParams) -> None:
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise ValueError("SamplingParams: stop strings need a tokenizer; pass LLM(tokenizer=...) or "
                             "use stop_token_ids")
        trunc = self.executor.truncation
        if params.prompt_logprobs is not None and trunc is not None and trunc.mode == "compact":
            raise ValueError("SamplingParams: prompt_logprobs is not available with "
                             "yoco_prefill_truncation_mode='compact' (the YOCO consumer layers skip the "
                             "prompt rows before the last yoco_prefill_keep_tokens); allowed there: None; "
                             "use the mode 'off' or 'mask' for prompt logprobs")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise ValueError(f"SamplingParams: {name}={getattr(params, name)} exceeds "
                                 f"vocab_size={self.vocab_size}")

    def _sequences(self, req: Request) -> list[Sequence]:
        p = req.params
        # vLLM: prompt + output stays within max_model_len (a full-length prompt still gets one).
        max_tokens = max(1, self.max_model_len - len(req.prompt_token_ids))
        max_tokens = min(max_tokens, p.max_tokens) if p.max_tokens is not None else max_tokens
        stop_ids = frozenset(p.all_stop_token_ids(self.eos_token_id))
        seqs = []
        for j in range(p.n):
            self._next_seq_id += 1
            seqs.append(Sequence(self._next_seq_id, req, j, completion_seed(req.seed, j), max_tokens, stop_ids,
                                 want_prompt_logprobs=j == 0 and p.prompt_logprobs is not None))
        return seqs

    def _refuse_failed_constraints(self) -> None:
        """Finish the waiting sequences whose constraint can never be ready (a grammar that failed
        to compile or timed out); `refused` says why. They never ran, so nothing else is owed."""
        for seq in self.scheduler.unready():
            reason = seq.request.constraint.error()
            tracked = self._requests.get(seq.request.request_id)
            if reason is None or tracked is None:
                continue
            self.refused[seq.request.request_id] = reason
            for s in tracked.seqs:
                if not s.finished:
                    self.scheduler.finish(s)
                    s.finish_reason = "abort"
                    self._finished(tracked, s)

    def _idle(self) -> None:
        unready = self.scheduler.unready()
        if unready:                        # only grammars still compiling: wait for the first one
            unready[0].request.constraint.wait(CONSTRAINT_POLL_SECONDS)
        elif self.scheduler.has_unfinished():
            raise RuntimeError("scheduler scheduled nothing while requests are pending "
                               "(the state cache is too small for any waiting request)")

    @staticmethod
    def _mark_scheduled(admitted: list[Sequence]) -> None:
        now = timestamp()
        for seq in admitted:
            m = seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now

    # ---- post-processing -----------------------------------------------------------------------
    def _process(self, step: InFlight) -> None:
        tokens, lp = self.executor.collect(step)
        for i, host in step.prompt_logprobs.items():
            self._add_prompt_logprobs(step.chunks[i], host)
        lp_at = {row: j for j, row in enumerate(lp.rows)} if lp is not None else None
        now = timestamp()
        requests, touched = self._requests, self._touched
        for row, (c, tok) in enumerate(zip(step.sampled, tokens)):
            seq = c.seq
            seq.num_pending -= 1
            if seq.status is SeqStatus.FINISHED:
                self.num_dropped_tokens += 1       # planned before its stop was seen: dropped
                continue
            req = seq.request
            if lp_at is not None and row in lp_at:
                self._add_logprobs(seq, lp, lp_at[row], tok)
            m = req.metrics
            m.token_times.append(now)
            if m.first_token_time is None:
                m.first_token_time = now
            if tok not in seq.stop_ids and seq.detokenizer is None and len(seq.token_ids) + 1 < seq.max_tokens:
                seq.token_ids.append(tok)          # the common case of append_token, inline
                seq.num_tokens += 1
                stopped = False
            else:
                stopped = append_token(seq, tok)
            if seq.constraint_state is not None:
                stopped = advance_constraint(seq, tok, stopped)
            if stopped:
                tracked = requests.get(req.request_id)
                if tracked is not None:
                    self.scheduler.finish(seq)
                    self._finished(tracked, seq)
            elif req.stream and req.request_id in requests:
                touched[req.request_id] = requests[req.request_id]
        if step.spec is not None:
            self._process_speculation(step.spec, now)

    def _finished(self, tracked: _Tracked, seq: Sequence) -> None:
        finalize_text(seq, self.tokenizer)
        seq.constraint_state = None
        tracked.unfinished -= 1
        self._touched[tracked.request.request_id] = tracked
        if tracked.unfinished == 0:
            tracked.request.metrics.finished_time = timestamp()

    def _outputs(self) -> list[RequestOutput]:
        outs = []
        for rid, tracked in self._touched.items():
            req, seqs = tracked.request, tracked.seqs
            done = tracked.unfinished == 0
            if not (req.stream or done):
                continue
            outs.append(RequestOutput(rid, req.prompt, req.prompt_token_ids, seqs[0].prompt_logprobs,
                                      [s.to_output(delta=req.stream) for s in seqs], done, req.metrics,
                                      max(0, seqs[0].num_cached_tokens)))
            if done:
                del self._requests[rid]
        self._touched = {}
        return outs

    def _add_logprobs(self, seq: Sequence, lp: HostLogprobs, j: int, token: int) -> None:
        k = seq.request.params.logprobs
        tok = self.tokenizer if seq.request.params.detokenize else None
        entry = logprobs_entry(lp.top_values[j][:k], lp.top_ids[j][:k], token, lp.token_logprobs[j],
                               lp.token_ranks[j], tok)
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(entry)
        seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lp.token_logprobs[j]

    def _add_prompt_logprobs(self, c: ScheduledChunk, host: tuple) -> None:
        """Row r predicts prompt token start + r + 1 (the first prompt token gets None). Entries are
        written by position, so a chunk recomputed after a preemption simply overwrites its own."""
        seq = c.seq
        vals, ids, slp, ranks = (t.tolist() for t in host)
        entries = seq.prompt_logprobs if seq.prompt_logprobs is not None else [None]
        targets = seq.prompt_ids[c.start + 1:c.start + c.num_tokens + 1]
        end = c.start + 1 + len(targets)
        entries.extend([None] * (end - len(entries)))
        tok = self.tokenizer if seq.request.params.detokenize else None
        entries[c.start + 1:end] = [logprobs_entry(vals[r], ids[r], t, slp[r], ranks[r], tok)
                                    for r, t in enumerate(targets)]
        seq.prompt_logprobs = entries
