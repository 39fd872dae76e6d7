"""Where the server loses throughput against `LLM.generate`, without HTTP: the same requests (random
token ids, greedy, ignore_eos) through the online engine in four ways, output tokens per second each:

  offline   engine.step() loop in this thread, stream=False (what LLM.generate does)
  stream    the same loop, stream=True (per-step deltas, incremental detokenisation)
  thread    the server's EngineLoop thread (engine_loop.py) + asyncio consumers in this thread that
            build each SSE chunk as /v1/completions does (dicts + json.dumps), no sockets
  thread+p  `thread` with cProfile on the engine thread (its top functions printed)
  process   `thread` over `LLM(engine_process=True)`: the engine in a child process (--engine-process)

--rounds K: each of the C consumers sends K requests one after another (the next as soon as its previous
one finished), as serve_bench.py --prompts-per-concurrency K does over HTTP; the thread modes report the
time to each request's first output (p50 / p99).

    python benchmarks/serve_gap.py --layers 4 --input-len 512 --output-len 128 --concurrency 1,64,256
    python benchmarks/serve_gap.py --tiny --input-len 32 --output-len 8 --concurrency 1,4     # CPU smoke
    python benchmarks/serve_gap.py --layers 4 --concurrency 16,64,256 --rounds 2 --engine-process  # waves

On CUDA the table also counts the Triton kernels compiled during each mode's run (after the warm-ups;
`deepinfer_kernels.compile_watch`): a compile in the middle of serving stalls every request for
seconds, and the JSON names each one with the arguments that made it a new variant.

Prints a table and writes benchmarks/results/serve_gap_<device>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import time
from pathlib import Path
from types import SimpleNamespace

import throughput_run as TR

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.serve.engine_loop import EngineLoop

RESULTS = Path(__file__).resolve().parent / "results"


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def run_loop(llm: LLM, ids: list[list[int]], out_len: int, stream: bool, tag: str) -> float:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(ids):
        eng.add_request(f"{tag}-{i}", p, params, stream=stream)
    t0, tokens = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        tokens += sum(len(c.token_ids) for out in eng.step() for c in out.outputs)
    dt = time.perf_counter() - t0
    _check(tokens, len(ids) * out_len, tag)
    return dt


def _check(tokens: int, want: int, tag: str) -> None:
    if tokens != want:             # a mode that lost or doubled tokens would measure something else
        raise SystemExit(f"serve_gap: {tag} produced {tokens} output tokens, expected {want}")


async def _consume(loop: EngineLoop, rid: str, ids: list[int], params: SamplingParams,
                   ttfts: list[float]) -> int:
    head = {"id": rid, "object": "text_completion", "created": 0, "model": "m"}
    n, t0 = 0, time.perf_counter()
    async for out in loop.generate(rid, ids, params):
        if n == 0:
            ttfts.append(time.perf_counter() - t0)
        for c in out.outputs:
            n += len(c.token_ids)
            choice = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
            json.dumps({**head, "choices": [choice]})
    return n


class ProfiledLoop(EngineLoop):
    """The server's engine loop with cProfile on its thread (cProfile profiles the thread it runs in)."""

    def __init__(self, engine) -> None:
        self.profile = cProfile.Profile()
        super().__init__(engine)

    def _run(self) -> None:
        self.profile.enable()
        try:
            super()._run()
        finally:
            self.profile.disable()


def run_thread(engine, rounds: list[list[list[int]]], out_len: int, tag: str,
               profile: bool) -> tuple[float, list[float], str]:
    """`rounds[k][i]`: the k-th request of consumer i; a consumer sends its next one when the last finished."""
    loop = ProfiledLoop(engine) if profile else EngineLoop(engine)
    loop.start()
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    ttfts: list[float] = []

    async def consumer(i: int) -> int:
        return sum([await _consume(loop, f"{tag}-{k}-{i}", r[i], params, ttfts) for k, r in enumerate(rounds)])

    async def main() -> tuple[float, int]:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(consumer(i) for i in range(len(rounds[0]))))
        return time.perf_counter() - t0, sum(counts)
    dt, tokens = asyncio.run(main())
    _check(tokens, len(rounds) * len(rounds[0]) * out_len, tag)
    loop.stop(timeout=30)
    top = ""
    if profile:
        s = io.StringIO()
        pstats.Stats(loop.profile, stream=s).sort_stats("tottime").print_stats(12)
        top = s.getvalue()
    return dt, ttfts, top


