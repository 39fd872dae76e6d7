"""Resident weight bytes of a V4 model on the nvidia backend, by the engine's own accounting: the
model graph built on the meta device (no weights are read or made), the backend's weight processing
run on it (shapes only), then every buffer summed. Printed beside the checkpoint's bytes (the same
graph before processing: what the loader reads) for both forms of the routed FP4 experts: re-encoded
to FP8 at load (the default) and kept FP4 (`fp4_experts=True`).

    python benchmarks/weight_memory.py [--config DIR] [--dtype bfloat16]

Default config: the real V4-Flash config.json (tests/data/deepseek-v4-flash, 43 layers + the MTP
block). Writes benchmarks/results/weight_memory.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "backends" / "nvidia_sm100"))
GB = 1e9
CATEGORIES = ("experts", "moe gate", "attention", "mhc and norms", "embed and head", "mtp block")


def category(name: str) -> str:
    if name.startswith("mtp."):
        return "mtp block"
    if name.startswith(("embed.", "head.")):
        return "embed and head"
    if ".ffn.gate." in name:
        return "moe gate"
    if ".ffn." in name:
        return "experts"                # routed and shared (processing stacks them together)
    if ".attn." in name:
        return "attention"
    return "mhc and norms"


def tensor_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of every buffer and parameter by category."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, t in [*module.named_buffers(), *module.named_parameters()]:
        out[category(name)] += t.numel() * t.element_size()
    return out


def nvidia_ops(cfg, dtype: torch.dtype, simulate_qat: bool, fp4_experts: bool) -> SimpleNamespace:
    """The nvidia backend's linear methods (by weight format) and MoE method, made as its plugin
    makes them (`deepinfer_nvidia.plugin`: the FP8 blocks are the config's `weight_block_size`, 32x32
    for V4.1), without a GPU."""
    from deepinfer_nvidia.linear import Bf16LinearMethod, Fp8LinearMethod
    from deepinfer_nvidia.moe import NvidiaMoEMethod
    block = cfg.weight_block_size or (128, 128)
    fp8 = Fp8LinearMethod(dtype, simulate_qat, block)
    return SimpleNamespace(linear={"fp8": fp8, "fp4": fp8, "bf16": Bf16LinearMethod(dtype, simulate_qat, block)},
                           moe=NvidiaMoEMethod(fp4_experts=fp4_experts))


def process_nvidia(model: torch.nn.Module, dtype: torch.dtype, simulate_qat: bool, fp4_experts: bool) -> None:
    """Bind the nvidia backend's linear and MoE methods as its plugin does and process the weights
    (on the meta device: shapes only)."""
    from deepinfer_core.model import process_weights
    from deepinfer_core.model.layers import Linear
    from deepinfer_core.model.moe import MoE
    ops = nvidia_ops(model.cfg, dtype, simulate_qat, fp4_experts)
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.method = ops.linear[mod.fmt]
        elif isinstance(mod, MoE):
            mod.method = ops.moe
    process_weights(model)


def account(cfg, dtype: torch.dtype = torch.bfloat16, simulate_qat: bool = True) -> dict:
    """Checkpoint bytes and, per expert form, resident bytes (total and by category) of `cfg`'s model."""
    from deepinfer_core.model.deepseek_v4 import build_model
    from deepinfer_core.tools.make_tiny_checkpoint import model_tensor_spec
    spec = model_tensor_spec(dict(cfg.raw))
    checkpoint = sum(torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
                     for shape, dt in spec.values())
    result = dict(checkpoint_bytes=checkpoint)
    for form, fp4 in (("fp8_experts", False), ("fp4_experts", True)):
        model = build_model(cfg, device="meta")
        before = tensor_bytes(model)
        process_nvidia(model, dtype, simulate_qat, fp4)
        after = tensor_bytes(model)
        fused = sum(1 for m in model.modules() if getattr(m, "nv_fused", None) is not None)
        result[form] = dict(resident_bytes=sum(after.values()), by_category=after, graph_bytes=sum(before.values()),
                            fused_moe_layers=fused)
    return result


def main() -> None:
    from deepinfer_core.config import ModelConfig
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=HERE.parent / "tests" / "data" / "deepseek-v4-flash")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = ap.parse_args()
    cfg = ModelConfig.from_file(a.config)
    r = account(cfg, getattr(torch, a.dtype))
    print(f"{a.config}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} routed experts ({cfg.expert_dtype})")
    print(f"checkpoint tensors: {r['checkpoint_bytes'] / GB:8.2f} GB")
    print(f"{'resident, nvidia backend':28}{'FP8 experts':>14}{'FP4 experts':>14}")
    for c in CATEGORIES:
        print(f"  {c:26}{r['fp8_experts']['by_category'][c] / GB:14.2f}{r['fp4_experts']['by_category'][c] / GB:14.2f}")
    print(f"  {'total':26}{r['fp8_experts']['resident_bytes'] / GB:14.2f}{r['fp4_experts']['resident_bytes'] / GB:14.2f}")
    out = HERE / "results" / "weight_memory.json"
    out.write_text(json.dumps(dict(config=str(a.config.name), dtype=a.dtype, **r), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
