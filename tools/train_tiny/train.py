"""Train the tiny DeepSeek-V4 (every V4 part, MTP included) on the corpus and export its compact artifact.

    python -m tools.train_tiny.corpus corpus.npz
    python -m tools.train_tiny.train corpus.npz OUT_DIR [--device cuda] [--minutes 4]

Windows of `--length` tokens are drawn at random (seeded) from the training split; the loss is the
main next-token NLL plus `--mtp-weight` times the MTP block's next-next-token NLL (DeepSeek's
objective, weight 0.3 early in their training). Every `--eval-every` steps both are measured on a
fixed set of held-out windows, and the weights of the best evaluation are the ones exported (the
corpus is small: a long run overfits). OUT_DIR gets `curve.json` (the losses), `artifact.safetensors` (the
compact weights: see export.py) and `report.json`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer_core.ops import portable_attention

from . import model as M
from .export import write_artifact


def windows_at(rows: np.ndarray, starts: np.ndarray, length: int, device: str) -> torch.Tensor:
    idx = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(rows[idx]).to(device)


def heldout_starts(n_tokens: int, length: int, count: int) -> np.ndarray:
    """`count` evenly spread, non-overlapping windows of the held-out split."""
    count = min(count, n_tokens // length)
    return (np.arange(count) * (n_tokens // count)).astype(np.int64)


@torch.no_grad()
def evaluate(model, rows: np.ndarray, starts: np.ndarray, length: int, device: str, batch: int) -> dict:
    sums: dict[str, float] = {}
    for i in range(0, len(starts), batch):
        main, mtp, stats = M.forward_losses(model, windows_at(rows, starts[i:i + batch], length, device))
        n = len(starts[i:i + batch])
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v * n
    return {k: v / len(starts) for k, v in sums.items()}


def learning_rate(a: argparse.Namespace, step: int, seconds: float) -> float:
    """Linear warm-up, then linear decay to 10% over the steps or the time budget, whichever ends first."""
    progress = max(step / a.steps, seconds / (a.minutes * 60))
    return a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * max(0.0, 1 - progress))


def optimizer_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], loss: torch.Tensor) -> None:
    """One step on `loss`, gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def train(a: argparse.Namespace) -> dict:
    torch.manual_seed(a.seed)
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    # one attention score tensor per window instead of query chunks: autograd keeps every chunk's
    # scores for the backward anyway, so chunking saves no memory here, only launches
    portable_attention.QUERY_CHUNK = max(portable_attention.QUERY_CHUNK, a.length)
    data = np.load(a.corpus)
    vocab = M.VocabMap.most_frequent(data["train"], a.vocab_rows - 1)
    to_row = vocab.row_of_token()
    train_rows, held_rows = to_row[data["train"]], to_row[data["heldout"]]
    cfg = M.training_config(vocab.rows)
    model = M.build(cfg, a.device, a.seed, qat=not a.no_qat, act_noise=a.act_noise)
    params = M.parameters(model)
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    rng = np.random.default_rng(a.seed)
    held = heldout_starts(len(held_rows), a.length, a.eval_windows)
    curve: list[dict] = []
    best: tuple[float, int, dict] | None = None      # (held-out NLL, step, weights) of the best evaluation
    t0 = time.perf_counter()
    step = 0
    while step < a.steps and time.perf_counter() - t0 < a.minutes * 60:
        lr = learning_rate(a, step, time.perf_counter() - t0)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train_rows) - a.length, a.batch)
        main, mtp, stats = M.forward_losses(model, windows_at(train_rows, starts, a.length, a.device))
        loss = main if mtp is None else main + a.mtp_weight * mtp
        optimizer_step(opt, params, loss)
        step += 1
        if step % a.eval_every == 0 or step == a.steps:
            point = {"step": step, "seconds": round(time.perf_counter() - t0, 1), "lr": lr,
                     "train": stats, "heldout": evaluate(model, held_rows, held, a.length, a.device, a.batch)}
            curve.append(point)
            print(json.dumps(point), flush=True)
            if best is None or point["heldout"]["main_nll"] < best[0]:
                best = (point["heldout"]["main_nll"], step, {n: t.detach().clone() for n, t in model.named_buffers()})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    run = {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "tokens_seen": step * a.batch * a.length,
           "train_tokens": int(len(train_rows)), "heldout_tokens": int(len(held_rows)), "vocab_rows": vocab.rows,
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "final": curve[-1] if curve else None, "best_step": best[1] if best else step,
           "heldout_windows": {"count": len(held), "length": a.length, "starts": held.tolist()}}
    keep_best = a.export == "best" and best is not None
    if keep_best and best[1] != step:    # the held-out loss rose since: keep the best weights
        with torch.no_grad():
            for n, t in model.named_buffers():
                t.copy_(best[2][n])
    M.round_to_checkpoint(model)
    exported = evaluate(model, held_rows, held, a.length, a.device, a.batch)
    print(json.dumps({"exported_heldout": exported}), flush=True)
    info = dict(run, exported_step=best[1] if keep_best else step, exported_heldout=exported)
    write_artifact(model, vocab, out / "artifact.safetensors", info)
    (out / "report.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def run_parser(tool: str, doc: str) -> argparse.ArgumentParser:
    """The arguments every training tool here takes (corpus, output, device, seed, step and time budget)."""
    ap = argparse.ArgumentParser(prog=f"python -m tools.train_tiny.{tool}", description=doc.split("\n\n")[0])
    ap.add_argument("corpus", type=Path, help="the .npz of tools.train_tiny.corpus")
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2000, help="learning-rate schedule length (and the most steps)")
    ap.add_argument("--minutes", type=float, default=1e9, help="stop after this long")
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = run_parser("train", __doc__)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--no-qat", action="store_true", help="train the clean numerics (default: the served QAT simulation)")
    ap.add_argument("--act-noise", type=float, default=0.0,
                    help="relative noise on activations before their FP8 rounding, in training steps (see "
                         "model.build); 0: none")
    ap.add_argument("--vocab-rows", type=int, default=8192, help="embedding/head rows (the last is shared)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--export", choices=("best", "final"), default="best",
                    help="the weights exported: the best held-out evaluation's or the last step's (a run meant to "
                         "learn the training text by heart keeps training past the held-out minimum)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    train(parse())
