"""The device side of one engine step: inputs -> forward -> constraint masks -> penalties and the
min_tokens mask -> one sampler call for every row -> one logprobs call at the largest k -> the
sampled ids written into the runner's per-slot last-token record and copied to the host
asynchronously.

Nothing here waits for the device. `launch` returns an `InFlight` step whose host copies complete
on an event; `collect` waits for that event (by then the device is usually busy with the next
step, launched in between). The next step's inputs never need the host to know this step's tokens:
a sequence whose token is still in flight feeds it from the runner's last-token record on the
device (its input id is encoded as -1 - slot), and a verify chunk's drafts from the drafter's
per-slot record (runner/slot_tables.py). With a speculator, `launch` leaves the verification and
drafting to `speculate` (the engine calls it when it needs the verdict: speculative/engine_step.py).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..contracts import StepRunner, TokenSampler
from ..ops.penalties import PenaltyState
from ..ops.sampler import compute_logprobs
from ..ops.transfer import to_device, to_host
from .scheduler import CacheUpdates, ScheduledChunk


@dataclass
class StepBatch:
    """What the runner needs for one forward: flat ids (pending rows hold -1 - slot), per-sequence
    slots/starts/lens, the rows whose logits are wanted, and the cache bookkeeping changes."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    ids: list[int]
    logit_rows: list[int]
    updates: CacheUpdates
    pending: bool = False                  # some ids are -1 - slot
    rect_lo: list[int] | None = None       # V4.1 bounded replay: each sequence's rectangle start


@dataclass
class HostLogprobs:
    rows: list[int]                        # sampled-row index of each entry
    top_values: list[list[float]]
    top_ids: list[list[int]]
    token_logprobs: list[float]
    token_ranks: list[int]


@dataclass
class InFlight:
    chunks: list[ScheduledChunk]
    sampled: list[ScheduledChunk]          # the chunks whose last row sampled, in row order
    tokens: torch.Tensor | None            # host int64 [len(sampled)] (pinned, filled asynchronously)
    logprobs: tuple | None                 # host tensors of the logprobs rows
    logprob_rows: list[int] = field(default_factory=list)
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)   # chunk index -> host tensors
    event: Any = None                      # torch.cuda.Event after the copies, or None (CPU)
    masked: bool = False                   # constraint masks were copied from the host this step
    spec: Any = None                       # speculative/engine_step.SpecOutcome once speculated
    # what `StepExecutor.speculate` reads (the forward's outputs, views of static graph buffers):
    # set by a speculative launch, cleared once the speculator ran
    spec_inputs: tuple | None = None

    @property
    def verdict_pending(self) -> bool:
        """Verified on the device; the engine has not committed the verdict yet."""
        return self.spec is not None and self.spec.accepted_copy is not None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


_cpu_worker: ThreadPoolExecutor | None = None


def _on_cpu_worker(fn, *args):
    """Run a CPU step on one shared worker thread and wait for it. On the 2-core VMs this engine is
    developed and tested on, torch's CPU kernels ran 1.6x (idle) to 10x (loaded) slower on the main
    thread than on a worker thread, matmul loops included; the step stays synchronous."""
    global _cpu_worker
    if _cpu_worker is None:
        _cpu_worker = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-cpu-step")
    return _cpu_worker.submit(fn, *args).result()


