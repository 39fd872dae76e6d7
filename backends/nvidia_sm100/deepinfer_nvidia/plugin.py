"""NVIDIA backend plugin (SM90 Hopper and SM100 Blackwell): claims the platform and serves the linear
layers, attention, MoE and mHC from the Triton kernels in `deepinfer_kernels` (the sampler is the
core's, which runs on the device without host syncs).

Detection is import-light on purpose (it runs in every process): it looks at the driver's procfs
entry and device node only, never at torch.cuda, so no CUDA context is created.
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import probe_platform

NAME = "nvidia"
MIN_CAPABILITY = (9, 0)      # FP8 tensor cores (Hopper); SM100 runs the same Triton code
DEEPINFER_PLUGIN_INFO = {
    "status": "partial",
    "note": "Triton kernels for FP8 linear layers, the fused MoE (FP4 experts re-encoded to FP8, or "
            "kept FP4 with fp4_experts=True), "
            "sparse attention with the indexer and compressors, mHC, fused RMSNorm/RoPE/KV quant; decode "
            "CUDA graphs; Engram tables gathered from pinned host memory. V4.1 attention (ratio-1/2 "
            "compressors, shared caches) and FP8 linears in 32x32 blocks (V4.1's shared experts "
            "included) run on the core's portable ops. "
            "Not yet: SM100-specific paths",
}
# Either path means a loaded NVIDIA kernel driver (tests may replace this tuple).
PROBE_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidia0")


@hookimpl
def deepinfer_detect_platform(requested):
    # PROBE_PATHS is read at call time so tests can replace it
    return probe_platform(requested, NAME, "cuda", PROBE_PATHS, "NVIDIA driver",
                          "NVIDIA GPU (Triton kernels)")


def _fp8_capable(device) -> bool:
    import torch
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= MIN_CAPABILITY


def _serves(ctx) -> bool:
    """This backend's ops run on an SM90+ GPU of the nvidia platform; anything else falls through."""
    return ctx.platform.name == NAME and _fp8_capable(ctx.device)


def model_ratios(cfg) -> tuple[int, ...]:
    """Every compression ratio of the main and MTP layers."""
    return tuple({cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)}
                 | {cfg.mtp_ratio(i) for i in range(cfg.num_nextn_predict_layers)})


@hookimpl
def deepinfer_attention_backend(ctx):
    """V4 only: V4.1's ratio-1/2 compressors, shared caches and candidate blocks run on the core's
    portable attention (on the same GPU) until they have kernels."""
    if not _serves(ctx) or ctx.model_config.family != "v4":
        return None
    from .attention import NvidiaAttentionBackend
    return NvidiaAttentionBackend(model_ratios(ctx.model_config), official=ctx.simulate_qat)


@hookimpl
def deepinfer_linear_method(ctx, weight_format):
    """FP8 (and FP4, re-encoded to FP8 at load) weights on an SM90+ GPU: FP8 x FP8 with the QAT
    numerics, FP8 weights x bf16/fp32 activations without; bf16 weights as fp32-accumulating bf16
    GEMMs. Other devices fall through to the core."""
    if weight_format not in ("fp8", "fp4", "bf16") or not _serves(ctx):
        return None
    from .linear import Bf16LinearMethod, Fp8LinearMethod
    cls = Bf16LinearMethod if weight_format == "bf16" else Fp8LinearMethod
    return cls(ctx.torch_dtype, ctx.simulate_qat, ctx.model_config.weight_block_size or (128, 128))


@hookimpl
def deepinfer_pointwise_method(ctx):
    if not _serves(ctx):
        return None
    from .pointwise import NvidiaPointwise
    return NvidiaPointwise(official=ctx.simulate_qat)


@hookimpl
def deepinfer_mhc_method(ctx):
    if not _serves(ctx):
        return None
    from .mhc import NvidiaMHC
    c = ctx.model_config
    return NvidiaMHC(c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                     official=ctx.simulate_qat)


@hookimpl
def deepinfer_moe_method(ctx):
    if not _serves(ctx):
        return None
    from .moe import NvidiaMoEMethod
    return NvidiaMoEMethod(fp4_experts=fp4_experts(ctx))


# GPU architectures (capability majors) on which FP4 experts stay FP4 unless fp4_experts says
# otherwise: those where the whole compiled kernel and engine suite has passed with them in one run.
# None yet: Hopper (9) joins after that run (docs/development.md, "Next GPU runs").
FP4_EXPERTS_BY_DEFAULT: tuple[int, ...] = ()


def fp4_experts(ctx) -> bool:
    """The engine's fp4_experts, with None resolved by the GPU's architecture."""
    asked = ctx.options.model.fp4_experts
    if asked is not None:
        return asked
    import torch
    return torch.cuda.get_device_capability(torch.device(ctx.device))[0] in FP4_EXPERTS_BY_DEFAULT
