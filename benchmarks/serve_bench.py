"""Online serving benchmark of the OpenAI-compatible DeepInfer server (like `vllm bench serve`).

It drives a running `python -m deepinfer_core.serve` over HTTP (`--base-url`), or starts one itself
(`--launch "SERVE ARGS"`: a subprocess on a free port, waited for on /health, stopped with SIGTERM at
the end; its log goes to `--server-log`), so one command measures end to end. With `--dummy-layers N`
the launched server gets a temporary config-only model directory of the real V4-Flash config cut to N
layers (throughput.py's `--layers N` model: CSA/HCA alternating, or at 43 layers V4-Flash's own schedule;
FP8 experts, or FP4 with `--expert-dtype fp4` as the checkpoints ship them; the V4 tokenizer) and
`--load-format dummy`: random weights of V4-Flash width, no checkpoint needed.

Every request is a streamed `/v1/completions` call (aiohttp, asyncio): a token-id prompt (random ids,
seeded, `--input-len` +- `--range-ratio`) or a `--dataset` line, `max_tokens` = its output length,
`ignore_eos`, temperature 0, `stream_options.include_usage`. Requests arrive on a seeded Poisson
schedule (`--request-rate`, default inf = all at once; `--burstiness` as vLLM's) and at most
`--max-concurrency` are in flight; `--concurrency 1,16,64` measures each value in turn
(num_prompts = `--num-prompts`, or C x `--prompts-per-concurrency`, else max(4 x C, 16)). Before
each measurement a warm-up sends min(C, num_prompts) other prompts of `--warmup-input-len` tokens (default
the same length) with `--warmup-output-len` tokens (new batch shapes compile or capture there, not in the
measured window).

Figures per measurement (serve_bench_metrics.py says how tokens and chunks are counted): completed
and failed requests (a failure is counted and its error kept), duration, request / output / total
token throughput, mean / p50 / p90 / p99 of TTFT, TPOT = (e2e - TTFT) / (tokens - 1), ITL (gaps
between content chunks) and e2e latency; the peak number in flight, the client's CPU use (near 100 %:
the client, not the server, is the limit) and the server's own counters over the window (/metrics
deltas, its mean TTFT / TPOT); output tok/s per GPU divides by the server's data-parallel ranks. Before
the first measurement /metrics gives what each engine (each rank) holds: weight and state-cache bytes
and its device. A table row per measurement is printed; the JSON (settings, server and its memory per
rank, this host's devices, commit, rows, and per row the fields to set beside `benchmarks/throughput.py`
at the same lengths and concurrency) goes to benchmarks/results/serve_bench_<label>.json, rewritten after every
measurement so a run cut short keeps what it measured (SIGTERM / Ctrl-C also stop a launched server).
Pieces: `serve_bench_http` (the launched server, the streaming client), `serve_bench_metrics`.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --input-len 1024 --output-len 256 \\
        --concurrency 1,16,64,256
    python benchmarks/serve_bench.py --launch "--model /tmp/tiny-v4 --max-model-len 512" \\
        --input-len 32 --output-len 32 --concurrency 1,4 --label tiny
    python benchmarks/serve_bench.py --dummy-layers 4 --launch "--max-model-len 4096 --max-num-seqs 256" \\
        --input-len 1024 --output-len 256 --concurrency 1,16,64,256
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, run as a script

import serve_bench_http as SH  # noqa: E402
import serve_bench_metrics as SM  # noqa: E402
from throughput_metrics import int_list  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    s = ap.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (ignored with --launch)")
    s.add_argument(
        "--launch",
        default=None,
        metavar="SERVE_ARGS",
        help="start `python -m deepinfer_core.serve "
        "SERVE_ARGS` (a free port unless --port is among them) and stop it at the end",
    )
    s.add_argument(
        "--dummy-layers",
        type=int,
        default=None,
        help="with --launch: serve a dummy-weight model of "
        "the V4-Flash config (or --dummy-config) cut to N layers, as throughput.py --layers N",
    )
    s.add_argument("--dummy-config", default=None, help="config.json (or its directory) for --dummy-layers")
    s.add_argument(
        "--expert-dtype",
        choices=("fp8", "fp4"),
        default=None,
        help="routed experts of the --dummy-layers model (default fp8, as throughput.py; fp4: as the V4 "
        "checkpoints ship them). An NVIDIA server keeps them FP4 only with --fp4-experts in --launch, else it "
        "re-encodes them to FP8 at load (twice the expert bytes); the run prints and records which",
    )
    s.add_argument("--launch-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    s.add_argument(
        "--server-log",
        default=None,
        help="the launched server's stdout+stderr (default: "
        "serve_bench_<label>.server.log in the temporary directory, out of the tree)",
    )
    s.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    s.add_argument("--model-name", default=None, help="the `model` field (default: the first of GET /v1/models)")
    w = ap.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random ids, seeded)")
    w.add_argument("--output-len", type=int, default=256, help="max_tokens with ignore_eos")
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len x [1-r, 1+r]")
    w.add_argument(
        "--dataset",
        default=None,
        help='JSON lines {"prompt": str | [ids], "output_len": int} instead of random prompts (cycled to num_prompts)',
    )
    w.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"random ids in [2, V) (default: the launched model's config.json, else {SM.V4_VOCAB})",
    )
    w.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per measurement (default: max(4 x concurrency, 16); 64 without a concurrency limit)",
    )
    w.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=None,
        help="requests per measurement = this x its concurrency (1: C prompts at once, the workload of "
        "throughput.py --sweep-batches C; k: k such rounds); replaces --num-prompts",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    w.add_argument("--warmup-output-len", type=int, default=4, help="tokens of each warm-up request (0: none)")
    w.add_argument(
        "--warmup-input-len",
        type=int,
        default=None,
        help="prompt tokens of each warm-up request (default --input-len; shorter ones warm the batch shapes "
        "without paying the long prefill of every concurrency twice); random prompts only",
    )
    w.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    r = ap.add_argument_group("arrivals")
    r.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at 0)")
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    r.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    r.add_argument("--concurrency", type=int_list, default=None, help="e.g. 1,16,64,256: one measurement each")
    o = ap.add_argument_group("output")
    o.add_argument("--label", default=None, help="the JSON's name (default: the dummy model's or the model's)")
    o.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_bench_<label>.json)")
    return ap


# ---- the run ---------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # no git: the JSON says null
        return ""


class Bench:
    def __init__(self, a: argparse.Namespace, argv: list[str] | None, srv: SH.Server):
        self.a, self.argv, self.srv, self.t0 = a, argv, srv, time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.models: Any = None
        self.memory: dict[str, Any] | None = None  # SM.server_memory before the first measurement
        self.num_gpus = 1  # the server's data-parallel ranks (one GPU each): output tok/s per GPU
        self.model = a.model_name
        self.path = Path(a.out) if a.out else RESULTS / f"serve_bench_{a.label}.json"

    def plan(self) -> list[tuple[int | None, int]]:
        """(concurrency, num_prompts) per measurement."""
        a = self.a
        concs: list[int | None] = a.concurrency or [a.max_concurrency]
        if a.prompts_per_concurrency:
            return [(c, a.prompts_per_concurrency * c) for c in concs]
        return [(c, a.num_prompts or (max(4 * c, 16) if c else 64)) for c in concs]

    def requests(
        self, k: int, n: int, out_len: int | None = None, salt: int = 0, in_len: int | None = None
    ) -> list[SM.BenchRequest]:
        """Measurement k's prompts (seed (seed, k, salt): warm-ups (salt 1) never repeat a measured prompt)."""
        a = self.a
        if a.dataset:
            reqs = SM.dataset_requests(a.dataset, n)
        else:
            seed = [a.seed, k, salt]
            reqs = SM.random_requests(n, in_len or a.input_len, a.output_len, a.range_ratio, a.vocab_size, seed)
        return [SM.BenchRequest(r.prompt, out_len, r.prompt_len) for r in reqs] if out_len else reqs

    async def measure_all(self) -> None:
        a = self.a
        headers = auth(a.api_key)
        async with SH.client_session(self.srv.url, headers, a.request_timeout) as cl:
            for k, (conc, n) in enumerate(self.plan()):
                row: dict[str, Any] = {
                    "concurrency": conc,
                    "request_rate": a.request_rate,
                    "num_prompts": n,
                    "input_len": a.input_len,
                    "output_len": a.output_len,
                }
                try:  # a server that died mid-run: the remaining rows say so, the run still ends cleanly
                    async with cl.get("/health") as health:
                        down = None if health.status == 200 else f"{health.status} {(await health.text())[:200]}"
                except SH.CLIENT_ERRORS as e:
                    down = f"{type(e).__name__}: {e}"
                if down is not None:
                    row["status"] = f"not run: /health: {down}"
                    self.add(row)
                    continue
                if a.warmup_output_len > 0:
                    wu = self.requests(k, min(conc or n, n), a.warmup_output_len, 1, a.warmup_input_len)
                    res, dur = await SH.run_requests(cl, self.model, wu, [0.0] * len(wu), conc)
                    row["warmup"] = {"requests": len(wu), "failed": sum(not x.ok for x in res), "duration_s": dur}
                reqs = self.requests(k, n)
                offsets = SM.arrival_offsets(n, a.request_rate, [a.seed, k], a.burstiness)
                before, cpu0 = await SH.scrape(cl), time.process_time()
                results, duration = await SH.run_requests(cl, self.model, reqs, offsets, conc)
                row["client_cpu_pct"] = 100.0 * (time.process_time() - cpu0) / duration
                after = await SH.scrape(cl)
                row.update(SM.summarize(results, duration))
                if row["output_throughput"] is not None:
                    row["output_throughput_per_gpu"] = row["output_throughput"] / self.num_gpus
                row["server_counters"] = SM.counter_delta(before, after) if before and after else None
                bad = [f"{row['failed']} failed"] * bool(row["failed"])
                bad += [f"{row['short_outputs']} short outputs"] * bool(row["short_outputs"])
                row["status"] = "; ".join(bad) or "ok"
                self.add(row)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        c = "inf" if row["concurrency"] is None else row["concurrency"]
        print(
            f"[serve_bench] concurrency {c}: {row['status']}; out tok/s {row.get('output_throughput') or 0:.1f}",
            flush=True,
        )
        self.write(complete=False)

    def comparison(self) -> list[dict[str, Any]]:
        """Per measured row, what to set beside benchmarks/throughput.py (offline LLM.generate): same
        lengths and concurrency (throughput.py --sweep-batches C runs C prompts at once), output tok/s."""
        a, out = self.a, []
        for r in self.rows:
            if r.get("output_throughput") is None:
                continue
            cmd = (
                f"python benchmarks/throughput.py --input-len {a.input_len} --output-len {a.output_len} "
                f"--sweep-batches {r['concurrency'] or r['num_prompts']}"
            )
            if a.dummy_layers:
                cmd += f" --layers {a.dummy_layers}" + (f" --config {a.dummy_config}" if a.dummy_config else "")
                cmd += f" --expert-dtype {a.expert_dtype}" if a.expert_dtype else ""
            elif self.srv.launched and SH.flag(self.srv.launched, "--model"):
                cmd += f" --model {SH.flag(self.srv.launched, '--model')}"
            if self.srv.launched:  # the launched server's compute dtype (the engine's default is float32)
                cmd += f" --dtype {SH.flag(self.srv.launched, '--dtype') or 'float32'}"
            out.append(
                {
                    "input_len": a.input_len,
                    "output_len": a.output_len,
                    "concurrency": r["concurrency"],
                    "num_prompts": r["num_prompts"],
                    "output_tok_s": r["output_throughput"],
                    # k x C equal requests at concurrency C, all at once, are k rounds of throughput.py's batch
                    "same_workload": bool(r["concurrency"])
                    and r["num_prompts"] % r["concurrency"] == 0
                    and a.request_rate == float("inf")
                    and not a.dataset
                    and a.range_ratio == 0
                    and r["failed"] == 0
                    and r["short_outputs"] == 0,
                    "throughput_command": cmd,
                }
            )
        return out

    def write(self, complete: bool) -> dict[str, Any]:
        a, srv = self.a, self.srv
        res = {
            "schema": "deepinfer-serve-bench/1",
            "complete": complete,
            "label": a.label,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": _git("rev-parse", "HEAD") or None,
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "command": [sys.executable, *sys.argv] if self.argv is None else ["benchmarks/serve_bench.py", *self.argv],
            "settings": {k: v for k, v in vars(a).items()},
            "server": {
                "url": srv.url,
                "model": self.model,
                "models": self.models,
                "launched": srv.launched,
                "startup_s": srv.startup_s,
                "log": str(srv.log_path) if srv.log_path else None,
                "exit_code": srv.exit_code,
                "dummy_model": None
                if srv.dummy is None
                else {"config_source": srv.dummy.source, "config": srv.dummy.config, "notes": srv.dummy.notes},
                "data_parallel_size": self.num_gpus,
                "memory": self.memory,
            },
            "device": SH.device_info(),
            "rows": self.rows,
            "workload_notes": SM.workload_notes(
                self.plan(), a.input_len, a.warmup_input_len, a.warmup_output_len, a.dataset
            ),
            "throughput_comparison": self.comparison(),
            "definitions": SM.DEFINITIONS,
            "elapsed_s": time.perf_counter() - self.t0,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        return res


def resolve(argv: list[str] | None) -> argparse.Namespace:
    a = parser().parse_args(argv)
    for flag in ("input_len", "output_len"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"serve_bench: --{flag.replace('_', '-')} must be >= 1")
    if a.concurrency and a.max_concurrency:
        raise SystemExit("serve_bench: --concurrency is a list of --max-concurrency values; give one of them")
    if a.prompts_per_concurrency is not None and (a.prompts_per_concurrency < 1 or a.num_prompts):
        raise SystemExit("serve_bench: --prompts-per-concurrency must be >= 1 and replaces --num-prompts")
    if a.prompts_per_concurrency and not (a.concurrency or a.max_concurrency):
        raise SystemExit("serve_bench: --prompts-per-concurrency needs --concurrency or --max-concurrency")
    if a.dummy_layers and not a.launch:
        raise SystemExit("serve_bench: --dummy-layers shapes the model of a launched server; add --launch")
    if a.dummy_layers and SH.flag(shlex.split(a.launch), "--model"):
        raise SystemExit("serve_bench: --dummy-layers gives the launched server its --model; drop one of them")
    if a.expert_dtype and not a.dummy_layers:
        raise SystemExit("serve_bench: --expert-dtype shapes the --dummy-layers model; add --dummy-layers")
    if a.warmup_input_len is not None and a.warmup_input_len < 1:
        raise SystemExit("serve_bench: --warmup-input-len must be >= 1")
    return a


def auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_models(url: str, api_key: str | None) -> dict[str, Any]:
    """GET /v1/models: the model name to send and what the server says of itself (a clean exit when the
    server is not there or refuses the key)."""
    headers = auth(api_key)
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=60)
    except httpx.HTTPError as e:
        raise SystemExit(f"serve_bench: no server at {url} ({type(e).__name__}: {e}); start one or use --launch")
    if r.status_code != 200 or not r.json().get("data"):
        raise SystemExit(f"serve_bench: GET {url}/v1/models answered {r.status_code}: {r.text[:300]}")
    return r.json()


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = resolve(argv)
    srv = SH.Server(url=a.base_url.rstrip("/"))
    # SIGTERM (a job's time limit) unwinds like Ctrl-C: the JSON is written and a launched server stopped
    on_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _interrupted) if on_main else None
    launch_model = SH.flag(shlex.split(a.launch), "--model") if a.launch else None
    try:
        cfg = None
        if a.dummy_layers:
            srv.dummy = SH.dummy_model(a.dummy_layers, a.dummy_config, a.expert_dtype)
            cfg = srv.dummy.config
            if a.expert_dtype == "fp4":
                srv.dummy.notes.append(SH.fp4_note(shlex.split(a.launch)))
                print(f"[serve_bench] {srv.dummy.notes[-1]}", flush=True)
        elif launch_model and (Path(launch_model) / "config.json").is_file():
            cfg = json.loads((Path(launch_model) / "config.json").read_text())
        a.vocab_size = a.vocab_size or int((cfg or {}).get("vocab_size", SM.V4_VOCAB))
        if a.launch:
            tag = a.label or (srv.dummy.label if srv.dummy is not None else Path(launch_model or "server").name)
            log = Path(a.server_log or Path(tempfile.gettempdir()) / f"serve_bench_{tag}.server.log")
            SH.launch(srv, shlex.split(a.launch), log, a.launch_timeout)
        models = served_models(srv.url, a.api_key)
        memory = SM.server_memory(SH.metrics_text(srv.url, auth(a.api_key)) or "")
        model = a.model_name or models["data"][0]["id"]
        name = srv.dummy.label if srv.dummy is not None else Path(model).name
        a.label = a.label or name.replace(" ", "_").replace("/", "_")
        bench = Bench(a, argv, srv)
        bench.models, bench.model, bench.memory = models, model, memory
        dp = SH.flag(srv.launched or [], "--data-parallel-size")
        bench.num_gpus = len(memory["ranks"]) or int(dp or 1)  # the ranks the server reports, else the flag
        for line in SM.memory_lines(memory["ranks"]):
            print(f"[serve_bench] {line}", flush=True)
        try:
            asyncio.run(bench.measure_all())
        finally:
            SH.stop(srv)
            result = bench.write(complete=len(bench.rows) == len(bench.plan()))
    finally:
        SH.stop(srv)
        if on_main:  # None: a handler not set from Python, i.e. the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    SM.print_table(bench.rows)
    print(f"[serve_bench] wrote {bench.path} ({result['elapsed_s']:.0f} s)")
    return {**result, "json_path": str(bench.path)}


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:  # the JSON holds every finished measurement; no traceback needed
        print(f"[serve_bench] interrupted ({e or 'Ctrl-C'}); measurements finished so far are in the JSON")
        sys.exit(130)
