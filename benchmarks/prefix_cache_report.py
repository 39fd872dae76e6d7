"""The figures of `benchmarks/prefix_cache.py`: one call's row (from its `RequestOutput`s), the
off / on comparison per turn, the summary, the agreement of greedy outputs, and the printed table.
Host arithmetic only (no torch, no engine), so it is testable on synthetic rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import throughput_metrics as TM

MODES = ("off", "on")
WORKLOADS = ("shared", "no_shared")

DEFINITIONS = {
    "ttft_ms": "first token - arrival (RequestOutput.metrics); p50 / p99 over a call's requests",
    "output_tok_s": "output tokens of the call / its wall time",
    "total_tok_s": "(prompt tokens, cached or not, + output tokens) / the call's wall time",
    "hit_rate": "sum of RequestOutput.num_cached_tokens / sum of prompt tokens (caching on)",
    "best_hit_rate": "the most a cache could hold / prompt tokens: turn k >= 2: min(previous "
                     "turn's prompt + output - 1, this prompt - 1), rounded down to the block; "
                     "turn 1: 0",
    "hit_of_best": "cached tokens / best cached tokens",
    "prefix_stats": "the scheduler's PrefixCacheStats over the call (deltas)",
    "checkpoint_slots_full": "boundaries not kept for want of a free checkpoint slot "
                             "(--checkpoint-slots)",
    "summary.off_over_on_elapsed": "wall time with caching off / on over the turns both ran",
    "agreement": "greedy outputs on vs off; shared: a conversation that differed is not "
                 "compared after that turn",
}
# --server: the figures as the client sees them (prefix_cache_server.py)
SERVER_DEFINITIONS = {
    "ttft_ms": "the client's time from sending a request to its first streamed chunk (which "
               "carries a token); p50 / p99 over a turn's requests",
    "e2e_ms": "the client's time from sending a request to its [DONE]",
    "output_tok_s": "output tokens of the turn / the time from its first send to its last [DONE]",
    "total_tok_s": "(prompt tokens, cached or not, + output tokens) / the same time",
    "hit_rate": "sum of usage.prompt_tokens_details.cached_tokens / sum of prompt tokens "
                "(caching on)",
}


def definitions(server: bool) -> dict[str, str]:
    """The JSON's definitions: through `LLM.generate`, or through the server (`--server`)."""
    return {**DEFINITIONS, **SERVER_DEFINITIONS} if server else DEFINITIONS


def stats_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """PrefixCacheStats (as dicts) over one call: after - before, and its own hit rate."""
    if before is None or after is None:
        return None
    out: dict[str, Any] = {k: v - before.get(k, 0) for k, v in after.items()
                           if isinstance(v, (int, float)) and k != "hit_rate"}
    cut = {k: v - before["cut_short"].get(k, 0) for k, v in after["cut_short"].items()}
    out["cut_short"] = {k: v for k, v in cut.items() if v}
    out["hit_rate"] = out["hit_tokens"] / out["query_tokens"] if out.get("query_tokens") else 0.0
    return out


def call_row(turn: int, outs: Sequence[Any], elapsed: float, prompts: list[list[int]],
             best: list[int], output_len: int) -> dict[str, Any]:
    """One call's figures: throughput_metrics' (tok/s, TTFT, ...) and the cache's hits against
    the best possible (`best`: per request, the most a cache could hold)."""
    row: dict[str, Any] = {"turn": turn, "status": "ok"}
    short = sum(len(o.outputs[0].token_ids) != output_len for o in outs)
    if short:
        row["status"] = f"warning: {short} requests did not generate {output_len} tokens"
    row.update(TM.request_metrics(outs, elapsed))
    cached = [int(o.num_cached_tokens) for o in outs]
    n, hit, most = row["prompt_tokens"], sum(cached), sum(best)
    row.update(prompt_len_mean=n / len(outs), prompt_len_max=max(len(p) for p in prompts),
               cached_tokens=hit, best_cached_tokens=most, requests_hit=sum(c > 0 for c in cached),
               hit_rate=hit / n, best_hit_rate=most / n, hit_of_best=hit / most if most else None)
    return row


