"""The op table: which torch_npu mapping serves each hook, chosen once at start-up from the SoC,
the compute dtype and the model config (the idea of vllm-ascend's per-SoC device adaptor, without
branches inside the forward). The hooks hand the engine the table's plain objects; a `None` entry
lets the core's portable op (trylast) answer, running the same torch code on the NPU.

| hook       | A5 (SoC 260)                                  | A2 / A3                          |
|------------|-----------------------------------------------|----------------------------------|
| pointwise  | npu_rms_norm + npu_rotary_mul                 | the same (both pages list A2/A3) |
| linear fp8 | MXFP8 npu_quant_matmul (bf16 + QAT)           | portable (no MX formats)         |
| mhc        | npu_mhc_pre + _sinkhorn + _post (bf16, no QAT)| portable (A5-only ops)           |
| attention  | npu_sparse_flash_attention (+ sinks) and      | portable (no sinks before A5)    |
|            | npu_lightning_indexer (V4, bf16, D 512)       |                                  |
| moe        | init_routing_v2 + grouped_matmul (MX W8A8 /   | portable (chain mapped for A5    |
|            | W4A8 with bf16 + QAT, else plain) + unpermute | first)                           |
|            | (routing itself portable)                     |                                  |
| graphs     | aclgraph decode/verify steps (V4 layers,      | eager                            |
|            | with the attention above: attention_graph.py) |                                  |
| moe (EP)   | the rank's slots on grouped_matmul            | portable                         |
|            | (ep_experts.py)                               |                                  |
| others     | portable                                      | portable                         |
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.cache.state_cache import BLOCK_SIZE
from deepinfer_core.model.layers import weight_format

from .attention import AscendAttentionBackend
from .attention import unsupported as attention_unsupported
from .linear import MxFp8LinearMethod
from .mhc import AscendMHC
from .moe import AscendMoE, moe_form
from .pointwise import AscendPointwise
from .runtime import AscendRuntime

PORTABLE_HOOKS = {
    "moe routing": "portable: no torch_npu op computes V4's sqrt-softplus scores, bias for "
                   "selection only, hash table, renorm and routed scale exactly",
    "sampler": "portable (vllm-ascend samples in PyTorch on A5 too)",
    "distributed": "the core's: hccl process groups (torch.distributed's backend for npu), one "
                   "NPU per data-parallel rank through torch.npu, the portable all-to-all EP "
                   "exchange (npu_moe_distribute_dispatch/combine not used); a rank's experts on "
                   "the grouped matmul (ep_experts.py)",
}


@dataclass
class OpTable:
    soc_family: str
    pointwise: Any = None
    mhc: Any = None
    moe: Any = None
    attention: Any = None
    linear: dict[str, Any] = field(default_factory=dict)    # weight format -> method
    portable: dict[str, str] = field(default_factory=dict)  # hook -> why the core's op runs

    def summary(self) -> str:
        chosen = [f"pointwise={type(self.pointwise).__name__}" if self.pointwise else None,
                  f"mhc={type(self.mhc).__name__}" if self.mhc else None,
                  f"moe={type(self.moe).__name__}({self.moe.form})" if self.moe else None,
                  f"attention={type(self.attention).__name__}" if self.attention else None,
                  *(f"linear[{f}]={type(m).__name__}" for f, m in sorted(self.linear.items()))]
        portable = ", ".join(sorted(self.portable))
        return f"SoC {self.soc_family}: " + ", ".join(c for c in chosen if c) + \
            f"; portable: {portable}"


def build_op_table(rt: AscendRuntime, ctx: Any) -> OpTable:
    """The table for this runtime and build context (no hook call, no SoC test after this)."""
    import torch
    tnpu, official = rt.torch_npu, bool(ctx.simulate_qat)
    table = OpTable(rt.soc.family, portable=dict(PORTABLE_HOOKS))
    table.pointwise = AscendPointwise(tnpu, official=official)
    block = tuple(ctx.model_config.weight_block_size or (128, 128))
    if rt.soc.has_mx and ctx.torch_dtype == torch.bfloat16 and ctx.simulate_qat:
        table.linear["fp8"] = MxFp8LinearMethod(tnpu, ctx.torch_dtype, ctx.simulate_qat, block)
    else:
        why = ("no MX formats before the Ascend 950" if not rt.soc.has_mx else
               "the MX matmul needs the bf16 compute dtype and the QAT numerics")
        table.portable["linear"] = f"portable: {why}; bf16 and fp4 weights always"
    cfg = ctx.model_config
    if rt.soc.has_mx and ctx.torch_dtype == torch.bfloat16 and cfg.hc_mult in (4, 6, 8) \
            and not official:
        table.mhc = AscendMHC(tnpu, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                              cfg.rms_norm_eps)
    else:
        table.portable["mhc"] = ("portable: npu_mhc_* are Ascend 950 ops on bf16/fp16 streams "
                                 "with hc_mult 4, 6 or 8, and cannot follow the QAT numerics' "
                                 "official rounding order")
    fmt = weight_format(cfg, "expert")
    form, why = moe_form(rt.soc.has_mx, ctx.torch_dtype, official, fmt, block)
    if form:
        table.moe = AscendMoE(tnpu, form, ctx.torch_dtype, official, block)
    else:
        table.portable["moe"] = why
    why = attention_unsupported(rt.soc.family, ctx.torch_dtype, cfg, BLOCK_SIZE)
    if why is None:
        table.attention = AscendAttentionBackend(tnpu, official=official, index_topk=cfg.index_topk)
    else:
        table.portable["attention"] = why
    if "linear" not in table.portable:
        table.portable["linear"] = "portable for bf16 and fp4 weights"
    return table


# One table per build context, built in deepinfer_configure and read by the op hooks.
_tables: dict[int, tuple[weakref.ref, OpTable]] = {}


def table_for(rt: AscendRuntime, ctx: Any) -> OpTable:
    entry = _tables.get(id(ctx))
    if entry is not None and entry[0]() is ctx:
        return entry[1]
    table = build_op_table(rt, ctx)
    _tables[id(ctx)] = (weakref.ref(ctx, lambda _, key=id(ctx): _tables.pop(key, None)), table)
    return table
