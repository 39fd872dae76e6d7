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
on how many drafts this one accepted, so a step is launched only after the previous one's verdict.
With async scheduling the steps still overlap the host: step() verifies and drafts step N (the host
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
import time
from dataclasses import dataclass
from typing import Any

from ..api.outputs import RequestMetrics, RequestOutput, SpecMetrics
from ..api.sampling_params import SamplingParams
from ..contracts import StepRunner, TokenSampler
from ..ops.sampler import mix_seed
from .constraints import attach_constraint
from .output_processor import (
    append_token,
    finalize_text,
    logprobs_entry,
    start_detokenizer,
)
from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from .sequence import Request, SeqStatus, Sequence
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


class Engine:
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
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request (a ValueError naming the problem leaves the engine as it
        was). `stream`: step() reports its new tokens (and text) every step; else only when done.
        `seed` overrides the default per-request seed (params.seed, else derived from the engine's
        seed and a request counter)."""
        arrival = time.time() if arrival_time is None else arrival_time
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"add_request: request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"add_request: request_id {request_id!r} is already in the engine")
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
                      constraint, stream)
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

    def use_speculator(self, speculator: Any, backtrack: int) -> None:
        """Draft with `speculator` from now on (benchmarks: a replay drafter); `backtrack`: the
        runner's rollback room, which a verify step of k drafts needs k + 1 of. Only when idle."""
        if self.has_unfinished_requests():
            raise RuntimeError("use_speculator: the engine has requests in flight")
        if backtrack < speculator.num_drafts + 1:
            raise ValueError(f"{speculator.num_drafts} drafts per step need max_backtracking_tokens >= "
                             f"{speculator.num_drafts + 1} (DEEPINFER_MAX_BACKTRACKING_TOKENS), the runner has {backtrack}")
        self.executor.speculator = speculator
        speculator.want_confidence = self.varlen is not None or self.acceptance_log is not None
        self.spec_metrics = SpecMetrics()

    def use_varlen(self, policy: Any) -> None:
        """Confidence-scheduled verification (speculative/varlen.py VarlenPolicy), or None: verify
        every draft. Its max_drafts must be the speculator's. Only when idle."""
        spec = self.executor.speculator
        if spec is None:
            raise ValueError("DEEPINFER_ENABLE_MTP_VARLEN=1 schedules draft verification, but the engine has no "
                             "drafter (DEEPINFER_USE_NEXTN_DECODE=0 or no mtp.* tensors)")
        if self.has_unfinished_requests():
            raise RuntimeError("use_varlen: the engine has requests in flight")
        if policy is not None and policy.max_drafts != spec.num_drafts:
            raise ValueError(f"VARLEN policy for {policy.max_drafts} drafts, the drafter proposes {spec.num_drafts}")
        self.varlen = self.scheduler.draft_length = policy
        spec.want_confidence = policy is not None or self.acceptance_log is not None

    def record_acceptance(self, log: list | None) -> None:
        """From now on every verification appends (the cumulative confidences of the drafts it could
        accept, drafts accepted) to `log` (calibration: deepinfer_dspark.calibrate); None stops."""
        spec = self.executor.speculator
        if spec is None:
            raise ValueError("record_acceptance: the engine has no drafter (DEEPINFER_USE_NEXTN_DECODE=0 or no "
                             "mtp.* tensors)")
        self.acceptance_log = log
        spec.want_confidence = log is not None or self.varlen is not None

    def _observe_step_time(self, chunks: list[ScheduledChunk], ms: float) -> None:
        """A step of verify chunks of one shape, or of decodes (VARLEN chose no drafts: observing
        those too keeps a step of drafts from looking free forever), is timed against the table:
        its period, from the previous step's commit to its own (host work included)."""
        rows = chunks[0].num_tokens
        if all(c.samples and c.num_tokens == rows and (c.num_drafts or rows == 1) for c in chunks):
            self.varlen.observe(len(chunks), rows, ms)

    def _verifies_on_device(self, chunks: list[ScheduledChunk]) -> bool:
        """A step of greedy verify chunks of one shape, every draft acceptable, whose sequences need no
        host work per token (device_verdict.py), on graphs that take device positions."""
        q = chunks[0].num_tokens
        return (self.executor.speculator is not None
                and all([c.num_drafts and c.num_tokens == q and c.max_accept == c.num_drafts
                         and c.seq.verifies_on_device for c in chunks])
                and self.executor.verifies_on_device(len(chunks), q))

    def _speculate(self, step: InFlight) -> None:
        """Verify and draft `step` (queued behind its forward), then commit what planning the next
        step needs (`_commit_outcome`)."""
        self._drafts_as_ids(step.chunks)           # verification reads them (the launch used codes)
        self.executor.speculate(step)
        spec = step.spec
        # The next step is launched with the new drafts' device codes, without waiting for the drafter,
        # unless their confidences must reach the scheduler (VARLEN, calibration) or the drafter drew
        # them on the host.
        lazy = spec.draft_codes is not None and spec.confidence is None
        if not lazy:
            step.wait()                            # the host copies of the drafts (and confidences)
        self._commit_outcome(step, lazy)

    def _commit(self, step: InFlight, successor: InFlight | None = None) -> None:
        """Commit a verdict that stayed on the device (the step's event: its host copies). A
        `successor` planned before it (Scheduler.schedule_blind) learns its positions now."""
        self._drafts_as_ids(step.chunks)           # emitted by _process (the launch used codes)
        step.wait()
        step.spec.read_accepted()
        self._commit_outcome(step, True, successor)

    def _commit_outcome(self, step: InFlight, lazy: bool, successor: InFlight | None = None) -> None:
        """What planning the next step needs: each verified sequence's next position and the tokens it
        has in flight (accepted drafts + the added one), and every drafting sequence's new drafts
        (`lazy`: named by their device codes until the host reads them). Emitting the tokens is left
        to `_process`."""
        spec = step.spec
        follows = {id(c.seq): c for c in successor.chunks} if successor is not None else {}
        for c, j in zip(spec.verified, spec.accepted):
            seq = c.seq
            if seq.status is SeqStatus.FINISHED:
                continue                           # stopped meanwhile: its tokens are dropped later
            seq.num_computed = c.start + 1 + j     # rejected rows roll back
            seq.num_pending += j                   # the plan counted the added token only
            follow = follows.get(id(seq))
            if follow is not None:                 # planned at the device's positions
                follow.start = seq.num_computed
                seq.num_computed += follow.num_tokens
            for metrics in (self._spec_metrics(seq.request), self.spec_metrics):
                metrics.record(c.max_accept, j)
            if self.acceptance_log is not None and seq.draft_conf:
                self.acceptance_log.append((seq.draft_conf[:c.max_accept], j))
        conf = spec.confidence.tolist() if spec.confidence is not None else None
        drafts = spec.draft_codes if lazy else spec.drafts.tolist() if spec.draft_seqs else ()
        for i, (seq, ids) in enumerate(zip(spec.draft_seqs, drafts)):
            if not seq.finished:
                seq.draft_ids, seq.draft_source = ids, (step, i) if lazy else None
                if conf is not None:
                    seq.draft_conf = conf[i]
                for metrics in (self._spec_metrics(seq.request), self.spec_metrics):
                    metrics.num_drafted_tokens += len(ids)
        now = time.perf_counter()
        if self.varlen is not None and self._last_commit is not None:
            self._observe_step_time(step.chunks, (now - self._last_commit) * 1e3)
        self._last_commit = now

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
        now = time.time()
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
        now = time.time()
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
                stopped = _advance_constraint(seq, tok, stopped)
            if stopped:
                tracked = requests.get(req.request_id)
                if tracked is not None:
                    self.scheduler.finish(seq)
                    self._finished(tracked, seq)
            elif req.stream and req.request_id in requests:
                touched[req.request_id] = requests[req.request_id]
        if step.spec is not None:
            self._process_speculation(step.spec, now)

    def _drafts_as_ids(self, chunks: list[ScheduledChunk], constrained_only: bool = False) -> None:
        """Verify chunks planned with their drafts' device codes get the drafts as token ids."""
        for c in chunks:
            if c.num_drafts and c.drafts[0] < 0 and (not constrained_only or c.seq.request.constraint is not None):
                c.drafts = self._host_drafts(c.seq)

    @staticmethod
    def _host_drafts(seq: Sequence) -> list[int]:
        """`seq`'s drafts as token ids: read from the host copy of the step that drew them (waiting
        for it) when the sequence only holds their device codes."""
        if seq.draft_source is not None:
            step, i = seq.draft_source
            step.wait()
            seq.draft_ids, seq.draft_source = step.spec.draft_rows()[i], None
        return seq.draft_ids

    def _process_speculation(self, spec, now: float) -> None:
        """Verified chunks (committed by `_speculate`): append the accepted drafts and the added token,
        up to a stop."""
        lp = None
        if spec.logprobs is not None:
            vals, ids, slp, ranks = spec.logprobs
            lp = HostLogprobs([], vals.tolist(), ids.tolist(), slp.tolist(), ranks.tolist())
        for n, (c, j, tok) in enumerate(zip(spec.verified, spec.accepted,
                                            spec.tokens.tolist() if spec.verified else ())):
            seq = c.seq
            if seq.status is SeqStatus.FINISHED:
                self.num_dropped_tokens += 1 + j
                continue
            seq.num_pending -= 1 + j
            req = seq.request
            stopped = False
            first = spec.logprob_rows.get(n)
            emitted = list(c.drafts[:j])
            emitted.append(tok)
            if (first is None and seq.detokenizer is None and seq.constraint_state is None
                    and len(seq.token_ids) + j + 1 < seq.max_tokens and seq.stop_ids.isdisjoint(emitted)):
                seq.token_ids += emitted           # the common case of append_token, inline
                seq.num_tokens += j + 1
                req.metrics.token_times += [now] * (j + 1)
                if req.stream and req.request_id in self._requests:
                    self._touched[req.request_id] = self._requests[req.request_id]
                continue
            for e, t in enumerate(emitted):
                req.metrics.token_times.append(now)
                if first is not None:
                    self._add_logprobs(seq, lp, first + e, t)
                stopped = append_token(seq, t)
                if seq.constraint_state is not None:
                    stopped = _advance_constraint(seq, t, stopped)
                if stopped:
                    break
            tracked = self._requests.get(req.request_id)
            if stopped and tracked is not None:
                self.scheduler.finish(seq)
                self._finished(tracked, seq)
            elif req.stream and tracked is not None:
                self._touched[req.request_id] = tracked

    @staticmethod
    def _spec_metrics(req: Request) -> SpecMetrics:
        if req.metrics.spec is None:
            req.metrics.spec = SpecMetrics()
        return req.metrics.spec

    def _finished(self, tracked: _Tracked, seq: Sequence) -> None:
        finalize_text(seq, self.tokenizer)
        seq.constraint_state = None
        tracked.unfinished -= 1
        self._touched[tracked.request.request_id] = tracked
        if tracked.unfinished == 0:
            tracked.request.metrics.finished_time = time.time()

    def _outputs(self) -> list[RequestOutput]:
        outs = []
        for rid, tracked in self._touched.items():
            req, seqs = tracked.request, tracked.seqs
            done = tracked.unfinished == 0
            if not (req.stream or done):
                continue
            outs.append(RequestOutput(rid, req.prompt, req.prompt_token_ids, seqs[0].prompt_logprobs,
                                      [s.to_output(delta=req.stream) for s in seqs], done, req.metrics))
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


def _advance_constraint(seq: Sequence, token: int, stopped: bool) -> bool:
    """Feed the completion's constraint its new token; whether the completion stops now (a grammar
    that is complete ends it with "stop", its stop token even with ignore_eos)."""
    done = seq.request.constraint.processor.advance([seq.constraint_state], [token])[0]
    if done and not stopped:
        seq.finish_reason, seq.stop_reason = "stop", None
        return True
    return stopped