# ---- agreement -----------------------------------------------------------------------------------

def agreement(outputs: dict[tuple[str, bool], list[list[list[int]]]],
              conversations: int) -> dict[str, Any]:
    """Per workload run in both modes, per turn: the requests compared and those identical. In the
    shared workload a conversation that differed resends another history afterwards: not compared
    on later turns."""
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        off, on = outputs.get((w, False)), outputs.get((w, True))
        if off is None or on is None:
            continue
        alive, turns = set(range(conversations)), []
        for k, (x, y) in enumerate(zip(off, on), start=1):
            same = {c for c in alive if x[c] == y[c]}
            turns.append({"turn": k, "compared": len(alive), "identical": len(same)})
            if w == "shared":
                alive = same
        first = next((t["turn"] for t in turns if t["identical"] < t["compared"]), None)
        out[w] = {"identical": first is None, "turns": turns, "first_difference_turn": first}
    return out


def check_agreement(agree: dict[str, Any], invariant: bool, path: Path | str) -> None:
    """Batch-invariant greedy outputs must not depend on caching: AssertionError when they do."""
    bad = {w: r["first_difference_turn"] for w, r in agree.items() if not r["identical"]}
    if invariant and bad:
        raise AssertionError(f"prefix_cache: greedy outputs differ with caching on vs off in "
                             f"batch-invariant mode (workload: first turn that differs) {bad}; "
                             f"see {path}")


# ---- off vs on -----------------------------------------------------------------------------------

def compare_rows(runs: dict[str, dict], turns: int) -> list[dict]:
    """Per turn: the off and on figures side by side (the hit figures are caching on's)."""
    off, on = (runs.get(m, {}).get("rows", []) for m in MODES)
    out = []
    for k in range(1, turns + 1):
        x = next((r for r in off if r["turn"] == k), {})
        y = next((r for r in on if r["turn"] == k), {})
        row: dict[str, Any] = {"turn": k, "status_off": x.get("status", "not run"),
                               "status_on": y.get("status", "not run")}
        for key in ("ttft_ms", "e2e_ms"):
            for p in ("p50", "p99"):
                u, v = ((r.get(key) or {}).get(p) for r in (x, y))
                row[f"{key}_{p}_off"], row[f"{key}_{p}_on"] = u, v
                row[f"{key}_{p}_on_over_off"] = v / u if u and v else None
        for key in ("output_tok_s", "total_tok_s", "elapsed_s"):
            u, v = x.get(key), y.get(key)
            row[f"{key}_off"], row[f"{key}_on"] = u, v
            row[f"{key}_on_over_off"] = v / u if u and v else None
        row["prompt_len_mean"] = x.get("prompt_len_mean") or y.get("prompt_len_mean")
        for key in ("hit_rate", "best_hit_rate", "hit_of_best", "cached_tokens",
                    "best_cached_tokens", "requests_hit"):
            row[key] = y.get(key)
        cut = (y.get("prefix_stats") or {}).get("cut_short") or {}
        row["checkpoint_slots_full"] = cut.get("checkpoint_slots_full", 0)
        out.append(row)
    return out


def summary(all_runs: dict[str, dict[str, dict]], turns: int) -> dict[str, Any]:
    """Per workload, over the turns both modes ran: wall time and tok/s per mode, off / on, and
    (turns >= 2) the cached tokens over the best possible."""
    out: dict[str, Any] = {}
    for w, runs in all_runs.items():
        both = [r for r in compare_rows(runs, turns) if r["elapsed_s_off"] and r["elapsed_s_on"]]
        if not both:
            continue
        s: dict[str, Any] = {"turns": len(both)}
        for m in MODES:
            rows = {r["turn"]: r for r in runs[m]["rows"]}
            mine = [rows[r["turn"]] for r in both]
            el = sum(r["elapsed_s"] for r in mine)
            gen = sum(r["output_tokens"] for r in mine)
            s[m] = {"elapsed_s": el, "output_tok_s": gen / el,
                    "total_tok_s": (gen + sum(r["prompt_tokens"] for r in mine)) / el}
        s["off_over_on_elapsed"] = s["off"]["elapsed_s"] / s["on"]["elapsed_s"]
        later = [r for r in both if r["turn"] >= 2]
        best = sum(r["best_cached_tokens"] for r in later)
        if best:
            s["turns_2_on_hit_of_best"] = sum(r["cached_tokens"] for r in later) / best
        out[w] = s
    return out


