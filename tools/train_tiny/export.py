"""The compact artifact of a trained model: every checkpoint tensor in its official storage format
(FP8 weights + UE8M0 128x128 scales, packed FP4 experts + per-32 scales, bf16, fp32), except that the
embedding, the LM head and the hash-routing tables hold only the model's K + 1 vocabulary rows, plus
`vocab.kept` (the K token ids of rows 0..K-1; every other id uses row K). The config (with the real
vocabulary size) and the training report ride in the safetensors metadata.

deepinfer_core/tools/trained_model.py expands it into the official on-disk checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer_core.model.layers import Linear
from deepinfer_core.tools.make_tiny_checkpoint import model_tensor_spec

from .model import FULL_VOCAB, VocabMap, storage


@torch.no_grad()
def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The trained model's tensors in checkpoint format (its own, compact vocabulary)."""
    cfg = dict(model.cfg.raw)
    spec = model_tensor_spec(cfg)
    buffers = dict(model.named_buffers())
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    block = tuple(model.cfg.weight_block_size or (128, 128))
    for name, (_, dtype) in spec.items():
        if name in out:
            continue
        stem, _, leaf = name.rpartition(".")
        module = modules.get(stem)
        if isinstance(module, Linear) and leaf == "weight":
            weight, scale = storage(buffers[name].detach().float().cpu(), module.fmt, block)
            out[name] = weight
            if scale is not None:
                out[f"{stem}.scale"] = scale
        else:
            out[name] = buffers[name].detach().cpu().to(dtype)
    for name, (shape, dtype) in spec.items():
        if (tuple(out[name].shape), out[name].dtype) != (shape, dtype):
            raise ValueError(f"export: {name} came out {list(out[name].shape)} {out[name].dtype}, "
                             f"the checkpoint wants {list(shape)} {dtype}")
    return {k: v.contiguous() for k, v in out.items()}


def write_artifact(model, vocab: VocabMap, path: Path, info: dict) -> int:
    """Write the artifact; returns its size in bytes."""
    from safetensors.torch import save_file
    tensors = checkpoint_tensors(model)
    tensors["vocab.kept"] = torch.from_numpy(vocab.kept).to(torch.int32)
    for name in [n for n in tensors if n.endswith(".tid2eid")]:
        tensors[name] = tensors[name].to(torch.int8)        # expert ids < 128: a quarter of the bytes
    config = {**model.cfg.raw, "vocab_size": FULL_VOCAB}
    save_file(tensors, str(path), metadata={"format": "pt", "config": json.dumps(config), "training": json.dumps(info)})
    return Path(path).stat().st_size
