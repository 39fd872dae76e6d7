"""The sweep's figures from its measurements: per-layer and full-depth (43-layer) extrapolation,
fractions of the hardware peaks, distance to the roofline, the speed-up over transformers, the
verdicts on the performance targets, and the printed tables.
"""
from __future__ import annotations

import statistics

import roofline
import roofline_v41
from roofline import Peaks, StepRoofline

# The performance targets examples/sweep/run_sweep.sh is judged by, on the measured model: the
# decode step against its own roofline (batch -> at most this many times it), the 16k prefill's
# FLOP rate against the FP8 peak, and the speed-up over transformers where it ran.
TARGETS = {
    "decode_roofline_x": {1: 2.0, 8: 1.6, 64: 1.5, 256: 1.5},
    "prefill_fp8_frac": 0.40,       # prefill of 16k tokens at >= 40 % of the FP8 tensor-core peak
    "prefill_hf_tokens": 4096,      # the prefill compared with transformers
    "hf_speedup": 10.0,             # prefill 4k, and decode wherever transformers fits, >= 10x faster
}


def extrapolate(measured_ms: float, split: dict | None, ratios: list, full_ratios: list,
                roof: StepRoofline, peaks: Peaks) -> dict:
    """Per-layer and full-depth time from the measured step. With a split: each layer kind's mean
    block time (V4: kind = ratio; window-only layers, absent from the sweep model, take the HCA
    time: an HCA block is a window block plus a cheap compressor; V4.1: kind =
    roofline_v41.layer_kind, one absent from the measured model takes `_v41_fallback`'s) and the
    measured remainder for embed + head, all scaled to `measured_ms`. Without one: mean block
    time, embed + head at their roofline floor."""
    L = len(ratios)
    if split and split.get("total_ms", 0) > 0:
        f = measured_ms / split["total_ms"]
        eh = split["embed_head_ms"] * f
        kinds: dict[int, list[float]] = {}
        for r, t in zip(ratios, split["layers_ms"]):
            kinds.setdefault(r, []).append(t * f)
        kind_ms = {r: statistics.mean(v) for r, v in kinds.items()}
        source = "per-layer events"
    else:
        eh = 1e3 * roof.head.t_floor(peaks)
        kind_ms = {r: max(0.0, measured_ms - eh) / L for r in set(ratios)}
        source = "mean layer; embed+head at roofline floor"
    mean_layer = max(0.0, measured_ms - eh) / L

    def kind_time(r) -> float:
        if r in kind_ms:
            return kind_ms[r]
        if isinstance(r, str):
            return _v41_fallback(r, kind_ms, mean_layer)
        return kind_ms.get(128, mean_layer)
    full = eh + sum(kind_time(r) for r in full_ratios)
    per_kind = {str(r): t for r, t in sorted(kind_ms.items())}
    out = {"per_layer_ms": mean_layer, "per_kind_ms": per_kind, "embed_head_ms": eh,
           "full_ms": full, "full_layers": len(full_ratios), "source": source}
    missing = sorted({r for r in full_ratios if isinstance(r, str) and r not in kind_ms})
    if missing:
        out["estimated_kinds"] = {r: kind_time(r) for r in missing}
    return out


def _v41_fallback(kind: str, kind_ms: dict, mean_layer: float) -> float:
    """A V4.1 layer kind the measured model lacks: the same kind without Engram, else the mean of
    the measured kinds of its ratio ("SWA", "C2", "C1"), else the mean layer."""
    plain = kind.split("+")[0]
    if plain in kind_ms:
        return kind_ms[plain]
    ratio = plain.split(" ")[0]
    same = [t for k, t in kind_ms.items() if k.split("+")[0].split(" ")[0] == ratio]
    return statistics.mean(same) if same else mean_layer


