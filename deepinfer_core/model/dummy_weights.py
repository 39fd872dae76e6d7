"""Random weights in the checkpoint's on-disk format (vLLM's `load_format="dummy"`).

Benchmarks need the engine at V4-Flash width with any number of layers and no checkpoint on disk. The
buffers `build_model(cfg, device=...)` declares are filled in place, on their own device, in exactly
the format a checkpoint would load them in, so `bind_ops` + `process_weights` then run the real
conversion paths:

* FP8 e4m3 linears: codes ~ N(0, 64^2) (amax ~ 4.5 sigma < 448) drawn through bf16 chunks (no fp32 copy
  of the model), with one power-of-two UE8M0 scale for every 128x128 block;
* packed FP4 routed experts: uniform random bytes (every e2m1 code equally likely, std ~ 3) with one
  UE8M0 scale for every 32 inputs;
* bf16/fp32 tensors: small ones take `make_tiny_checkpoint.float_values` (its role-by-name magnitudes:
  norms ~ 1, O(1) mHC mixes, ...), large ones (embedding, head, plain linears) a normal of the same
  std drawn on the device;
* hash-routing `tid2eid` tables: k distinct experts per token id.

Every scale is chosen so that each linear has unit-variance outputs for unit-variance inputs (within a
factor sqrt(2) from the power-of-two rounding), as in a trained model; logits stay O(1).

Each tensor is drawn from a generator seeded by (seed, name), so its values do not depend on which other
tensors exist (the layer count, MTP kept or dropped). Values differ between devices (CPU and CUDA
generators differ); the same seed on the same device gives the same bytes.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from ..config import ModelConfig
from ..tools.make_tiny_checkpoint import float_values

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP8_CODE_STD = 64.0     # std of the drawn e4m3 codes
FP4_CODE_STD = 3.0      # std of uniform e2m1 codes (+-{0, .5, 1, 1.5, 2, 3, 4, 6}): sqrt(68.5 / 8)
SMALL = 1 << 20         # float tensors up to this many elements take float_values' exact rule (on host)
CHUNK = 1 << 24         # elements per temporary when drawing large tensors on the device


def tensor_seed(seed: int, name: str) -> int:
    """One seed per (seed, name), as make_tiny_checkpoint does: torch's CPU generator only uses the low
    32 bits of a seed, so both are hashed together rather than added."""
    return zlib.crc32(f"{seed}:{name}".encode())


def large_std(name: str, shape: tuple[int, ...], hidden: int) -> float:
    """float_values' magnitude rule for the tensors drawn on the device (too big to draw on the host):
    `shape` is the logical (unpacked) [out, in] of a linear."""
    if name == "embed.weight":
        return 1.0
    if name == "head.weight":
        return hidden ** -0.5
    if name.endswith(".weight") and len(shape) == 2:
        return shape[1] ** -0.5
    return 0.02


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """[out, in] of a linear's weight: packed FP4 (int8) holds two inputs per byte."""
    return (t.shape[0], t.shape[1] * 2) if t.dtype == torch.int8 else tuple(t.shape)


@torch.no_grad()
def _normal_chunks(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """t ~ N(0, std^2) (any float dtype incl. e4m3) through bf16 row chunks, clamped to e4m3's range."""
    rows = t.shape[0]
    per = max(1, CHUNK // max(1, t[0].numel()))
    for a in range(0, rows, per):
        part = t[a:a + per]
        tmp = torch.empty(part.shape, dtype=torch.bfloat16, device=t.device).normal_(0.0, std, generator=gen)
        if t.dtype == FP8:
            tmp.clamp_(-448.0, 448.0)
        part.copy_(tmp)


@torch.no_grad()
def _tid2eid(t: torch.Tensor, n_experts: int, gen: torch.Generator) -> None:
    """k DISTINCT experts per token id (top-k of random keys), in row chunks: the vocab x experts keys
    of V4-Flash would be 130 MB at once."""
    vocab, k = t.shape
    per = max(1, CHUNK // n_experts)
    for a in range(0, vocab, per):
        n = min(per, vocab - a)
        keys = torch.rand(n, n_experts, device=t.device, generator=gen)
        t[a:a + n] = keys.topk(k, dim=1).indices


def _scale_byte(weight_name: str, weight: torch.Tensor, hidden: int) -> int:
    """The UE8M0 exponent byte that makes codes x scale have the weight's wanted std."""
    code_std = FP8_CODE_STD if weight.dtype == FP8 else FP4_CODE_STD
    return 127 + round(math.log2(large_std(weight_name, logical_shape(weight), hidden) / code_std))


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, cfg: ModelConfig, seed: int = 0) -> None:
    """Every checkpoint-format buffer of `model` (built with deepinfer_core.model.build_model(cfg,
    device=...)) gets seeded random values of a trained model's magnitude, generated on the buffer's
    device. Raises ValueError for a buffer on the meta device or one no rule covers (a new buffer kind
    must get a deliberate rule, not silently keep torch.empty garbage)."""
    tensors = model.state_dict(keep_vars=True)
    # float_values reads the config dict; `raw` is empty when the ModelConfig was built directly
    cfg_dict = {**cfg.raw, "hidden_size": cfg.hidden_size}
    hidden = cfg.hidden_size
    gens: dict[torch.device, torch.Generator] = {}
    for name, t in tensors.items():
        if t.is_meta:
            raise ValueError(f"fill_dummy_weights: {name} is on the meta device; build the model with "
                             f"build_model(cfg, device=...) on the target device")
        if t.device not in gens:
            gens[t.device] = torch.Generator(device=t.device)
        gen = gens[t.device].manual_seed(tensor_seed(seed, name))
        stem = name.rpartition(".")[0]
        shape = tuple(t.shape)
        if t.dtype in (FP8, torch.int8):
            scale = tensors.get(f"{stem}.scale")
            if not name.endswith(".weight") or scale is None or scale.dtype != E8M0:
                raise ValueError(f"fill_dummy_weights: quantized {name} {list(shape)} {t.dtype} has no "
                                 f"UE8M0 {stem}.scale")
            if t.dtype == FP8:
                _normal_chunks(t, FP8_CODE_STD, gen)
            else:
                t.view(torch.uint8).random_(0, 256, generator=gen)
        elif t.dtype == E8M0:
            weight = tensors.get(f"{stem}.weight")
            if not name.endswith(".scale") or weight is None or weight.dtype not in (FP8, torch.int8):
                raise ValueError(f"fill_dummy_weights: UE8M0 {name} {list(shape)} scales no FP8/FP4 weight")
            t.view(torch.uint8).fill_(_scale_byte(f"{stem}.weight", weight, hidden))
        elif t.dtype == torch.int64 and name.endswith(".tid2eid"):
            _tid2eid(t, cfg.n_routed_experts, gen)
        elif t.is_floating_point() and t.numel() <= SMALL:
            host = torch.Generator().manual_seed(tensor_seed(seed, name))
            t.copy_(float_values(name, shape, cfg_dict, host))
        elif t.is_floating_point():
            _normal_chunks(t, large_std(name, shape, hidden), gen)
        else:
            raise ValueError(f"fill_dummy_weights: no value rule for {name} {list(shape)} {t.dtype}")