# ---- the table -----------------------------------------------------------------------------------

def _pct(v: float | None) -> float | None:
    return None if v is None else 100 * v


def print_table(res: dict[str, Any]) -> None:
    """One line per turn: TTFT off / on, throughput off / on, hit rate (caching on) vs best."""
    f = TM._f
    print(f"\n{'turn':>4} {'prompt':>7} {'TTFT p50 off':>12} {'on':>8} {'on/off':>6} "
          f"{'p99 off':>9} {'on':>8} {'on/off':>6} {'tok/s off':>10} {'on':>9} {'on/off':>6} "
          f"{'out tok/s off':>13} {'on':>8} {'hit %':>6} {'best %':>6} {'of best':>7}")
    for name, rows in (("shared", res["turns"]), ("no-shared", res["no_shared"])):
        if rows:
            print(f"-- {name}")
        for r in rows or []:
            print(f"{r['turn']:4d} {f(r['prompt_len_mean'], '7.0f')} "
                  f"{f(r['ttft_ms_p50_off'], '12.1f')} {f(r['ttft_ms_p50_on'], '8.1f')} "
                  f"{f(r['ttft_ms_p50_on_over_off'], '6.2f')} {f(r['ttft_ms_p99_off'], '9.1f')} "
                  f"{f(r['ttft_ms_p99_on'], '8.1f')} {f(r['ttft_ms_p99_on_over_off'], '6.2f')} "
                  f"{f(r['total_tok_s_off'], '10.1f')} {f(r['total_tok_s_on'], '9.1f')} "
                  f"{f(r['total_tok_s_on_over_off'], '6.2f')} {f(r['output_tok_s_off'], '13.1f')} "
                  f"{f(r['output_tok_s_on'], '8.1f')} {f(_pct(r['hit_rate']), '6.1f')} "
                  f"{f(_pct(r['best_hit_rate']), '6.1f')} {f(_pct(r['hit_of_best']), '7.1f')}")
    print("(tok/s: prompt + output tokens per second of the call; hit %: cached / prompt tokens "
          "with caching on)")
    if res.get("through") == "server":
        print("(through the OpenAI server: TTFT is the client's, from the send to the first "
              "streamed chunk; hit % from usage.prompt_tokens_details.cached_tokens)")
    for w, s in res["summary"].items():
        line = (f"{w}: {s['turns']} turns, wall time off {s['off']['elapsed_s']:.2f} s, on "
                f"{s['on']['elapsed_s']:.2f} s (off / on {s['off_over_on_elapsed']:.2f})")
        if s.get("turns_2_on_hit_of_best") is not None:
            line += f"; turns >= 2 cached {100 * s['turns_2_on_hit_of_best']:.1f} % of the best"
        print(line)
    full = sum(r["checkpoint_slots_full"] for r in res["turns"])
    if full:
        print(f"shared: {full} checkpoint boundaries not kept (every checkpoint slot held): "
              f"--checkpoint-slots above max_num_seqs keeps them")
    for w, ag in res["agreement"].items():
        n = sum(t["identical"] for t in ag["turns"])
        c = sum(t["compared"] for t in ag["turns"])
        how = "batch-invariant: asserted" if res["batch_invariant"] else "not batch-invariant"
        print(f"{w}: greedy outputs on == off for {n} / {c} requests compared ({how})")
