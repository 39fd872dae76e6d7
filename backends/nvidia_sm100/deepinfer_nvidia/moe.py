"""The NVIDIA backend's MoE method: routing, permutation, FP8 grouped GEMMs with the SwiGLU epilogue
and the fixed-order combine from `deepinfer_kernels.moe`, with no host synchronisation in `apply`
(CUDA-graph safe) and results independent of the batch's row order.

`process_weights` stacks every routed expert, plus the shared expert as expert E, into
w13 [E+1, 2, I, D] / w2 [E+1, D, I] e4m3 with float32 128x128 block scales, registered on the MoE
module (so `model.to(device)` moves them once) and frees the per-expert buffers, so memory is not
doubled. A shared expert whose FP8 blocks are not 128x128 (V4.1's 32x32: their power-of-two
scales do not re-encode into 128x128 blocks exactly in general) stays out of the stacks
(w13 [E, 2, I, D]) and runs beside the grouped GEMMs through its own linear layers, its output
taking the shared expert's slot of the combine. FP4 experts are re-encoded to FP8 exactly as
`Fp8LinearMethod` does (whatever the model's FP8 block size: their scales are per 32 inputs); with
`fp4_experts` (the engine option of that name) the routed ones stay FP4 instead: their packed codes
and UE8M0 group bytes as the checkpoint stores them, with the block scales of their exact FP8
re-encoding, which the grouped GEMMs rebuild tile by tile in registers
(`deepinfer_kernels.fp4_experts`: the same bits as the re-encoded weights, about half the bytes).
The numerics follow the experts' own linear method (`Fp8LinearMethod`): its compute dtype, and
activation quantisation exactly where it would apply it (simulate_qat and the layer's act_quant).
A layer whose routed experts are not FP8 (bf16 model, FP4 that cannot be re-encoded, another linear
method) keeps the core's portable method, which runs each expert through its own linear layers.

Note the call order of `deepinfer_core.model.process_weights` (pre-order): the MoE method runs before
its experts' linear layers were processed, so the raw checkpoint tensors are read here and the
experts' linears get a stand-in method whose `process_weights` does nothing.
"""
from __future__ import annotations

import logging

import torch
import triton
from deepinfer_kernels.fp4_experts import GROUP, Fp4Experts, fp4_fits, to_resident

from deepinfer_core.ops.portable_moe import PortableMoE
from deepinfer_core.ops.quant import e8m0_to_float, fp4_to_fp8_block

from .ep_experts import NvidiaEPExperts
from .fused_spec import FusedAway, FusedSpec
from .linear import Fp8LinearMethod

log = logging.getLogger("deepinfer.nvidia")
BLOCK = 128


def _fp8_servable(lin) -> bool:
    """Whether an expert linear is served as FP8 in 128x128 blocks, as far as its form tells:
    processed by Fp8LinearMethod already, FP8 weights in 128x128 blocks, or FP4 weights (re-encoded
    into 128x128 blocks whatever the model's FP8 block size; exactly or not, encoding tells)."""
    if getattr(lin, "fp8_scale", None) is not None:
        return True
    if not isinstance(lin.method, Fp8LinearMethod) or lin.grouped or lin.scale is None:
        return False
    return lin.fmt == "fp4" or (lin.fmt == "fp8" and lin.method.block == (BLOCK, BLOCK))


