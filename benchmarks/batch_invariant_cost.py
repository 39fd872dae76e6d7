"""Cost of batch-invariant mode: the same sweep (benchmarks/sweep.py) run with and without
--batch-invariant, shape by shape.

    python benchmarks/sweep.py --no-hf --cuda-graph ...                    -> sweep_<gpu>.json
    python benchmarks/sweep.py --no-hf --cuda-graph --batch-invariant ...  -> sweep_<gpu>_invariant.json
    python benchmarks/batch_invariant_cost.py benchmarks/results/sweep_<gpu>.json \\
        benchmarks/results/sweep_<gpu>_invariant.json

Prints a table and writes benchmarks/results/batch_invariant_cost_<gpu>.json. Decode compares the
CUDA-graph step when both runs have one (what the engine replays), else the eager step; prefill the
eager forward over the prompt. `slower_%` = invariant / default - 1.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _decode_ms(row: dict) -> tuple[float | None, str]:
    ours = row.get("ours", {})
    g = ours.get("cuda_graph", {})
    if g.get("status") == "ok":
        return g["median_ms"], "cuda_graph"
    e = ours.get("eager")
    return (e["median_ms"], "eager") if e else (None, "")


def compare(default: dict, invariant: dict) -> dict:
    rows = []
    for kind in ("decode", "prefill"):
        inv = {r["label"]: r for r in invariant.get(kind, []) if r.get("status") == "ok"}
        for r in default.get(kind, []):
            other = inv.get(r["label"])
            if r.get("status") != "ok" or other is None:
                continue
            if kind == "decode":
                (a, how_a), (b, how_b) = _decode_ms(r), _decode_ms(other)
                how = how_a if how_a == how_b else "eager"
                if how != how_a:
                    a, b = r["ours"]["eager"]["median_ms"], other["ours"]["eager"]["median_ms"]
            else:
                a, b, how = r["ours"]["eager"]["median_ms"], other["ours"]["eager"]["median_ms"], "eager"
            rows.append({"kind": kind, "label": r["label"], "timing": how, "default_ms": a, "invariant_ms": b,
                         "slower_pct": 100.0 * (b / a - 1.0)})
    worst = max((r["slower_pct"] for r in rows), default=None)
    return {"gpu": default.get("gpu"), "layers": default.get("layers"), "commit_default": default.get("commit"),
            "commit_invariant": invariant.get("commit"), "rows": rows, "worst_slower_pct": worst,
            "target_slower_pct": 20.0}


def table(result: dict) -> str:
    lines = [f"{'shape':<24} {'timing':<10} {'default ms':>11} {'invariant ms':>13} {'slower %':>9}"]
    for r in result["rows"]:
        lines.append(f"{r['label']:<24} {r['timing']:<10} {r['default_ms']:>11.3f} {r['invariant_ms']:>13.3f} "
                     f"{r['slower_pct']:>9.1f}")
    if result["worst_slower_pct"] is not None:
        lines.append(f"worst: {result['worst_slower_pct']:.1f}% slower (target <= {result['target_slower_pct']:.0f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("default_json")
    ap.add_argument("invariant_json")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    result = compare(json.loads(Path(a.default_json).read_text()), json.loads(Path(a.invariant_json).read_text()))
    print(table(result))
    gpu = (result["gpu"] or "unknown").replace(" ", "_")
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "results" / f"batch_invariant_cost_{gpu}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
