"""NVIDIA backend plugin (SM90 Hopper and SM100 Blackwell): claims the platform and serves FP8
linear layers from the Triton kernels in `deepinfer_kernels`; attention, MoE and mHC still come from
the core's portable ops (on the GPU) until their kernels land.

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
    "note": "FP8 block-scaled linear layers (and FP4 experts re-encoded to FP8) on the tensor cores "
            "(Triton); attention, MoE routing, mHC and sampling still run the core's portable ops",
}
# Either path means a loaded NVIDIA kernel driver (tests may replace this tuple).
PROBE_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidia0")


@hookimpl
def deepinfer_detect_platform(requested):
    # PROBE_PATHS is read at call time so tests can replace it
    return probe_platform(requested, NAME, "cuda", PROBE_PATHS, "NVIDIA driver",
                          "NVIDIA GPU (FP8 Triton linear layers; other ops portable)")


def _fp8_capable(device) -> bool:
    import torch
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= MIN_CAPABILITY


@hookimpl
def deepinfer_linear_method(ctx, weight_format):
    """FP8 (and FP4, re-encoded to FP8 at load) weights on an SM90+ GPU: FP8 x FP8 with the QAT
    numerics, FP8 weights x bf16/fp32 activations without; bf16 weights and other devices fall
    through to the core."""
    if ctx.platform.name != NAME or weight_format not in ("fp8", "fp4"):
        return None
    if not _fp8_capable(ctx.device):
        return None
    from .linear import Fp8LinearMethod
    return Fp8LinearMethod(ctx.torch_dtype, ctx.simulate_qat, ctx.model_config.weight_block_size or (128, 128))
