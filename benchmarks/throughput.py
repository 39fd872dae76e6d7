"""Offline throughput of `LLM.generate` (like `vllm bench throughput`), with the forward-only step time
of the same batch beside it, so the engine's host overhead is a number.

What it runs, in one process (the model is built once; a V4-Flash-width model takes a while):
1. `LLM(model=DIR, load_format="dummy" | "auto", ...)`: a checkpoint (`--model`), or a temporary
   directory holding only a config.json (`--config`, default the real V4-Flash config, cut to `--layers`
   layers the way `benchmarks/sweep.py` cuts it: CSA/HCA alternating, FP8 experts; a DeepSeek-V4.1
   config by the shared V4.1 cut, `v41_cut.py`; or `--tiny`) with random weights of its shape. The
   construction time is reported as start-up.
2. The first request of the process, then one more like it (another prompt of the same length): cold
   and warm time to first token (a kernel compiled inside a user's first request shows as cold >> warm;
   `--fresh-kernel-cache` empties Triton's cache first, as on a fresh machine).
3. Per concurrency (`--num-prompts`, or each of `--sweep-batches`): a warm-up `generate` of the same
   batch with `--warmup-output-len` tokens (compiles the prefill shapes, captures the decode graph of
   that batch), then the measured `generate` of `num_prompts` seeded random prompts of `--input-len`
   ids, `SamplingParams(temperature=0, max_tokens=--output-len, ignore_eos=True)`.
4. The forward-only step of the same batch: `concurrency` sequences at context input_len +
   output_len/2 run through the LLM's own model (`llm.runner.model`) on a fresh state cache made by
   the sweep's `decode_states` (random pools, fabricated positions, the engine's cache layout), timed
   by the sweep's `Clock` (eager median) and, on CUDA unless `--enforce-eager`, `cuda_graph_timing`
   (median of graph replays); the forward step is min(eager, graph), as the sweep's `step_ms`. On the
   CPU the eager forwards are timed on the main thread and on a worker thread (where the async engine
   runs them; OpenMP makes the two differ on a busy host) and the faster counts. No sampler, no
   scheduler: what the device needs for the step, so the numbers compare with `sweep.py`.

Figures (`throughput_metrics`): requests/s, output and total tok/s over the measured call; TTFT, TPOT
and end-to-end percentiles from `RequestOutput.metrics`; the steady-state decode step (median gap
between a request's consecutive tokens while every request is decoding: see throughput_metrics) and
steady tok/s = concurrency / step; host overhead % = (steady step / forward step - 1) x 100, the
ratio steady step / forward step, and steady tok/s / forward-only tok/s (the fraction of what the
forward alone allows).

`--compare-async` measures every concurrency with async scheduling on and off, the two modes
interleaved per concurrency. The model is built once: the other mode runs on a second LLM over the
same runner (`LLM.from_runner(llm.runner, config=llm.config.replace(async_scheduling=...))`: same
weights, state cache and CUDA graphs, one engine each, used one at a time), or, on an LLM that reads
its `async_scheduling` attribute per call, by switching that attribute. Either is checked (after a
short call the engine must report the mode asked for); when neither works one LLM per mode is built
in turn, the first freed before the next. The JSON's `async_switch` says which happened.

Prints one table line per (concurrency, async mode) and writes the JSON (every setting, device,
versions, commit, start-up, all figures) to benchmarks/results/throughput_<device>_<label>.json,
rewritten after every measurement so a run cut short by a time limit keeps what it measured.
Pieces: `throughput_run` (model, LLM, generate calls, forward-only step), `throughput_metrics`.

    python benchmarks/throughput.py --model DIR --input-len 32 --output-len 96 --num-prompts 64
    python benchmarks/throughput.py --tiny --sweep-batches 1,16,64,256 --input-len 32 --output-len 96 \\
        --compare-async
    python benchmarks/throughput.py --layers 4 --input-len 1024 --output-len 256 --sweep-batches 1,64,256
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the sibling modules, run as a script

import throughput_metrics as TM  # noqa: E402
import throughput_run as TR  # noqa: E402
from v41_cut import DEFAULT_ENGRAM_ROWS, family  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def add_model_args(m, seed_help: str = "seeds the prompts, the LLM and the forward-only state") -> None:
    """The model options (benchmarks/prefix_cache.py takes the same)."""
    m.add_argument("--model", default=None, help="checkpoint directory (or HF cache repo id); weights loaded "
                   "unless --load-format dummy")
    m.add_argument("--config", default=None, help="config.json (or a directory holding one) of a random-weight "
                   "model; default: the real V4-Flash config in tests/data/deepseek-v4-flash")
    m.add_argument("--tiny", action="store_true", help="random weights of the tiny config "
                   "(deepinfer_core/tools/tiny_config.py: the bundled tiny model's shape)")
    m.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                   help="LLM(load_format=...): default auto with --model, dummy with --config/--tiny")
    m.add_argument("--layers", type=int, default=None,
                   help="main layers of a --config model (default 4, cut as sweep.py does: "
                        "CSA/HCA alternating; V4.1: benchmarks/v41_cut.py) or of --tiny (default "
                        "8, its own schedule)")
    m.add_argument("--expert-dtype", choices=("fp8", "fp4", "bf16"), default=None,
                   help="routed experts of a dummy model (default: fp8 for --config as in the "
                        "sweep, fp4 for a V4.1 --config, the tiny config's fp4 for --tiny)")
    m.add_argument("--engram-rows", type=int, default=DEFAULT_ENGRAM_ROWS,
                   help="V4.1 --config: Engram table rows per head and n-gram order at most "
                        "(0: the config's)")
    m.add_argument("--mtp", action="store_true", help="keep the config's MTP blocks in a dummy model (built, "
                   "never run without speculative decoding); default: dropped")
    m.add_argument("--device", default=None, help="torch device (default: the detected platform's)")
    m.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    m.add_argument("--no-qat", action="store_true", help="simulate_qat=False (default: the engine's True)")
    m.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "fp8"), default=None,
                   help="LLM(kv_cache_dtype=...) (default: the engine's)")
    m.add_argument("--seed", type=int, default=0, help=seed_help)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap.add_argument_group("model"))
    e = ap.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=None, help="LLM(max_num_seqs=...) (default: the "
                   "largest concurrency asked, so all prompts run at once)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="LLM(max_num_batched_tokens=...) "
                   "(default: the engine's)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="LLM(max_model_len=...) (default: the config's)")
    e.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="LLM(gpu_memory_utilization=...) (default: the engine's)")
    e.add_argument("--enforce-eager", action="store_true", help="LLM(enforce_eager=True): no CUDA graphs "
                   "(the forward-only step is then timed eager only)")
    e.add_argument("--async", dest="async_scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="LLM(async_scheduling=...) (default: DEEPINFER_ZERO_OVERHEAD_SCHEDULING)")
    e.add_argument("--compare-async", action="store_true", help="measure every concurrency with async "
                   "scheduling on and off (one model, two engines where the LLM allows: see the docstring)")
    w = ap.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=1024, help="prompt length in tokens (random ids, seeded)")
    w.add_argument("--output-len", type=int, default=256, help="generated tokens per prompt (ignore_eos)")
    w.add_argument("--num-prompts", type=int, default=64, help="prompts of the measured call")
    w.add_argument("--sweep-batches", type=TM.int_list, default=None,
                   help="e.g. 1,16,64,256: one measurement per concurrency (num_prompts = it) with one LLM "
                   "(max_num_seqs = the largest); replaces --num-prompts")
    w.add_argument("--warmup-output-len", type=int, default=8,
                   help="tokens of the warm-up generate before each measurement (same batch and prompt length)")
    w.add_argument("--no-detokenize", action="store_true", help="SamplingParams(detokenize=False) "
                   "(default: detokenize, as a user's request does)")
    f = ap.add_argument_group("forward-only step")
    f.add_argument("--no-forward", action="store_true", help="skip the forward-only step")
    f.add_argument("--forward-warmup", type=int, default=2, help="untimed forwards before timing")
    f.add_argument("--forward-reps", type=int, default=5, help="timed eager forwards (median; graph replays: "
                   "max(this, 10))")
    o = ap.add_argument_group("output")
    o.add_argument("--label", default=None, help="name of this run in the JSON file name (default: tiny, "
                   "<config dir>_<N>L or the checkpoint dir's name)")
    o.add_argument("--json", default=None, help="result path (default: benchmarks/results/"
                   "throughput_<device>_<label>.json)")
    o.add_argument("--profile", default=None, help="write a cProfile (.prof) of the generate call's host "
                   "thread (an extra run of each measured workload, so the timed run is unprofiled) and "
                   "print its top 25 by tottime")
    o.add_argument("--time-budget", type=float, default=0.0, help="seconds for the whole run: measurements "
                   "not started by then are recorded as not run (0: no limit; the JSON is rewritten after "
                   "every measurement either way)")
    o.add_argument("--fresh-kernel-cache", action="store_true", help="point TRITON_CACHE_DIR at a new empty "
                   "directory first (cold start as on a fresh machine; removed at the end)")
    return ap


# ---- bookkeeping --------------------------------------------------------------------------------------

def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        return done.stdout.strip()
    except Exception:
        return ""


def versions() -> dict[str, Any]:
    from importlib import metadata
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for dist in ("triton", "deepinfer-core", "deepinfer-kernels"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def host_load() -> list[float] | None:
    """1/5/15-minute load averages: a busy host invalidates CPU timings."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def device_name(device: Any) -> str:
    d = torch.device(device)
    return torch.cuda.get_device_name(d) if d.type == "cuda" else f"CPU {platform.machine()}"


