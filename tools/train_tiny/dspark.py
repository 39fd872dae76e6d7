"""Train a DSpark drafter against the trained tiny target and export it.

    python -m tools.train_tiny.dspark corpus.npz OUT_DIR [--device cuda] [--minutes 4]

The target is the bundled trained model (deepinfer_core/tools/data, or --target ARTIFACT), frozen and
run with the served QAT numerics; the drafter is the engine's own module graph (model/dspark.py: three
window-only V4 stages with their own MoE, `main_proj`/`main_norm`, the Markov and confidence heads) and
the plugin's own block forward (deepinfer_dspark.drafter: `block_hidden`, `draft_heads`), trained
with the DSpark paper's objective on random anchors of corpus windows:

    L = 0.1 CE(label) + 0.9 ||p_draft - p_target||_1 + BCE(confidence logit, 1 - 1/2 ||p_draft - p_target||_1)

each position k (0-based) weighted exp(-k/4), teacher-forced (the Markov bias of position k uses the
corpus token before it). Embedding and head are the target's, shared and frozen. Every `--eval-every`
steps held-out windows give per-position CE, total variation, greedy agreement with the target's
argmax and the expected acceptance lengths; the best evaluation's weights are exported.

OUT_DIR gets `curve.json`, `report.json` and `drafter.safetensors`: the stages' tensors in checkpoint
format (the Markov tables with the target's compact vocabulary rows) with the drafter's config keys in
the metadata; deepinfer_core/tools/trained_model.py merges it with the target into a DSpark checkpoint.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from deepinfer_dspark.drafter import (
    block_hidden,
    draft_heads,
    main_features,
    stage_keys,
)

from deepinfer_core.model import ForwardBatch
from deepinfer_core.model.layers import Linear
from deepinfer_core.ops import portable_attention
from deepinfer_core.ops.quant import dequant_fp4, dequant_fp8_block
from deepinfer_core.tools.trained_model import ARTIFACT, read_artifact

from . import model as M
from .export import checkpoint_tensors
from .train import heldout_starts, learning_rate, optimizer_step, run_parser, windows_at

# the drafter's config keys (as in DeepSeek's DSpark checkpoints), scaled to the tiny target: three
# stages like V4's, fed by the last three target layers, gamma 5, the real noise token id
DRAFTER_KEYS = dict(num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=128799,
                    dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=64, dspark_n_routed_experts=8,
                    dspark_num_experts_per_tok=2, dspark_target_attn_input=True)


def drafter_config(target: dict, rows: int, **overrides) -> dict:
    """The target's config (with `rows` vocabulary rows) plus the drafter's keys; compress_ratios get
    one 0 per stage in place of the MTP block's."""
    cfg = {**target, **DRAFTER_KEYS, **overrides, "vocab_size": rows}
    n = cfg["num_hidden_layers"]
    cfg["compress_ratios"] = list(target["compress_ratios"][:n]) + [0] * cfg["num_nextn_predict_layers"]
    return cfg


@torch.no_grad()
def load_target(model, tensors: dict[str, torch.Tensor]) -> None:
    """The artifact's target tensors (compact vocabulary) into the training model's float buffers;
    the drafter (`mtp.*`) keeps its initial values."""
    block = tuple(model.cfg.weight_block_size or (128, 128))
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    for name, t in model.named_buffers():
        if name.startswith("mtp."):
            continue
        stem = name.rpartition(".")[0]
        stored = tensors[name]
        if stem in linears and name.endswith(".weight") and f"{stem}.scale" in tensors:
            scale = tensors[f"{stem}.scale"]
            stored = (dequant_fp4(stored, scale, 32, torch.float32) if stored.dtype == torch.int8
                      else dequant_fp8_block(stored, scale, block, torch.float32))
        t.copy_(stored.to(t.device, t.dtype))


def build(target_cfg: dict, tensors: dict, device: str, seed: int):
    """The training model: the frozen target with a fresh drafter (the Markov bias starts at 0)."""
    model = M.build(drafter_config(target_cfg, int(tensors["embed.weight"].shape[0])), device, seed)
    load_target(model, tensors)
    last = model.mtp[-1]
    with torch.no_grad():
        last.markov_head.markov_w2.zero_()
        last.confidence_head.proj.zero_()
    for name, t in model.named_buffers():
        if t.requires_grad and not name.startswith("mtp."):
            t.requires_grad_(False)
    model.capture_layers = tuple(model.cfg.dspark.target_layer_ids)
    return model


