"""EPLB placement quality on synthetic V4-like expert loads (CPU, seconds): the load imbalance
`Σ max rank load / Σ mean rank load` (1.00 = perfect; DS-DeepInfer's `moe_lb`) of the static
placement and of the two policies (`rebalance`, `rebalance_simple`), each planned on one window of
steps and scored on the next (held out: in-sample figures flatter every policy), overall and for the
three hash-routed layers alone.

    python benchmarks/eplb_balance.py [--steps 100] [--layers 43]

Prints a table and writes benchmarks/results/eplb_balance.json. The load generators below are also the
ones tests/parallel/test_eplb.py checks the policies with.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from deepinfer_core.parallel.eplb import imbalance, rank_load, rebalance, rebalance_simple
from deepinfer_core.parallel.expert_map import ExpertPlacement

E = 256  # V4's routed experts per layer
REPO = pathlib.Path(__file__).resolve().parents[1]


# ---- synthetic loads [W, L, E] (token counts) -----------------------------------------------------------
def _counts(probs: torch.Tensor, pairs: int, g: torch.Generator) -> torch.Tensor:
    """Expected counts with +-20% uniform noise per (step, layer, expert), rounded to tokens."""
    noise = 0.8 + 0.4 * torch.rand(probs.shape, generator=g, dtype=torch.float64)
    return (probs / probs.sum(-1, keepdim=True) * pairs * noise).round()


def zipf_load(steps: int, layers: int, s: float, seed: int, pairs: int = 8192) -> torch.Tensor:
    """Expert popularity ~ 1/rank^s, a different expert order per layer, stationary over steps."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    probs = torch.stack([base[torch.randperm(E, generator=g)] for _ in range(layers)])
    return _counts(probs.expand(steps, -1, -1), pairs, g)


def hot_load(steps: int, layers: int, seed: int, hot: int = 4, factor: float = 10.0) -> torch.Tensor:
    """Uniform experts except `hot` random ones per step and layer with `factor` x the load."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.ones(steps, layers, E, dtype=torch.float64)
    chosen = torch.rand(steps, layers, E, generator=g).argsort(-1)[..., :hot]
    return _counts(probs.scatter(-1, chosen, factor), 8192, g)


def v4_like_load(steps: int, layers: int, seed: int) -> torch.Tensor:
    """Three very skewed hash-routed layers (token frequency, no bias correction), then milder ones."""
    return torch.cat([zipf_load(steps, 3, 1.2, seed), zipf_load(steps, layers - 3, 0.6, seed + 1)], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="steps per window (plan window, then held-out window)")
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    load = v4_like_load(2 * args.steps, args.layers, args.seed)
    plan_on, score_on = load[: args.steps], load[args.steps :]
    rows = []
    print(
        f"{'EP':>3} {'R':>3} {'static':>7} {'rebalance':>10} {'simple':>7} {'hash static':>12} {'hash rebal.':>12}"
        f" {'plan s':>7}"
    )
    for ep, redundant in ((2, 0), (2, 32), (4, 0), (4, 32), (8, 0), (8, 16), (8, 32)):
        static = ExpertPlacement.initial(args.layers, E, ep, redundant)
        slots = static.num_slots
        start = time.perf_counter()
        planned = rebalance(plan_on, slots, slots // ep)
        plan_s = time.perf_counter() - start
        plans = {
            "static": static,
            "rebalance": planned,
            "rebalance_simple": rebalance_simple(plan_on, slots, slots // ep),
        }
        held = {k: rank_load(score_on, p, ep) for k, p in plans.items()}
        row = dict(
            ep=ep,
            redundant=slots - E,
            rebalance_seconds=round(plan_s, 3),
            **{k: round(imbalance(v), 4) for k, v in held.items()},
            hash_static=round(imbalance(held["static"][:, :3]), 4),
            hash_rebalance=round(imbalance(held["rebalance"][:, :3]), 4),
        )
        rows.append(row)
        print(
            f"{ep:>3} {row['redundant']:>3} {row['static']:>7.3f} {row['rebalance']:>10.3f} "
            f"{row['rebalance_simple']:>7.3f} {row['hash_static']:>12.3f} {row['hash_rebalance']:>12.3f} {plan_s:>7.2f}"
        )
    out = REPO / "benchmarks" / "results" / "eplb_balance.json"
    out.write_text(json.dumps(dict(settings=vars(args), load="v4_like_load", rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
