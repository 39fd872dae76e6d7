"""PNG of a sweep's JSON (benchmarks/sweep.py): decode step time against its roofline per batch,
achieved HBM bandwidth, prefill time against its roofline with the FP8-peak fraction, and the
speed-up over transformers. matplotlib is optional: without it `plot` returns a message saying so
(the sweep records it) instead of raising.

    python benchmarks/plot_sweep.py benchmarks/results/sweep_NVIDIA_H200.json [-o out.png]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def plot(result: dict, png: str | Path) -> str:
    """Draw `result` (the sweep's JSON as a dict) into `png`; returns what happened, in one line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("not drawn: matplotlib is not installed (pip install matplotlib, then run "
                "benchmarks/plot_sweep.py on the JSON)")
    decode, prefill = _ok(result.get("decode", [])), _ok(result.get("prefill", []))
    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(13, 9))
    fig.suptitle(f"DeepInfer sweep on {result.get('gpu', '?')}: {result.get('layers')}-layer model, "
                 f"commit {str(result.get('commit'))[:10]}", fontsize=11)
    batches = sorted({r["batch"] for r in decode})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, b in enumerate(batches):
        rows = sorted((r for r in decode if r["batch"] == b), key=lambda r: r["context"])
        ctx = [r["context"] for r in rows]
        col = colors[i % len(colors)]
        ax1.plot(ctx, [r["step_ms"] for r in rows], "o-", color=col, label=f"batch {b}")
        ax1.plot(ctx, [r["roofline_ms"] for r in rows], "--", color=col, alpha=0.6)
        ax2.plot(ctx, [100 * r["hbm_frac"] for r in rows], "o-", color=col, label=f"batch {b}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("decode step (ms, measured model)")
    ax1.set_title("decode: measured (solid) vs roofline (dashed)")
    ax2.set_ylabel("achieved HBM bandwidth (% of peak)")
    ax2.set_title("decode: bytes the step must move / time")
    if decode:
        ax1.legend(fontsize=8)
        ax2.legend(fontsize=8)

    labels = [str(r["tokens"]) for r in prefill]
    xs = list(range(len(prefill)))
    ax3.bar([x - 0.2 for x in xs], [r["step_ms"] for r in prefill], 0.4, label="measured")
    ax3.bar([x + 0.2 for x in xs], [r["roofline_ms"] for r in prefill], 0.4, label="roofline")
    for x, r in zip(xs, prefill):
        ax3.annotate(f"{100 * r['fp8_peak_frac']:.0f}% FP8 peak", (x - 0.2, r["step_ms"]), ha="center",
                     va="bottom", fontsize=8)
    ax3.set_xticks(xs, labels)
    ax3.set_xlabel("prompt tokens")
    ax3.set_ylabel("prefill time (ms, measured model)")
    ax3.set_title("prefill")
    ax3.legend(fontsize=8)

    cmp_rows = [r for r in decode + prefill if r.get("speedup_vs_hf")]
    ax4.bar(range(len(cmp_rows)), [r["speedup_vs_hf"] for r in cmp_rows])
    ax4.axhline(10.0, color="red", linestyle="--", label="target 10x")
    ax4.set_xticks(range(len(cmp_rows)), [r["label"] for r in cmp_rows], rotation=30, ha="right", fontsize=8)
    ax4.set_yscale("log")
    ax4.set_ylabel("transformers time / ours")
    ax4.set_title("speed-up over transformers (same weights)")
    ax4.legend(fontsize=8)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"wrote {png}"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description="PNG of a sweep JSON")
    ap.add_argument("json")
    ap.add_argument("-o", "--out", default=None, help="PNG path (default: next to the JSON)")
    a = ap.parse_args(argv)
    src = Path(a.json)
    msg = plot(json.loads(src.read_text()), a.out or src.with_suffix(".png"))
    print(msg)
    return msg


if __name__ == "__main__":
    main()