def _has_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class StepExecutor:
    def __init__(self, runner: StepRunner, sampler: TokenSampler, eos_token_id: int | None, vocab_size: int, num_slots: int,
                 speculator: Any = None):
        """`speculator`: a speculative/engine_step.Speculator when the engine drafts (its steps then
        run the forward with the streams the drafter reads)."""
        self.runner, self.sampler, self.eos_token_id = runner, sampler, eos_token_id
        self.truncation = getattr(runner, "truncation", None)
        self.device = torch.device(runner.device)
        self.penalties = PenaltyState(num_slots, vocab_size, self.device)
        self.speculator = speculator

    # ---- launch --------------------------------------------------------------------------------
    def launch(self, chunks: list[ScheduledChunk], updates: CacheUpdates,
               previous: InFlight | None = None, on_device: bool = False, blind: bool = False) -> InFlight:
        """Queue one step on the device (on a CPU: run it, on the CPU worker thread). `on_device`:
        greedy verify chunks of one shape, verified and drafted without the host (`verifies_on_device`);
        `blind`: their positions are the device's (the previous step's verdict is not read yet)."""
        fn, args = (self._launch_on_device, (chunks, updates, blind)) if on_device else \
            (self._launch, (chunks, updates, previous))
        if self.device.type == "cpu":
            return _on_cpu_worker(fn, *args)
        return fn(*args)

    def verifies_on_device(self, num_seqs: int, q: int) -> bool:
        """Whether a verify step of this shape can be verified and drafted on the device."""
        spec = self.speculator
        return (spec is not None and self.runner.slot_tables.drafts.shape[0] >= spec.num_drafts
                and self.runner.verifies_on_device(num_seqs, q) and spec.device_drafting(num_seqs, q))

    @torch.no_grad()
    def _launch_on_device(self, chunks: list[ScheduledChunk], updates: CacheUpdates, blind: bool) -> InFlight:
        slots = [c.seq.slot for c in chunks]
        slots_t = to_device(slots, torch.long, self.device)
        ids = []
        for c in chunks:      # the last token (the device's record when the host has not read it), the drafts
            seq = c.seq
            ids.append(-1 - seq.slot if blind or c.start >= seq.num_tokens else seq.token_slice(c.start, c.start + 1)[0])
            ids.extend(c.drafts[:c.num_drafts])
        out, ids_t, starts_t = self.runner.execute_verify(updates, slots, slots_t, ids, chunks[0].num_tokens,
                                                          None if blind else [c.start for c in chunks])
        step = InFlight(chunks, [], None, None)
        step.spec = self.speculator.run_on_device(out, chunks, slots, slots_t, starts_t, ids_t,
                                                  self.runner.slot_tables)
        self._record(step)
        return step

    @torch.no_grad()
    def _launch(self, chunks: list[ScheduledChunk], updates: CacheUpdates, previous: InFlight | None) -> InFlight:
        batch, sampled, prompt_lp = self._inputs(chunks, updates)
        fresh = [c.seq for c in chunks if c.start == c.seq.first_start and _has_penalties(c.seq.request.params)]
        if fresh:      # (re)started sequences: their counts from the outputs they already have
            self.penalties.start([s.slot for s in fresh], [s.prompt_ids for s in fresh],
                                 [s.token_ids for s in fresh])
        spec = self.speculator
        if spec is None:
            logits = self.runner.execute(batch)
        else:
            out, fb = self.runner.execute_with_streams(batch)
            logits = out.logits
            sampled = [c for c in sampled if not c.num_drafts]      # verify chunks: the speculator's
        step = InFlight(chunks, sampled, None, None)
        row = 0
        sample_rows, logit_starts = [], []
        for i, c in enumerate(chunks):
            logit_starts.append(row)
            if c.num_drafts:
                row += c.num_tokens
            elif i in prompt_lp:
                n = c.num_tokens
                targets = c.seq.prompt_ids[c.start + 1:c.start + n + 1]
                k = c.seq.request.params.prompt_logprobs
                t = to_device(targets, torch.long, logits.device)
                res = compute_logprobs(logits[row:row + len(targets)], k, t)
                step.prompt_logprobs[i] = tuple(to_host(x) for x in (res.top_logprobs, res.top_ids,
                                                                     res.sampled_logprobs, res.sampled_ranks))
                row += n
                if c.samples:
                    sample_rows.append(row - 1)
            elif c.samples:
                sample_rows.append(row)
                row += 1
        tokens = None
        if sampled:
            plain = logits
            if len(sample_rows) != logits.shape[0]:
                plain = logits.index_select(0, to_device(sample_rows, torch.long, logits.device))
            tokens = self._sample(plain, step, previous)
        if spec is not None:
            if any([c.num_drafts and c.seq.request.constraint is not None for c in chunks]):
                self._mask_verify_rows(logits, chunks, logit_starts, step, previous)
            step.spec_inputs = (out, fb, logit_starts, tokens)
        else:
            self._record(step)
        return step

    def speculate(self, step: InFlight) -> None:
        """Verify the step's drafts and draft the next ones (speculative/engine_step.py), queued behind
        its forward. Must run before the next launch: the forward's outputs are graph buffers that the
        next replay overwrites. Its host sync is the verdict (the accepted counts)."""
        if self.device.type == "cpu":
            return _on_cpu_worker(self._speculate, step)
        return self._speculate(step)

    @torch.no_grad()
    def _speculate(self, step: InFlight) -> None:
        out, fb, logit_starts, tokens = step.spec_inputs
        step.spec_inputs = None
        step.spec = self.speculator.run(out, fb, step.chunks, logit_starts, tokens, self.runner.last_token,
                                        self.penalties)
        self._record(step)

    def _record(self, step: InFlight) -> None:
        if self.device.type == "cuda":
            step.event = torch.cuda.Event()
            step.event.record()

    def _inputs(self, chunks: list[ScheduledChunk], updates: CacheUpdates):
        """The flat step inputs; this runs for every sequence at every step."""
        if all([c.num_tokens == 1 and c.samples and not c.seq.want_prompt_logprobs for c in chunks]):
            return self._decode_inputs(chunks, updates), list(chunks), set()
        slots, starts, lens, ids, rows, sampled, prompt_lp = [], [], [], [], [], [], set()
        pending = False
        for i, c in enumerate(chunks):
            seq, start, n = c.seq, c.start, c.num_tokens
            end, known = start + n, seq.num_tokens
            if c.num_drafts:                       # verify: the last token, its drafts; every row's logits
                if known > start:
                    ids.extend(seq.token_slice(start, start + 1))
                else:                              # added by the previous verify step, still on the device
                    ids.append(-1 - seq.slot)
                    pending = True
                drafts = c.drafts[:c.num_drafts]
                ids.extend(drafts)
                pending = pending or drafts[0] < 0  # device codes of drafts still being drawn
                rows.extend(range(len(ids) - n, len(ids)))
                sampled.append(c)
                slots.append(seq.slot)
                starts.append(start)
                lens.append(n)
                continue
            if known >= end:
                ids.extend(seq.token_slice(start, end))
            else:                                  # its newest token is still on the device
                if known > start:
                    ids.extend(seq.token_slice(start, known))
                ids.append(-1 - seq.slot)
                pending = True
            if c.samples:
                sampled.append(c)
                if seq.want_prompt_logprobs and start < len(seq.request.prompt_token_ids):
                    prompt_lp.add(i)
                    rows.extend(range(len(ids) - n, len(ids)))
                else:
                    rows.append(len(ids) - 1)
            elif seq.want_prompt_logprobs and start < len(seq.request.prompt_token_ids):
                prompt_lp.add(i)
                rows.extend(range(len(ids) - n, len(ids)))
            slots.append(seq.slot)
            starts.append(start)
            lens.append(n)
        rect = None
        if self.truncation is not None:          # V4.1 bounded replay of the prompt
            rect = [self.truncation.rectangle(len(c.seq.request.prompt_token_ids)) for c in chunks]
        return StepBatch(slots, starts, lens, ids, rows, updates, pending, rect), sampled, prompt_lp

    @staticmethod
    def _decode_inputs(chunks: list[ScheduledChunk], updates: CacheUpdates) -> StepBatch:
        """A pure decode step (one token per sequence, each sampling): list comprehensions only.
        A token the host does not know yet is -1 - slot (the device's last-token record; after a
        verify step still in post-processing, several tokens are in flight and it is the newest)."""
        seqs = [c.seq for c in chunks]
        slots = [s.slot for s in seqs]
        starts = [c.start for c in chunks]
        ids = [-1 - s.slot if st >= s.num_tokens else s.token_slice(st, st + 1)[0] for s, st in zip(seqs, starts)]
        pending = any([i < 0 for i in ids])
        return StepBatch(slots, starts, [1] * len(chunks), ids, list(range(len(chunks))), updates, pending)

    def _sample(self, logits: torch.Tensor, step: InFlight, previous: InFlight | None) -> torch.Tensor:
        sampled = step.sampled
        # comprehensions, not one loop with appends: this runs for every row at every step
        seqs = [c.seq for c in sampled]
        params = [s.params for s in seqs]
        slots = [s.slot for s in seqs]
        positions = [c.start + c.num_tokens for c in sampled]
        seeds = [s.seed for s in seqs]
        penalised = any([s.penalised for s in seqs])
        constrained_rows = any([s.request.constraint is not None for s in seqs])
        held_rows = any([s.min_tokens > len(s.token_ids) + s.num_pending - 1 for s in seqs if s.min_tokens])
        want_lp = any([s.wants_logprobs for s in seqs])
        constrained = self._constrained(seqs) if constrained_rows else {}
        if constrained:
            if previous is not None and previous.masked:
                previous.wait()                    # its mask copy reads the processors' host buffers
            for processor, (rows, states) in constrained.items():
                # In place on this step's own logits rows: the masked logits are the request's
                # distribution, so logprobs see the mask too (as in vLLM).
                processor.mask(logits, rows, states)
            step.masked = True
        slots_t = to_device(slots, torch.long, logits.device)
        proc = self.penalties.apply(logits, slots_t, params) if penalised else logits
        if held_rows:
            proc = self._hold_stop_tokens(proc, seqs, constrained)
        tokens = self.sampler.sample(proc, params, positions, seeds)
        self.runner.last_token.index_copy_(0, slots_t, tokens)
        self.penalties.add(slots_t, tokens)
        step.tokens = to_host(tokens)
        if want_lp:
            want = [i for i, p in enumerate(params) if p.logprobs is not None]
            k = max(params[i].logprobs for i in want)
            if len(want) == len(params):
                lp_logits, lp_tokens = logits, tokens
            else:
                idx = to_device(want, torch.long, logits.device)
                lp_logits, lp_tokens = logits.index_select(0, idx), tokens.index_select(0, idx)
            res = compute_logprobs(lp_logits, k, lp_tokens)
            step.logprobs = tuple(to_host(x) for x in (res.top_logprobs, res.top_ids, res.sampled_logprobs,
                                                        res.sampled_ranks))
            step.logprob_rows = want
        return tokens

    def _mask_verify_rows(self, logits: torch.Tensor, chunks: list[ScheduledChunk], logit_starts: list[int],
                          step: InFlight, previous: InFlight | None) -> None:
        """Grammar masks of the verify rows of constrained requests, in place (row j: the grammar after
        the first j drafts); a chunk accepts no draft past the first its grammar refuses."""
        verifying = [(c, lo) for c, lo in zip(chunks, logit_starts) if c.num_drafts]
        groups = self._constrained([c.seq for c, _ in verifying])
        if not groups:
            return
        if previous is not None and previous.masked:
            previous.wait()                        # its mask copy reads the processors' host buffers
        for processor, (idx, states) in groups.items():
            allowed = processor.mask_drafts(logits, [verifying[i][1] for i in idx], states,
                                            [verifying[i][0].drafts[:verifying[i][0].max_accept]
                                             for i in idx])
            for i, n in zip(idx, allowed):
                verifying[i][0].max_accept = n
        step.masked = True

    def _constrained(self, seqs) -> dict[Any, tuple[list[int], list[Any]]]:
        """processor -> (rows, states) of the sampled rows that carry a constraint."""
        groups: dict[Any, tuple[list[int], list[Any]]] = {}
        for i, seq in enumerate(seqs):
            cons = seq.request.constraint
            if cons is None:
                continue
            if seq.constraint_state is None:
                seq.constraint_state = cons.new_state(seq.request.params, self.eos_token_id)
            rows, states = groups.setdefault(cons.processor, ([], []))
            rows.append(i)
            states.append(seq.constraint_state)
        return groups

    @staticmethod
    def _hold_stop_tokens(proc: torch.Tensor, seqs, constrained) -> torch.Tensor:
        """min_tokens: no stop token while fewer outputs exist (decided on the host, per sequence)."""
        held = {}
        for i, s in enumerate(seqs):
            if s.request.params.min_tokens > s.num_outputs_scheduled - 1:
                stop = [t for t in s.stop_ids if t < proc.shape[-1]]
                if stop:
                    held[i] = stop
        if not held:
            return proc
        before, proc = proc, proc.clone()
        for i, stop in held.items():
            proc[i, stop] = float("-inf")
        if constrained and any(seqs[i].request.constraint is not None for i in held):
            # A grammar that can only end now wins over min_tokens: a row left with nothing to
            # sample keeps its stop tokens (decided on the device, no sync).
            proc = torch.where(proc.isneginf().all(-1, keepdim=True), before, proc)
        return proc

    # ---- collect -------------------------------------------------------------------------------
    @staticmethod
    def collect(step: InFlight) -> tuple[list[int], HostLogprobs | None]:
        """Wait for the step's copies; the sampled ids (one per sampled chunk) and logprobs."""
        step.wait()
        tokens = step.tokens.tolist() if step.tokens is not None else []
        lp = None
        if step.logprobs is not None:
            vals, ids, slp, ranks = step.logprobs
            lp = HostLogprobs(step.logprob_rows, vals.tolist(), ids.tolist(), slp.tolist(), ranks.tolist())
        return tokens, lp