def drafter_losses(model, windows: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """windows: int64 [B, L] vocabulary rows; anchors: int64 [B, A] anchor positions in 1..L-1-gamma.
    The target runs once over the windows (no gradient); each anchor's block is drafted from the
    target's features at positions < anchor. Returns (loss, per-position stats)."""
    B, L = windows.shape
    k, dev = model.cfg.dspark.block_size, windows.device
    M.round_weights(model)
    ids = windows.reshape(-1)
    positions = torch.arange(L, device=dev).repeat(B)
    with torch.no_grad():
        states = M.fresh_states(model, B, L, str(dev))
        out = model(ForwardBatch(ids, positions, [0] * B, [L] * B, states, torch.arange(B * L, device=dev)))
    main_h = main_features(model.mtp, out.features)
    flat = (torch.arange(B, device=dev)[:, None] * L + anchors).reshape(-1)             # [N] anchor rows
    a = anchors.reshape(-1)
    steps = torch.arange(k, device=dev)
    block_ids = torch.full((len(flat), k), model.cfg.dspark.noise_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[flat]
    block_ids = torch.where(block_ids < model.cfg.vocab_size, block_ids, model.cfg.vocab_size - 1)  # shared row

    def contexts(i: int, attn) -> tuple[torch.Tensor, torch.Tensor]:
        keys = stage_keys(attn, main_h, positions)
        back = torch.arange(-attn.window, 0, device=dev)
        valid = (a[:, None] + back) >= 0
        ctx = keys[torch.where(valid, flat[:, None] + back, flat[:, None])]
        return ctx.masked_fill(~valid[..., None], 0.0), valid

    hidden = block_hidden(model, block_ids.reshape(-1), (a[:, None] + steps).reshape(-1), contexts, k)
    last = model.mtp[-1]
    base = model.lm_head(last.norm(hidden))
    rows = (flat[:, None] + steps).reshape(-1)                      # position k predicts the token at a+k+1
    logits, z = draft_heads(model, hidden, base, ids[rows], last.markov_head.markov_w2, last.confidence_head.proj)
    extra = torch.zeros(logits.shape[-1], device=dev)
    extra[-1] = M.shared_log_count(logits.shape[-1])             # the shared row's probability, all its ids
    logp = torch.log_softmax(logits + extra, -1)
    target = torch.softmax(out.logits[rows].float() + extra, -1)
    ce = -logp.gather(1, ids[rows + 1][:, None]).squeeze(1).view(-1, k)
    tv = (logp.exp() - target).abs().sum(-1).view(-1, k)                                    # in [0, 2]
    accept = (1 - 0.5 * tv).clamp(0, 1).detach()                  # the chance a T=1 draft is accepted
    conf = F.binary_cross_entropy_with_logits(z.view(-1, k), accept, reduction="none")
    weight = torch.exp(-steps.float() / 4)
    loss = ((0.1 * ce + 0.9 * tv + conf) * weight).sum(1).mean() / weight.sum()
    agree = (logits.argmax(-1) == out.logits[rows].argmax(-1)).float().view(-1, k)
    stats = {"ce": ce.mean(0).tolist(), "tv": tv.mean(0).tolist(), "accept_t1": accept.mean(0).tolist(),
             "agree_greedy": agree.mean(0).tolist(),
             "tau_t1": 1 + accept.cumprod(1).sum(1).mean().item(),
             "tau_greedy": 1 + agree.cumprod(1).sum(1).mean().item(),
             "confidence_gap": (torch.sigmoid(z.detach().view(-1, k)) - accept).mean(0).tolist()}
    return loss, stats


def anchors_for(rng: np.random.Generator, batch: int, count: int, length: int, k: int, device: str) -> torch.Tensor:
    return torch.from_numpy(rng.integers(1, length - k, (batch, count))).to(device)


@torch.no_grad()
def evaluate(model, rows: np.ndarray, starts: np.ndarray, a: argparse.Namespace) -> dict:
    rng = np.random.default_rng(1234)                            # the same anchors every evaluation
    k = model.cfg.dspark.block_size
    parts = []
    for i in range(0, len(starts), a.batch):
        chunk = starts[i:i + a.batch]
        _, stats = drafter_losses(model, windows_at(rows, chunk, a.length, a.device),
                                  anchors_for(rng, len(chunk), a.anchors, a.length, k, a.device))
        parts.append((len(chunk), stats))
    n = sum(c for c, _ in parts)
    return {key: (np.sum([np.asarray(s[key]) * c for c, s in parts], 0) / n).round(5).tolist() for key in parts[0][1]}


def write_drafter(model, kept: torch.Tensor, path: Path, info: dict) -> int:
    """The stages' tensors in checkpoint format (compact vocabulary rows), the drafter's config keys
    and the training report in the metadata."""
    from safetensors.torch import save_file
    tensors = {n: t for n, t in checkpoint_tensors(model).items() if n.startswith("mtp.")}
    tensors["vocab.kept"] = kept.to(torch.int32)
    keys = {key: model.cfg.raw[key] for key in (*DRAFTER_KEYS, "compress_ratios")}
    save_file(tensors, str(path), metadata={"format": "pt", "drafter_config": json.dumps(keys),
                                            "training": json.dumps(info)})
    return path.stat().st_size


def train(a: argparse.Namespace) -> dict:
    torch.manual_seed(a.seed)
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    portable_attention.QUERY_CHUNK = max(portable_attention.QUERY_CHUNK, a.length)
    target_cfg, tensors, _ = read_artifact(a.target)
    kept = tensors["vocab.kept"]
    to_row = np.full(M.FULL_VOCAB, len(kept), dtype=np.int64)
    to_row[kept.long().numpy()] = np.arange(len(kept))
    data = np.load(a.corpus)
    train_rows, held_rows = to_row[data["train"]], to_row[data["heldout"]]
    model = build(target_cfg, tensors, a.device, a.seed)
    params = [t for n, t in model.named_buffers() if t.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    k = model.cfg.dspark.block_size
    rng = np.random.default_rng(a.seed)
    held = heldout_starts(len(held_rows), a.length, a.eval_windows)
    curve, best, t0, step = [], None, time.perf_counter(), 0
    while step < a.steps and time.perf_counter() - t0 < a.minutes * 60:
        for group in opt.param_groups:
            group["lr"] = learning_rate(a, step, time.perf_counter() - t0)
        starts = rng.integers(0, len(train_rows) - a.length, a.batch)
        loss, stats = drafter_losses(model, windows_at(train_rows, starts, a.length, a.device),
                                     anchors_for(rng, a.batch, a.anchors, a.length, k, a.device))
        optimizer_step(opt, params, loss)
        step += 1
        if step % a.eval_every == 0 or step == a.steps:
            point = {"step": step, "seconds": round(time.perf_counter() - t0, 1), "loss": round(loss.item(), 5),
                     "train_tau_greedy": round(stats["tau_greedy"], 4), "heldout": evaluate(model, held_rows, held, a)}
            curve.append(point)
            print(json.dumps(point), flush=True)
            score = point["heldout"]["tau_t1"] + point["heldout"]["tau_greedy"]
            if best is None or score > best[0]:
                best = (score, step, {n: t.detach().clone() for n, t in model.named_buffers() if n.startswith("mtp.")})
    if best is not None and best[1] != step:
        with torch.no_grad():
            for n, t in model.named_buffers():
                if n in best[2]:
                    t.copy_(best[2][n])
    M.round_to_checkpoint(model)
    exported = evaluate(model, held_rows, held, a)
    info = {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "best_step": best[1] if best else step,
            "args": {key: str(v) if isinstance(v, Path) else v for key, v in vars(a).items()},
            "exported_heldout": exported}
    print(json.dumps({"exported_heldout": exported}), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    info["bytes"] = write_drafter(model, kept, out / "drafter.safetensors", info)
    (out / "report.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = run_parser("dspark", __doc__)
    ap.add_argument("--target", type=Path, default=ARTIFACT, help="the target's artifact (default: the bundled one)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=256, help="anchors drafted per window")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=32)
    return ap.parse_args(argv)


if __name__ == "__main__":
    train(parse())