def sweep_assumptions(family: str) -> list[str]:
    """The sweep JSON's `assumptions`: the roofline's (V4 or V4.1) and the measurement's."""
    v41 = family == "v41"
    full = ("V4.1 kinds (roofline_v41.layer_kind) absent from the measured model at the same kind "
            "without Engram, else the mean of the measured kinds of their ratio" if v41 else
            "window-only layers at the HCA time")
    outside = ("embedding, Engram hashing, the final stream collapse, LM head" if v41 else
               "embedding, hc_head, LM head")
    return (roofline_v41.ASSUMPTIONS if v41 else roofline.ASSUMPTIONS) + [
        "decode state fabricated: random pools, num_tokens = context, one new token per sequence "
        "at position context, no commit (every timed step writes the same position); at a context "
        "that is a multiple of 128 the timed step closes no compressed block (the roofline "
        "amortises the pooling over steps)",
        "per-layer figures: block times from CUDA events on forward hooks (one extra run), scaled "
        "to the median; embed+head = the remainder; full-depth figures = embed+head + the "
        f"schedule's layers at their kind's time ({full})",
        f"embed_head_ms = time outside the blocks: {outside} and the step's host-side "
        "batch building",
        "verdicts: the performance targets (sweep_report.TARGETS) on the measured model "
        "(the full-depth figures are in each roofline and FP8-peak verdict's info); the "
        "transformers comparison uses the measured model; decode step = min(eager, CUDA graph) "
        "median"]


def fractions(ms: float, roof: StepRoofline, peaks: Peaks) -> dict:
    """Achieved HBM bandwidth and FLOP rates (from the roofline's bytes and FLOPs) as peak fractions."""
    tot, s = roof.total, ms / 1e3
    floor_ms = 1e3 * tot.t_floor(peaks)
    return {"hbm_frac": tot.total_bytes / s / peaks.bw, "fp8_peak_frac": tot.total_flops / s / peaks.fp8,
            "bf16_peak_frac": tot.total_flops / s / peaks.bf16, "roofline_ms": floor_ms, "x_roofline": ms / floor_ms}


def _ok(row: dict) -> bool:
    return row.get("status") == "ok"


def _verdict(name: str, target: str, values: list[tuple[str, float]], passes, worst_of, margin) -> dict:
    if not values:
        return {"target": name, "goal": target, "pass": None, "detail": "not measured"}
    worst_label, worst = worst_of(values, key=lambda v: v[1])
    ok = all(passes(v) for _, v in values)
    return {"target": name, "goal": target, "pass": ok, "worst": worst, "worst_at": worst_label,
            "margin": margin(worst), "values": {k: v for k, v in values}}


def verdicts(decode: list[dict], prefill: list[dict]) -> list[dict]:
    """The performance targets (`TARGETS`), on the measured model; each roofline and FP8-peak
    verdict also gives the full-depth (43-layer) extrapolation as `info`."""
    fr, sp, hf_tokens = TARGETS["prefill_fp8_frac"], TARGETS["hf_speedup"], TARGETS["prefill_hf_tokens"]
    out = []
    by_limit: dict[float, list[int]] = {}
    for b, x in TARGETS["decode_roofline_x"].items():
        by_limit.setdefault(x, []).append(b)
    for xr, batches in by_limit.items():
        rows = [r for r in decode if _ok(r) and r["batch"] in batches]
        vals = [(f"b{r['batch']} c{r['context']}", r["x_roofline"]) for r in rows]
        names = " and ".join(f"{b}" for b in batches)
        v = _verdict(f"decode batch {names} within {xr}x of the roofline", f"step time / roofline <= {xr}", vals,
                     lambda x, xr=xr: x <= xr, max,
                     lambda w, xr=xr: f"{w:.2f}x the roofline: " + (f"{w / xr:.2f}x over the target" if w > xr
                                                                    else f"{xr / w:.2f}x headroom"))
        v["info"] = {f"b{r['batch']} c{r['context']} full depth": r.get("full_x_roofline") for r in rows}
        out.append(v)
    rows = [r for r in prefill if _ok(r)]
    vals = [(f"{r['tokens']} tokens", r["fp8_peak_frac"]) for r in rows if r["tokens"] == 16384]
    v = _verdict(f"prefill 16k tokens >= {fr:.0%} of FP8 peak", f"FLOP rate / FP8 peak >= {fr}", vals,
                 lambda x: x >= fr, min,
                 lambda w: f"{w:.1%} of FP8 peak: " + (f"short by {fr / w:.2f}x" if w < fr else f"{w / fr:.2f}x above"))
    v["info"] = {**{f"{r['tokens']} tokens": r["fp8_peak_frac"] for r in rows},
                 **{f"{r['tokens']} tokens full depth": r.get("full_fp8_peak_frac") for r in rows}}
    out.append(v)

    def margin(w: float) -> str:
        return f"{w:.1f}x: " + (f"short by {sp / w:.2f}x" if w < sp else f"{w / sp:.2f}x above")
    for name, shapes in ((f"prefill {hf_tokens // 1024}k >= {sp:.0f}x faster than transformers",
                          [r for r in prefill if r["tokens"] == hf_tokens]),
                         (f"decode >= {sp:.0f}x faster than transformers where it fits", decode)):
        vals = [(r["label"], r["speedup_vs_hf"]) for r in shapes if _ok(r) and r.get("speedup_vs_hf")]
        v = _verdict(name, f"transformers time / ours >= {sp}", vals, lambda x: x >= sp, min, margin)
        v["not_compared"] = [r["label"] for r in shapes if not r.get("speedup_vs_hf")]
        out.append(v)
    return out


