"""The figures of `benchmarks/throughput.py`, from the `RequestOutput`s of one `LLM.generate` call and
the forward-only step time; plus the printed table. Pure host arithmetic (no torch), so it is testable
on synthetic timestamps.

Every time comes from `RequestOutput.metrics` (`api/outputs.py` RequestMetrics, `time.time()` stamps):
arrival, first token, finish, and one stamp per generated token (`token_times`).

Steady-state decode step (the number the engine is judged by): a request's consecutive tokens t_i,
t_{i+1} form a gap; the gap is *steady* when every request of the call was decoding throughout it,
i.e. each request s has its first token at or before t_i (prefilled: no prompt chunk shares the step)
and its last token at or after t_{i+1} (still in the batch: the step is not a shrinking tail). With
num_prompts <= max_num_seqs that is the window [last request's first token, first request's last
token], the middle of the run, where the batch is exactly num_prompts sequences and nothing else runs.
When that window holds no gap at all (num_prompts > max_num_seqs: requests run in waves, so the first
finishes before the last starts) the steady gaps are those during which the number of decoding
requests is at its peak. The steady step is the median of the steady gaps (robust to the odd slow
step: a Python GC pause, an allocator call); `concurrency` is how many requests decoded during those
gaps, and the steady decode throughput is concurrency / step. The engine stamps every token of a
step with one time, so the test is exact at the window's edges; a stamp taken per sequence would only
drop a few edge gaps, never admit a gap from a mixed step.
"""
from __future__ import annotations

import argparse
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
GAP_CHUNK = 8192          # gaps tested at once against every request (bounds the [gaps, requests] mask)


def percentiles(values: Iterable[float], scale: float = 1e3) -> dict[str, float] | None:
    """{"mean", "p50", "p90", "p99"} of `values` x `scale` (seconds -> ms by default); None when empty."""
    v = np.asarray(list(values), dtype=np.float64) * scale
    if v.size == 0:
        return None
    out = {"mean": float(v.mean())}
    out.update({f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES})
    return out


def _num_tokens(o: Any) -> int:
    return sum(len(c.token_ids) for c in o.outputs)


def request_metrics(outputs: Sequence[Any], elapsed_s: float) -> dict[str, Any]:
    """vLLM bench throughput's figures (requests/s, output and total tok/s over the whole call) and the
    latency percentiles (ms): TTFT = first token - arrival, TPOT per request = (last - first token
    time) / (n - 1) (requests with n >= 2), e2e = finish - arrival, queue = first scheduled - arrival."""
    prompt_toks = sum(len(o.prompt_token_ids) for o in outputs)
    out_toks = sum(_num_tokens(o) for o in outputs)
    ms = [o.metrics for o in outputs]
    ttft = [m.first_token_time - m.arrival_time for m in ms if m.first_token_time is not None]
    tpot = [(m.token_times[-1] - m.token_times[0]) / (len(m.token_times) - 1)
            for m in ms if len(m.token_times) > 1]
    e2e = [m.finished_time - m.arrival_time for m in ms if m.finished_time is not None]
    queue = [m.first_scheduled_time - m.arrival_time for m in ms if m.first_scheduled_time is not None]
    return {"num_requests": len(outputs), "prompt_tokens": prompt_toks, "output_tokens": out_toks,
            "elapsed_s": elapsed_s, "requests_per_s": len(outputs) / elapsed_s,
            "output_tok_s": out_toks / elapsed_s, "total_tok_s": (prompt_toks + out_toks) / elapsed_s,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "e2e_ms": percentiles(e2e),
            "queue_ms": percentiles(queue)}


def steady_state(token_times: Sequence[Sequence[float]]) -> dict[str, Any] | None:
    """The steady-state decode step (module docstring) from each request's token stamps (seconds);
    None when no request has two tokens."""
    times = [np.asarray(t, dtype=np.float64) for t in token_times if len(t) > 0]
    if not times or all(t.size < 2 for t in times):
        return None
    first = np.array([t[0] for t in times])
    last = np.array([t[-1] for t in times])
    a = np.concatenate([t[:-1] for t in times])
    b = np.concatenate([t[1:] for t in times])
    # decoding[g] = requests whose decode phase covers gap g (checked in chunks: gaps x requests)
    decoding = np.empty(a.size, dtype=np.int64)
    for i in range(0, a.size, GAP_CHUNK):
        sa, sb = a[i:i + GAP_CHUNK, None], b[i:i + GAP_CHUNK, None]
        decoding[i:i + GAP_CHUNK] = ((first[None, :] <= sa) & (last[None, :] >= sb)).sum(axis=1)
    everyone = decoding == len(times)
    basis = "all requests decoding"
    if not everyone.any():
        everyone = decoding == decoding.max()
        basis = "peak number of requests decoding (no window where all were)"
    gaps = b[everyone] - a[everyone]
    step = float(np.median(gaps))
    conc = int(decoding[everyone][0])
    start, end = float(a[everyone].min()), float(b[everyone].max())
    return {"step_ms": step * 1e3, "mean_gap_ms": float(gaps.mean()) * 1e3,
            "p90_gap_ms": float(np.percentile(gaps, 90)) * 1e3, "concurrency": conc,
            "tok_s": conc / step if step > 0 else None, "num_gaps": int(gaps.size),
            "window_s": end - start, "basis": basis}


