"""Repetition, presence and frequency penalties (vLLM semantics).

`apply_penalties` is the reference: it rebuilds every penalised row's token counts from Python lists,
one row at a time, which costs host work proportional to the output so far on every step and, on
an accelerator, a host sync per row (`torch.tensor(..., device=...)` from pageable memory).

`PenaltyState` keeps the counts on the device instead, one row per KV slot: a sequence's row is
(re)built once when it is admitted (`start`, after a preemption too), every sampled token is added
in place (`add`, no host sync), and `apply` reads the rows of a step's batch. Per step the host only
looks at each row's `SamplingParams` and stages one small tensor. `apply` performs the same
floating-point operations, in the same order and dtypes, as `apply_penalties`, so on the CPU the two
agree bit for bit. (On CUDA `apply_penalties` divides by a Python scalar, which PyTorch turns into a
multiplication by its reciprocal, up to 1 ulp away; `apply` divides by a tensor, a true division
there as on the CPU, so its results do not depend on the device.)
"""
from __future__ import annotations

import math
from itertools import chain
from typing import Any, Sequence

import torch

from .transfer import to_device


def wants_penalties(p: Any) -> bool:
    """Whether a row's SamplingParams ask for any penalty (decided on the host, from the params)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _is_plus_zero(v: float) -> bool:
    return v == 0 and math.copysign(1.0, v) > 0


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype PyTorch computes `tensor <op> python_float` in: float32 for the 16-bit floats (the
    result is rounded back afterwards), the tensor's own dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def apply_penalties(logits: torch.Tensor, params: Sequence[Any], output_token_ids: Sequence[Sequence[int]],
                    prompt_token_ids: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Repetition, presence and frequency penalties; returns a new tensor (the raw logits stay intact
    for logprobs).

    Presence/frequency count the output tokens so far. Repetition penalises tokens seen in the output
    and, when `prompt_token_ids` is given, in the prompt too (vLLM semantics): positive logits are
    divided by the penalty, negative ones multiplied.
    """
    active = [i for i, p in enumerate(params) if wants_penalties(p)]
    if not active:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in active:
        p = params[i]
        out_ids = torch.tensor(list(output_token_ids[i]), dtype=torch.long, device=logits.device)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if prompt_token_ids is not None and len(prompt_token_ids[i]):
                seen[torch.tensor(list(prompt_token_ids[i]), dtype=torch.long, device=logits.device)] = True
            r = p.repetition_penalty
            row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        logits[i] = row
    return logits


