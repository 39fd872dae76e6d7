"""The engine's speculative steps (a mixin of `Engine`, engine.py): installing a drafter or VARLEN,
committing a verdict (read on the host before the next launch, `_speculate`, or left on the device
until after it, `_commit`), and emitting a verify step's tokens (`_process_speculation`).

A verify step appends the accepted drafts and the token verification adds, stopping at the first
stop, as decoding them one by one would. Drafts the drafter left on the device are named by their
codes until the host needs them (`_host_drafts`).
"""
from __future__ import annotations

import time
from typing import Any

from ..api.outputs import SpecMetrics
from .output_processor import advance_constraint, append_token
from .scheduler import ScheduledChunk
from .sequence import Request, SeqStatus, Sequence
from .step_executor import HostLogprobs, InFlight


class SpeculativeSteps:
    """Speculative decoding's part of `Engine` (its state lives in Engine.__init__)."""

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
                    stopped = advance_constraint(seq, t, stopped)
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
