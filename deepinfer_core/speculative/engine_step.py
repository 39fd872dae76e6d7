"""Speculative decoding inside an engine step: verify the drafts of the step's verify chunks, then
run the MTP block over every row the target just ran and draft the next step's tokens.

The step executor calls `Speculator.run` once per step, right after the target forward and the
ordinary sampling of the other rows. A verify chunk is `[last token, x_1..x_k]` of one sequence
(scheduler.py plans it from `Sequence.draft_ids`, kept in `ScheduledChunk.drafts`); `ops.verify`
accepts a prefix of the drafts and adds one token (lossless: the argmax rule for greedy requests, speculative sampling otherwise, every
uniform keyed by (seed, position, purpose)). The rows a verification rejects need no undo: every
state is addressed by position (rings and tails hold window + backtrack slots; compressed rows are
rewritten when real tokens complete their block), so the engine only moves the sequence's next
position back to the accepted prefix.

The MTP block must see every committed position, so it runs over every row of the step (prefill
chunks included; row t's next token is the prompt's, the sampled token, or the verified one), and
drafts from the last committed row of each sequence that speculates. Drafts of a sampled request keep
their distributions q on the device until its next verify step (keyed by slot).

Requests with a grammar or penalties draft too: the step executor masks a constrained request's
verify rows by its grammar pushed through the drafts (`mask_drafts`), and verification penalises
row j by the output counts plus the request's first j drafts, then counts the emitted tokens. The
drafters propose without either (the verifier's p carries them; any q stays lossless). Logprobs of
the emitted tokens come from the verify rows (the grammar-masked logits without penalties, as the
sampler's logprobs); a request whose constraint processor cannot mask drafts does not draft.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..contracts import DraftProposer, DraftVerifier
from ..engine.scheduler import ScheduledChunk
from ..engine.sequence import Sequence
from ..model.deepseek_v4 import DeepseekV4Model, ModelOutput
from ..model.forward_batch import ForwardBatch
from ..ops.penalties import PenaltyState
from ..ops.sampler import GREEDY_EPS, compute_logprobs
from ..ops.transfer import to_device, to_host
from ..ops.verify import ExactVerifier
from .device_verdict import mtp_drafts_on_device, verify_on_device
from .mtp import Drafts, MTPDrafter, draft_confidence, draw
from .mtp_graphs import MTPGraphs
from .replay import ReplayDrafter


@dataclass
class SpecOutcome:
    """What one step's speculation leaves for the engine's post-processing (host tensors)."""

    verified: list[ScheduledChunk] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)       # drafts accepted per verified chunk
    tokens: torch.Tensor | None = None                      # [verified] the token each verification adds
    draft_seqs: list[Sequence] = field(default_factory=list)
    drafts: torch.Tensor | None = None                      # [draft_seqs, k] their next drafts
    # the input ids that stand for those drafts in the device's slot tables (runner/slot_tables.py),
    # when the drafter wrote them there: the next step can be launched before they reach the host
    draft_codes: list[list[int]] | None = None
    confidence: torch.Tensor | None = None                  # [draft_seqs, k] cumulative (VARLEN only)
    # logprobs of the emitted tokens of the verified chunks that want them: chunk index in `verified`
    # -> its first row in `logprobs` (one row per emitted token: accepted drafts, then the added one)
    logprob_rows: dict[int, int] = field(default_factory=dict)
    logprobs: tuple | None = None                           # host (top values, top ids, token lp, ranks)
    # a verdict still on the device (speculative/device_verdict.py): `accepted` is read from this
    # host copy once the step's event has passed (`read_accepted`)
    accepted_copy: torch.Tensor | None = None
    _draft_rows: list[list[int]] | None = None

    def read_accepted(self) -> None:
        if self.accepted_copy is not None:
            self.accepted, self.accepted_copy = self.accepted_copy.tolist(), None

    def draft_rows(self) -> list[list[int]]:
        """`drafts` as lists (read once, after the step's event)."""
        if self._draft_rows is None:
            self._draft_rows = self.drafts.tolist()
        return self._draft_rows


class Speculator:
    def __init__(self, model: DeepseekV4Model, num_drafts: int,
                 graphs: Callable[[torch.Tensor], MTPGraphs] | None = None, replay: ReplayDrafter | None = None,
                 proposer: DraftProposer | None = None, verifier: DraftVerifier | None = None):
        """Drafts with `proposer` (a plugin's, e.g. DSpark) when given, else with the checkpoint's MTP
        block. `graphs`: builds the MTP drafter's CUDA graphs (from the first step's target streams)
        when the runner has decode graphs; None runs it eagerly. `replay`: draft with a ReplayDrafter
        instead (benchmarks). `verifier`: the acceptance rule (deepinfer_verifier; None: the core's);
        one without the core's exact greedy rule verifies every step on the host."""
        self.replay, self.proposer = replay, proposer
        self.verifier = verifier if verifier is not None else ExactVerifier()
        self.drafter = MTPDrafter(model, num_drafts) if replay is None and proposer is None else None
        if proposer is not None:
            graphs = None
        self.num_drafts = num_drafts
        self.want_confidence = False     # VARLEN: the scheduler reads each draft's confidence
        self._probs: dict[int, torch.Tensor] = {}       # slot -> [k, V] q of its sampled drafts
        self._make_graphs, self._graphs = graphs, None

    def run(self, target: ModelOutput, fb: ForwardBatch, chunks: list[ScheduledChunk], logit_starts: list[int],
            sampled_tokens: torch.Tensor | None, last_token: torch.Tensor,
            penalties: PenaltyState) -> SpecOutcome:
        """`target`: the step's forward: its logits rows (`logit_starts[i]`: chunk i's first; verify
        rows already grammar-masked), the final streams of every row of `fb` (and DSpark's features);
        `sampled_tokens`: the tokens sampled for the chunks that sample and do not verify, in chunk
        order; `penalties`: the executor's output counts, read and advanced for penalised requests.
        Slots come from `fb` (the step's own): a sequence that stopped after the launch (found by the
        post-processing of the step before) has already given its slot back."""
        out = SpecOutcome(verified=[c for c in chunks if c.num_drafts])
        slots = fb.slot_ids if fb.slot_ids is not None else [c.seq.slot for c in chunks]
        extra = None
        if out.verified:
            extra = self._verify(target.logits, chunks, slots, logit_starts, out, last_token, penalties)
        if any(c.seq.may_draft for c in chunks):
            self._draft(target, fb, chunks, slots, sampled_tokens, extra, out)
        return out

    def device_drafting(self, num_seqs: int, q: int) -> bool:
        """Whether this drafter can draft after a verdict that stays on the device, for a verify step
        of this shape (the replay drafter; the MTP drafter on CUDA graphs that take device positions)."""
        if not self.verifier.exact_greedy:
            return False
        if self.replay is not None:
            return True
        graphs = self._graphs
        return (self.proposer is None and graphs is not None and graphs.observe_graphs.takes_device_starts
                and graphs.fits([q] * num_seqs))

    def run_on_device(self, target: ModelOutput, chunks: list[ScheduledChunk], slots: list[int],
                      slots_t: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor, tables) -> SpecOutcome:
        """Verify greedy chunks of one shape and draft the next tokens without the host
        (speculative/device_verdict.py); the outcome's host copies complete on the step's event.
        `slots_t` [n], `starts` [n], `ids` [n*q]: the chunks' slots, first positions and resolved
        inputs, on the device."""
        verdict = verify_on_device(target.logits, ids, starts, slots_t, tables)
        out = SpecOutcome(verified=list(chunks), tokens=to_host(verdict.tokens),
                          accepted_copy=to_host(verdict.accepted), draft_seqs=[c.seq for c in chunks])
        conf = None
        if self.replay is not None:
            drafts = self.replay.propose_on_device([s.prompt_ids for s in out.draft_seqs],
                                                   [s.seed for s in out.draft_seqs], slots, slots_t, verdict.last,
                                                   tables.num_slots)
            if self.want_confidence:
                conf = self.replay.confidence_on_device().expand(len(slots), -1)
        else:
            drafts, conf = mtp_drafts_on_device(self._graphs, target.streams, ids, verdict, starts, slots,
                                                self.num_drafts, self.want_confidence)
            if conf is not None:
                conf = conf.cumprod(1)
        if not tables.write_drafts(slots_t, drafts):
            raise RuntimeError(f"the slot tables hold {tables.drafts.shape[0]} drafts per slot, the drafter "
                               f"proposes {self.num_drafts}")
        out.drafts = to_host(drafts)
        out.draft_codes = [tables.draft_codes(slot, self.num_drafts) for slot in slots]
        if conf is not None:
            out.confidence = to_host(conf)
        return out

    # ---- verification ------------------------------------------------------------------------
    def _verify(self, logits, chunks, chunk_slots, logit_starts, out: SpecOutcome, last_token,
                penalties: PenaltyState) -> torch.Tensor:
        rows, ids, ks, slot_list = [], [], [], []
        for c, slot, lo in zip(chunks, chunk_slots, logit_starts):
            if c.num_drafts:
                rows.extend(range(lo, lo + c.max_accept + 1))
                ids.extend(c.drafts[:c.max_accept])
                ks.append(c.max_accept)
                slot_list.append(slot)
        dev = logits.device
        seqs = [c.seq for c in out.verified]
        params = [s.params for s in seqs]
        drafts = [c.drafts for c in out.verified]
        probs = None
        if any(p.temperature >= GREEDY_EPS for p in params):
            probs = torch.cat([self._probs[slot][:k] if p.temperature >= GREEDY_EPS else self._one_hot(d[:k], logits)
                               for slot, d, p, k in zip(slot_list, drafts, params, ks)])
        target = logits.index_select(0, to_device(rows, torch.long, dev))
        penalised = any(s.penalised for s in seqs)
        if penalised:
            target = self._penalise(target, seqs, slot_list, drafts, ks, penalties)
        verdict = self.verifier.verify(target, ks, to_device(ids, torch.long, dev), probs, params,
                         [c.start + 1 for c in out.verified], [s.seed for s in seqs])
        slots = to_device(slot_list, torch.long, dev)
        last_token.index_copy_(0, slots, verdict.tokens)
        out.accepted, out.tokens = verdict.accepted, to_host(verdict.tokens)
        if penalised:     # the emitted tokens join the counts (accepted drafts, then the added one)
            accepted = [t for d, j in zip(drafts, verdict.accepted) for t in d[:j]]
            if accepted:
                penalties.add(to_device([slot for slot, j in zip(slot_list, verdict.accepted) for _ in range(j)],
                                        torch.long, dev), to_device(accepted, torch.long, dev))
            penalties.add(slots, verdict.tokens)
        if any(s.wants_logprobs for s in seqs):
            self._logprobs(logits, chunks, logit_starts, out, verdict.tokens)
        return verdict.tokens

    @staticmethod
    def _penalise(target: torch.Tensor, seqs: list[Sequence], slots: list[int], drafts: list[list[int]],
                  ks: list[int], penalties: PenaltyState) -> torch.Tensor:
        """Row j of a verify chunk is penalised as a decode step after its first j drafts would be:
        the output counts plus those drafts (the rows of requests without penalties stay as they are)."""
        row_slots = [slot for slot, k in zip(slots, ks) for _ in range(k + 1)]
        row_params = [s.params for s, k in zip(seqs, ks) for _ in range(k + 1)]
        preceding = [d[:j] for d, k in zip(drafts, ks) for j in range(k + 1)]
        return penalties.apply(target, row_slots, row_params, preceding=preceding, inplace=True)

    @staticmethod
    def _logprobs(logits, chunks, logit_starts, out: SpecOutcome, extra: torch.Tensor) -> None:
        """Logprobs of every emitted token (row r of a verify chunk predicts its token r + 1), in one
        call at the largest k asked for."""
        starts = {id(c): lo for c, lo in zip(chunks, logit_starts)}
        rows, targets, extra_at, k = [], [], [], 0
        for i, (c, j) in enumerate(zip(out.verified, out.accepted)):
            if not c.seq.wants_logprobs:
                continue
            out.logprob_rows[i] = len(rows)
            rows.extend(range(starts[id(c)], starts[id(c)] + j + 1))
            targets.extend(list(c.drafts[:j]) + [0])
            extra_at.append((len(targets) - 1, i))
            k = max(k, c.seq.params.logprobs)
        dev = logits.device
        t = to_device(targets, torch.long, dev)
        t[to_device([a for a, _ in extra_at], torch.long, dev)] = extra.index_select(
            0, to_device([i for _, i in extra_at], torch.long, dev))
        res = compute_logprobs(logits.index_select(0, to_device(rows, torch.long, dev)), k, t)
        out.logprobs = tuple(to_host(x) for x in (res.top_logprobs, res.top_ids, res.sampled_logprobs,
                                                  res.sampled_ranks))

    @staticmethod
    def _one_hot(drafts: list[int], logits: torch.Tensor) -> torch.Tensor:
        """q of a greedy request's drafts: its argmax drafts, one-hot (verification of mixed batches)."""
        k = len(drafts)
        q = torch.zeros(k, logits.shape[-1], dtype=torch.float64, device=logits.device)
        q[torch.arange(k, device=logits.device), to_device(list(drafts), torch.long, logits.device)] = 1.0
        return q

    # ---- drafting ----------------------------------------------------------------------------
    def _draft(self, target: ModelOutput, fb: ForwardBatch, chunks, chunk_slots, sampled_tokens, extra,
               out: SpecOutcome) -> None:
        """The drafter sees every row (MTP: row t's next token at t + 1; DSpark: row t's features), then
        drafts from the last committed row of every sequence that speculates (not of one that stopped
        after the launch)."""
        streams = target.streams
        next_ids, fix_rows, rows, positions, seqs, states, slots = [], [], [], [], [], [], []
        verified = iter(out.accepted)
        off = 0
        for i, c in enumerate(chunks):
            seq, n = c.seq, c.num_tokens
            if c.num_drafts:                    # rows past the accepted ones are rolled back anyway
                j = next(verified)
                next_ids += list(c.drafts[:c.num_drafts]) + [0]
                last = off + j
            else:
                next_ids += seq.token_slice(c.start + 1, c.start + n + 1)
                last = off + n - 1
                if c.samples:
                    next_ids.append(0)
            if c.samples:
                fix_rows.append(last)
                if seq.may_draft and not seq.finished:
                    rows.append(last)
                    positions.append(c.start + last - off)
                    seqs.append(seq)
                    states.append(fb.states[i])
                    slots.append(chunk_slots[i])
            off += n
        if self.replay is not None:
            if not seqs:
                return
            drafts = self.replay.propose([s.prompt_ids for s in seqs], [s.seed for s in seqs], positions)
            out.draft_seqs, out.drafts = seqs, torch.tensor(drafts, dtype=torch.long).view(len(seqs), -1)
            if self.want_confidence:
                out.confidence = self.replay.cumulative_confidence().expand(len(seqs), -1)
            return
        dev = streams.device
        ids = to_device(next_ids, torch.long, dev)
        if fix_rows:       # the tokens sampled or verified this step, in chunk order
            plain = [c for c in chunks if c.samples and not c.num_drafts]
            by_chunk = _interleave(chunks, sampled_tokens if plain else None, extra)
            ids[to_device(fix_rows, torch.long, dev)] = by_chunk
        params = [s.params for s in seqs]
        drafts = None
        if self.proposer is not None:
            self.proposer.observe(fb, target)
            if not seqs:
                return
            drafts = self.proposer.propose(ids.index_select(0, to_device(rows, torch.long, dev)),
                                          [p + 1 for p in positions], states, params, [s.seed for s in seqs])
        elif self._make_graphs is not None and len(fix_rows) == len(chunks):
            drafts = self._draft_graphed(streams, ids, chunks, chunk_slots, fix_rows, rows, positions, slots, params,
                                         [s.seed for s in seqs])
        if drafts is None and self.proposer is None:
            logits, mtp_streams = self.drafter.observe(fb, streams, ids, to_device(rows, torch.long, dev))
            if not seqs:
                return
            drafts = self.drafter.propose(logits, mtp_streams, states, positions, params, [s.seed for s in seqs],
                                          slot_ids=slots, slot_tables=fb.slot_tables,
                                          with_confidence=self.want_confidence)
        if not seqs:
            return
        if drafts.probs is not None:
            for i, (slot, p) in enumerate(zip(slots, params)):
                if p.temperature >= GREEDY_EPS:
                    self._probs[slot] = drafts.probs[i]
        out.draft_seqs, out.drafts = seqs, to_host(drafts.ids)
        tables = fb.slot_tables
        if tables is not None and tables.write_drafts(to_device(slots, torch.long, dev), drafts.ids):
            k = drafts.ids.shape[1]
            out.draft_codes = [tables.draft_codes(slot, k) for slot in slots]
        if drafts.confidence is not None and self.want_confidence:
            out.confidence = to_host(drafts.confidence.cumprod(1))


    def _draft_graphed(self, streams, ids, chunks, chunk_slots, last_rows, rows, positions, slots, params,
                       seeds) -> Drafts | None:
        """Drafts through the drafter's CUDA graphs, for a step of q rows per sequence that all
        sample (None: the step does not fit, or capture failed; the caller runs eagerly). Each draft
        is drawn between two replays, as the eager drafter draws it (argmax, or a sample of the
        request's processed distribution with its "draft" uniform)."""
        lens = [c.num_tokens for c in chunks]
        if self._graphs is None:
            self._graphs = self._make_graphs(streams)
        graphs = self._graphs
        if not graphs.fits(lens):
            return None
        q, dev = lens[0], streams.device
        all_positions = [p for c in chunks for p in range(c.start, c.start + q)]
        out = graphs.observe(streams, ids, all_positions, list(chunk_slots), q, last_rows)
        if out is None:
            return None
        logits, mtp_streams = out
        if len(rows) != len(last_rows):            # some sequences do not speculate
            drafting = set(rows)
            keep = to_device([i for i, r in enumerate(last_rows) if r in drafting], torch.long, dev)
            logits, mtp_streams = logits.index_select(0, keep), mtp_streams.index_select(0, keep)
        if not rows:
            return Drafts(torch.empty(0, self.num_drafts, dtype=torch.long, device=dev), None)
        greedy = all(p.temperature < GREEDY_EPS for p in params)
        drafted, dists, conf = [], [], [] if self.want_confidence else None
        for step in range(self.num_drafts):
            tok, q = draw(logits, params, [p + 2 + step for p in positions], seeds, greedy)
            drafted.append(tok)
            dists.append(q)
            if conf is not None:
                conf.append(draft_confidence(logits))
            if step + 1 == self.num_drafts:
                break
            out = graphs.draft_step(mtp_streams, tok, [p + 1 + step for p in positions], slots)
            if out is None:
                return None
            logits, mtp_streams = out
        return Drafts(torch.stack(drafted, 1), None if greedy else torch.stack(dists, 1),
                      None if conf is None else torch.stack(conf, 1))


def _interleave(chunks, sampled: torch.Tensor | None, verified: torch.Tensor | None) -> torch.Tensor:
    """One token per sampling chunk in chunk order, from the plain-sampled and the verified ones."""
    kinds = [bool(c.num_drafts) for c in chunks if c.samples]
    if all(kinds):
        return verified
    if not any(kinds):
        return sampled
    dev = (sampled if sampled is not None else verified).device
    order = torch.empty(len(kinds), dtype=torch.long, device=dev)
    order[to_device([i for i, k in enumerate(kinds) if not k], torch.long, dev)] = sampled
    order[to_device([i for i, k in enumerate(kinds) if k], torch.long, dev)] = verified
    return order
