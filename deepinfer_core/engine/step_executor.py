"""The device side of one engine step: bind states, resolve pending input tokens, run the batched
forward, apply the request constraints (structured-output masks), compute logprobs, apply
penalties and the min_tokens mask, sample, and advance the constraints with the sampled tokens.

It runs steps strictly in submission order (inline, or on one worker thread when scheduling is
asynchronous), so it can keep the facts a step needs from the previous one: each sequence's state
and every token it sampled. The host plans step N+1 without waiting for step N's tokens; a chunk
marked `pending` takes its last input token from this executor's record instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..ops.sampler import LogprobsResult, apply_penalties, compute_logprobs
from ..ops.transfer import to_device


@dataclass
class SampleSpec:
    params: Any                         # SamplingParams
    seed: int
    prompt_ids: list[int]
    stop_ids: list[int]                 # masked while fewer than min_tokens outputs exist
    constraint: Any = None              # RequestConstraint (engine/constraints.py) or None


@dataclass
class ChunkPlan:
    seq_id: int
    slot: int
    block_ids: tuple[int, ...]
    start: int                          # 0 = the sequence (re)starts: bind a fresh state
    known_ids: list[int]                # input tokens the host knows
    pending: bool                       # one more input: this sequence's newest sampled token
    logit_mode: str                     # "all" (prompt logprobs) | "last" | "none"
    sample: SampleSpec | None = None
    prompt_targets: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.known_ids) + int(self.pending)


@dataclass
class StepPlan:
    chunks: list[ChunkPlan]
    released: list[int] = field(default_factory=list)    # sequences whose state is gone
    finished: list[int] = field(default_factory=list)    # ... and whose token record can go too


@dataclass
class StepResult:
    tokens: list[int]                                     # one per sampling chunk, in order
    logprobs: list[LogprobsResult | None]
    prompt_logprobs: dict[int, LogprobsResult]            # chunk index -> result
    constraint_done: list[bool] = field(default_factory=list)   # per sampled token: constraint complete


class StepExecutor:
    def __init__(self, runner: Any, sampler: Any, eos_token_id: int | None = None):
        self.runner, self.sampler, self.eos_token_id = runner, sampler, eos_token_id
        self.states: dict[int, Any] = {}
        self.outputs: dict[int, list[int]] = {}           # every token each sequence sampled
        # Per-completion constraint states. They survive a preemption (the recompute re-feeds
        # exactly the tokens they have accepted) and go when the sequence finishes.
        self.constraint_states: dict[int, Any] = {}

    @property
    def num_states(self) -> int:
        return len(self.states)

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        for sid in plan.released:
            state = self.states.pop(sid, None)
            if state is not None:
                self.runner.release(state)
        for sid in plan.finished:
            self.outputs.pop(sid, None)
            self.constraint_states.pop(sid, None)
        if not plan.chunks:
            return StepResult([], [], {})
        states, inputs = [], []
        for c in plan.chunks:
            if c.start == 0:
                if c.seq_id in self.states:
                    self.runner.release(self.states.pop(c.seq_id))
                self.states[c.seq_id] = self.runner.bind_sequence(c.slot, list(c.block_ids))
            state = self.states[c.seq_id]
            if hasattr(state, "table") and len(state.table) != len(c.block_ids):
                state.table.set(list(c.block_ids))
            states.append(state)
            inputs.append(c.known_ids + [self.outputs[c.seq_id][-1]] if c.pending else c.known_ids)
        logits = self.runner.forward_batch(inputs, states, logit_modes=[c.logit_mode for c in plan.chunks])
        rows, sampling, prompt_lp, row = [], [], {}, 0
        for i, c in enumerate(plan.chunks):
            n_rows = {"none": 0, "last": 1, "all": c.num_tokens}[c.logit_mode]
            if c.prompt_targets:
                t = torch.tensor(c.prompt_targets, device=logits.device)
                prompt_lp[i] = compute_logprobs(logits[row:row + len(t)], c.prompt_logprobs, t)
            if c.sample is not None:
                rows.append(row + n_rows - 1)
                sampling.append(c)
            row += n_rows
        # index_select with a staged index: indexing by a list would wait for the forward on a GPU,
        # and the host work of sampling (the structured-output masks) is meant to overlap it.
        picked = logits.index_select(0, to_device(rows, torch.long, logits.device)) if rows else logits[:0]
        tokens, logprobs, done = self._sample(picked, sampling)
        return StepResult(tokens, logprobs, prompt_lp, done)

    def _constrained(self, chunks: list[ChunkPlan]) -> dict[Any, tuple[list[int], list[Any]]]:
        """processor -> (rows, states) of the sampled rows that carry a constraint."""
        groups: dict[Any, tuple[list[int], list[Any]]] = {}
        for i, c in enumerate(chunks):
            cons = c.sample.constraint
            if cons is None:
                continue
            state = self.constraint_states.get(c.seq_id)
            if state is None:
                state = self.constraint_states[c.seq_id] = cons.new_state(c.sample.params, self.eos_token_id)
            rows, states = groups.setdefault(cons.processor, ([], []))
            rows.append(i)
            states.append(state)
        return groups

    def _sample(self, logits: torch.Tensor, chunks: list[ChunkPlan]) -> tuple[list[int], list, list[bool]]:
        if not chunks:
            return [], [], []
        specs = [c.sample for c in chunks]
        params = [s.params for s in specs]
        outs = [self.outputs.setdefault(c.seq_id, []) for c in chunks]
        constrained = self._constrained(chunks)
        for processor, (rows, states) in constrained.items():
            # In place: `logits` is this step's own gathered copy. The masked logits are the request's
            # distribution, so logprobs see the mask too (as in vLLM).
            processor.mask(logits, rows, states)
        proc = apply_penalties(logits, params, outs, [s.prompt_ids for s in specs])
        held = {i: [t for t in s.stop_ids if t < proc.shape[-1]] for i, s in enumerate(specs)
                if len(outs[i]) < s.params.min_tokens}        # min_tokens: no stop token yet
        held = {i: stop for i, stop in held.items() if stop}
        if held:
            before, proc = proc, proc.clone()
            for i, stop in held.items():
                proc[i, stop] = float("-inf")
            if any(specs[i].constraint is not None for i in held):
                # A grammar that can only end now wins over min_tokens: a row left with nothing to
                # sample keeps its stop tokens (decided on the device, no sync).
                proc = torch.where(proc.isneginf().all(-1, keepdim=True), before, proc)
        positions = [c.start + c.num_tokens for c in chunks]
        tokens = self.sampler.sample(proc, params, positions, [s.seed for s in specs]).tolist()
        logprobs = []
        for i, (s, tok) in enumerate(zip(specs, tokens)):
            outs[i].append(int(tok))
            k = s.params.logprobs
            logprobs.append(None if k is None else
                            compute_logprobs(logits[i:i + 1], k, torch.tensor([tok], device=logits.device)))
        done = [False] * len(chunks)
        for processor, (rows, states) in constrained.items():
            for r, d in zip(rows, processor.advance(states, [tokens[r] for r in rows])):
                done[r] = d
        return [int(t) for t in tokens], logprobs, done
