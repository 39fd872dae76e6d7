"""Checkpoint loading: resolve a model path locally, then stream safetensors shards into buffers.

The model's `state_dict(keep_vars=True)` names are exactly the official checkpoint tensor names, with
the checkpoint dtypes and shapes, so loading is a strict name-by-name match. All problems
are collected from the shard headers first and raised as one `CheckpointError` before any buffer
is touched; then shards are opened one at a time (memory-mapped) so peak memory stays near one
shard plus the model.

Two leniencies, as in vLLM, for checkpoints users have: a plain float tensor (bf16/f16/f32/f64)
stored in another float dtype than its buffer is cast (e.g. a model saved in float32 after
fine-tuning), and a checkpoint without any `mtp.*` tensor loads with the MTP blocks dropped.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
DEEPSEEK_DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"    # DS-DeepInfer's default checkpoint
SINGLE_FILE = "model.safetensors"

# Copies of the shared embedding/head inside MTP blocks (later checkpoints); the model reuses the
# main ones, so these are skipped. So are V4.1's vision parts (the text path never reads them:
# the ViT, its aligner, the image span embeddings and the image-token routing bias).
IGNORED_PATTERN = re.compile(r"^mtp\.\d+\.(emb\..+|head\.weight)$"
                             r"|^(vision|aligner)\.|^image_(start|end|newline)\b|\.ffn\.gate\.bias_vl$")

# Other spellings of a tensor the model names one way: DS-DeepInfer's V4.1 DSpark names for the
# V4-Flash-0731 ones the model uses (model/dspark.py).
TENSOR_ALIASES = (
    (re.compile(r"^(mtp\.\d+\.markov_head)\.embed\.weight$"), r"\1.markov_w1"),
    (re.compile(r"^(mtp\.\d+\.markov_head)\.head\.weight$"), r"\1.markov_w2"),
    (re.compile(r"^(mtp\.\d+\.confidence_head\.proj)\.weight$"), r"\1"),
)

_ST_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
_PLAIN_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MTP_PREFIX = "mtp."
_QUANT_WEIGHTS = (torch.float8_e4m3fn, torch.int8)   # int8 = packed FP4 (two e2m1 per byte)


class CheckpointError(ValueError):
    """The checkpoint on disk does not match the model (or cannot be read)."""


@dataclass
class LoadReport:
    tensors_loaded: int = 0
    bytes_loaded: int = 0
    shards_read: list[str] = field(default_factory=list)
    substituted: list[str] = field(default_factory=list)   # quantized linears given as plain weights
    ignored: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)   # plain floats stored in another float dtype
    mtp_dropped: bool = False                       # no mtp.* tensors: model.mtp emptied
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)   # not read: the caller's `skip` (other EP ranks' experts)


@dataclass
class _Plan:
    """What loading will do, decided from the shard headers alone."""

    problems: list[str]
    ignored: list[str]                 # checkpoint tensors the model shares (IGNORED_PATTERN)
    plain: set[str]                    # prefixes of quantized linears given as plain float weights
    cast: dict[str, torch.dtype]       # name -> dtype a plain float tensor is converted to
    mtp_dropped: bool
    skipped: list[str] = field(default_factory=list)   # checkpoint tensors `skip` leaves unread


@dataclass(frozen=True)
class _Entry:
    shard: Path
    shape: tuple[int, ...]
    dtype: torch.dtype | str      # str when safetensors reports a dtype torch does not know here
    stored: str | None = None     # the name in the file when it is an alias (TENSOR_ALIASES)


# ---- locating the model ------------------------------------------------------------------------

def _snapshot_of_cache_repo(repo_dir: Path) -> Path | None:
    """`models--org--name` cache folder -> the snapshot refs/main points at (or the only one)."""
    snaps = repo_dir / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        cand = snaps / ref.read_text().strip()
        if (cand / "config.json").is_file():
            return cand
    found = sorted(p for p in snaps.iterdir() if (p / "config.json").is_file())
    return found[-1] if len(found) == 1 else None


def resolve_model_path(model: str) -> Path:
    """Local directory, HF cache repo/snapshot directory, or repo id found in the local HF cache.

    Never downloads: repo ids are looked up with huggingface_hub in offline mode only.
    """
    tried: list[str] = []
    p = Path(model).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p.resolve()
        snap = _snapshot_of_cache_repo(p)
        if snap is not None:
            return snap.resolve()
        raise CheckpointError(f"model directory {p} has no config.json (nor a Hugging Face cache "
                              f"snapshot with one)")
    tried.append(f"local directory {p}: does not exist")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        try:
            from huggingface_hub import constants, try_to_load_from_cache
            cfg = try_to_load_from_cache(repo_id=model, filename="config.json")
            if isinstance(cfg, str) and Path(cfg).is_file():
                return Path(cfg).parent.resolve()
            tried.append(f"Hugging Face cache {constants.HF_HUB_CACHE}: no snapshot of {model!r} "
                         f"with config.json")
        except Exception as e:   # a malformed repo id or cache layout: report, don't crash
            tried.append(f"Hugging Face cache lookup of {model!r} failed: {e}")
    else:
        tried.append(f"{model!r} is not a repo id of the form 'org/name'")
    raise CheckpointError(f"model {model!r} not found locally (nothing is downloaded); tried:\n  - "
                          + "\n  - ".join(tried) + "\nGive model= (or DEEPINFER_HF_MODEL_DIR) a local "
                          f"checkpoint directory, or download the repo into the HF cache first (e.g. "
                          f"`huggingface-cli download {DEEPSEEK_DEFAULT_MODEL}`, DeepSeek's own engine's "
                          "default model)")


# ---- reading the checkpoint layout -------------------------------------------------------------

def _shard_files(path: Path) -> tuple[dict[str, Path] | None, list[Path]]:
    """(weight_map or None, shard files) for a directory, an index file or a single shard."""
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            return None, [path / SINGLE_FILE]
        else:
            raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise CheckpointError(f"shard file {path} does not exist")
        return None, [path]
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"index file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"index file {path} is not valid JSON: {e}") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"index file {path} has no valid 'weight_map' (name -> shard file)")
    weight_map = {name: path.parent / shard for name, shard in wm.items()}
    shards = sorted(set(weight_map.values()))
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"index file {path} lists shard files that do not exist: {missing}")
    return weight_map, shards


def _open(shard: Path):
    from safetensors import safe_open
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except Exception as e:   # truncated/corrupt header or data: SafetensorError, OSError, ...
        raise CheckpointError(f"cannot read shard {shard}: {type(e).__name__}: {e}") from None


def _scan(weight_map: dict[str, Path] | None, shards: list[Path]) -> tuple[dict[str, _Entry], list[str]]:
    """Headers of every shard -> {name: entry}, plus index/shard inconsistencies."""
    entries: dict[str, _Entry] = {}
    problems: list[str] = []
    for shard in shards:
        with _open(shard) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                st = sl.get_dtype()
                if name in entries:
                    problems.append(f"{name}: present in two shards ({entries[name].shard.name}, {shard.name})")
                entries[name] = _Entry(shard, tuple(sl.get_shape()), _ST_DTYPES.get(st, st))
    if weight_map is not None:
        for name, shard in sorted(weight_map.items()):
            if name not in entries:
                problems.append(f"{name}: listed in the index under {shard.name} but not stored there")
            elif entries[name].shard != shard:
                problems.append(f"{name}: index says {shard.name}, stored in {entries[name].shard.name}")
        problems += [f"{n}: stored in {e.shard.name} but not listed in the index"
                     for n, e in sorted(entries.items()) if n not in weight_map]
    return _resolve_aliases(entries, problems), problems


def _resolve_aliases(entries: dict[str, _Entry], problems: list[str]) -> dict[str, _Entry]:
    out: dict[str, _Entry] = {}
    for name, e in entries.items():
        plain = name.removeprefix("model.")        # V4.1 checkpoints may carry the prefix
        if plain != name:
            e = _Entry(e.shard, e.shape, e.dtype, stored=name)
        for pattern, repl in TENSOR_ALIASES:
            model_name = pattern.sub(repl, plain)
            if model_name != name:
                if model_name in entries:
                    problems.append(f"{name}: stored beside {model_name}, another name of the same tensor")
                out[model_name] = _Entry(e.shard, e.shape, e.dtype, stored=name)
                break
        else:
            if plain != name and plain in entries:
                problems.append(f"{name}: stored beside {plain}, another name of the same tensor")
            out.setdefault(plain, e)
    return out


# ---- matching against the model ----------------------------------------------------------------

def _dt(d: torch.dtype | str) -> str:
    return str(d).replace("torch.", "")


def _load_dtype(buf: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """dtype a plain float tensor stored in another float dtype than its buffer `buf` is loaded as.

    What the model keeps, except for a 16-bit buffer in a float32 run: every buffer is used in
    float32 there anyway, so the tensor becomes float32 (exact from f16/f32, one rounding from f64)
    instead of being rounded through bf16 -- a user's fine-tuned float32 weights are used exactly.
    """
    if compute_dtype == torch.float32 and buf in (torch.bfloat16, torch.float16):
        return torch.float32
    return buf


def _plan(expected: dict[str, torch.Tensor], entries: dict[str, _Entry], *,
          compute_dtype: torch.dtype | None = None, require_mtp: bool = False,
          skip: Callable[[str], bool] | None = None) -> _Plan:
    """Match the checkpoint's headers against the model's buffers (see `_Plan`)."""
    problems: list[str] = []
    ignored: list[str] = []
    skipped: list[str] = []
    plain: set[str] = set()
    cast: dict[str, torch.dtype] = {}
    # No mtp.* tensor at all: a checkpoint saved without the MTP head (it only drafts tokens for
    # speculative decoding), so the main model is complete. Some but not all: a damaged one.
    mtp_absent = (any(n.startswith(MTP_PREFIX) for n in expected)
                  and not any(n.startswith(MTP_PREFIX) for n in entries))
    if mtp_absent and require_mtp:
        problems.append(f"{MTP_PREFIX}*: the checkpoint has no MTP tensors; speculative "
                        f"decoding (MTP drafting) needs them (listed as missing)")
    elif mtp_absent:
        expected = {n: b for n, b in expected.items() if not n.startswith(MTP_PREFIX)}
    for name, buf in expected.items():
        e = entries.get(name)
        if e is None:
            continue
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if (prefix is not None and buf.dtype in _QUANT_WEIGHTS and f"{prefix}.scale" in expected
                and e.dtype in _PLAIN_FLOATS):
            logical = tuple(buf.shape) if buf.dtype != torch.int8 else (buf.shape[0], buf.shape[1] * 2)
            if f"{prefix}.scale" in entries:
                problems.append(f"{name}: wrong dtype: expected {_dt(buf.dtype)}, got {_dt(e.dtype)} "
                                f"(a plain float weight must come without {prefix}.scale)")
            elif e.shape != logical:
                problems.append(f"{name}: wrong shape for a plain float weight: expected "
                                f"{list(logical)}, got {list(e.shape)}")
            else:
                plain.add(prefix)
            continue
        if e.shape != tuple(buf.shape):
            problems.append(f"{name}: wrong shape: expected {list(buf.shape)}, got {list(e.shape)}")
        if e.dtype != buf.dtype and buf.dtype in _PLAIN_FLOATS and e.dtype in _PLAIN_FLOATS:
            cast[name] = _load_dtype(buf.dtype, compute_dtype)
        elif not (e.dtype == buf.dtype or (buf.dtype == torch.int8 and e.dtype == torch.uint8)):
            problems.append(f"{name}: wrong dtype: expected {_dt(buf.dtype)}, got {_dt(e.dtype)}")
    for name in sorted(expected):
        if name not in entries:
            owner = name.rsplit(".", 1)[0]
            if not (name.endswith(".scale") and owner in plain):
                problems.append(f"{name}: missing (expected {list(expected[name].shape)} "
                                f"{_dt(expected[name].dtype)})")
    for name in sorted(entries):
        if name in expected:
            continue
        if IGNORED_PATTERN.search(name):
            ignored.append(name)
        elif skip is not None and skip(name):
            skipped.append(name)
        else:
            e = entries[name]
            problems.append(f"{name}: unexpected tensor ({list(e.shape)} {_dt(e.dtype)} "
                            f"in {e.shard.name})")
    return _Plan(sorted(problems), ignored, plain, cast, mtp_absent and not require_mtp, skipped)


def _log_casts(cast: dict[str, torch.dtype], expected: dict[str, torch.Tensor],
               entries: dict[str, _Entry]) -> None:
    """One line: how many tensors, stored -> loaded dtype per group, the first few names."""
    groups: dict[str, int] = {}
    for name, to in cast.items():
        buf = expected[name].dtype
        label = f"{_dt(entries[name].dtype)}->{_dt(to)}" + (
            f" (float32 run, not {_dt(buf)})" if to != buf else "")
        groups[label] = groups.get(label, 0) + 1
    names = sorted(cast)
    msg = "loading %d float checkpoint tensors in another dtype than the model keeps, cast %s: %s"
    log.info(msg, len(names), ", ".join(f"{label} x{n}" for label, n in sorted(groups.items())),
             ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))


def _assign(model: nn.Module, name: str, value: torch.Tensor | None, current: torch.Tensor | None) -> None:
    """Put `value` under `name`: in place when the buffer already has real storage of the same
    kind, else as a fresh persistent buffer (meta buffers get real storage this way)."""
    prefix, _, attr = name.rpartition(".")
    mod = model.get_submodule(prefix) if prefix else model
    if (value is not None and current is not None and not current.is_meta
            and current.dtype == value.dtype and current.shape == value.shape):
        with torch.no_grad():
            current.copy_(value)
        return
    if value is not None:
        # safe_open tensors are views of a shared file mapping: take a private copy.
        on = current.device if current is not None and not current.is_meta else value.device
        value = value.to(on, copy=True)
    if attr in mod._parameters:        # tolerate parameters; inference needs no grad
        mod._parameters[attr] = None if value is None else nn.Parameter(value, requires_grad=False)
    else:
        mod.register_buffer(attr, value, persistent=True)


def check_checkpoint(model: nn.Module, path: str | Path, *, require_mtp: bool = False) -> list[str]:
    """Every mismatch between the model and the checkpoint at `path`, without loading anything
    (float dtype differences and absent MTP tensors are not mismatches: loading handles them)."""
    weight_map, shards = _shard_files(Path(path))
    entries, problems = _scan(weight_map, shards)
    plan = _plan(model.state_dict(keep_vars=True), entries, require_mtp=require_mtp)
    return sorted(problems + plan.problems)


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str | Path, *, compute_dtype: torch.dtype | None = None,
                    require_mtp: bool = False, skip: Callable[[str], bool] | None = None) -> LoadReport:
    """Load every checkpoint tensor into the same-named buffer of `model` (strict, see module doc).

    `compute_dtype`: the run's dtype; float32 keeps float32-stored tensors exact (`_load_dtype`).
    `require_mtp`: refuse a checkpoint without MTP tensors instead of dropping `model.mtp`; for
    speculative decoding (MTP drafting; the engine drafts when they are present, speculative/engine_step.py).
    `skip`: checkpoint names the model deliberately lacks (an EP rank's model holds only its own experts,
    parallel/ep_moe.py): they are neither read nor reported as unexpected.
    """
    t0 = time.perf_counter()
    weight_map, shards = _shard_files(Path(path))
    entries, problems = _scan(weight_map, shards)
    expected = model.state_dict(keep_vars=True)
    plan = _plan(expected, entries, compute_dtype=compute_dtype, require_mtp=require_mtp, skip=skip)
    problems = sorted(problems + plan.problems)
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model ({len(problems)} problems):\n  "
                              + "\n  ".join(problems))
    if plan.ignored:
        log.info("ignoring %d checkpoint tensors the model shares: %s", len(plan.ignored),
                 plan.ignored)
    if plan.mtp_dropped:
        blocks = {n.split(".")[1] for n in expected if n.startswith(MTP_PREFIX)}
        log.info("checkpoint has no %s* tensors: dropping the model's %d MTP block(s) (they only "
                 "draft tokens for speculative decoding)", MTP_PREFIX, len(blocks))
        model.mtp = nn.ModuleList()
    if plan.cast:
        _log_casts(plan.cast, expected, entries)

    report = LoadReport(ignored=plan.ignored, substituted=sorted(f"{p}.weight" for p in plan.plain),
                        cast=sorted(plan.cast), mtp_dropped=plan.mtp_dropped, skipped=plan.skipped)
    by_shard: dict[Path, list[str]] = {}
    for name in expected:
        if name in entries:
            by_shard.setdefault(entries[name].shard, []).append(name)
    for shard in shards:
        names = by_shard.get(shard, [])
        with _open(shard) as f:
            for name in names:
                try:
                    t = f.get_tensor(entries[name].stored or name)
                except Exception as e:
                    raise CheckpointError(f"cannot read {name} from shard {shard}: "
                                          f"{type(e).__name__}: {e}") from None
                report.tensors_loaded += 1
                report.bytes_loaded += t.numel() * t.element_size()
                cur = expected[name]
                if t.dtype == torch.uint8 and cur.dtype == torch.int8:
                    t = t.view(torch.int8)       # FP4 packed bytes tagged U8 by some writers
                elif name in plan.cast:
                    t = t.to(plan.cast[name])
                _assign(model, name, t, cur)
        report.shards_read.append(shard.name)
    for prefix in sorted(plan.plain):   # plain weight: later code must see no scale
        _assign(model, f"{prefix}.scale", None, None)
    report.seconds = time.perf_counter() - t0
    log.info("loaded %d tensors (%.1f MB) from %d shards in %.2fs", report.tensors_loaded,
             report.bytes_loaded / 1e6, len(report.shards_read), report.seconds)
    return report
