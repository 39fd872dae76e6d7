"""The data-parallel serving report of `examples/multi_gpu/run_dp_bench.sh`: one or
more serve_bench JSONs of one configuration (a run split in parts, e.g. to fit a time limit, is joined
by concurrency) as one table per concurrency (output tok/s, per GPU, TPOT, TTFT), what each rank holds
(weights, state cache, device), and with `--compare` a published reference beside ours: their figures,
our per-GPU throughput at high concurrency as a multiple of theirs, and the goal met or not.

Written to benchmarks/results/dp_bench_<label>.json (the serve_bench JSONs stay the full record).

    python benchmarks/dp_report.py benchmarks/results/serve_bench_dp4_h200.json --compare sglang-4xh200
    python benchmarks/dp_report.py part1.json part2.json --label dp2_h200
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import serve_bench_metrics as SM

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HIGH_CONCURRENCY = 256  # rows at or above it are "high concurrency" for a reference's throughput figures

# Published figures only, as SGLang reports them; nothing here was measured by us.
REFERENCES: dict[str, dict[str, Any]] = {
    "sglang-4xh200": {
        "system": "SGLang serving DeepSeek-V4-Flash on 4x H200",
        "source": "SGLang's published DeepSeek-V4-Flash 4xH200 recipe / blog figures",
        "gpus": 4,
        "output_tok_s_per_gpu_high_concurrency": [467.0, 506.0],
        "tpot_ms_concurrency_1": 3.37,
        "tpot_note": "theirs with MTP speculative decoding; ours without (a random-weight model accepts no drafts)",
        "goal_factor": 2.0,
        "goal": "our output tok/s per GPU at high concurrency >= 2x theirs (2x the upper end of their range)",
    },
}


def _row(r: dict[str, Any]) -> dict[str, Any]:
    def pick(key: str, *stats: str) -> dict[str, Any] | None:
        d = r.get(key)
        return {s: d.get(s) for s in stats} if d else None

    return {
        "concurrency": r.get("concurrency"),
        "num_prompts": r.get("num_prompts"),
        "completed": r.get("completed"),
        "failed": r.get("failed"),
        "status": r.get("status"),
        "duration_s": r.get("duration_s"),
        "output_tok_s": r.get("output_throughput"),
        "output_tok_s_per_gpu": r.get("output_throughput_per_gpu"),
        "tpot_ms": pick("tpot_ms", "p50", "mean", "p99"),
        "ttft_ms": pick("ttft_ms", "p50", "mean", "p99"),
        "itl_ms": pick("itl_ms", "p50", "p99"),
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' rows by concurrency (a later run's row replaces an earlier one of the same concurrency),
    checked to be one configuration: the same lengths and data-parallel size."""
    keys = {
        (r["settings"]["input_len"], r["settings"]["output_len"], r["server"].get("data_parallel_size")) for r in runs
    }
    if len(keys) != 1:
        raise SystemExit(f"dp_report: the JSONs are of different runs (input, output, ranks): {sorted(keys)}")
    rows: dict[Any, dict[str, Any]] = {}
    for run in runs:
        for r in run["rows"]:
            rows[r.get("concurrency")] = r
    memory = next((r["server"].get("memory") for r in runs if (r["server"].get("memory") or {}).get("ranks")), None)
    first = runs[0]
    dummy = first["server"].get("dummy_model") or {}
    return {
        "input_len": first["settings"]["input_len"],
        "output_len": first["settings"]["output_len"],
        "data_parallel_size": first["server"].get("data_parallel_size"),
        "model": {
            "dummy_layers": first["settings"].get("dummy_layers"),
            "expert_dtype": first["settings"].get("expert_dtype"),
            "config_source": dummy.get("config_source"),
            "notes": dummy.get("notes"),
            "launch": first["server"].get("launched"),
        },
        "memory": memory,
        "rows": [_row(rows[c]) for c in sorted(rows, key=lambda c: (c is None, c or 0))],
        "workload_notes": sorted({n for r in runs for n in r.get("workload_notes", [])}),
        "complete": all(r.get("complete") for r in runs),
        "commits": sorted({str(r.get("commit")) for r in runs}),
    }