def _expert_fp8(lin) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 weight [N, K], float32 block scales [N/128, K/128]) of a `_fp8_servable` expert
    linear, or None when its FP4 weights cannot be re-encoded to FP8 exactly."""
    if getattr(lin, "fp8_scale", None) is not None:        # already processed by Fp8LinearMethod
        return lin.weight, lin.fp8_scale
    if lin.fmt == "fp4":
        enc = fp4_to_fp8_block(lin.weight, lin.scale)
        return None if enc is None else (enc[0], e8m0_to_float(enc[1]))
    return lin.weight, e8m0_to_float(lin.scale)


def _stack_experts(linears: list[tuple], I: int, D: int, n_fp4: int) -> dict[str, torch.Tensor] | None:
    """The MoE's stacked expert buffers from its experts' (w1, w3, w2) linears: w13 [E1, 2, I, D] /
    w2 [E1, D, I] e4m3 with float32 128x128 block scales (`nv_w13`, `nv_s13`, `nv_w2`, `nv_s2`); with
    `n_fp4`, experts below it stay FP4 (`nv_w13_codes` [n_fp4, 2, I, D/2] / `nv_w13_groups`
    [n_fp4, 2, I, D/32] uint8 in `to_resident` order, likewise `nv_w2_*`), their block scales those of the exact FP8
    re-encoding, and `nv_w13` / `nv_w2` hold the experts from n_fp4 on. None: an expert is not
    servable as FP8 (checked before anything is allocated, except the exactness of an FP4
    re-encoding, which only the encoding tells)."""
    if not all(_fp8_servable(lin) for trio in linears for lin in trio):
        return None
    E1, nbi, nbd = len(linears), triton.cdiv(I, BLOCK), triton.cdiv(D, BLOCK)
    dev = linears[0][0].weight.device
    out = dict(nv_w13=torch.empty((E1 - n_fp4, 2, I, D), dtype=torch.float8_e4m3fn, device=dev),
               nv_s13=torch.empty((E1, 2, nbi, nbd), dtype=torch.float32, device=dev),
               nv_w2=torch.empty((E1 - n_fp4, D, I), dtype=torch.float8_e4m3fn, device=dev),
               nv_s2=torch.empty((E1, nbd, nbi), dtype=torch.float32, device=dev))
    if n_fp4:
        out.update(nv_w13_codes=torch.empty((n_fp4, 2, I, D // 2), dtype=torch.uint8, device=dev),
                   nv_w13_groups=torch.empty((n_fp4, 2, I, D // GROUP), dtype=torch.uint8, device=dev),
                   nv_w2_codes=torch.empty((n_fp4, D, I // 2), dtype=torch.uint8, device=dev),
                   nv_w2_groups=torch.empty((n_fp4, D, I // GROUP), dtype=torch.uint8, device=dev))
    for i, (l1, l3, l2) in enumerate(linears):
        for name, index, lin in (("w13", (i, 0), l1), ("w13", (i, 1), l3), ("w2", (i,), l2)):
            enc = _expert_fp8(lin)
            if enc is None:
                return None
            out[f"nv_s{name[1:]}"][index].copy_(enc[1])
            if i < n_fp4:       # the checkpoint's codes and scale bytes, reordered; FP8 is rebuilt in registers
                codes, groups = to_resident(lin.weight.view(torch.uint8), lin.scale.view(torch.uint8))
                out[f"nv_{name}_codes"][index].copy_(codes)
                out[f"nv_{name}_groups"][index].copy_(groups)
            else:
                out[f"nv_{name}"][(index[0] - n_fp4, *index[1:])].copy_(enc[0])
    return out


def _numerics(lin) -> tuple[torch.dtype, bool]:
    """(compute dtype, act_quant applied) as Fp8LinearMethod.apply decides them for this layer."""
    method = lin.method
    return lin.compute_dtype or method.dtype, bool(lin.act_quant and method.simulate_qat)


class NvidiaMoEMethod:
    """Same interface as the core's PortableMoE: `process_weights(moe)` once after loading, then
    `apply(moe, x, input_ids)` per forward."""

    def __init__(self, config: dict | None = None, batch_invariant: bool = False, fp4_experts: bool = False) -> None:
        self.portable = PortableMoE()
        self.config = config        # tile-config override for `fused_moe` (tuning, tests); None = heuristic
        self.batch_invariant = batch_invariant
        self.fp4_experts = fp4_experts      # keep FP4 routed experts FP4 (else re-encode them to FP8)

    def batch_invariant_variant(self) -> "NvidiaMoEMethod":
        """Fixed grouped-GEMM tiles for every batch and the router GEMM on fixed tiles (the
        batch_invariant feature's protocol); the combine already sums in slot order."""
        return type(self)(self.config, batch_invariant=True, fp4_experts=self.fp4_experts)

    def ep_experts(self) -> NvidiaEPExperts:
        """The expert-parallel seam (`deepinfer_core.parallel.ep_moe.EPExperts`): the grouped GEMMs over
        an EP rank's received pairs instead of the portable per-expert loop."""
        return NvidiaEPExperts(self)

    @staticmethod
    def fused(moe) -> bool:
        return getattr(moe, "nv_fused", None) is not None

    @torch.no_grad()
    def process_weights(self, moe) -> None:
        self._fuse(moe)
        if self.batch_invariant and not self.fused(moe):
            raise ValueError(f"DEEPINFER_BATCH_INVARIANT=1: MoE layer {moe.layer_id} cannot use the fused FP8 "
                             f"MoE (see the log), and the portable fallback on the GPU is not batch invariant")

    def _fuse(self, moe) -> None:
        if self.fused(moe):
            return
        gate_bf16 = moe.gate.weight
        self.portable.process_weights(moe)          # gate weight -> fp32 (routing reads it as is)
        if gate_bf16.dtype == torch.bfloat16:       # for bf16 activations: see `route`
            moe.gate.register_buffer("weight_bf16", gate_bf16.contiguous(), persistent=False)
        moe.nv_fused = None
        routed = [(ex.w1, ex.w3, ex.w2) for ex in moe.experts]
        shared = (moe.shared_experts.w1, moe.shared_experts.w3, moe.shared_experts.w2)
        # a shared expert the stacks cannot hold (V4.1's 32x32 FP8 blocks) runs beside them
        shared_stacked = all(_fp8_servable(lin) for lin in shared)
        linears = routed + [shared] if shared_stacked else routed
        w1 = routed[0][0]
        I, D = w1.out_features, w1.in_features
        if not isinstance(w1.method, Fp8LinearMethod) and getattr(w1, "fp8_scale", None) is None:
            log.info("MoE layer %s: experts are not FP8 (%s); portable MoE", moe.layer_id, w1.fmt)
            return
        numerics = {(_numerics(a), _numerics(b), _numerics(c)) for a, b, c in linears}
        shapes = {(a.out_features, a.in_features, b.out_features, b.in_features, c.out_features, c.in_features)
                  for a, b, c in linears}
        if len(shapes) != 1 or shapes.pop() != (I, D, I, D, D, I) or len(numerics) != 1:
            log.warning("MoE layer %s: experts differ in shape or numerics; portable MoE", moe.layer_id)
            return
        (dt1, q1), (dt3, q3), (dt2, q2) = numerics.pop()
        if q1 != q3 or len({dt1, dt3, dt2}) != 1:
            log.warning("MoE layer %s: w1/w3/w2 numerics differ; portable MoE", moe.layer_id)
            return
        keep_fp4 = self.fp4_experts and all(lin.fmt == "fp4" for trio in routed for lin in trio)
        if keep_fp4 and not (fp4_fits(I, D) and fp4_fits(D, I)):
            log.warning("MoE layer %s: FP4 experts of [I, D] = [%d, %d] cannot stay FP4 (multiples of 128 wanted); "
                        "re-encoded to FP8", moe.layer_id, I, D)
            keep_fp4 = False
        n_fp4 = len(moe.experts) if keep_fp4 else 0
        buffers = _stack_experts(linears, I, D, n_fp4)
        if buffers is None:      # nothing freed yet: the portable method takes the layer as loaded
            log.warning("MoE layer %s: expert weights not servable as FP8 (%s); portable MoE", moe.layer_id, w1.fmt)
            return
        dev = w1.weight.device
        for lin in (lin for trio in linears for lin in trio):
            lin.register_buffer("weight", torch.empty(0, dtype=torch.float8_e4m3fn, device=dev), persistent=False)
            lin.scale = None
            if hasattr(lin, "fp8_scale"):
                lin.fp8_scale = None
            lin.method = FusedAway()
        for name, t in buffers.items():
            moe.register_buffer(name, t, persistent=False)
        moe.nv_fused = FusedSpec(n_routed=len(moe.experts), compute_dtype=dt1, quant_in=q1, quant_mid=q2,
                                 swiglu_limit=float(moe.experts[0].swiglu_limit), n_fp4=n_fp4,
                                 clamp_shared=moe.shared_experts.swiglu_limit > 0,
                                 shared_stacked=shared_stacked)

    def route(self, moe, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k+1] int32, weights [T, k+1] fp32); the last column is the shared expert."""
        from deepinfer_kernels.moe_routing import route_topk
        gate = moe.gate
        w16 = getattr(gate, "weight_bf16", None)
        if self.batch_invariant:
            from deepinfer_kernels.dense_gemm import dense_gemm
            logits = dense_gemm(x, w16, torch.float32) if w16 is not None and x.dtype == torch.bfloat16 \
                else dense_gemm(x.float(), gate.weight, torch.float32)
        elif w16 is not None and x.dtype == torch.bfloat16 and x.is_cuda:     # (mm's out_dtype is CUDA-only)
            # the reference's fp32 product of bf16 values, exact per term: a bf16 GEMM accumulating in fp32
            logits = torch.mm(x, w16.t(), out_dtype=torch.float32)
        else:
            logits = x.float() @ gate.weight.t()
        return route_topk(logits, gate.topk, bias=gate.bias, tid2eid=gate.tid2eid if gate.hash_routed else None,
                          input_ids=input_ids.reshape(-1) if gate.hash_routed else None,
                          renormalize=gate.renormalize, routed_scale=gate.routed_scale, shared_expert=True)

    def _config(self, spec, tokens: int, k1: int, experts: int, device) -> dict | None:
        if self.config is not None or not self.batch_invariant:
            return self.config
        from deepinfer_kernels.fp8_gemm import wgmma_family
        from deepinfer_kernels.moe import invariant_moe_config
        return invariant_moe_config(tokens, k1, experts, wide_fp32=spec.compute_dtype == torch.float32
                                    and not (spec.quant_in and spec.quant_mid), mma_v2_family=wgmma_family(device))

    def apply(self, moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        spec = moe.nv_fused if self.fused(moe) else None
        if spec is None:
            return self.portable.apply(moe, x, input_ids)
        from deepinfer_kernels.moe import expert_outputs, fused_moe
        from deepinfer_kernels.moe_combine import moe_combine
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        ids, w = self.route(moe, x2, input_ids)
        w13, w2 = moe.nv_w13, moe.nv_w2
        if spec.n_fp4:
            w13 = Fp4Experts(moe.nv_w13_codes, moe.nv_w13_groups, w13)
            w2 = Fp4Experts(moe.nv_w2_codes, moe.nv_w2_groups, w2)
        args = (x2, ids, w, w13, moe.nv_s13, w2, moe.nv_s2)
        config = self._config(spec, x2.shape[0], ids.shape[1], moe.nv_s13.shape[0], x.device)
        kw = dict(n_clamped=spec.n_clamped, swiglu_limit=spec.swiglu_limit, quant_in=spec.quant_in,
                  quant_mid=spec.quant_mid, compute_dtype=spec.compute_dtype, config=config)
        if spec.shared_stacked:
            out = fused_moe(*args, shared_last=True, **kw)
        else:
            # the shared column's id (n_routed) lies past the stacks: no tile writes it, the shared
            # expert's own linears do (its clamp included), and the combine adds it first as ever
            y = expert_outputs(*args, **kw)
            y[:, -1] = moe.shared_experts(x2, silu=self.portable.silu)
            out = moe_combine(y, x.dtype, shared_last=True)
        return out.view(*lead, out.shape[-1])