def engine_info(llm: Any) -> dict[str, Any]:
    """What the runner chose (best effort: read by name, absent fields left out)."""
    runner = llm.runner
    name = lambda o: f"{type(o).__module__}.{type(o).__qualname__}"  # noqa: E731
    info: dict[str, Any] = {"device": str(getattr(runner, "device", None)),
                            "dtype": str(getattr(runner, "dtype", None))}
    loaded = getattr(runner, "loaded", None)
    ops = getattr(loaded, "ops", None)
    if ops is not None:
        info["ops"] = {"attention": name(ops.attention), "moe": name(ops.moe), "mhc": name(ops.mhc),
                       "linear": {f: name(m) for f, m in ops.linear.items()}}
    if getattr(loaded, "load_seconds", None) is not None:
        info["load_seconds"] = loaded.load_seconds
    graphs = getattr(runner, "graphs", None)
    info["cuda_graphs"] = None if graphs is None else {"failed": getattr(graphs, "failed", None)}
    info["cache_note"] = getattr(runner, "cache_note", None)
    info["max_num_seqs"] = getattr(llm, "max_num_seqs", None)
    info["max_num_batched_tokens"] = getattr(llm, "max_num_batched_tokens", None)
    info["max_model_len"] = getattr(llm, "max_model_len", None)
    info["tokenizer"] = getattr(llm, "tokenizer", None) is not None
    config = getattr(llm, "config", None)
    if hasattr(config, "as_options"):                # the resolved EngineConfig, flat
        info["engine_config"] = config.as_options()
    return info


