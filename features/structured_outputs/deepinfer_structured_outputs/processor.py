"""The structured-outputs logits processor (the `deepinfer_logits_processors` answer).

Per step, for the sampled rows whose request has so_args: fill one int32 bitmask row per constrained
row on the host (xgrammar's batch fill on several threads; a forced trigger token is one
bit), copy it to the logits' device (pinned, asynchronous) and apply it there in place (xgrammar's
Triton kernel on CUDA, its C++ kernel on the CPU). The executor calls this after launching the
forward, so on a GPU the host fill overlaps the device's work. The masked logits then feed logprobs
and every sampler path alike (greedy, top-k/top-p/min-p, seeded).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from deepinfer_core.api.structured_outputs import parse_so_args
from deepinfer_core.ops.transfer import to_device

from .grammar_service import GrammarConstraint, GrammarService, ServiceSettings
from .matcher_state import FORCING, GRAMMAR, set_single_token


@dataclass
class MaskStats:
    """Host time spent building masks (the benchmark reads it)."""

    calls: int = 0
    rows: int = 0
    fill_seconds: float = 0.0        # bitmask fill on the host
    total_seconds: float = 0.0       # fill + copy + apply launch


class StructuredOutputProcessor:
    name = "structured_outputs"

    def __init__(self, settings: ServiceSettings | None = None, fill_threads: int | str = "auto"):
        self.settings = settings or ServiceSettings.from_env()
        self.service = GrammarService(self.settings)
        self.fill_threads = fill_threads
        self._batch = None
        # (host, device) bitmask buffers of the sampled rows and of the verify rows: a step masks
        # both, and a host buffer must not change while its asynchronous copy is queued
        self._bufs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stats = MaskStats()

    # ---- submission (host) -----------------------------------------------------------------------
    def claims(self, params: Any) -> bool:
        return getattr(params, "so_args", None) is not None

    def prepare(self, params: Any, *, tokenizer: Any, vocab_size: int,
                eos_token_id: int | None) -> GrammarConstraint:
        so = parse_so_args(params.so_args)
        for name, ids in (("trigger_token_ids", so.trigger_token_ids),
                          ("bound_token_id", () if so.bound_token_id is None else (so.bound_token_id,))):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(f"SamplingParams: so_args {name} has id(s) {outside} outside "
                                 f"[0, vocab_size={vocab_size})")
        if tokenizer is None:
            raise ValueError("SamplingParams: so_args needs the model's tokenizer (the checkpoint has no "
                             "tokenizer files; pass LLM(tokenizer=...))")
        try:
            import xgrammar  # noqa: F401
        except ImportError as e:
            raise ValueError(f"SamplingParams: so_args needs the xgrammar package ({e}); "
                             f"pip install deepinfer-structured-outputs pulls it in") from None
        future = self.service.submit(so, tokenizer, vocab_size, eos_token_id)
        return GrammarConstraint(self, so, future, self.settings.timeout_s)

    # ---- the step (executor thread) ----------------------------------------------------------------
    def _buffers(self, rows: int, vocab: int, device: torch.device,
                 purpose: str = "sample") -> tuple[torch.Tensor, torch.Tensor]:
        words = (vocab + 31) // 32
        host, dev = self._bufs.get(purpose, (None, None))
        if host is None or host.shape[0] < rows or host.shape[1] != words or dev.device != device:
            cap = max(rows, 64)
            pinned = device.type == "cuda"
            host = torch.empty(cap, words, dtype=torch.int32, pin_memory=pinned)
            dev = host if not pinned else torch.empty(cap, words, dtype=torch.int32, device=device)
            self._bufs[purpose] = host, dev
        return host, dev

    def mask(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[Any]) -> None:
        t0 = time.perf_counter()
        grammar = [(r, s) for r, s in zip(rows, states) if s.phase == GRAMMAR]
        forced = [(r, s) for r, s in zip(rows, states) if s.phase == FORCING]
        if not grammar and not forced:
            return
        import xgrammar as xgr

        n = logits.shape[0]
        host, dev = self._buffers(n, logits.shape[-1], logits.device)
        if grammar:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(self.fill_threads)
            self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in grammar], host[:n],
                                                      [r for r, _ in grammar])
        for r, s in forced:
            set_single_token(host, r, s.forced_token)
        self._apply(logits, host, dev, sorted(r for r, _ in grammar + forced), t0)

    def mask_drafts(self, logits: torch.Tensor, first_rows: Sequence[int], states: Sequence[Any],
                    drafts: Sequence[Sequence[int]]) -> list[int]:
        """Speculative verification: request i's rows first_rows[i] .. + len(drafts[i]) get the
        masks of the token after each prefix of its drafts (the state pushed through them and
        rolled back, `fill_draft_masks`); returns how many drafts each state allows (a verifier
        never reads a row past the first refused draft, so those rows stay unmasked)."""
        t0 = time.perf_counter()
        host, dev = self._buffers(logits.shape[0], logits.shape[-1], logits.device, "verify")
        allowed, masked = [], []
        for first, state, ids in zip(first_rows, states, drafts):
            allowed.append(state.fill_draft_masks(list(ids), host, first))
            masked.extend(range(first, first + len(ids) + 1))
        self._apply(logits, host, dev, masked, t0)
        return allowed

    def _apply(self, logits: torch.Tensor, host: torch.Tensor, dev: torch.Tensor, masked: list[int],
               t0: float) -> None:
        """Copy the filled bitmask rows to the logits' device and apply them to rows `masked` in
        place; account the host fill (since t0) and the whole call in `stats`."""
        import xgrammar as xgr

        t1 = time.perf_counter()
        n, rows = logits.shape[0], len(masked)
        if dev is not host:
            dev[:n].copy_(host[:n], non_blocking=True)
            # A list would be copied from pageable memory, which waits for the queued forward.
            masked = to_device(masked, torch.int32, logits.device)
        xgr.apply_token_bitmask_inplace(logits, dev[:n], vocab_size=logits.shape[-1], indices=masked)
        st = self.stats
        st.calls, st.rows = st.calls + 1, st.rows + rows
        st.fill_seconds += t1 - t0
        st.total_seconds += time.perf_counter() - t0

    def advance(self, states: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        done = []
        for s, t in zip(states, tokens):
            if not s.accept(int(t)):
                raise RuntimeError(f"structured outputs: token {int(t)} was sampled although the mask "
                                   f"forbids it ({s.describe()})")
            done.append(s.done)
        return done
