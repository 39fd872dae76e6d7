"""How long a rank's report waits between a host-bound producer and the front end, through a
`multiprocessing.Queue` (a feeder thread pickles and writes it, and needs the GIL) or a pipe written in
the producer's own thread (`deepinfer_core/parallel/reports.py`). The producer holds the GIL between
reports as a host-bound engine loop does (a busy Python loop of --step-ms), then sends a payload shaped
like a step's 256 streamed outputs.

    python benchmarks/report_channel.py [--steps 600 --step-ms 3.5]

Prints a table and writes benchmarks/results/report_channel.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _busy(ms: float) -> None:
    end, x = time.perf_counter() + ms / 1e3, 0
    while time.perf_counter() < end:
        x += 1


def _producer(kind: str, chan, steps: int, step_ms: float) -> None:
    payload = [("x" * 40, list(range(8)), {"a": 1.0, "b": [1.0] * 8}) for _ in range(256)]
    send = chan.put if kind == "queue" else chan.send
    for _ in range(steps):
        _busy(step_ms)
        send((time.time(), payload))
    send(None)
    if kind == "queue":
        chan.close()
        chan.join_thread()


def measure(kind: str, steps: int, step_ms: float) -> dict:
    ctx = mp.get_context("spawn")
    if kind == "queue":
        q = ctx.Queue()
        receive, chan = q.get, q
    else:
        reader, chan = ctx.Pipe(duplex=False)
        receive = reader.recv
    proc = ctx.Process(target=_producer, args=(kind, chan, steps, step_ms))
    proc.start()
    waits = []
    while (msg := receive()) is not None:
        waits.append(time.time() - msg[0])
    proc.join()
    waits.sort()
    pick = lambda q: waits[min(len(waits) - 1, int(q * len(waits)))] * 1e3   # noqa: E731
    return {"channel": kind, "reports": len(waits), "p50_ms": pick(0.5), "p99_ms": pick(0.99),
            "max_ms": waits[-1] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--step-ms", type=float, default=3.5)
    a = ap.parse_args()
    rows = [measure(kind, a.steps, a.step_ms) for kind in ("queue", "pipe")]
    print(f"{'channel':>8} {'reports':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for r in rows:
        print(f"{r['channel']:>8} {r['reports']:>8} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "report_channel.json"
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