# ---- main -------------------------------------------------------------------------------------------

def resolve(argv: list[str] | None) -> argparse.Namespace:
    """Parse and fill the defaults that depend on the device and the workload."""
    a = parser().parse_args(argv)
    for flag in ("input_len", "output_len", "num_prompts", "warmup_output_len"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"throughput: --{flag.replace('_', '-')} must be >= 1")
    a.triton_cache_dir = None
    if a.fresh_kernel_cache:                 # before anything imports Triton or compiles a kernel
        a.triton_cache_dir = tempfile.mkdtemp(prefix="deepinfer-triton-cache-")
        os.environ["TRITON_CACHE_DIR"] = a.triton_cache_dir
    if a.device is None:
        from deepinfer_core.plugins import get_plugin_manager
        a.device = get_plugin_manager().detect_platform().device_type
    a.dtype = a.dtype or ("bfloat16" if torch.device(a.device).type == "cuda" else "float32")
    a.batches = a.sweep_batches or [a.num_prompts]
    a.max_num_seqs = a.max_num_seqs or max(a.batches)
    a.modes = [True, False] if a.compare_async else [a.async_scheduling]
    return a


class Run:
    """One process's measurements: the LLM (built once, or once per async mode when switching it does
    not take effect), the forward-only step per concurrency, the rows, and the JSON, rewritten after
    every row so a run stopped by a time limit keeps what it measured."""

    def __init__(self, a: argparse.Namespace, argv: list[str] | None):
        self.a, self.argv, self.t0 = a, argv, time.perf_counter()
        self.load_start = host_load()
        self.spec = TR.prepare_model(a)
        self.label = a.label or self.spec.label
        self.dev_name = device_name(a.device)
        default = RESULTS / f"throughput_{self.dev_name.replace(' ', '_')}_{self.label}.json"
        self.path = Path(a.json) if a.json else default
        self.llm: Any = None
        self.switcher: TR.AsyncSwitch | None = None
        self.rows: list[dict] = []
        self.forwards: dict[int, dict] = {}
        self.builds: list[dict] = []
        self.info: dict = {}
        self.first: dict = {}
        self.switch = "not needed (one mode)"
        self.context = a.input_len + a.output_len // 2

    def build(self, mode: bool | None) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
            TR.free(self.a.device)
        self.llm, startup = TR.build_llm(self.a, self.spec, mode)
        self.builds.append({"async_scheduling": mode, "startup_s": startup})
        print(f"[throughput] LLM built in {startup:.1f} s (async {mode})", flush=True)

    def over_budget(self) -> bool:
        return bool(self.a.time_budget) and time.perf_counter() - self.t0 > self.a.time_budget

    def row(self, batch: int, mode: bool | None) -> None:
        """Forward-only step of the batch (once per concurrency), then the engine measurement."""
        a = self.a
        llm = self.switcher.get(mode) if self.switcher is not None else self.llm
        conc = min(batch, a.max_num_seqs)
        if self.over_budget():
            self.rows.append({"concurrency": conc, "num_prompts": batch, "async_scheduling": mode,
                              "status": f"not run: --time-budget {a.time_budget:.0f} s spent"})
            return
        if batch not in self.forwards:
            self.forwards[batch] = ({"status": "not run: --no-forward"} if a.no_forward
                                    else TR.forward_only(self.llm, conc, self.context, a))
        many = len(a.batches) * len(a.modes) > 1
        r = TR.measure(llm, a, batch, conc, mode, self.forwards[batch],
                       TR.profile_path_for(a, conc, mode, many))
        self.rows.append(r)
        s, f = r.get("steady") or {}, self.forwards[batch]
        print(f"[throughput] concurrency {conc}, async {mode}: {r['status']}; steady step "
              f"{s.get('step_ms', float('nan')):.3f} ms, forward-only {f.get('step_ms', float('nan')):.3f} ms",
              flush=True)
        self.write(complete=False)

    def measure_all(self) -> None:
        a = self.a
        self.build(a.modes[0])
        self.info = engine_info(self.llm)
        try:
            self.first = TR.first_request(self.llm, a, a.device)
            print(f"[throughput] first request TTFT cold {self.first['ttft_cold_ms']:.1f} ms, warm "
                  f"{self.first['ttft_warm_ms']:.1f} ms", flush=True)
        except Exception as e:                       # the throughput rows may still work
            self.first = {"status": TR.failure_status(e)}
        damaged = False
        if len(a.modes) > 1:
            self.switcher = TR.AsyncSwitch(self.llm, a)
            if self.switcher.method is None:
                self.switch = "one LLM per mode (" + "; ".join(self.switcher.errors or ["mode unchanged"]) + ")"
                damaged, self.switcher = self.switcher.base_damaged, None
            else:
                self.switch = self.switcher.method
        if len(a.modes) == 1 or self.switcher is not None:
            for b in a.batches:                         # modes interleaved: drift hits both alike
                for mode in a.modes:
                    self.row(b, mode)
            return
        for i, mode in enumerate(a.modes):
            if i or damaged:
                self.build(mode)
            for b in a.batches:
                self.row(b, mode)

    def close(self) -> None:
        if self.switcher is not None:
            self.switcher.close()
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        if self.spec.tmp_dir is not None:
            shutil.rmtree(self.spec.tmp_dir, ignore_errors=True)

    def result(self, complete: bool) -> dict[str, Any]:
        a, spec = self.a, self.spec
        settings = {k: v for k, v in vars(a).items()}
        out = {
            "schema": "deepinfer-throughput/1", "complete": complete,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": str(a.device), "device_name": self.dev_name, "commit": _git("rev-parse", "HEAD") or None,
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")), "versions": versions(),
            "command": ([sys.executable, *sys.argv] if self.argv is None
                        else ["benchmarks/throughput.py", *self.argv]),
            "settings": settings, "label": self.label,
            "model": {"path": None if spec.tmp_dir else spec.path, "load_format": spec.load_format,
                      "config_source": spec.source, "config": spec.config, "notes": spec.notes,
                      "family": family(spec.config) if spec.config else None,
                      **({"v41_cut": spec.cut} if spec.cut else {})},
            "engine": self.info, "startup_s": self.builds[0]["startup_s"] if self.builds else None,
            "builds": self.builds, "async_switch": self.switch, "first_request": self.first,
            "forward_context": self.context, "rows": self.rows,
            "async_on_over_off": {str(k): v for k, v in TM.async_ratios(self.rows).items()},
            "definitions": DEFINITIONS, "elapsed_s": time.perf_counter() - self.t0,
            "host": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "loadavg_start": self.load_start, "loadavg_now": host_load(),
                     "note": "CPU timings need an idle host: with the cores oversubscribed, OpenMP barriers "
                             "make main-thread forwards many times slower (loadavg)"},
        }
        if torch.device(a.device).type == "cuda":
            out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(torch.device(a.device)) / 2**30
        return out

    def write(self, complete: bool) -> dict[str, Any]:
        res = self.result(complete)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        return res


