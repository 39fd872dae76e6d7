"""The DeepSeek-V4 model graph and its binding to op implementations."""
from __future__ import annotations

import torch

from ..contracts import ModelOps
from .attention import Attention, Compressor, Indexer, Numerics
from .deepseek_v4 import Block, DeepseekV4Model, ModelOutput, build_model
from .engram import EngramTable
from .forward_batch import ForwardBatch
from .layers import Linear, RMSNorm
from .moe import MoE
from .rope import rope_tables

__all__ = ["build_model", "bind_ops", "process_weights", "ModelOps", "DeepseekV4Model", "ForwardBatch",
           "ModelOutput"]


def bind_ops(model: DeepseekV4Model, ops: ModelOps, numerics: Numerics) -> None:
    """Hand every layer its op objects, RoPE table and numerics switches."""
    ropes = rope_tables(model.cfg, official=numerics.simulate_qat)
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.method = ops.linear[mod.fmt]
        elif isinstance(mod, Attention):
            mod.backend = ops.attention
            mod.rope = ropes["compress" if mod.ratio else "main"]
        elif isinstance(mod, (Compressor, Indexer)):
            mod.rope = ropes["compress"]
        elif isinstance(mod, MoE):
            mod.method = ops.moe
        elif isinstance(mod, (Block, DeepseekV4Model)):
            mod.mhc = ops.mhc
        elif isinstance(mod, EngramTable):
            mod.gather = ops.pointwise.gather_rows
        if isinstance(mod, (Attention, Compressor, Indexer, DeepseekV4Model)):
            mod.numerics = numerics
        if isinstance(mod, (Attention, Indexer, RMSNorm)):
            mod.pointwise = ops.pointwise


@torch.no_grad()
def process_weights(model: DeepseekV4Model) -> None:
    """After loading: let each op object turn checkpoint tensors into its runtime form."""
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.method.process_weights(mod)
        elif isinstance(mod, MoE):
            mod.method.process_weights(mod)
