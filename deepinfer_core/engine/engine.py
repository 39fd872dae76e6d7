"""The step loop: schedule -> one batched forward over every scheduled chunk -> sample the rows that
produce tokens -> stop checks -> free finished sequences. Host-side policy lives in the scheduler,
tensors in the runner; this file only moves data between them.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ..ops.sampler import apply_penalties, compute_logprobs
from .output_processor import check_stop, logprobs_entry
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, SeqStatus


class Engine:
    def __init__(self, runner: Any, sampler: Any, scheduler: Scheduler, tokenizer: Any, eos_token_id: int | None):
        self.runner, self.sampler, self.scheduler = runner, sampler, scheduler
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that finished in it."""
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self._release(seq)
        if not out.chunks:
            raise RuntimeError("scheduler scheduled nothing while requests are pending "
                               "(the state cache is too small for any waiting request)")
        modes = [self._logit_mode(c) for c in out.chunks]
        for c in out.chunks:
            if c.seq.state is None:
                c.seq.state = self.runner.new_sequence()
            if c.seq.request.metrics.first_scheduled_time is None:
                c.seq.request.metrics.first_scheduled_time = time.time()
        logits = self.runner.forward_batch([c.seq.token_slice(c.start, c.start + c.num_tokens) for c in out.chunks],
                                           [c.seq.state for c in out.chunks], logit_modes=modes)
        rows, sampling, row = [], [], 0
        for c, mode in zip(out.chunks, modes):
            c.seq.num_computed += c.num_tokens
            n_rows = {"none": 0, "last": 1, "all": c.num_tokens}[mode]
            if mode == "all":
                self._prompt_logprobs(c, logits[row:row + n_rows])
            if c.samples:
                rows.append(row + n_rows - 1)
                sampling.append(c.seq)
            row += n_rows
        return self._sample_and_finish(logits[rows] if rows else logits[:0], sampling)

    # ---- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _logit_mode(c: ScheduledChunk) -> str:
        if c.seq.want_prompt_logprobs and c.start < len(c.seq.prompt_ids):
            return "all"
        return "last" if c.samples else "none"

    def _prompt_logprobs(self, c: ScheduledChunk, rows: torch.Tensor) -> None:
        """Row r predicts prompt token start + r + 1 (the first prompt token gets None)."""
        seq, k = c.seq, c.seq.request.params.prompt_logprobs
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        targets = seq.prompt_ids[c.start + 1:c.start + c.num_tokens + 1]
        if targets and len(seq.prompt_logprobs) < len(seq.prompt_ids):
            res = compute_logprobs(rows[:len(targets)], k, torch.tensor(targets, device=rows.device))
            tok = self.tokenizer if seq.request.params.detokenize else None
            seq.prompt_logprobs.extend(logprobs_entry(res, r, t, tok) for r, t in enumerate(targets))

    def _sample_and_finish(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sequence]:
        if not seqs:
            return []
        params = [s.request.params for s in seqs]
        outs = [s.completion.token_ids for s in seqs]
        proc = apply_penalties(logits, params, outs, [s.prompt_ids for s in seqs])
        for i, s in enumerate(seqs):            # min_tokens: stop tokens may not be sampled yet
            if len(outs[i]) < params[i].min_tokens:
                stop = [t for t in params[i].all_stop_token_ids(self.eos_token_id) if t < proc.shape[-1]]
                if stop:
                    proc = proc.clone() if proc is logits else proc
                    proc[i, stop] = float("-inf")
        positions = [s.num_tokens for s in seqs]
        tokens = self.sampler.sample(proc, params, positions, [s.completion.seed for s in seqs]).tolist()
        finished, now = [], time.time()
        for i, (s, tok) in enumerate(zip(seqs, tokens)):
            p, comp = params[i], s.completion
            if p.logprobs is not None:
                res = compute_logprobs(logits[i:i + 1], p.logprobs, torch.tensor([tok]))
                comp.logprobs = comp.logprobs if comp.logprobs is not None else []
                comp.logprobs.append(logprobs_entry(res, 0, tok, self.tokenizer if p.detokenize else None))
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + float(res.sampled_logprobs[0])
            comp.token_ids.append(int(tok))
            m = s.request.metrics
            m.token_times.append(now)
            m.first_token_time = m.first_token_time or now
            if check_stop(comp, p, eos_token_id=self.eos_token_id, max_tokens=s.max_tokens, tokenizer=self.tokenizer):
                self.scheduler.finish(s)
                self._release(s)
                finished.append(s)
        return finished

    def _release(self, seq: Sequence) -> None:
        if seq.state is not None:
            self.runner.release(seq.state)
            seq.state = None
        if seq.status is SeqStatus.WAITING:      # preempted: recompute from scratch later
            seq.prompt_logprobs = None