DEFINITIONS = {
    "steady.step_ms": "median gap between a request's consecutive tokens over the gaps during which every "
                      "request was decoding (first token at or before the gap, last token at or after it); "
                      "else at the peak number decoding (throughput_metrics)",
    "steady.tok_s": "requests decoding in that window / steady step",
    "forward.step_ms": "decode step of `concurrency` sequences at forward_context on the LLM's model with the "
                       "sweep's machinery: min(eager median, CUDA graph replay median); on the CPU the eager "
                       "median is the faster of the main thread's and a worker thread's",
    "vs_forward.host_overhead_pct": "(steady step / forward step - 1) x 100",
    "vs_forward.engine_over_forward": "steady step / forward step",
    "vs_forward.engine_vs_forward_tok_s": "steady tok/s / (concurrency / forward step): the fraction of what "
                                          "the forward alone allows",
    "tpot_ms": "per request (last - first token time) / (n - 1)", "ttft_ms": "first token - arrival",
    "first_request": "the process's first request and a second like it: TTFT cold vs warm",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = resolve(argv)
    try:
        run = Run(a, argv)
        print(f"[throughput] {run.dev_name}: {run.spec.source} ({run.spec.load_format}), {a.dtype}, "
              f"input {a.input_len} output {a.output_len}, concurrency {a.batches}, "
              f"max_num_seqs {a.max_num_seqs}, async {a.modes}", flush=True)
        try:
            run.measure_all()
        finally:
            run.close()
    finally:
        if a.triton_cache_dir is not None:
            shutil.rmtree(a.triton_cache_dir, ignore_errors=True)
    TM.print_table(run.rows)
    result = run.write(complete=True)
    print(f"[throughput] wrote {run.path} ({result['elapsed_s']:.0f} s)")
    result["json_path"] = str(run.path)
    return result


if __name__ == "__main__":
    main()