def compare(engine_step_ms: float | None, concurrency: int, forward_step_ms: float | None,
            steady_concurrency: int | None = None) -> dict[str, Any]:
    """Engine step against the forward-only step of the same batch: ratio, host overhead % and the
    fraction of the forward-only throughput the engine delivers (steady tok/s / forward tok/s)."""
    if not engine_step_ms or not forward_step_ms:
        return {"engine_over_forward": None, "host_overhead_pct": None, "forward_tok_s": None,
                "engine_vs_forward_tok_s": None}
    ratio = engine_step_ms / forward_step_ms
    fwd_tok_s = concurrency / (forward_step_ms / 1e3)
    eng_tok_s = (steady_concurrency or concurrency) / (engine_step_ms / 1e3)
    return {"engine_over_forward": ratio, "host_overhead_pct": (ratio - 1.0) * 100.0,
            "forward_tok_s": fwd_tok_s, "engine_vs_forward_tok_s": eng_tok_s / fwd_tok_s}


def async_ratios(rows: list[dict]) -> dict[int, float]:
    """{concurrency: steady step with async on / with async off} where both were measured."""
    by = {(r["concurrency"], r["async_scheduling"]): r for r in rows if r.get("status") == "ok"}
    out = {}
    for (c, mode), r in by.items():
        other = by.get((c, False))
        if mode is True and other and r["steady"] and other["steady"]:
            out[c] = r["steady"]["step_ms"] / other["steady"]["step_ms"]
    return out


# ---- the table -------------------------------------------------------------------------------------

def _f(v: Any, fmt: str) -> str:
    width = int(fmt.split(".")[0]) if fmt[0].isdigit() else 8
    return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "-".rjust(width)


def _p(d: dict | None, key: str) -> float | None:
    return d.get(key) if d else None


def print_table(rows: list[dict]) -> None:
    """One line per (concurrency, async mode): throughput, latencies, the steady engine step beside the
    forward-only step of the same batch, and the host overhead."""
    print(f"\n{'conc':>5} {'async':>5} {'req/s':>8} {'out tok/s':>10} {'tot tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'step ms':>8} {'steady tok/s':>12} "
          f"{'fwd ms':>8} {'step/fwd':>8} {'host %':>7} {'%fwd tok/s':>10}  status")
    for r in rows:
        s, f, c = r.get("steady") or {}, r.get("forward") or {}, r.get("vs_forward") or {}
        frac = c.get("engine_vs_forward_tok_s")
        asked = r.get("async_scheduling")          # None: the env default; show what the engine ran
        mode = {True: "on", False: "off", None: "?"}[asked if asked is not None else r.get("async_effective")]
        print(f"{r['concurrency']:5d} {mode:>5} {_f(r.get('requests_per_s'), '8.2f')} "
              f"{_f(r.get('output_tok_s'), '10.1f')} {_f(r.get('total_tok_s'), '10.1f')} "
              f"{_f(_p(r.get('ttft_ms'), 'p50'), '9.2f')} {_f(_p(r.get('ttft_ms'), 'p99'), '9.2f')} "
              f"{_f(_p(r.get('tpot_ms'), 'p50'), '9.3f')} {_f(_p(r.get('tpot_ms'), 'p99'), '9.3f')} "
              f"{_f(s.get('step_ms'), '8.3f')} {_f(s.get('tok_s'), '12.1f')} {_f(f.get('step_ms'), '8.3f')} "
              f"{_f(c.get('engine_over_forward'), '8.2f')} {_f(c.get('host_overhead_pct'), '7.1f')} "
              f"{_f(None if frac is None else 100 * frac, '10.1f')}  {r.get('status', '?')}")
    ratios = async_ratios(rows)
    if ratios:
        pairs = ", ".join(f"conc {c}: {v:.3f}" for c, v in sorted(ratios.items()))
        print(f"async on / off steady step: {pairs}")


def int_list(text: str) -> list[int]:
    """'1,16,64' -> [1, 16, 64] (each >= 1)."""
    out = [int(p) for p in text.split(",") if p.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of ints >= 1")
    return out
