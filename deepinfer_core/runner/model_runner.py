"""Model runner: builds the model once (hooks resolved here, never again), loads the checkpoint,
and runs forward passes over per-sequence state. It makes no policy decisions.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.sequence_state import SequenceState, new_sequence_state
from ..config import ModelConfig
from ..model import ForwardBatch, ModelOps, bind_ops, build_model, process_weights
from ..model.attention import Numerics
from ..model.deepseek_v4 import DeepseekV4Model
from ..plugin_context import BuildContext, normalize_dtype
from ..plugins import get_plugin_manager

log = logging.getLogger(__name__)
WEIGHT_FORMATS = ("bf16", "fp8", "fp4")
@dataclass
class LoadedModel:
    model: DeepseekV4Model
    ctx: BuildContext
    sampler: object
    load_seconds: float


def load_model(model_dir: str | Path, *, dtype="float32", simulate_qat: bool = True, device: str = "cpu",
               options: dict | None = None) -> LoadedModel:
    """Config -> hooks -> graph on the meta device -> checkpoint (one shard at a time) -> runtime weights."""
    from ..model.weights import load_checkpoint   # local: the loader pulls in safetensors

    t0 = time.perf_counter()
    cfg = ModelConfig.from_file(model_dir)
    pm = get_plugin_manager()
    platform = pm.detect_platform()
    ctx = BuildContext(model_config=cfg, platform=platform, device=device, dtype=normalize_dtype(dtype),
                       simulate_qat=bool(simulate_qat), options=dict(options or {}))
    pm.configure(ctx)
    ops = ModelOps(linear={f: pm.linear_method(ctx, f) for f in WEIGHT_FORMATS},
                   attention=pm.attention_backend(ctx), moe=pm.moe_method(ctx), mhc=pm.mhc_method(ctx))
    sampler = pm.sampler(ctx)
    model = build_model(cfg, device="meta")
    load_checkpoint(model, model_dir)
    bind_ops(model, ops, Numerics(dtype=ctx.torch_dtype, simulate_qat=ctx.simulate_qat))
    process_weights(model)
    model.to(device)
    return LoadedModel(model=model, ctx=ctx, sampler=sampler, load_seconds=time.perf_counter() - t0)


class ModelRunner:
    def __init__(self, model_dir: str | Path, *, dtype="float32", simulate_qat: bool = True,
                 device: str = "cpu", max_backtracking_tokens: int | None = None, **options):
        self.loaded = load_model(model_dir, dtype=dtype, simulate_qat=simulate_qat, device=device, options=options)
        self.model = self.loaded.model
        self.sampler = self.loaded.sampler      # chosen through deepinfer_sampler, once
        self.model_config: ModelConfig = self.model.cfg
        self.device = device
        self.dtype = self.loaded.ctx.torch_dtype
        if max_backtracking_tokens is None:      # the env table is the one source of the default
            from ..envs import read_settings
            max_backtracking_tokens = read_settings().effective_max_backtracking_tokens
        self.backtrack = max_backtracking_tokens
        log.info("model loaded in %.1f s", self.loaded.load_seconds)

    def new_sequence(self) -> SequenceState:
        return new_sequence_state(self.model_config, self.dtype, self.device, self.backtrack)

    @torch.no_grad()
    def forward_batch(self, token_ids: list[list[int]], seqs: list[SequenceState],
                      all_logits: bool = False, logit_modes: list[str] | None = None) -> torch.Tensor:
        """Feed each sequence its new tokens at its next positions; fp32 logits of the wanted rows
        (see ForwardBatch.build for `logit_modes`)."""
        batch = ForwardBatch.build(token_ids, seqs, self.device, all_logits=all_logits, logit_modes=logit_modes)
        out = self.model(batch)
        batch.commit()
        return out.logits

    def forward(self, seq: SequenceState, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        return self.forward_batch([token_ids], [seq], all_logits)

    def release(self, seq: SequenceState) -> None:
        seq.layers.clear()
        seq.mtp_layers.clear()
