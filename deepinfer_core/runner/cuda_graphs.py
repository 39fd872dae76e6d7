"""CUDA graphs of the decode and speculative-verification forwards, captured at start-up (decode:
`runner/warmup.py`) or on first use. The graph calls come from the device's torch module
(`GraphApi`): torch.cuda's CUDAGraph, or torch.npu's NPUGraph (aclgraph) on an Ascend NPU.

A decode step (one new token per sequence, the last row's logits) and a verification step (q = k+1
tokens per sequence: the last accepted token and k drafts, the logits of every row) run the same
kernels at every step, so replaying a captured graph removes the per-kernel launch cost from Python
(tens of microseconds per Triton launch, hundreds per layer). One graph per key (batch bucket, q):
q = 1 is decode (logits [B, vocab]), 1 < q <= `max_query_len` is verification (logits [B*q, vocab],
sequence after sequence). The batch is padded up to its bucket with padding sequences that feed q
tokens at positions 0..q-1 in the cache's spare slot and block (outside the allocator), so padding
never touches a real sequence's state: q <= block_size keeps every padding position inside the one
spare block, and the spare slot's ring and tails are scratch.

Only an attention backend that can describe a batch with fixed-shape device metadata
(contracts.GraphAttentionBackend: deepinfer_nvidia.attention, deepinfer_ascend.attention) can be
captured; every op of the forward must be free of host synchronisation. A capture that fails turns
graphs off with one warning and the runner stays eager. `DEEPINFER_ENFORCE_EAGER=1` or
`LLM(enforce_eager=True)` never captures.
"""
from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..contracts import AttentionBackend, GraphAttentionBackend, GraphMetadata
from ..device_module import device_module, device_type
from ..model import ForwardBatch, ModelOutput
from ..ops.transfer import copy_into
from .slot_tables import SlotTables

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_QUERY_LEN = 8        # the default cap on q: every (bucket, q) graph keeps its own logits buffer


@dataclass(frozen=True)
class GraphApi:
    """The capture calls of one device type's torch module, resolved once: torch.cuda (CUDAGraph,
    graph, Stream, current_stream, stream) or torch.npu (NPUGraph, graph, ...), `<TYPE>Graph` by name."""

    device_type: str
    graph_class: type                 # torch.cuda.CUDAGraph, torch.npu.NPUGraph
    capture: Callable[..., Any]       # torch.cuda.graph(graph, pool=...), torch.npu.graph
    streams: types.ModuleType         # the module: Stream, current_stream, stream

    @classmethod
    def of(cls, device, backend: Any = None) -> GraphApi | None:
        """The API of `device`'s type, or None where its module has no graphs (the CPU). An
        attention backend may name the device type whose graphs hold its ops (optional
        `graph_device_type`): the Ascend backend's ops are torch.npu's also where its tensors sit
        on the CPU (the tests' simulated torch_npu)."""
        kind = getattr(backend, "graph_device_type", None) or device_type(device)
        module = device_module(kind)
        graph_class = getattr(module, f"{kind.upper()}Graph", None)
        if graph_class is None or not callable(getattr(module, "graph", None)):
            return None
        return cls(kind, graph_class, module.graph, module)


@dataclass
class _Captured:
    graph: Any | None            # the device's graph; None: run the static batch eagerly (capture=False)
    batch: ForwardBatch          # static inputs read by the graph (input_ids, positions, ...)
    inputs: torch.Tensor         # [size*q ids (-1 - slot: its last token) | size*q positions | size slots | extras]
    meta: GraphMetadata          # the backend's static metadata, derived on the device from `inputs`
    logits: torch.Tensor | None  # static outputs, overwritten by the next replay
    streams: torch.Tensor | None = None
    features: torch.Tensor | None = None   # DSpark's target features, when the model captured them


def buckets_for(max_seqs: int) -> list[int]:
    return [b for b in BUCKETS if b < max_seqs] + [max_seqs]


