"""Helpers for comparing our model with HF transformers' DeepseekV4ForCausalLM (the oracle).

The oracle loads a float32 copy of our tiny checkpoint in the official tensor names through
transformers' own official-name conversion; nothing of our model code touches it. Weights are
dequantised with `ops.quant` (tested bit-exact against hand-computed values elsewhere).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.cache.state_cache import new_sequence_state
from deepinfer_core.model import ForwardBatch
from deepinfer_core.ops.quant import dequant_fp4, dequant_fp8_block
from deepinfer_core.runner.model_loader import load_model


def variant_dir(src: Path, dst: Path, **config_overrides) -> Path:
    """Same weights (shards linked, not copied), different config.json values."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            os.symlink(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config_overrides)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def write_hf_copy(src: Path, dst: Path) -> Path:
    """A float32, unquantised copy of the checkpoint in official names, for transformers."""
    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    raw = {}
    for shard in sorted(set(index.values())):
        with safe_open(src / shard, framework="pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    out = {}
    for k, v in raw.items():
        if k.endswith(".scale"):
            continue
        scale = raw.get(k[: -len("weight")] + "scale") if k.endswith(".weight") else None
        if scale is not None and v.dtype == torch.int8:
            v = dequant_fp4(v, scale, 32, torch.float32)
        elif scale is not None:
            v = dequant_fp8_block(v, scale, (128, 128), torch.float32)
        elif v.is_floating_point():
            v = v.float()
        out[k] = v.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def load_hf(path: Path):
    from transformers import DeepseekV4ForCausalLM
    model, info = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers did not load the checkpoint cleanly: {problems}"
    return model.eval()


class Ours:
    """Our model in float32 with the QAT simulation off, driven chunk by chunk."""

    def __init__(self, path: Path, dtype: str = "float32", simulate_qat: bool = False):
        self.loaded = load_model(path, dtype=dtype, simulate_qat=simulate_qat)
        self.model, self.cfg = self.loaded.model, self.loaded.model.cfg

    def new_state(self):
        return new_sequence_state(self.cfg, self.loaded.ctx.torch_dtype)

    @torch.no_grad()
    def logits(self, ids: list[int], chunks: list[int] | None = None, state=None) -> torch.Tensor:
        """Logits of every position of `ids`, fed in the given chunk sizes (default: one chunk)."""
        state = state if state is not None else self.new_state()
        chunks = chunks or [len(ids)]
        assert sum(chunks) == len(ids)
        outs, i = [], 0
        for n in chunks:
            batch = ForwardBatch.build([ids[i:i + n]], [state], all_logits=True)
            outs.append(self.model(batch).logits)
            batch.commit()
            i += n
        return torch.cat(outs)

    @torch.no_grad()
    def greedy(self, ids: list[int], steps: int) -> list[int]:
        state, out = self.new_state(), []
        logits = self.logits(ids, state=state)[-1]
        for _ in range(steps):
            tok = int(torch.argmax(logits))
            out.append(tok)
            logits = self.logits([tok], state=state)[-1]
        return out


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position: max |ours - ref| over the vocabulary / max |ref| over the vocabulary."""
    return (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
