"""transformers' DeepseekV4ForCausalLM on the sweep model's config and *the same weights*, in memory.

No checkpoint is written: the HF model is constructed on the target device without initialisation
(compute dtype by default; transformers' `_keep_in_fp32_modules_strict` tensors in fp32, as
`from_pretrained(dtype=bfloat16)` would give), and every one of its tensors is filled from our
checkpoint-format buffers. Names go through transformers' own official-checkpoint conversion for
deepseek_v4 (`conversion_mapping`: renamings, then the expert-stacking converters, which are done here
by hand: gate_up_proj[e] = [w1_e; w3_e], down_proj[e] = w2_e). FP8 weights are dequantised with
`deepinfer_core.ops.quant` one tensor at a time, so the peak extra memory is one fp32 matrix.
"""
from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any

import torch

from deepinfer_core.ops.quant import dequant_fp4, dequant_fp8_block

EXPERT_KEY = re.compile(r"experts\.(\d+)\.(w[123])\.weight$")


def hf_config(cfg_dict: dict[str, Any]):
    """HF config from our config dict: unquantised (the weights arrive dequantised); MTP not built."""
    from transformers import DeepseekV4Config
    d = {k: v for k, v in cfg_dict.items() if k not in ("quantization_config", "expert_dtype")}
    return DeepseekV4Config.from_dict(d)


@contextlib.contextmanager
def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:                       # transformers 4.x kept it in modeling_utils
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    with no_init_weights():
        yield


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside the block, restored after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _keep_fp32(hf, dtype: torch.dtype) -> None:
    """What from_pretrained(dtype=bf16) does with `_keep_in_fp32_modules_strict`: every tensor whose
    name matches one of the listed names (regex search, as transformers does) stays fp32."""
    names = sorted(getattr(hf, "_keep_in_fp32_modules_strict", None) or [])
    if dtype not in (torch.float16, torch.bfloat16) or not names:
        return
    pat = re.compile("|".join(n.replace("*", ".*") for n in names))
    for mod_name, mod in hf.named_modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in list(store.items()):
                full = f"{mod_name}.{name}" if mod_name else name
                if t is not None and t.is_floating_point() and t.dtype != torch.float32 and pat.search(full):
                    if isinstance(t, torch.nn.Parameter):
                        t.data = t.data.float()
                    else:
                        store[name] = t.float()


def build_hf(src: dict[str, torch.Tensor], cfg_dict: dict[str, Any], device, dtype: torch.dtype,
             block: tuple[int, int] = (128, 128)):
    """DeepseekV4ForCausalLM on `device` holding the weights of `src` (our checkpoint-format buffers)."""
    from transformers import DeepseekV4ForCausalLM
    config = hf_config(cfg_dict)
    with _no_init(), torch.device(device), default_dtype(dtype):
        hf = DeepseekV4ForCausalLM(config)
    _keep_fp32(hf, dtype)
    copy_weights(src, hf, block)
    return hf.eval()


def _dense(src: dict[str, torch.Tensor], key: str, block: tuple[int, int]) -> torch.Tensor:
    w = src[key]
    scale = src.get(key[: -len("weight")] + "scale") if key.endswith(".weight") else None
    if scale is None:
        return w
    if w.dtype == torch.int8:
        return dequant_fp4(w, scale, 32, torch.float32)
    return dequant_fp8_block(w, scale, block, torch.float32)


@torch.no_grad()
def copy_weights(src: dict[str, torch.Tensor], hf, block: tuple[int, int] = (128, 128)) -> int:
    """Fill every HF parameter/persistent buffer from `src` (official names); returns how many source
    tensors were copied. Raises when a name does not map or an HF tensor is left (partly) unfilled."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    conv = get_model_conversion_mapping(hf)
    renamings = [c for c in conv if isinstance(c, WeightRenaming)]
    converters = [c for c in conv if isinstance(c, WeightConverter)]
    dst = dict(hf.state_dict(keep_vars=True))
    inter = hf.config.moe_intermediate_size
    filled: dict[str, int] = {}
    copied = 0
    for key in src:
        if key.endswith(".scale") or key.startswith("mtp."):
            continue
        target, pattern = rename_source_key(key, renamings, converters, hf.base_model_prefix, dst)
        if target not in dst:
            raise KeyError(f"transformers has no tensor for {key!r} (conversion gave {target!r})")
        value, out = _dense(src, key, block), dst[target]
        if pattern is not None:                    # a routed expert: one slice of the stacked tensor
            m = EXPERT_KEY.search(key)
            if m is None:
                raise KeyError(f"{key!r} matched converter {pattern!r} but is not an expert weight")
            e, which = int(m[1]), m[2]
            out = out[e] if which == "w2" else (out[e, :inter] if which == "w1" else out[e, inter:])
        if tuple(out.shape) != tuple(value.shape):
            raise ValueError(f"{key} {tuple(value.shape)} does not fit transformers' {target} {tuple(out.shape)}")
        out.copy_(value)
        filled[target] = filled.get(target, 0) + value.numel()
        copied += 1
    left = [k for k, t in dst.items() if filled.get(k, 0) != t.numel()]
    if left:
        raise ValueError(f"transformers tensors not (fully) filled from our weights: {left[:8]}")
    return copied


def _cache_kwarg(hf) -> str:
    """transformers 5.x renamed past_key_values to cache."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def new_cache(hf):
    from transformers import DynamicCache
    return DynamicCache(config=hf.config)


@torch.no_grad()
def hf_step(hf, ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward of [batch, tokens] ids through HF with its own cache; logits of the last position.

    Under bf16 autocast: transformers 5.17 (the H200's) feeds the fp32 output of its fp32-kept mHC
    modules straight into bf16 linears and fails with a dtype mismatch; autocast runs those matmuls
    in bf16 (what the model's bf16 weights mean) and leaves the fp32 elementwise parts alone."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=_param_dtype(hf) == torch.bfloat16):
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{_cache_kwarg(hf): cache})
    return out.logits[:, -1]


def _param_dtype(hf) -> torch.dtype:
    return hf.get_input_embeddings().weight.dtype
