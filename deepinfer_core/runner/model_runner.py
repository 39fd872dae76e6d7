"""Model runner: holds the model loaded once (model_loader.py: hooks resolved there, never again),
its state cache and decode graphs, and runs forward passes over per-sequence state. It makes no
policy decisions.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..cache.budget import CacheRequest, resolve_num_blocks
from ..cache.sequence_state import SequenceState
from ..cache.state_cache import CacheLayout, StateCache
from ..config import ModelConfig
from ..contracts import DraftProposer, check_contract
from ..device_module import device_module, peak_memory_bytes
from ..engine_config import EngineConfig
from ..model import ForwardBatch
from ..model.deepseek_v4 import ModelOutput
from ..ops.transfer import to_device, to_device_parts
from .cuda_graphs import DecodeGraphs, GraphApi
from .model_loader import engine_config, load_model
from .options import no_dspark_plugin, resolve_kv_fp8, resolve_num_drafts
from .slot_tables import SlotTables
from .warmup import compiles_expected, warm_up

if TYPE_CHECKING:
    from ..engine.step_executor import StepBatch

log = logging.getLogger(__name__)


def _positions(batch: StepBatch) -> list[int]:
    """The position of every row of an engine step."""
    if len(batch.ids) == len(batch.slots):
        return batch.starts
    return [p for s, k in zip(batch.starts, batch.lens) for p in range(s, s + k)]


class ModelRunner:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, expert_shard=None, **options):
        """`config`: the resolved engine options (`LLM` passes its own); or `options` by name, as for
        `LLM(...)` (tests, tools). `expert_shard`: an EP rank's experts (see `load_model`)."""
        self.config = config = engine_config(config, options)
        self.loaded = load_model(model_dir, config, expert_shard)
        self.model = self.loaded.model
        self.sampler = self.loaded.sampler      # chosen through deepinfer_sampler, once
        self.truncation = self.loaded.truncation     # V4.1 bounded replay, or None
        self.logits_processors = self.loaded.logits_processors
        self.scheduler_policy = self.loaded.scheduler_policy
        self.model_config: ModelConfig = self.model.cfg
        self.device = self.loaded.ctx.device
        self.dtype = self.loaded.ctx.torch_dtype
        self.backtrack = config.cache.max_backtracking_tokens
        dspark = self.model_config.dspark
        if dspark is not None and self.loaded.proposer is None:
            self.num_drafts = no_dspark_plugin(config.speculative.num_speculative_tokens)
        else:
            self.num_drafts = resolve_num_drafts(config.speculative.num_speculative_tokens, len(self.model.mtp),
                                                 dspark.block_size if dspark is not None else None)
        if self.loaded.proposer is not None and self.num_drafts:
            self.confidence_temperatures()                    # a wrong-length list fails at start-up
            if dspark is not None:                            # before any CUDA graph is captured: the
                self.model.capture_layers = dspark.target_layer_ids     # graphs then return the features
        if config.speculative.enable_mtp_varlen and not self.num_drafts:
            raise ValueError("enable_mtp_varlen=True (DEEPINFER_ENABLE_MTP_VARLEN=1) schedules the verification of "
                             "drafts, but the checkpoint has no drafter (mtp.* tensors); unset it")
        # Expert parallelism: the variable exchange (ep_comm) reads sizes on the host, which a CUDA graph
        # cannot hold; with enable_ep_cuda_graphs decode graphs hold the fixed-size one (ep_padded) and
        # the ranks agree on each step's bucket (`step_vote`, installed by the DP rank after start-up).
        self.expert_parallel = expert_shard is not None and expert_shard.ep_size > 1
        ep_graphs = self.expert_parallel and config.parallel.enable_ep_cuda_graphs and not self.num_drafts
        self.enforce_eager = config.model.enforce_eager or (self.expert_parallel and not ep_graphs)
        self.step_vote = None     # StepVote of a DP rank whose decode graphs hold EP exchanges
        self._live_rows: torch.Tensor | None = None     # real rows of a padded EP graph step (graphs read it)
        if ep_graphs and config.parallel.enable_eplb:     # before capture: the graphs record the counting
            from ..parallel.ep_moe import moe_layers
            moe_layers(self.model)[0].method.start_load_recording(self.device)
        if self.expert_parallel and not config.model.enforce_eager and torch.device(self.device).type == "cuda":
            log.info("expert parallel over %d ranks: decode %s", expert_shard.ep_size,
                     "replays CUDA graphs (fixed-size exchanges)" if ep_graphs else "runs eagerly (no CUDA graphs)")
        self.kv_fp8 = resolve_kv_fp8(config.cache.kv_cache_dtype, self.dtype, config.model.simulate_qat,
                                     self.model.cfg.family)
        self.graphs: DecodeGraphs | None = None
        self.cache: StateCache | None = None
        self._cache_request: CacheRequest | None = None
        self.checkpoint_slots = 0                # of the cache's slots, those for prefix checkpoints
        self.cache_note = ""                     # where the cache's size came from (logged, tests)
        self.profile_tokens = config.scheduler.max_num_batched_tokens   # the LLM sets it again
        log.info("model loaded in %.1f s", self.loaded.load_seconds)

    # ---- state cache ---------------------------------------------------------------------------
    def cache_layout(self) -> CacheLayout:
        # no MTP layer states when the checkpoint came without MTP weights (the loader dropped them)
        return CacheLayout.from_config(self.model_config, self.dtype, self.backtrack,
                                       with_mtp=len(self.model.mtp) > 0, kv_fp8=self.kv_fp8)

    def allocate_cache(self, request: CacheRequest) -> StateCache:
        """Size and allocate the state cache once (again only when the request changed and nothing
        is resident but cached prefixes, which are dropped)."""
        if self.cache is not None and self._cache_request == request:
            return self.cache
        if self.cache is not None and not self.cache.allocator.reclaim():
            raise RuntimeError("state cache: cannot re-size while sequences are resident")
        self.graphs = None                      # they point into the old cache's pools
        self.cache = None                       # free the old pools before sizing the new ones
        layout = self.cache_layout()
        use_graphs = self._graphs_wanted()
        graph_bytes = self._graph_output_bytes(request.num_slots) if use_graphs else 0
        num_blocks, checkpoints, note = resolve_num_blocks(
            layout, request, self.device, lambda: self._profile_activation_bytes() + graph_bytes)
        self.checkpoint_slots = checkpoints      # the prefix cache's (engine_builder.prefix_cache)
        # decode graphs pad batches into one extra slot and block of their own
        slots = request.num_slots + checkpoints
        self.cache = StateCache(layout, slots, num_blocks, self.device, spare=use_graphs)
        max_blocks = -(-(request.max_model_len or self.model_config.max_position_embeddings) // layout.block_size)
        # draft rows for any drafter the rollback room allows (k <= backtrack - 1), also one installed
        # later (Engine.use_speculator): the graphs read these tensors, so they are never re-allocated
        self.slot_tables = SlotTables(self.cache.num_slots, max_blocks, self.device,
                                      max(self.num_drafts, self.backtrack - 1))
        self.slot_states = [None] * self.cache.num_slots
        if use_graphs and self.expert_parallel:      # decode only, exchanges of fixed size, all at start-up
            self._live_rows = torch.zeros((), dtype=torch.int64, device=self.device)
            self.graphs = DecodeGraphs(self._padded_forward, self.cache, self.loaded.ops.attention,
                                       request.num_slots, max_blocks, max_query_len=1, tables=self.slot_tables,
                                       collective=True)
        elif use_graphs:
            self.graphs = DecodeGraphs(self.model, self.cache, self.loaded.ops.attention, request.num_slots,
                                       max_blocks, tables=self.slot_tables)
            note += "; +1 slot and block for CUDA-graph padding"
        self._cache_request, self.cache_note = request, note
        if checkpoints:
            note += (f"; {checkpoints} of the slots hold prefix-cache checkpoints "
                     f"({checkpoints * layout.slot_bytes / 2**20:.1f} MiB)")
        log.info("state cache: %d slots x %d B + %d blocks x %d B = %.1f MiB (%s)", slots,
                 layout.slot_bytes, num_blocks, layout.block_bytes, self.cache.nbytes() / 2**20, note)
        self.warmup_seconds = warm_up(self, self.profile_tokens)
        return self.cache

    def _graphs_wanted(self) -> bool:
        """Decode graphs need an attention backend with fixed-shape metadata and a device whose
        torch module captures graphs (`GraphApi`: torch.cuda's CUDAGraph, torch.npu's NPUGraph)."""
        ops = self.loaded.ops
        return (not self.enforce_eager and ops is not None and DecodeGraphs.supported(ops.attention)
                and GraphApi.of(self.device, ops.attention) is not None)

    def new_sequence(self) -> SequenceState:
        """A self-managed state: its slot and blocks come from the cache's allocator and go back on
        `release` (tests and tools that drive the runner without the engine)."""
        if self.cache is None:
            self.allocate_cache(CacheRequest(num_slots=8, max_model_len=self.model_config.max_position_embeddings,
                                             cpu_memory_bytes=self.config.cache.cpu_kv_cache_bytes))
        alloc = self.cache.allocator
        state = self.cache.bind(alloc.allocate_slot(), [])

        def grow(st: SequenceState, need: int) -> None:
            st.table.set(st.table.ids + alloc.allocate_blocks(need - len(st.table)))
        state.grow = grow
        return state

    def release(self, state: SequenceState) -> None:
        if state.grow is not None and state.slot >= 0:     # self-managed: give everything back
            self.cache.allocator.free_blocks(state.table.ids)
            self.cache.allocator.free_slot(state.slot)
        state.table.set([])
        state.slot = -1

    def _graph_output_bytes(self, max_seqs: int) -> int:
        """Device memory the decode graphs keep besides the shared activations: each bucket's static
        fp32 logits (the warm-up captures every bucket before the first request)."""
        from .cuda_graphs import buckets_for
        return sum(buckets_for(max_seqs)) * int(self.model_config.vocab_size) * 4

    def _profile_activation_bytes(self) -> int:
        """Peak extra device memory of one forward over a full token budget (an accelerator's)."""
        n = min(int(self.profile_tokens), int(self.model_config.max_position_embeddings))
        layout = self.cache_layout()
        scratch = StateCache(layout, 1, -(-n // layout.block_size), self.device)

        def forward(cache: StateCache) -> None:
            with torch.no_grad(), compiles_expected(self):
                self.model(ForwardBatch.build([[0] * n], [cache.bind(0, list(range(cache.num_blocks)))], self.device))
        peak = peak_memory_bytes(self.device, forward, scratch)
        del scratch
        device_module(self.device).empty_cache()
        return peak

    def make_speculator(self):
        """The engine's drafter and verifier, or None without speculation (num_drafts == 0)."""
        if not self.num_drafts:
            return None
        from ..speculative.engine_step import Speculator
        from ..speculative.mtp_graphs import MTPGraphs
        graphs = None
        if self.graphs is not None:
            def graphs(streams, decode=self.graphs):
                return MTPGraphs(self.model, decode, self.cache, self.loaded.ops.attention, streams)
        proposer = None
        if self.loaded.proposer is not None:
            proposer = check_contract(self.loaded.proposer(self.model, self.num_drafts, self.confidence_temperatures()),
                                      DraftProposer, "proposer")
            if self.graphs is not None and callable(getattr(proposer, "use_graphs", None)):
                proposer.use_graphs(self.graphs.buckets[-1], self.cache.spare_slot)   # its own graphs (optional)
        return Speculator(self.model, self.num_drafts, graphs, proposer=proposer,
                          verifier=self.loaded.verifier)

    def confidence_temperatures(self) -> tuple[float, ...]:
        """The option (DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE) when set, else the calibration the
        checkpoint stores (dspark_confidence_temperatures: its first gamma values), else 1.0."""
        chosen = self.config.speculative.confidence_head_temperature
        if chosen is not None:
            if len(chosen) not in (1, self.num_drafts):
                raise ValueError(f"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE has {len(chosen)} values; allowed: 1 "
                                 f"or {self.num_drafts} (DEEPINFER_USE_NEXTN_DECODE)")
            return tuple(chosen)
        stored = self.model.cfg.dspark.confidence_temperatures if self.model.cfg.dspark else None
        if stored is None:
            return (1.0,)
        if 1 < len(stored) < self.num_drafts:
            raise ValueError(f"config.json: dspark_confidence_temperatures has {len(stored)} values for "
                             f"{self.num_drafts} drafts (DEEPINFER_USE_NEXTN_DECODE); set "
                             f"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE (1 or {self.num_drafts} values)")
        return stored if len(stored) == 1 else stored[:self.num_drafts]

    def varlen_policy(self, max_seqs: int, num_drafts: int | None = None):
        """VARLEN's policy over a step-time table profiled now (batches up to `max_seqs` sequences of
        1..num_drafts + 1 rows; default: this runner's drafts)."""
        from ..speculative.varlen import VarlenPolicy
        from .step_times import profile_step_times
        k = self.num_drafts if num_drafts is None else num_drafts
        return VarlenPolicy(profile_step_times(self, max_seqs, k + 1), k)

    # ---- forward --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_batch(self, token_ids: list[list[int]], seqs: list[SequenceState],
                      all_logits: bool = False, logit_modes: list[str] | None = None) -> torch.Tensor:
        """Feed each sequence its new tokens at its next positions; fp32 logits of the wanted rows
        (see ForwardBatch.build for `logit_modes`)."""
        for st, toks in zip(seqs, token_ids):
            st.reserve(len(toks))
        if self.graphs is not None and self.graphs.fits(token_ids, seqs, all_logits, logit_modes):
            logits = self.graphs.run(token_ids, seqs)
            if logits is not None:               # decode (q = 1) or verification (q tokens each)
                for st, toks in zip(seqs, token_ids):
                    st.num_tokens += len(toks)
                return logits
        batch = ForwardBatch.build(token_ids, seqs, self.device, all_logits=all_logits, logit_modes=logit_modes)
        out = self.model(batch)
        batch.commit()
        return out.logits

    def forward(self, seq: SequenceState, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        return self.forward_batch([token_ids], [seq], all_logits)

    # ---- the engine's steps ---------------------------------------------------------------------
    @property
    def last_token(self) -> torch.Tensor:
        """[slots] the newest token sampled per slot (the sampler writes it on the device)."""
        return self.slot_tables.last_token

    @torch.no_grad()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """One engine step (engine/step_executor.py): fp32 logits of `batch.logit_rows`. A decode
        batch replays a CUDA graph when there are graphs; everything else runs eagerly. Under a
        `step_vote` the ranks first agree on the step's bucket (or on eager) and every rank follows it."""
        self._apply_updates(batch.updates)
        n = len(batch.slots)
        fits = self.graphs is not None and self.graphs.fits_step(n, len(batch.ids), len(batch.logit_rows))
        if self.step_vote is not None:
            size = self.step_vote(self.graphs.bucket_for(n) if fits else None, True)
            if size is not None:
                self._live_rows.fill_(n)          # the bucket's other rows are padding: routed nowhere
                return self.graphs.run_step(batch.ids, batch.starts, batch.slots, size=size)
        elif fits:
            logits = self.graphs.run_step(batch.ids, batch.starts, batch.slots)
            if logits is not None:
                return logits
        fb = self._forward_batch(batch)
        return self.model(fb).logits

    @torch.no_grad()
    def idle_step(self) -> bool:
        """A DP rank's lockstep iteration without a forward of its own, under expert parallelism: join
        the other ranks' MoE exchanges (eagerly with `idle_forward`, or by replaying the agreed decode
        graph with padding rows only). False when no rank had a forward (nothing to join)."""
        from ..parallel.ep_moe import idle_forward
        size = self.step_vote(None, False) if self.step_vote is not None else None
        if size is None:
            idle_forward(self.model, self.dtype)
        elif size:
            self._live_rows.fill_(0)
            self.graphs.run_step([], [], [], size=size)
        return size != 0

    def _padded_forward(self, batch: ForwardBatch) -> ModelOutput:
        """The decode graphs' body under expert parallelism: every MoE layer exchanges with fixed sizes
        (`ep_padded`), which the graph records."""
        from ..parallel.ep_moe import moe_layers
        with moe_layers(self.model)[0].method.padded_exchange(self._live_rows):
            return self.model(batch)

    @torch.no_grad()
    def execute_with_streams(self, batch: StepBatch) -> tuple[ModelOutput, ForwardBatch]:
        """An engine step whose rows also feed a drafter: (the model's output: logits of
        `batch.logit_rows`, the final streams of every row and, for DSpark, the target features; the
        ForwardBatch of the step). A step of q tokens per sequence that wants every row's logits (a
        verify step, or decode) replays a CUDA graph when there are graphs (captured with the features
        when a DSpark drafter drafts)."""
        self._apply_updates(batch.updates)
        fb = self._forward_batch(batch)
        if self.graphs is not None and self.graphs.fits_uniform(batch.lens, len(batch.logit_rows)):
            out = self.graphs.replay_output(batch.ids, _positions(batch), batch.slots, batch.lens[0])
            if out is not None:
                if self.model.capture_layers and out.features is None:
                    raise RuntimeError("a CUDA graph captured before the DSpark feature capture was set up")
                return out, fb
        return self.model(fb), fb

    @torch.no_grad()
    def execute_verify(self, updates, slots: list[int], slots_t: torch.Tensor, ids: list[int], q: int,
                       starts: list[int] | None) -> tuple[ModelOutput, torch.Tensor, torch.Tensor]:
        """A verify step of q rows per sequence on the CUDA graphs, for a verdict that stays on the
        device (speculative/device_verdict.py): (the graph's output, the resolved input ids [n*q],
        the first positions [n], both on the device). `slots_t`: `slots` on the device. `starts`
        None: each sequence's next_start on the device (the previous step's verdict, not read by the
        host yet)."""
        self._apply_updates(updates)
        tables = self.slot_tables
        if starts is None:
            starts_t = tables.next_start.index_select(0, slots_t)
            out = self.graphs.replay_output(ids, [], slots, q, device_starts=starts_t)
        else:
            starts_t = to_device(starts, torch.int64, self.device)
            out = self.graphs.replay_output(ids, [p for s in starts for p in range(s, s + q)], slots, q)
        if out is None:
            raise RuntimeError(f"a verify CUDA graph (batch {len(slots)}, {q} rows) could not be captured")
        return out, tables.resolve_ids(to_device(ids, torch.int64, self.device)), starts_t

    def verifies_on_device(self, num_seqs: int, q: int) -> bool:
        """Whether a verify step of this shape can run with device positions (`execute_verify`)."""
        graphs = self.graphs
        return graphs is not None and graphs.takes_device_starts and graphs.fits_uniform([q] * num_seqs, num_seqs * q)

    def _forward_batch(self, batch: StepBatch) -> ForwardBatch:
        ids, positions, rows = to_device_parts([batch.ids, _positions(batch), batch.logit_rows], self.device)
        ids = self.slot_tables.resolve_ids(ids) if batch.pending else ids
        out = ForwardBatch(ids, positions, batch.starts, batch.lens, [self.slot_states[s] for s in batch.slots],
                           rows, slot_ids=batch.slots, slot_tables=self.slot_tables)
        if batch.rect_lo is not None:
            out.truncation = (self.truncation.mode, batch.rect_lo)
        return out

    def _apply_updates(self, updates) -> None:
        """Prefix checkpoints are copied out of the slots that reached them; newly bound slots get
        fresh states (tails reset in one op per pool), then a prefix hit's checkpoint; new blocks go
        into the device table in one op and into the host tables the portable attention reads."""
        if updates.saves:
            self.cache.copy_slots(*zip(*updates.saves))
        if updates.bound_slots:
            self.cache.reset_slots(updates.bound_slots)
            for slot in updates.bound_slots:
                self.slot_states[slot] = self.cache.bind(slot, [], fresh=False)
        if updates.restores:
            self.cache.copy_slots(*zip(*updates.restores))
        if updates.table_writes:
            self.slot_tables.write(updates.table_writes)
            grown: dict[int, list[int]] = {}
            for slot, col, blk in updates.table_writes:
                ids = grown.setdefault(slot, list(self.slot_states[slot].table.ids))
                ids.extend([0] * (col + 1 - len(ids)))
                ids[col] = blk
            for slot, ids in grown.items():
                self.slot_states[slot].table.set(ids)
