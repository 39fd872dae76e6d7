"""How many expert weights EPLB moves, with each plan as the policy gives it and laid over the current
placement (`deepinfer_core.parallel.eplb_keep.keep_in_place`; CPU, seconds): three windows of different
synthetic skewed loads planned in a row, each from the placement the last one left, 4 layers of 256
experts, at EP 2 / 4 / 8 with 0 / 16 / 32 spare slots, both policies. Counts expert copies sent between
ranks and slots rewritten (either from another rank or by a local copy).

    python benchmarks/eplb_moves.py

Prints a table and writes benchmarks/results/eplb_moves.json. tests/parallel/test_eplb_keep.py runs
the same sequence (`rearrangements`) and checks it.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator

import torch
from eplb_balance import E, hot_load, zipf_load

from deepinfer_core.parallel.eplb import rebalance, rebalance_simple
from deepinfer_core.parallel.eplb_keep import keep_in_place
from deepinfer_core.parallel.expert_map import ExpertPlacement
from deepinfer_core.parallel.expert_move import plan_transfers

REPO = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = ((2, 0), (4, 16), (8, 32))           # (EP size, spare slots)


def transfers(old: ExpertPlacement, new: ExpertPlacement, ep: int) -> int:
    """Expert copies sent between ranks to go from `old` to `new` (DS-DeepInfer's pairing)."""
    return sum(len(plan_transfers(o, n, ep)) for o, n in zip(old.phys_to_log.tolist(), new.phys_to_log.tolist()))


def rewritten_slots(old: ExpertPlacement, new: ExpertPlacement) -> int:
    return int((old.phys_to_log != new.phys_to_log).sum())


def rearrangements(policy: Callable, ep: int, redundant: int
                   ) -> Iterator[tuple[torch.Tensor, ExpertPlacement, ExpertPlacement, ExpertPlacement]]:
    """(window, current placement, plan as the policy gives it, plan laid over the current placement) of
    three windows in a row; the next window starts from the laid-over plan."""
    slots = E + redundant
    current = ExpertPlacement.initial(4, E, ep, redundant)
    for window in (zipf_load(16, 4, 1.0, 1), hot_load(16, 4, 2), zipf_load(16, 4, 1.2, 3)):
        plan = policy(window, slots, slots // ep)
        kept = keep_in_place(current, plan, ep)
        yield window, current, plan, kept
        current = kept


def main() -> None:
    rows = []
    print(f"{'policy':<12} {'EP':>3} {'spare':>5} {'copies sent: plan -> laid over':>32} {'slots rewritten':>20}")
    for name, policy in (("deepinfer", rebalance), ("eplb_global", rebalance_simple)):
        for ep, redundant in SETTINGS:
            row = dict(policy=name, ep=ep, spare_slots=redundant, sent_plan=0, sent_kept=0, rewritten_plan=0,
                       rewritten_kept=0)
            for _, current, plan, kept in rearrangements(policy, ep, redundant):
                row["sent_plan"] += transfers(current, plan, ep)
                row["sent_kept"] += transfers(current, kept, ep)
                row["rewritten_plan"] += rewritten_slots(current, plan)
                row["rewritten_kept"] += rewritten_slots(current, kept)
            rows.append(row)
            print(f"{name:<12} {ep:>3} {redundant:>5} {row['sent_plan']:>20} -> {row['sent_kept']:<9} "
                  f"{row['rewritten_plan']:>9} -> {row['rewritten_kept']}")
    out = REPO / "benchmarks" / "results" / "eplb_moves.json"
    out.write_text(json.dumps(dict(layers=4, experts=E, windows=3, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
