"""The MoE method (hook `deepinfer_moe_method`) on torch_npu's MoE operators, Ascend 950 only.

Follows, as read: `torch_npu-npu_moe_init_routing_v2.md` (and aclnnMoeInitRoutingV2),
`torch_npu-npu_grouped_matmul.md` (the wheel's docstring: A2/A3 tables; its A5 MX forms have no
page, read from the 2.13.0 meta registration and torchair converter) and the 2.13.0 schema of
`npu_moe_token_unpermute` (no doc page). Nothing here has run on Ascend hardware.

Per forward (no host sync: counts and indices stay tensors, shapes come from the input's size):
1. Routing stays portable (`PortableMoE.route`, the same torch code on the NPU): V4's
   sqrt(softplus(logits)) scores, the bias for selection only, hash layers' tid2eid[input_ids],
   renormalisation and the routed scale. `npu_moe_gating_top_k` normalises by softmax or sigmoid
   only, so no mode of it gives V4's weights or selection exactly (its hash mode would weight the
   experts by sigmoid/softmax scores).
2. `npu_moe_init_routing_v2(x, ids, active_num=T*k, expert_num=E, expert_tokens_num_type=1,
   expert_tokens_num_flag=True, row_idx_type=0)`, dropless, no fused quantisation: the rows sorted
   by expert (stable), per-expert counts (int64 [E]) and expanded_row_idx (slot t*k+j -> row).
3. `npu_grouped_matmul` (group_type 0, group_list = the counts, group_list_type 1, split_item 2)
   for w1 and w3 stacked along N ([E, 2I, D], passed as its [E, D, 2I] transpose view), V4's
   clamped SwiGLU in torch (as `Expert.forward`: fp32, clamp, the routing weight multiplied in
   *before* w2, cast to the compute dtype), then the grouped matmul for w2.
4. `npu_moe_token_unpermute(y, expanded_row_idx, probs=ones)` sums each token's k rows in fp32
   (y passed in fp32, so nothing is rounded before the core's single rounding); probs are ones
   because the reference weights before w2 (with the QAT numerics w2's input quantisation sees the
   weighted activation). Then the shared expert, through its own linear layers (the op table's
   linear method), is added in fp32 and the sum rounded once to the compute dtype.

Forms (chosen once per SoC, dtype, numerics and expert format by the op table, `moe_form`):
* "mx" (A5, bf16, QAT numerics, FP8 or FP4 experts): activations quantised in torch as DeepSeek's
  act_quant does (e4m3, one power-of-two scale per 128 channels, `quant_fp8_act`), each scale
  repeated over its four 32-groups (mx.py). FP8 experts: W8A8 MXFP8, their 128x128 or 32x32
  block scales repeated into [E, ceil(K/64), N, 2] E8M0 at load (exact). FP4 experts stay FP4:
  W4A8 MXFP with `weight_dtype=float4_e2m1fn_x2`, the checkpoint's bytes (two e2m1 per byte
  along K, low nibble = even k, as the core stores them) and per-32 scales as `antiquant_scale`.
* "plain" (A5, any other dtype / numerics): weights dequantised exactly to the compute dtype at
  load (the core's `PortableLinearMethod`), activations fake-quantised in torch where the core
  does, the plain bf16 / fp32 grouped matmul (fp32 sums, one rounding: the core's to rounding).
[UNCONFIRMED]: the MX scale layouts and weight orientation of the grouped op (no page); the
packing of FP4 along K and its nibble order; unpermute's index convention (the 950 docstring's
example: sorted_indices indexed by source slot t*k+j, i.e. init_routing's row_idx_type 0 output
fed in unchanged; the A2/A3 example reads the inverse map); fp32 x in the plain form on A5.

Under expert parallelism (`ep_experts`, ep_experts.py) the layer holds this rank's slots only, and
`process_weights` stacks those; the exchange does init_routing's and unpermute's work, and the
received pairs run through the same two grouped matmuls and SwiGLU (`expert_rows`).

Portable (the core's `PortableMoE`, each expert through its own linear layers): A2/A3 (the
chain is mapped for the 950 first); a layer whose experts differ in format, shape or numerics, or
were processed already.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.portable_moe import PortableMoE
from deepinfer_core.ops.quant import fake_quant_fp8, quant_fp8_act

from .mx import MX_GROUP, act_mx_scale, weight_mx_scale

log = logging.getLogger("deepinfer.ascend")
ACT_BLOCK = 128          # DeepSeek's act_quant: one scale per 128 channels
FP4_BLOCK = (1, 32)      # FP4 weights: one scale per 32 inputs of each row


def moe_form(has_mx: bool, dtype: torch.dtype, simulate_qat: bool, expert_fmt: str,
             block=(128, 128)) -> tuple[str | None, str]:
    """(form, why): "mx", "plain" or None (the core's portable MoE), decided once."""
    if not has_mx:
        return None, ("portable: the init_routing_v2 / grouped-matmul chain is mapped for the "
                      "Ascend 950 only so far (A2/A3 keep the core's MoE)")
    if dtype not in (torch.bfloat16, torch.float32):
        return None, f"portable: compute dtype {dtype} (bf16 or fp32 only)"
    if simulate_qat and dtype == torch.bfloat16 and (
            expert_fmt == "fp4" or (expert_fmt == "fp8" and block[1] % MX_GROUP == 0)):
        return "mx", f"{expert_fmt} experts as MX grouped matmuls"
    return "plain", "experts dequantised to the compute dtype, plain grouped matmuls"


@dataclass(frozen=True)
class StackedSpec:
    """What `AscendMoE.process_weights` leaves on a layer it stacked (buffers `npu_w13`,
    `npu_w2` and, in the MX form, `npu_s13`, `npu_s2`)."""
    form: str               # "mx" | "plain"
    fmt: str                # the experts' checkpoint format
    inter: int              # I, the expert width
    quant_in: bool          # act_quant of w1/w3's input (QAT numerics)
    quant_mid: bool         # act_quant of w2's input
    swiglu_limit: float


class StackedAway:
    """Stand-in linear method for expert layers whose weights moved into the MoE's stacks."""

    def process_weights(self, layer) -> None:
        pass

    def apply(self, layer, x):
        raise RuntimeError("this expert's weights were moved into its MoE layer's stacks "
                           "(AscendMoE); run the MoE layer instead")

    apply_grouped = apply


def _loaded(lin) -> bool:
    """The linear still holds its checkpoint tensors (not processed by a linear method)."""
    if lin.fmt == "fp8":
        return lin.weight.dtype == torch.float8_e4m3fn and lin.scale is not None
    if lin.fmt == "fp4":
        return lin.weight.dtype in (torch.int8, torch.uint8) and lin.scale is not None
    return lin.scale is None


class AscendMoE(PortableMoE):
    """`process_weights(moe)` once after loading (before its experts' linears: the core visits
    the MoE first), then `apply(moe, x, input_ids)` per forward."""

    batch_invariant = False

    def __init__(self, torch_npu: Any, form: str, dtype: torch.dtype, simulate_qat: bool,
                 block=(128, 128)):
        self.form, self.dtype, self.simulate_qat = form, dtype, bool(simulate_qat)
        self.block = tuple(block)
        self._init_routing = torch_npu.npu_moe_init_routing_v2
        self._gmm = torch_npu.npu_grouped_matmul
        self._unpermute = torch_npu.npu_moe_token_unpermute
        self._e8m0 = torch_npu.float8_e8m0fnu
        self._fp4 = torch_npu.float4_e2m1fn_x2

    def ep_experts(self):
        """The EP seam (the core's `EPMoEMethod` asks before weights are processed): this rank's
        slots stacked, the received pairs through `expert_rows` (ep_experts.py)."""
        from .ep_experts import AscendEPExperts
        return AscendEPExperts(self)

    @staticmethod
    def stacked(moe) -> bool:
        return getattr(moe, "npu_moe", None) is not None

    def _why_not(self, moe) -> str | None:
        trios = [(ex.w1, ex.w3, ex.w2) for ex in moe.experts]
        lins = [lin for trio in trios for lin in trio]
        fmts = {lin.fmt for lin in lins}
        if len(fmts) != 1 or not all(_loaded(lin) for lin in lins):
            return f"experts in formats {sorted(fmts)} or already processed"
        if any(lin.compute_dtype not in (None, self.dtype) or lin.grouped for lin in lins):
            return "an expert layer has its own compute dtype"
        w1 = trios[0][0]
        shape = (w1.out_features, w1.in_features)
        if {((a.out_features, a.in_features), (b.out_features, b.in_features),
             (c.in_features, c.out_features)) for a, b, c in trios} != {(shape, shape, shape)}:
            return "experts differ in shape"
        if len({(a.act_quant, b.act_quant, c.act_quant) for a, b, c in trios}) != 1 \
                or trios[0][0].act_quant != trios[0][1].act_quant:
            return "experts differ in activation quantisation"
        if self.form == "mx" and not (fmts <= {"fp8", "fp4"} and trios[0][0].act_quant
                                      and trios[0][2].act_quant):
            return "the MX form needs FP8/FP4 experts with quantised activations"
        return None

    @torch.no_grad()
    def process_weights(self, moe) -> None:
        super().process_weights(moe)          # the gate's weight to fp32 (routing reads it)
        if self.stacked(moe):
            return
        moe.npu_moe = None
        why = self._why_not(moe)
        if why:
            log.info("MoE layer %s: portable MoE (%s)", moe.layer_id, why)
            return
        ex = moe.experts[0]
        fmt, inter = ex.w1.fmt, ex.w1.out_features
        trios = [(e.w1, e.w3, e.w2) for e in moe.experts]
        if self.form == "mx":
            w13 = torch.stack([torch.cat([a.weight, b.weight]) for a, b, _ in trios])
            w2 = torch.stack([c.weight for _, _, c in trios])
            if fmt == "fp4":                   # the checkpoint's bytes, two e2m1 along K
                w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
            s13 = torch.stack([torch.cat([self._mx_scale(a), self._mx_scale(b)], dim=1)
                               for a, b, _ in trios])                    # [E, K/64, 2I, 2]
            s2 = torch.stack([self._mx_scale(c) for _, _, c in trios])
            moe.register_buffer("npu_s13", s13, persistent=False)
            moe.register_buffer("npu_s2", s2, persistent=False)
        else:                                  # exact dequantisation, as the core's method does
            dequant = PortableLinearMethod(self.dtype, self.simulate_qat, self.block)
            for lin in (lin for trio in trios for lin in trio):
                dequant.process_weights(lin)
            w13 = torch.stack([torch.cat([a.weight, b.weight]) for a, b, _ in trios])
            w2 = torch.stack([c.weight for _, _, c in trios])
            moe.npu_s13 = moe.npu_s2 = None
        moe.register_buffer("npu_w13", w13.contiguous(), persistent=False)    # [E, 2I, D]
        moe.register_buffer("npu_w2", w2.contiguous(), persistent=False)      # [E, D, I]
        qat = self.simulate_qat
        moe.npu_moe = StackedSpec(self.form, fmt, inter, qat and ex.w1.act_quant,
                                  qat and ex.w2.act_quant, float(ex.swiglu_limit))
        for lin in (lin for trio in trios for lin in trio):     # memory is not doubled
            lin.register_buffer("weight", torch.empty(0, dtype=lin.weight.dtype,
                                                      device=lin.weight.device), persistent=False)
            lin.scale = None
            lin.method = StackedAway()

    def _mx_scale(self, lin) -> torch.Tensor:
        """The layer's block scales as MX weight scales [ceil(K/64), N, 2] uint8 (exact)."""
        block = FP4_BLOCK if lin.fmt == "fp4" else self.block
        return weight_mx_scale(lin.scale, lin.out_features, lin.in_features, block)

    def _grouped(self, spec: StackedSpec, rows: torch.Tensor, w: torch.Tensor, s, counts,
                 quant: bool) -> torch.Tensor:
        """rows [M, K] (sorted by expert) times their expert's w [E, N, K] -> [M, N]."""
        kw = dict(group_list=counts, split_item=2, group_type=0, group_list_type=1)
        if spec.form == "plain":
            if quant:
                rows = fake_quant_fp8(rows, ACT_BLOCK)
            return self._gmm([rows.to(w.dtype)], [w.transpose(1, 2)], **kw)[0]
        q, act_scale = quant_fp8_act(rows, ACT_BLOCK)
        kw.update(per_token_scale=[act_mx_scale(act_scale, rows.shape[-1], ACT_BLOCK)],
                  per_token_scale_dtype=self._e8m0, output_dtype=torch.bfloat16)
        if spec.fmt == "fp8":
            return self._gmm([q], [w.transpose(1, 2)], scale=[s], scale_dtype=self._e8m0,
                             **kw)[0]
        return self._gmm([q], [w.transpose(1, 2)], antiquant_scale=[s], weight_dtype=self._fp4,
                         **kw)[0]

    def apply(self, moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        spec = getattr(moe, "npu_moe", None)
        if spec is None:
            return super().apply(moe, x, input_ids)
        lead, d = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, d)
        weights, idx = self.route(moe.gate, x2, input_ids.reshape(-1),
                                  self.gate_logits(moe.gate, x2), self.softplus)
        t, k = idx.shape
        rows, row_idx, counts, _ = self._init_routing(
            x2, idx.to(torch.int32), active_num=t * k, expert_num=moe.npu_w13.shape[0],
            expert_tokens_num_type=1, expert_tokens_num_flag=True, row_idx_type=0)
        # each sorted row's routing weight: row_idx maps slot t*k+j to its row
        w_rows = torch.empty_like(weights.reshape(-1)).scatter_(0, row_idx.long(),
                                                                weights.reshape(-1))
        y = self.expert_rows(moe, rows, w_rows, counts)
        routed = self._unpermute(y.float(), row_idx, probs=torch.ones_like(weights))
        out = moe.shared_experts(x2, silu=self.silu).float() + routed
        return out.to(x.dtype).view(*lead, d)

    def expert_rows(self, moe, rows: torch.Tensor, w_rows: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
        """The experts of a stacked layer on rows sorted by expert: rows [M, D] in the compute
        dtype, w_rows [M] their routing weights (fp32), counts [E] int64 rows per expert ->
        [M, D] in the compute dtype. Grouped w1|w3, V4's clamped SwiGLU in fp32 with the weight
        multiplied in before w2 (as `Expert.forward`), grouped w2."""
        spec = moe.npu_moe
        h = self._grouped(spec, rows, moe.npu_w13, moe.npu_s13, counts, spec.quant_in)
        g, u = h[:, :spec.inter].float(), h[:, spec.inter:].float()
        if spec.swiglu_limit > 0:
            u = u.clamp(-spec.swiglu_limit, spec.swiglu_limit)
            g = g.clamp(max=spec.swiglu_limit)
        a = (w_rows[:, None] * (self.silu(g) * u)).to(rows.dtype)
        return self._grouped(spec, a, moe.npu_w2, moe.npu_s2, counts, spec.quant_mid)
