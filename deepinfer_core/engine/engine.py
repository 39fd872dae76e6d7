"""The step loop: schedule -> plan -> execute (forward + sample) -> post-process (tokens, logprobs,
stop checks, freeing finished sequences). Policy lives in the scheduler, tensors in the executor
and the runner; this file only moves plain data between them.

Request constraints (structured outputs, `constraints.py`): a sequence whose grammar is still
compiling waits without holding up the others; one whose grammar failed or timed out is refused
(`refused`); a completed grammar finishes its sequence like a stop token.

Zero-overhead scheduling (on by default): the executor runs step N on a worker thread while the
host post-processes step N-1 and plans step N+1. A sequence that stops at step N has already been
planned into step N+1; that extra token is dropped. Tokens come from the counter-based RNG keyed by
(seed, position), so the outputs are the same with the overlap on or off.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .output_processor import check_stop, logprobs_entry
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, SeqStatus
from .step_executor import ChunkPlan, SampleSpec, StepExecutor, StepPlan, StepResult

CONSTRAINT_POLL_SECONDS = 0.05     # nothing to run but grammars compiling: wait this long per step


class Engine:
    def __init__(self, runner: Any, sampler: Any, scheduler: Scheduler, tokenizer: Any,
                 eos_token_id: int | None, async_scheduling: bool = False):
        self.scheduler, self.tokenizer, self.eos_token_id = scheduler, tokenizer, eos_token_id
        self.executor = StepExecutor(runner, sampler, eos_token_id)
        self.async_scheduling = async_scheduling
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-step") if async_scheduling else None
        self._in_flight: tuple[list[ScheduledChunk], Future] | None = None
        self._released: list[int] = []
        self._finished_ids: list[int] = []
        self.num_steps = 0
        self.num_dropped_tokens = 0        # sampled for a sequence that had already stopped (async)
        self.refused: dict[int, str] = {}  # seq_id -> why its constraint never became ready

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[Sequence]:
        """Plan and launch one step, post-process the previous one (async) or this one (sync);
        returns the sequences that finished."""
        refused = self._refuse_failed_constraints()
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self._released.append(seq.seq_id)
        if not out.chunks:
            if self._in_flight is not None:
                return refused + self._process(*self._take_in_flight())
            unready = self.scheduler.unready()
            if unready:                    # only grammars still compiling: wait for the first one
                unready[0].request.constraint.wait(CONSTRAINT_POLL_SECONDS)
                return refused
            if refused or not self.scheduler.has_unfinished():
                return refused
            raise RuntimeError("scheduler scheduled nothing while requests are pending "
                               "(the state cache is too small for any waiting request)")
        plan = self._plan(out.chunks)
        self.num_steps += 1
        if self._pool is None:
            return self._process(out.chunks, self.executor.execute(plan))
        future = self._pool.submit(self.executor.execute, plan)
        finished = self._process(*self._take_in_flight()) if self._in_flight is not None else []
        self._in_flight = (out.chunks, future)
        return refused + finished

    def _refuse_failed_constraints(self) -> list[Sequence]:
        """Finish the waiting sequences whose constraint can never be ready (a grammar that failed
        to compile or timed out); `refused` says why. They never ran, so nothing else is owed."""
        out = []
        for seq in self.scheduler.unready():
            reason = seq.request.constraint.error()
            if reason is not None:
                self.scheduler.finish(seq)
                seq.completion.finish_reason = "abort"
                self.refused[seq.seq_id] = reason
                self._released.append(seq.seq_id)
                self._finished_ids.append(seq.seq_id)
                out.append(seq)
        return out

    def close(self) -> None:
        """Drain the last step, let the executor drop every remaining state, stop the worker."""
        try:
            while self._in_flight is not None:
                self._process(*self._take_in_flight())
            self.executor.execute(StepPlan([], self._released, self._finished_ids))
            self._released, self._finished_ids = [], []
        finally:
            if self._pool is not None:
                self._pool.shutdown()

    def abort_all(self) -> None:
        """After a failure: finish every sequence so the cache's slots and blocks return."""
        self._in_flight = None
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(seq)
            self._released.append(seq.seq_id)
            self._finished_ids.append(seq.seq_id)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.executor.execute(StepPlan([], self._released, self._finished_ids))
        self._released, self._finished_ids = [], []

    # ---- host side -----------------------------------------------------------------------------
    def _take_in_flight(self) -> tuple[list[ScheduledChunk], StepResult]:
        chunks, future = self._in_flight
        self._in_flight = None
        return chunks, future.result()

    def _plan(self, chunks: list[ScheduledChunk]) -> StepPlan:
        now = time.time()
        plans = []
        for c in chunks:
            seq = c.seq
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
            known_end = min(c.start + c.num_tokens, seq.num_tokens)
            p = ChunkPlan(seq.seq_id, seq.slot, c.block_ids, c.start, seq.token_slice(c.start, known_end),
                          pending=known_end < c.start + c.num_tokens, logit_mode=self._logit_mode(c))
            if p.logit_mode == "all":
                p.prompt_targets = seq.prompt_ids[c.start + 1:c.start + c.num_tokens + 1]
                p.prompt_logprobs = seq.request.params.prompt_logprobs
            if c.samples:
                params = seq.request.params
                p.sample = SampleSpec(params, seq.completion.seed, seq.prompt_ids,
                                      params.all_stop_token_ids(self.eos_token_id),
                                      seq.request.constraint)
            plans.append(p)
        plan = StepPlan(plans, self._released, self._finished_ids)
        self._released, self._finished_ids = [], []
        return plan

    @staticmethod
    def _logit_mode(c: ScheduledChunk) -> str:
        if c.seq.want_prompt_logprobs and c.start < len(c.seq.prompt_ids):
            return "all"
        return "last" if c.samples else "none"

    def _process(self, chunks: list[ScheduledChunk], result: StepResult) -> list[Sequence]:
        for i, lp in result.prompt_logprobs.items():
            self._add_prompt_logprobs(chunks[i], lp)
        finished, now = [], time.time()
        sampled = [c for c in chunks if c.samples]
        for c, tok, lp, done in zip(sampled, result.tokens, result.logprobs, result.constraint_done):
            seq = c.seq
            seq.num_pending -= 1
            if seq.status is SeqStatus.FINISHED:
                self.num_dropped_tokens += 1       # planned before its stop was seen: dropped
                continue
            params, comp = seq.request.params, seq.completion
            if lp is not None:
                comp.logprobs = comp.logprobs if comp.logprobs is not None else []
                comp.logprobs.append(logprobs_entry(lp, 0, tok, self.tokenizer if params.detokenize else None))
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + float(lp.sampled_logprobs[0])
            comp.token_ids.append(tok)
            m = seq.request.metrics
            m.token_times.append(now)
            m.first_token_time = m.first_token_time or now
            stopped = check_stop(comp, params, eos_token_id=self.eos_token_id, max_tokens=seq.max_tokens,
                                 tokenizer=self.tokenizer)
            if done and not stopped:       # the grammar is complete (its stop token, even with ignore_eos)
                comp.finish_reason, comp.stop_reason, stopped = "stop", None, True
            if stopped:
                self.scheduler.finish(seq)
                self._released.append(seq.seq_id)
                self._finished_ids.append(seq.seq_id)
                finished.append(seq)
        return finished

    def _add_prompt_logprobs(self, c: ScheduledChunk, res) -> None:
        """Row r predicts prompt token start + r + 1 (the first prompt token gets None). Entries are
        written by position, so a chunk recomputed after a preemption simply overwrites its own."""
        seq = c.seq
        entries = seq.prompt_logprobs if seq.prompt_logprobs is not None else [None]
        targets = seq.prompt_ids[c.start + 1:c.start + c.num_tokens + 1]
        end = c.start + 1 + len(targets)
        entries.extend([None] * (end - len(entries)))
        tok = self.tokenizer if seq.request.params.detokenize else None
        entries[c.start + 1:end] = [logprobs_entry(res, r, t, tok) for r, t in enumerate(targets)]
        seq.prompt_logprobs = entries