def compare(rows: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, Any]:
    """Ours beside the reference: the best per-GPU output throughput over the successful rows at high
    concurrency (else the highest concurrency measured), its multiple of their range's ends, the goal;
    TPOT at concurrency 1."""
    ok = [r for r in rows if r["status"] == "ok" and r["output_tok_s_per_gpu"] is not None and r["concurrency"]]
    high = [r for r in ok if r["concurrency"] >= HIGH_CONCURRENCY] or sorted(ok, key=lambda r: r["concurrency"])[-1:]
    best = max(high, key=lambda r: r["output_tok_s_per_gpu"], default=None)
    lo, hi = ref["output_tok_s_per_gpu_high_concurrency"]
    one = next((r for r in ok if r["concurrency"] == 1), None)
    ours = best["output_tok_s_per_gpu"] if best else None
    return {
        "ours_output_tok_s_per_gpu": ours,
        "ours_at_concurrency": best["concurrency"] if best else None,
        "x_their_low": ours / lo if ours else None,
        "x_their_high": ours / hi if ours else None,
        "goal_output_tok_s_per_gpu": ref["goal_factor"] * hi,
        "goal_met": None if ours is None else ours >= ref["goal_factor"] * hi,
        "ours_tpot_ms_concurrency_1": (one["tpot_ms"] or {}).get("p50") if one else None,
        "their_tpot_ms_concurrency_1": ref["tpot_ms_concurrency_1"],
    }


def _f(v: float | None, fmt: str) -> str:
    return format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))


def print_report(rep: dict[str, Any]) -> None:
    m, mem = rep["model"], rep["memory"] or {}
    ranks = mem.get("ranks") or []
    gpu = ranks[0].get("device_name") if ranks else "?"
    print(
        f"\n[dp_report] {rep['label']}: {rep['data_parallel_size']} ranks x {gpu}, {m['dummy_layers']} layers "
        f"({m['expert_dtype'] or 'fp8'} experts), {rep['input_len']} in / {rep['output_len']} out"
        + ("" if rep["complete"] else " (INCOMPLETE: the run was cut short)")
    )
    print(
        f"{'conc':>5} {'n':>5} {'ok':>5} {'fail':>4} {'out tok/s':>10} {'tok/s/GPU':>10} {'TPOT p50':>9} "
        f"{'TPOT mean':>9} {'TTFT p50':>10} {'dur s':>8}  status"
    )
    for r in rep["rows"]:
        tpot, ttft = r["tpot_ms"] or {}, r["ttft_ms"] or {}
        print(
            f"{r['concurrency'] or 'inf':>5} {r['num_prompts'] or 0:5d} {_f(r['completed'], '5.0f')} "
            f"{_f(r['failed'], '4.0f')} {_f(r['output_tok_s'], '10.1f')} {_f(r['output_tok_s_per_gpu'], '10.1f')} "
            f"{_f(tpot.get('p50'), '9.2f')} {_f(tpot.get('mean'), '9.2f')} {_f(ttft.get('p50'), '10.1f')} "
            f"{_f(r['duration_s'], '8.1f')}  {r['status']}"
        )
    for line in SM.memory_lines(ranks):
        print(f"  {line}")
    for note in rep["workload_notes"] + (m.get("notes") or []):
        print(f"  note: {note}")
    ref, cmp = rep.get("reference"), rep.get("comparison")
    if ref and cmp:
        lo, hi = ref["output_tok_s_per_gpu_high_concurrency"]
        print(
            f"  {ref['system']} ({ref['source']}): {lo:g}-{hi:g} output tok/s per GPU at high concurrency, "
            f"TPOT {ref['tpot_ms_concurrency_1']:g} ms at concurrency 1 ({ref['tpot_note']})"
        )
        if cmp["ours_output_tok_s_per_gpu"] is None:
            print("  ours: no successful measurement to compare")
        else:
            verdict = "met" if cmp["goal_met"] else "not met"
            print(
                f"  ours: {cmp['ours_output_tok_s_per_gpu']:.1f} tok/s per GPU at concurrency "
                f"{cmp['ours_at_concurrency']} = {cmp['x_their_low']:.2f}x their {lo:g}, {cmp['x_their_high']:.2f}x "
                f"their {hi:g}; goal >= {cmp['goal_output_tok_s_per_gpu']:g}: {verdict}; TPOT p50 at "
                f"concurrency 1: {_f(cmp['ours_tpot_ms_concurrency_1'], '.2f')} ms"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsons", nargs="+", help="serve_bench JSONs of one configuration")
    ap.add_argument("--compare", choices=sorted(REFERENCES), default=None, help="a published reference beside ours")
    ap.add_argument("--label", default=None, help="the report's name (default: the first JSON's label)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/dp_bench_<label>.json)")
    a = ap.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in a.jsons]
    label = a.label or runs[0]["label"]
    rep: dict[str, Any] = {
        "schema": "deepinfer-dp-bench/1",
        "label": label,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "sources": [str(p) for p in a.jsons],
        **combine(runs),
    }
    ref = REFERENCES[a.compare] if a.compare else None
    rep["reference"] = ref
    rep["comparison"] = compare(rep["rows"], ref) if ref else None
    path = Path(a.out) if a.out else RESULTS / f"dp_bench_{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1) + "\n")
    print_report(rep)
    print(f"[dp_report] wrote {path}")
    return {**rep, "json_path": str(path)}


if __name__ == "__main__":
    main()