class PenaltyState:
    """Per-slot output-token counts and prompt-token masks on the device, for `apply`.

    Slots are the engine's KV slots (0 <= slot < num_slots); a slot's row belongs to the sequence
    last `start`ed in it. Only sequences whose params ask for penalties need to be started: `apply`
    reads the rows of those only, so whatever `add` writes into the rows of other slots is harmless
    (and is wiped when the slot is started). Nothing is allocated before the first `start`: most runs
    never use penalties and the state is [num_slots, vocab] int32 + bool (~0.6 MiB a slot at a vocab of
    129k).
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str) -> None:
        self.num_slots = int(num_slots)
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None   # [num_slots, vocab] int32: output tokens so far
        self.prompt: torch.Tensor | None = None   # [num_slots, vocab] bool: token is in the prompt

    @property
    def allocated(self) -> bool:
        return self.counts is not None

    def _allocate(self) -> None:
        if self.counts is None:
            shape = (self.num_slots, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def start(self, slots: Sequence[int], prompt_ids: Sequence[Sequence[int]],
              output_ids: Sequence[Sequence[int]]) -> None:
        """(Re)initialise the rows of `slots`: counts = bincount of `output_ids` (not empty when a
        preempted sequence is recomputed), prompt mask = `prompt_ids`.

        All slots go through one staged copy and a fixed number of kernels (no per-slot launches, no
        host sync). Slots must be distinct and every id in [0, vocab): an id out of range would land
        in another slot's row, so it is refused here, on the host, where it is still cheap to check.
        """
        n = len(slots)
        if not n == len(prompt_ids) == len(output_ids):
            raise ValueError(f"PenaltyState.start: {n} slots but {len(prompt_ids)} prompts and "
                             f"{len(output_ids)} outputs")
        if n == 0:
            return
        slots = [int(s) for s in slots]
        if len(set(slots)) != n or min(slots) < 0 or max(slots) >= self.num_slots:
            raise ValueError(f"PenaltyState.start: slots must be distinct and in [0, {self.num_slots}), "
                             f"got {slots}")
        for seq in chain(prompt_ids, output_ids):
            if len(seq) and (min(seq) < 0 or max(seq) >= self.vocab_size):
                raise ValueError(f"PenaltyState.start: token ids must be in [0, {self.vocab_size})")
        self._allocate()
        out_lens = [len(s) for s in output_ids]
        prompt_lens = [len(s) for s in prompt_ids]
        n_out, n_prompt = sum(out_lens), sum(prompt_lens)
        # One copy: [slots | output lengths | prompt lengths | output ids | prompt ids].
        packed = [*slots, *out_lens, *prompt_lens]
        packed.extend(chain.from_iterable(output_ids))
        packed.extend(chain.from_iterable(prompt_ids))
        staged = to_device(packed, torch.int64, self.device)
        sl, o_len, p_len = staged[:n], staged[n:2 * n], staged[2 * n:3 * n]
        o_ids, p_ids = staged[3 * n:3 * n + n_out], staged[3 * n + n_out:]
        self.counts.index_fill_(0, sl, 0)
        self.prompt.index_fill_(0, sl, False)
        base = sl * self.vocab_size
        if n_out:
            # output_size: the length is known here, so repeat_interleave need not read it back.
            lin = torch.repeat_interleave(base, o_len, output_size=n_out) + o_ids
            self.counts.view(-1).index_add_(0, lin, torch.ones(n_out, dtype=torch.int32, device=self.device))
        if n_prompt:
            lin = torch.repeat_interleave(base, p_len, output_size=n_prompt) + p_ids
            self.prompt.view(-1).index_fill_(0, lin, True)

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """counts[slots[i], tokens[i]] += 1 for every i, in place on the device (no host sync).

        `slots` and `tokens` are 1-D integer tensors on the state's device; a slot may repeat (several
        tokens of one sequence in a step). Tokens must be in [0, vocab): this is not checked, a check
        would need a sync. A no-op until something was started.
        """
        if self.counts is None or tokens.numel() == 0:
            return
        lin = slots.to(torch.int64) * self.vocab_size + tokens.to(torch.int64)
        # index_add_ (atomic adds of integers) rather than index_put_(accumulate=True): sync-free, and
        # integer sums do not depend on the order of the adds.
        self.counts.view(-1).index_add_(0, lin, torch.ones_like(lin, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, slots: torch.Tensor | Sequence[int],
              params: Sequence[Any], *, inplace: bool = False,
              preceding: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """`apply_penalties(logits, params, outputs, prompts)` with the counts and prompt masks of
        the rows' slots: returns a new tensor, or `logits` itself when no row asks for penalties.
        With `inplace=True` the penalised rows are written into `logits` and it is returned: saves
        a copy of the whole batch for a caller that no longer needs the raw logits (logprobs are
        taken before penalties).

        Row i of `logits` belongs to slot `slots[i]` (a device int64 tensor, or a list). Which rows
        are penalised is decided from `params` on the host; their batch indices and penalty values
        go to the device in one copy, and all of them are processed together, with the operations
        of `apply_penalties` in the same order and dtypes (so the same bits).

        `preceding[i]`: output tokens row i counts on top of its slot's (speculative verification:
        row j of a verify chunk follows the chunk's first j drafts, not yet in the counts).
        """
        batch = logits.shape[0]
        if not len(params) == len(slots) == batch:
            raise ValueError(f"PenaltyState.apply: logits has {batch} rows but got {len(params)} params "
                             f"and {len(slots)} slots")
        active = [i for i, p in enumerate(params) if wants_penalties(p)]
        if not active:
            return logits
        if self.counts is None:
            raise RuntimeError("PenaltyState.apply: a row asks for penalties but no slot was started")
        a = len(active)
        sel = [params[i] for i in active]
        # One copy, float64 (exact for the indices and the Python floats):
        # [rows | repetition | frequency | presence | slots of the rows, when given as a list].
        packed = [*map(float, active), *(float(p.repetition_penalty) for p in sel),
                  *(float(p.frequency_penalty) for p in sel), *(float(p.presence_penalty) for p in sel)]
        if not isinstance(slots, torch.Tensor):
            packed.extend(float(slots[i]) for i in active)
        staged = to_device(packed, torch.float64, logits.device)
        rows = staged[:a].to(torch.int64)
        if isinstance(slots, torch.Tensor):
            sl = slots.to(torch.int64).index_select(0, rows)
        else:
            sl = staged[4 * a:].to(torch.int64)
        dtype, op = logits.dtype, _opmath(logits.dtype)
        # A Python float operand is rounded to the opmath dtype, as here.
        rep, freq, pres = (staged[j * a:(j + 1) * a].to(op)[:, None] for j in (1, 2, 3))

        x = logits if a == batch else logits.index_select(0, rows)
        cnt = self.counts.index_select(0, sl)
        if preceding is not None:
            extra = [j * self.vocab_size + t for j, i in enumerate(active) for t in preceding[i]]
            if extra:
                lin = to_device(extra, torch.int64, logits.device)
                cnt.view(-1).index_add_(0, lin, torch.ones_like(lin, dtype=torch.int32))
        seen_out = cnt > 0
        reps = [p.repetition_penalty != 1.0 for p in sel]
        if any(reps):
            seen = seen_out | self.prompt.index_select(0, sl)
            if not all(reps):
                seen &= rep != 1           # rows with a repetition penalty of 1 skip this, as there
            x = torch.where(seen, torch.where(x > 0, (x / rep).to(dtype), (x * rep).to(dtype)), x)
        # x - (+0.0) is x, bit for bit (-0.0 and NaN included): a term whose penalty is +0.0 on every
        # penalised row changes nothing and is skipped. -0.0 is not skipped: x - (-0.0) turns a -0.0
        # logit into +0.0, and the reference does that too.
        if not all(_is_plus_zero(p.frequency_penalty) for p in sel):
            x = x - (freq * cnt.to(dtype)).to(dtype)
        if not all(_is_plus_zero(p.presence_penalty) for p in sel):
            x = x - (pres * seen_out.to(dtype)).to(dtype)
        if a == batch and not inplace:
            return x               # every row penalised (so active == range(batch)): x is new already
        return (logits if inplace else logits.clone()).index_copy_(0, rows, x)