def _f(v, fmt: str) -> str:
    """`v` formatted, or a dash padded to the format's width when there is no value."""
    return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(int(fmt.split(".")[0] or 1))


def print_tables(decode: list[dict], prefill: list[dict], full_layers: int, layers: int) -> None:
    print(f"\nDECODE (one step, {layers}-layer model measured; TPOT extrapolated to {full_layers} layers)")
    print(f"{'batch':>5} {'ctx':>6} {'step ms':>9} {'graph ms':>9} {'roof ms':>8} {'x roof':>7} {'HBM%':>6} "
          f"{'layer ms':>9} {'TPOT ms':>9} {'x roof43':>8} {'out tok/s':>10} {'HF ms':>9} {'vs HF':>7}  status")
    for r in decode:
        g = r.get("ours", {}).get("cuda_graph", {}) or {}
        print(f"{r['batch']:5d} {r['context']:6d} {_f(r.get('step_ms'), '9.3f')} {_f(g.get('median_ms'), '9.3f')} "
              f"{_f(r.get('roofline_ms'), '8.3f')} {_f(r.get('x_roofline'), '7.2f')} "
              f"{_f(100 * r['hbm_frac'] if 'hbm_frac' in r else None, '6.1f')} "
              f"{_f(r.get('per_layer_ms'), '9.3f')} {_f(r.get('tpot_ms'), '9.2f')} "
              f"{_f(r.get('full_x_roofline'), '8.2f')} "
              f"{_f(r.get('output_tok_s'), '10.0f')} "
              f"{_f(r.get('hf', {}).get('median_ms'), '9.2f')} {_f(r.get('speedup_vs_hf'), '7.1f')}  {r['status']}")
    print(f"\nPREFILL (one sequence from position 0; TTFT extrapolated to {full_layers} layers)")
    print(f"{'tokens':>6} {'ms':>9} {'roof ms':>8} {'x roof':>7} {'FP8%':>6} {'tok/s':>9} {'layer ms':>9} "
          f"{'TTFT ms':>9} {'FP8%43':>7} {'HF ms':>9} {'vs HF':>7}  status")
    for r in prefill:
        print(f"{r['tokens']:6d} {_f(r.get('step_ms'), '9.2f')} {_f(r.get('roofline_ms'), '8.2f')} "
              f"{_f(r.get('x_roofline'), '7.2f')} "
              f"{_f(100 * r['fp8_peak_frac'] if 'fp8_peak_frac' in r else None, '6.1f')} "
              f"{_f(r.get('prefill_tok_s'), '9.0f')} {_f(r.get('per_layer_ms'), '9.3f')} "
              f"{_f(r.get('ttft_ms'), '9.1f')} "
              f"{_f(100 * r['full_fp8_peak_frac'] if 'full_fp8_peak_frac' in r else None, '7.1f')} "
              f"{_f(r.get('hf', {}).get('median_ms'), '9.1f')} {_f(r.get('speedup_vs_hf'), '7.1f')}  {r['status']}")


def print_verdicts(vs: list[dict]) -> None:
    print("\nTARGETS")
    for v in vs:
        mark = {True: "PASS", False: "MISS", None: "n/a "}[v["pass"]]
        detail = v.get("margin", v.get("detail", ""))
        at = f" (worst at {v['worst_at']})" if "worst_at" in v else ""
        print(f"  [{mark}] {v['target']}: {detail}{at}")