class DecodeGraphs:
    def __init__(self, model, cache, backend: GraphAttentionBackend, max_seqs: int, max_blocks: int, capture: bool = True,
                 max_query_len: int | None = None, tables: SlotTables | None = None,
                 per_sequence_output: bool = False, collective: bool = False, graph_api: GraphApi | None = None):
        """`capture=False` runs the same padded, fixed-shape batches eagerly instead of replaying a
        graph: the padding and static-metadata logic, testable without a GPU. `max_query_len` bounds
        q; by default q = k+1 <= the cache's backtrack room (a verify step of k drafts may roll back
        k tokens, k <= backtrack - 1: see envs.effective_max_backtracking_tokens), at most 8.
        `tables`: the engine's per-slot device tables (block table rows, last tokens); by default
        a private set over the cache's slots. `model`: any callable of a ForwardBatch whose result has
        `.logits` and `.streams` (the MTP drafter's graphs pass bodies of their own); with
        `per_sequence_output` those have one row per sequence instead of one per token.
        `collective`: the graphs hold collectives (expert-parallel exchanges), which every rank must
        record and replay together: every graph is captured at start-up (never on first use, which
        only one rank would do) and a failed capture raises instead of turning graphs off.
        `graph_api`: the device module's graph calls; by default those of the cache's device type
        (or the backend's `graph_device_type`, see GraphApi.of)."""
        self.model, self.backend, self.max_blocks, self.capture = model, backend, max_blocks, capture
        self.collective = collective
        self.per_sequence_output = per_sequence_output
        self.buckets = buckets_for(max_seqs)
        self.device = cache.device
        if graph_api is None and capture:
            graph_api = GraphApi.of(cache.device, backend)
        self.api = graph_api
        if cache.spare_slot is None:
            raise ValueError("decode CUDA graphs need a StateCache built with spare=True (padding slot)")
        if max_query_len is None:
            max_query_len = max(1, min(MAX_QUERY_LEN, cache.layout.backtrack))
        if not 1 <= max_query_len <= cache.layout.block_size:
            raise ValueError(f"max_query_len={max_query_len} must be in 1..{cache.layout.block_size} "
                             "(padding sequences live in one spare block)")
        self.max_query_len = max_query_len
        self.pad_slot, self.pad_block = cache.spare_slot, cache.spare_block   # never handed to sequences
        self.tables = tables if tables is not None else SlotTables(cache.num_slots, max_blocks, cache.device)
        if self.tables.max_blocks != max_blocks:
            raise ValueError(f"slot tables are {self.tables.max_blocks} blocks wide, the graphs {max_blocks}")
        self.tables.set_rows([self.pad_slot], [[self.pad_block]])
        self.pad_state = cache.bind(self.pad_slot, [self.pad_block])
        self.graphs: dict[tuple[int, int], _Captured] = {}     # (batch bucket, q) -> graph
        self.pool = None
        self.failed: str | None = None                 # why capture failed (graphs are off then)

    @staticmethod
    def supported(backend: AttentionBackend) -> bool:
        return isinstance(backend, GraphAttentionBackend)

    def fits(self, token_ids: list[list[int]], seqs, all_logits: bool, logit_modes) -> bool:
        """Every sequence feeds the same q tokens; q = 1 wants the last row's logits (decode),
        q > 1 every row's (verification)."""
        if self.failed is not None or not token_ids or len(token_ids) > self.buckets[-1]:
            return False
        q = len(token_ids[0])
        if not 1 <= q <= self.max_query_len or any(len(t) != q for t in token_ids):
            return False
        want = "last" if q == 1 else "all"
        if logit_modes is not None:
            if any(m != want for m in logit_modes):
                return False
        elif all_logits != (q > 1):
            return False
        return all(len(st.table) <= self.max_blocks for st in seqs)

    def fits_step(self, num_seqs: int, num_tokens: int, num_logit_rows: int) -> bool:
        """An engine step fits when every sequence feeds one token and wants its logits (decode)."""
        return (self.failed is None and 0 < num_seqs <= self.buckets[-1] and num_tokens == num_seqs
                and num_logit_rows == num_seqs)

    def fits_uniform(self, lens: list[int], num_logit_rows: int) -> bool:
        """An engine step of q tokens per sequence fits when q <= max_query_len and it wants the
        logits of every row (q > 1: verification) or of each sequence's one row (q = 1: decode)."""
        n, q = len(lens), lens[0] if lens else 0
        return (self.failed is None and 0 < n <= self.buckets[-1] and 1 <= q <= self.max_query_len
                and all(k == q for k in lens) and num_logit_rows == n * q)

    def run(self, token_ids: list[list[int]], seqs) -> torch.Tensor | None:
        """Logits of one step over self-managed states (tests, tools): their block tables are copied
        into the slot tables first. The caller advances `num_tokens` by q."""
        self.tables.set_rows([st.slot for st in seqs], [st.table.ids for st in seqs])
        q = len(token_ids[0])
        return self.run_step([t for toks in token_ids for t in toks],
                             [st.num_tokens + i for st in seqs for i in range(q)], [st.slot for st in seqs], q)

    def bucket_for(self, num_seqs: int, q: int = 1) -> int | None:
        """The captured bucket a step of `num_seqs` sequences would replay, or None."""
        size = next((b for b in self.buckets if b >= num_seqs), None)
        return size if self.failed is None and (size, q) in self.graphs else None

    def run_step(self, ids: list[int], positions: list[int], slots: list[int], q: int = 1,
                 size: int | None = None) -> torch.Tensor | None:
        """Logits of one step, [B, vocab] for q = 1 or [B*q, vocab] (sequence s owns rows s*q ..
        s*q+q-1) for q > 1: a view of the graph's output, valid until the next forward. `ids` may hold
        -1 - slot for a token still on the device (SlotTables.last_token). None when capturing
        failed (the caller runs eagerly). `size`: replay this bucket (>= the step's sequences; the
        ranks of an expert-parallel group agree on one) instead of the smallest that fits."""
        out = self.replay_output(ids, positions, slots, q, size=size)
        return None if out is None else out.logits

    def replay(self, ids: list[int], positions: list[int], slots: list[int], q: int = 1,
               device_ids: torch.Tensor | None = None,
               device_starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits, final streams) of one step, views of the graph's outputs (see run_step).
        `device_ids`: the step's first ids already on the device (they replace `ids`' first entries,
        no host round trip). `device_starts` [len(slots)]: each sequence's first position, on the
        device (then `positions` is ignored; needs `takes_device_starts`)."""
        out = self.replay_output(ids, positions, slots, q, device_ids, device_starts)
        return None if out is None else (out.logits, out.streams)

    @property
    def takes_device_starts(self) -> bool:
        """Whether `replay` may take device starts: the backend's metadata derives its host extras
        from device starts too (`extra_inputs_device`), judged on the graphs captured so far."""
        return self.failed is None and bool(self.graphs) and all(
            hasattr(cap.meta, "extra_inputs_device") for cap in self.graphs.values())

    def replay_output(self, ids: list[int], positions: list[int], slots: list[int], q: int = 1,
                      device_ids: torch.Tensor | None = None,
                      device_starts: torch.Tensor | None = None, size: int | None = None) -> ModelOutput | None:
        """As `replay`, with the target features (DSpark) when the model captured them at capture
        time (else features is None)."""
        n = len(slots)
        if size is None:
            size = next(b for b in self.buckets if b >= n)
        elif size < n or size not in self.buckets:
            raise ValueError(f"bucket {size} for {n} sequences; allowed: a bucket >= {n} of {self.buckets}")
        cap = self.graphs.get((size, q))
        if cap is None and not self.collective:
            cap = self._capture(size, q)
        if cap is None:
            return None
        if device_starts is None:
            self._load(cap, q, ids, positions, slots)
        else:
            self._load_device_starts(cap, q, ids, slots, device_starts)
        if device_ids is not None:
            cap.inputs[:device_ids.numel()].copy_(device_ids)
        rows = n if self.per_sequence_output else n * q
        if cap.graph is None:
            out = self._body(cap)
            logits, streams, features = out.logits, out.streams, getattr(out, "features", None)
        else:
            cap.graph.replay()
            logits, streams, features = cap.logits, cap.streams, cap.features
        return ModelOutput(logits[:rows], streams[:rows], None if features is None else features[:rows])

    def _load(self, cap: _Captured, q: int, ids: list[int], positions: list[int], slots: list[int]) -> None:
        """One host->device copy of the step's inputs; padding sequences (token 0 at positions
        0..q-1 in the spare slot and block) come last, so their rows are dropped by [:n*q]."""
        pad = cap.batch.num_seqs - len(slots)
        starts = positions[::q] + [0] * pad
        copy_into(cap.inputs, ids + [0] * (pad * q) + positions + list(range(q)) * pad
                  + slots + [self.pad_slot] * pad + cap.meta.extra_inputs(starts))

    def _load_device_starts(self, cap: _Captured, q: int, ids: list[int], slots: list[int],
                            starts: torch.Tensor) -> None:
        """`_load` with the positions and the backend's extras derived from device starts."""
        size, n = cap.batch.num_seqs, len(slots)
        t = size * q
        pad = size - n
        copy_into(cap.inputs[:t], ids + [0] * (pad * q))
        copy_into(cap.inputs[2 * t:2 * t + size], slots + [self.pad_slot] * pad)
        padded = torch.cat([starts, starts.new_zeros(pad)]) if pad else starts
        cap.inputs[t:2 * t].copy_((padded[:, None] + torch.arange(q, device=starts.device)).flatten())
        cap.inputs[2 * t + size:].copy_(cap.meta.extra_inputs_device(padded))

    def _body(self, cap: _Captured):
        """What the graph records: resolve pending ids, derive the metadata, run the model."""
        t, n = cap.batch.input_ids.numel(), cap.batch.num_seqs
        cap.batch.input_ids.copy_(self.tables.resolve_ids(cap.inputs[:t]))
        cap.meta.derive(cap.inputs[2 * t:2 * t + n], self.tables.block_table, cap.inputs[2 * t + n:])
        return self.model(cap.batch)

    def capture_bucket(self, size: int, q: int = 1) -> None:
        """Capture the graph of (bucket `size`, q) now (the start-up warm-up), unless present."""
        if self.failed is None and (size, q) not in self.graphs:
            self._capture(size, q)

    def _capture(self, size: int, q: int) -> _Captured | None:
        dev, t = self.device, size * q

        def static_batch(inputs: torch.Tensor) -> ForwardBatch:
            # logits_rows = every row: for q = 1 that is each sequence's last (only) row
            return ForwardBatch(input_ids=torch.zeros(t, dtype=torch.int64, device=dev), positions=inputs[t:2 * t],
                                starts=[0] * size, lens=[q] * size, states=[self.pad_state] * size,
                                logits_rows=torch.arange(t, device=dev))
        inputs = torch.zeros(2 * t + size + self.backend.graph_num_extra(size, q), dtype=torch.int64, device=dev)
        batch = static_batch(inputs)
        meta = self.backend.graph_meta(batch, self.max_blocks)
        cap = _Captured(None, batch, inputs, meta, None)
        self._load(cap, q, [], [], [])                # an all-padding batch for the warm-up and capture
        if not self.capture:
            self.graphs[(size, q)] = cap
            return cap
        try:
            if self.api is None:
                raise RuntimeError(f"torch has no graph API for device {str(dev)!r}")
            streams = self.api.streams
            side = streams.Stream(device=dev)         # warm-up (Triton compilation) off the capture
            side.wait_stream(streams.current_stream(dev))
            with streams.stream(side):
                for _ in range(2):
                    self._body(cap)
            streams.current_stream(dev).wait_stream(side)
            graph = self.api.graph_class()
            with self.api.capture(graph, pool=self.pool):
                out = self._body(cap)
        except Exception as exc:                      # a host sync or an uncapturable op somewhere
            if self.collective:      # this rank's peers captured (or wait in) the same collectives
                raise RuntimeError(f"CUDA graph capture of batch {size} under expert parallelism failed: "
                                   f"{type(exc).__name__}: {exc}; set enforce_eager=True") from exc
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, running eagerly from now on: %s", self.failed)
            return None
        self.pool = graph.pool()
        cap.graph, cap.logits, cap.streams = graph, out.logits, out.streams
        cap.features = getattr(out, "features", None)
        self.graphs[(size, q)] = cap
        log.info("captured the CUDA graph for batch size %d, %d token(s) per sequence", size, q)
        return cap