def _ms(values: list[float], q: float) -> float:
    v = sorted(values)
    return 1e3 * v[min(len(v) - 1, int(q * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--rounds", type=int, default=1, help="requests each consumer sends one after another")
    ap.add_argument("--engine-process", action="store_true",
                    help="also run the `process` mode (a second LLM with engine_process=True)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_gap_<device>.json)")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, float32 on CPU, "
                    "as throughput.py; the engine's own default is float32)")
    a = ap.parse_args()
    import torch
    a.dtype = a.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    watch = None
    if torch.cuda.is_available():
        from deepinfer_kernels.compile_watch import compile_watch
        watch = compile_watch()       # this process's compiles (an engine process's own are not seen)
    concs = [int(c) for c in a.concurrency.split(",")]
    spec = TR.prepare_model(SimpleNamespace(model=None, load_format=None, tiny=a.tiny, config=None, layers=a.layers,
                                            expert_dtype=None, mtp=False))
    llm = LLM(model=spec.path, load_format="dummy", dtype=a.dtype, max_model_len=a.max_model_len,
              max_num_seqs=max(concs))
    vocab = int(spec.config["vocab_size"])
    proc = (LLM(model=spec.path, load_format="dummy", dtype=a.dtype, max_model_len=a.max_model_len,
                max_num_seqs=max(concs), engine_process=True) if a.engine_process else None)
    modes = ("offline", "stream", "thread", "thread+p") + (("process",) if proc is not None else ())
    rows = []
    print(f"{'conc':>5} {'mode':>9} {'s':>8} {'out tok/s':>10} {'vs offline':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'compiles':>8}")
    for c in concs:
        run_loop(llm, prompts(c, a.input_len, vocab, 99), 4, False, f"warm{c}")      # shapes, graphs
        if proc is not None:
            run_thread(proc.serving_engine(), [prompts(c, a.input_len, vocab, 98)], a.output_len, f"pwarm{c}", False)
        row = {"concurrency": c, "rounds": a.rounds}
        for mode in modes:
            rounds = [prompts(c, a.input_len, vocab, c * 1000 + k) for k in range(a.rounds)]
            ttfts: list[float] = []
            mark = watch.mark() if watch is not None else 0
            if mode in ("offline", "stream"):
                dt = sum(run_loop(llm, ids, a.output_len, mode == "stream", f"{mode}{c}-{k}")
                         for k, ids in enumerate(rounds))
            else:
                engine = proc.serving_engine() if mode == "process" else llm.engine
                dt, ttfts, top = run_thread(engine, rounds, a.output_len, f"{mode}{c}", mode == "thread+p")
                if top:
                    row["engine_thread_profile"] = top
            tok_s = c * a.rounds * a.output_len / dt
            row[mode] = {"seconds": dt, "output_tok_s": tok_s}
            late = watch.since(mark) if watch is not None else []
            row[mode]["compiles"] = [str(e) for e in late] if mode != "process" else None
            if ttfts:
                row[mode].update(ttft_p50_ms=_ms(ttfts, 0.5), ttft_p99_ms=_ms(ttfts, 0.99))
            ratio = tok_s / row["offline"]["output_tok_s"]
            t50 = f"{row[mode]['ttft_p50_ms']:9.1f} {row[mode]['ttft_p99_ms']:9.1f}" if ttfts else f"{'-':>9} {'-':>9}"
            n_late = "-" if watch is None or mode == "process" else str(len(late))
            print(f"{c:>5} {mode:>9} {dt:8.3f} {tok_s:10.1f} {ratio:10.3f} {t50} {n_late:>8}", flush=True)
        print(row.get("engine_thread_profile", "")[:3000])
        rows.append(row)
    if proc is not None:
        proc.close()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    path = Path(a.out) if a.out else RESULTS / f"serve_gap_{dev.replace(' ', '_')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": dev, "args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
