"""The trained tiny DeepSeek-V4 (tools/train_tiny/): its compact artifact, shipped in the package,
expanded into the official on-disk checkpoint.

The artifact holds every checkpoint tensor in its storage format (FP8 + UE8M0 scales, packed FP4
experts, bf16, fp32) except the embedding, the LM head and the hash-routing tables, which hold only
the K + 1 rows the model was trained with: rows 0..K-1 are the token ids in `vocab.kept`, row K is
shared by every other id. Expanding gives each of the 129,280 ids its row, so the checkpoint the
engine loads computes exactly what was trained (the training loss counts the shared row's copies).

The DSpark drafter trained against it (tools/train_tiny/dspark.py) ships as a second artifact: its
stages (`mtp.*`, with compact Markov tables) and config keys. With `drafter=` the checkpoint is the
DSpark variant (as DeepSeek ships V4-Flash-DSpark beside V4-Flash): the target with the drafter's
stages in place of the MTP block.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .make_tiny_checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    model_tensor_spec,
    write_checkpoint,
)

ARTIFACT = Path(__file__).parent / "data" / "tiny_v4_shakespeare.safetensors"
DSPARK_ARTIFACT = Path(__file__).parent / "data" / "tiny_v4_shakespeare_dspark.safetensors"
VOCAB_ROWS = ("embed.weight", "head.weight")      # plus every "*.tid2eid" and the Markov tables
MARKOV_TABLES = (".markov_head.markov_w1", ".markov_head.markov_w2")


def _read(path: str | Path, config_key: str, what: str) -> tuple[dict, dict[str, torch.Tensor], dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if config_key not in meta:
        raise ValueError(f"{path}: not a {what} (no {config_key} in its metadata)")
    return json.loads(meta[config_key]), load_file(str(path)), json.loads(meta.get("training", "{}"))


def read_artifact(path: str | Path = ARTIFACT) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(config with the real vocabulary size, tensors, training report)."""
    return _read(path, "config", "trained-model artifact")


def read_drafter(path: str | Path = DSPARK_ARTIFACT) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(the drafter's config keys, its tensors, its training report)."""
    return _read(path, "drafter_config", "drafter artifact")


def expand_rows(compact: torch.Tensor, kept: torch.Tensor, vocab: int) -> torch.Tensor:
    """[K + 1, ...] -> [vocab, ...]: id kept[i] gets row i, every other id row K."""
    row = torch.full((vocab,), compact.shape[0] - 1, dtype=torch.long)
    row[kept.long()] = torch.arange(len(kept))
    return compact[row].contiguous()


def make_trained_checkpoint(out_dir: str | Path, artifact: str | Path = ARTIFACT,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, drafter: str | Path | None = None) -> Path:
    """The official checkpoint in `out_dir`; `drafter`: a DSpark drafter artifact to serve with it."""
    cfg, tensors, _ = read_artifact(artifact)
    kept, vocab = tensors.pop("vocab.kept"), int(cfg["vocab_size"])
    if drafter is not None:
        keys, stages, _ = read_drafter(drafter)
        if not torch.equal(stages.pop("vocab.kept"), kept):
            raise ValueError(f"{drafter}: trained against another target (its vocabulary rows differ from {artifact}'s)")
        cfg = {**cfg, **keys}
        tensors = {**{n: t for n, t in tensors.items() if not n.startswith("mtp.")}, **stages}
    spec = model_tensor_spec(cfg)
    for name in spec:
        if name in VOCAB_ROWS or name.endswith(".tid2eid") or name.endswith(MARKOV_TABLES):
            tensors[name] = expand_rows(tensors[name], kept, vocab).to(spec[name][1])
    unknown = sorted(set(tensors) - set(spec))
    missing = sorted(set(spec) - set(tensors))
    if unknown or missing:
        raise ValueError(f"{artifact}: tensors not in the model {unknown[:5]}, missing {missing[:5]}")

    def values(name: str) -> dict[str, torch.Tensor]:
        scale = name[:-len(".weight")] + ".scale" if name.endswith(".weight") else None
        return {n: tensors[n] for n in (name, scale) if n in tensors}

    return write_checkpoint(out_dir, cfg, spec, values, max_shard_bytes)
