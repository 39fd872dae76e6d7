"""The measuring pieces of `benchmarks/throughput.py`: the model it loads (a checkpoint, or a config.json
written to a temporary directory for `LLM(load_format="dummy")`), the timed `generate` calls, the
async-scheduling switch, the cProfile run, and the forward-only step on the LLM's own model with the
sweep's machinery (`sweep_model.decode_states`, `sweep_timing.Clock` / `cuda_graph_timing`).

Only the `LLM`'s public surface is relied on (`generate`, `RequestOutput.metrics`, `vocab_size`,
`runner.model` / `runner.device` / `runner.cache_layout()`); whatever else is read (the engine's async
mode and step count, the runner's graphs) is read by name and reported as None when absent, so the
benchmark keeps working while the engine under it changes.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import throughput_metrics as TM
from sweep_model import (bench_config, cache_layout, decode_states, default_expert_dtype,
                         full_config, load_base_config, random_ids)
from sweep_timing import Clock, cuda_graph_timing
from v41_cut import DEFAULT_ENGRAM_ROWS, cut_notes, family, text_keys

FORWARD_MAX_SECONDS = 30.0        # a slow forward shape stops repeating after this (the sweep's rule)


def failure_status(e: BaseException) -> str:
    """A row's status for a failure (the traceback goes to stderr)."""
    traceback.print_exc(file=sys.stderr)
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return f"failed: {type(e).__name__}: {first}"


def sync(device: Any) -> None:
    """Wait for the device: every wall-clock interval here starts and ends with it idle."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


def free(device: Any) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---- the model --------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    path: str                       # what LLM(model=...) gets
    load_format: str
    source: str                     # where the config came from
    config: dict | None
    label: str
    tmp_dir: Path | None = None     # the written config dir (removed at the end)
    notes: list[str] = field(default_factory=list)
    cut: dict | None = None         # a V4.1 config's cut (v41_cut.cut_notes)


def dummy_config(a: argparse.Namespace) -> tuple[dict, str, str]:
    """(config dict, source, default label) of a random-weight model. `--tiny`: the tiny config (the
    bundled tiny model's shape), with `--layers` its own real-like schedule. Otherwise `--config` (the
    real V4-Flash config by default) cut to `--layers` (4) by the sweep's `bench_config` (CSA/HCA
    alternating, FP8 experts), so the model is the sweep's; at the config's own layer count it is the whole
    model, with the config's own schedule (V4-Flash: two window-only layers first). MTP blocks are dropped
    unless `--mtp`: the engine never runs them without speculative decoding, they would only take
    memory. A V4.1 `--config`: the shared V4.1 cut (`v41_cut`; FP4 experts, Engram tables of at most
    `--engram-rows` rows per head and order, the DSpark drafter dropped, so `--mtp` is refused)."""
    if a.tiny:
        from deepinfer_core.tools.tiny_config import tiny_config_dict
        cfg = tiny_config_dict(**({"num_hidden_layers": a.layers} if a.layers else {}))
        if a.expert_dtype:
            cfg["expert_dtype"] = a.expert_dtype
            cfg["quantization_config"] = {**cfg["quantization_config"], "expert_dtype": a.expert_dtype}
        source, label = "deepinfer_core.tools.tiny_config", "tiny" + (f"_{a.layers}L" if a.layers else "")
    else:
        base, source = load_base_config(a.config)
        layers = a.layers or 4
        if family(base) == "v41" and a.mtp:
            raise SystemExit("throughput: --mtp: a DeepSeek-V4.1 --config model has no MTP "
                             "block (the V4.1 cut drops its DSpark drafter stages)")
        try:
            cfg = bench_config(base, layers, a.expert_dtype or default_expert_dtype(base),
                               getattr(a, "engram_rows", DEFAULT_ENGRAM_ROWS) or None)
        except ValueError as e:          # a V4.1 cut's --layers / --expert-dtype / --engram-rows
            raise SystemExit(f"throughput: {e}") from None
        if family(base) == "v4" and layers == int(base["num_hidden_layers"]):
            cfg = full_config(base, cfg, layers)
        label = f"{Path(source).parent.name}_{layers}L"
    if not a.mtp and family(cfg) == "v4":          # (a V4.1 cut has no drafter stages left)
        cfg["compress_ratios"] = list(cfg["compress_ratios"][:int(cfg["num_hidden_layers"])])
        cfg["num_nextn_predict_layers"] = 0
    return cfg, source, label


def prepare_model(a: argparse.Namespace) -> ModelSpec:
    """What LLM(model=...) loads: the checkpoint, or a temporary dir with the config.json (plus the V4
    tokenizer when the vocabularies match, so detokenization costs what it costs a user)."""
    if a.model:
        bad = [f for f, v in (("--tiny", a.tiny), ("--config", a.config), ("--layers", a.layers),
                              ("--expert-dtype", a.expert_dtype), ("--mtp", a.mtp)) if v]
        if bad:
            raise SystemExit(f"throughput: {', '.join(bad)} shape a dummy model; "
                             "--model loads a checkpoint as is")
        cfg_path = Path(a.model) / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
        return ModelSpec(a.model, a.load_format or "auto", str(cfg_path), cfg, Path(a.model).name or "model")
    if a.load_format == "auto":
        raise SystemExit("throughput: --load-format auto needs a checkpoint (--model DIR)")
    if a.tiny and a.config:
        raise SystemExit("throughput: --tiny and --config both name the config; pass one")
    cfg, source, label = dummy_config(a)
    tmp = Path(tempfile.mkdtemp(prefix="deepinfer-throughput-"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    spec = ModelSpec(str(tmp), "dummy", source, cfg, label, tmp)
    if family(cfg) == "v41":
        spec.cut = cut_notes(load_base_config(a.config)[0], cfg)
    vocab = int(text_keys(cfg)["vocab_size"])
    try:
        from tokenizers import Tokenizer
        from deepinfer_core.tools.make_tiny_checkpoint import TOKENIZER_FILES, tokenizer_dir
        n = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json")).get_vocab_size()
        if n == vocab:
            for name in TOKENIZER_FILES:
                shutil.copyfile(tokenizer_dir() / name, tmp / name)
        else:
            spec.notes.append(f"no tokenizer: the V4 tokenizer has {n} tokens, the config {vocab}")
    except Exception as e:                  # no tokenizer package: the run still works, undetokenized
        spec.notes.append(f"no tokenizer: {type(e).__name__}: {e}")
    return spec


def build_llm(a: argparse.Namespace, spec: ModelSpec, async_mode: bool | None) -> tuple[Any, float]:
    """(LLM, seconds its construction took: the start-up a user waits for). Options left at None are
    not passed, so the engine's own defaults apply."""
    from deepinfer_core import LLM
    kw: dict[str, Any] = dict(model=spec.path, load_format=spec.load_format, dtype=a.dtype,
                              simulate_qat=not a.no_qat, seed=a.seed, device=a.device,
                              max_num_seqs=a.max_num_seqs, async_scheduling=async_mode)
    for k in ("max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "kv_cache_dtype"):
        if getattr(a, k) is not None:
            kw[k] = getattr(a, k)
    if a.enforce_eager:
        kw["enforce_eager"] = True
    sync(a.device)
    t0 = time.perf_counter()
    try:
        llm = LLM(**kw)
    except Exception as e:
        if spec.load_format == "dummy":
            raise RuntimeError(
                f"LLM(load_format='dummy') failed on {spec.path} ({type(e).__name__}: {e}). The dummy loader "
                "random-fills a config-only directory; if this tree does not have it yet, "
                "use --model DIR with a checkpoint (python -m deepinfer_core.tools.make_tiny_checkpoint DIR)"
            ) from e
        raise
    sync(a.device)
    return llm, time.perf_counter() - t0


# ---- generate calls ---------------------------------------------------------------------------------

def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random ids in [2, vocab) (0 and 1 are BOS/EOS), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def sampling(a: argparse.Namespace, max_tokens: int) -> Any:
    """Greedy, exactly `max_tokens` tokens (EOS ignored): every request does the same work."""
    from deepinfer_core import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=not a.no_detokenize)


def timed_generate(llm: Any, prompts: list[list[int]], params: Any, device: Any) -> tuple[list, float]:
    """(outputs, wall seconds) of one generate call, the device idle before and after."""
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    sync(device)
    return outs, time.perf_counter() - t0


def _engine(llm: Any) -> Any:
    for name in ("engine", "last_engine", "_engine"):
        eng = getattr(llm, name, None)
        if eng is not None:
            return eng
    return None


def engine_async(llm: Any) -> bool | None:
    """The async mode the LLM's engine ran its last call with; None when it does not say."""
    v = getattr(_engine(llm), "async_scheduling", None)
    return v if isinstance(v, bool) else None


def engine_steps(llm: Any) -> int | None:
    v = getattr(_engine(llm), "num_steps", None)
    return v if isinstance(v, int) else None


class AsyncSwitch:
    """The same model measured with async scheduling on and off, without building it twice when the LLM
    allows. Tried in turn, each checked by a 2-token call per mode after which the engine must report
    the mode asked for:
    * "sibling LLMs on one runner": `LLM.from_runner(llm.runner, config=llm.config.replace(
      async_scheduling=mode))`, a second LLM (own engine) over the same model, state cache and graphs,
      used one at a time (each call finishes every request it started);
    * "attribute switched": `llm.async_scheduling = mode` before a call (an LLM that builds its engine
      per call from the attribute).
    `method` is None when neither works: the caller then builds one LLM per mode."""

    def __init__(self, llm: Any, a: argparse.Namespace):
        self.base, self.a = llm, a
        self.base_mode = engine_async(llm)
        self.siblings: dict[bool, Any] = {}
        self.method: str | None = None
        self.errors: list[str] = []
        self.base_damaged = False            # a sibling re-allocated the shared cache: rebuild the base
        for method in ("sibling LLMs on one runner", "attribute switched"):
            self.method = method
            try:
                if all(self._check(mode) for mode in (True, False)):
                    return
            except Exception as e:
                self.errors.append(f"{method}: {type(e).__name__}: {str(e)[:200]}")
            self.close()
            if self.base_damaged:
                break
        self.method = None

    def get(self, mode: bool) -> Any:
        """The LLM that runs `mode` (the base one when it already does)."""
        if self.method == "attribute switched":
            self.base.async_scheduling = mode
            return self.base
        if mode is self.base_mode:
            return self.base
        if mode not in self.siblings:
            from deepinfer_core import LLM
            cfg = self.base.config.replace(async_scheduling=mode)
            self.siblings[mode] = LLM.from_runner(self.base.runner, tokenizer=self.base.tokenizer, config=cfg)
        return self.siblings[mode]

    def _check(self, mode: bool) -> bool:
        cache = getattr(self.base.runner, "cache", None)
        llm = self.get(mode)
        prompt = make_prompts(1, 4, llm.vocab_size, self.a.seed + 17)
        timed_generate(llm, prompt, sampling(self.a, 2), self.a.device)
        if getattr(self.base.runner, "cache", None) is not cache:
            self.base_damaged = True
            raise RuntimeError("the second LLM re-allocated the shared state cache")
        return engine_async(llm) is mode

    def close(self) -> None:
        """Drop the siblings (the runner stays with the base LLM)."""
        for sib in self.siblings.values():
            sib.close()
        self.siblings = {}


def first_request(llm: Any, a: argparse.Namespace, device: Any) -> dict[str, Any]:
    """The process's first request, then a second one like it: cold vs warm time to first token (the
    cold one pays whatever the start-up left to compile)."""
    params = sampling(a, max(1, a.warmup_output_len))
    out: dict[str, Any] = {"input_len": a.input_len, "max_tokens": params.max_tokens}
    for kind, seed in (("cold", a.seed + 1_000_003), ("warm", a.seed + 1_000_004)):
        outs, dt = timed_generate(llm, make_prompts(1, a.input_len, llm.vocab_size, seed), params, device)
        m = outs[0].metrics
        out[f"ttft_{kind}_ms"] = (m.first_token_time - m.arrival_time) * 1e3
        out[f"{kind}_elapsed_s"] = dt
    out["cold_over_warm"] = out["ttft_cold_ms"] / out["ttft_warm_ms"]
    return out


def profile_generate(llm: Any, prompts: list, params: Any, device: Any, path: Path) -> dict[str, Any]:
    """cProfile of one generate call's host thread (an async worker thread is not in it), dumped to
    `path`; the top 25 functions by tottime are printed."""
    prof = cProfile.Profile()
    sync(device)
    t0 = time.perf_counter()
    prof.enable()
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        sync(device)
    finally:
        prof.disable()
    dt = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(path))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(f"\n[throughput] cProfile of the host thread ({dt:.2f} s under the profiler) -> {path}\n"
          f"{s.getvalue()}", flush=True)
    return {"path": str(path), "elapsed_s_profiled": dt,
            "note": "an extra generate of the measured workload, run after it (the profiler slows the host)"}


# ---- forward-only step ------------------------------------------------------------------------------

def graphs_in_use(llm: Any, device: Any, a: argparse.Namespace) -> bool:
    """Whether the engine's decode steps replay CUDA graphs (the forward-only step is then timed as a
    graph replay too, else eager only)."""
    if torch.device(device).type != "cuda" or a.enforce_eager:
        return False
    graphs = getattr(llm.runner, "graphs", None)
    return graphs is None or getattr(graphs, "failed", None) is None


def forward_only(llm: Any, batch: int, context: int, a: argparse.Namespace) -> dict[str, Any]:
    """The decode step of `batch` sequences at `context` on the LLM's own model with the sweep's
    machinery: `decode_states` on a fresh cache of the engine's layout (the engine's own cache stays
    untouched), eager forwards timed by `Clock` (CUDA events on CUDA; on the CPU on the main thread and
    on a worker thread), and on CUDA a CUDA-graph replay (`cuda_graph_timing`). The step is the least
    of those medians, as the sweep's `step_ms` is min(eager, graph)."""
    runner = llm.runner
    out: dict[str, Any] = {"batch": batch, "context": context, "status": "ok"}
    if hasattr(runner, "cache_layout"):
        layout = runner.cache_layout()
    else:
        layout = cache_layout(llm.model_config, runner.dtype, not a.no_qat, a.kv_cache_dtype or "auto")
    try:
        _time_forward(llm, layout, batch, context, a, out)
    except Exception as e:
        out["status"] = failure_status(e)
    free(runner.device)                      # the fresh cache is gone with _time_forward's frame
    return out


def _time_forward(llm: Any, layout: Any, batch: int, context: int, a: argparse.Namespace, out: dict) -> None:
    from deepinfer_core.model import ForwardBatch
    model, dev = llm.runner.model, llm.runner.device
    clock = Clock(dev)
    sync(dev)
    cache, states = decode_states(layout, batch, context, dev, a.seed)
    toks = [[t] for t in random_ids(batch, llm.vocab_size, a.seed + batch + context)]
    run = lambda: model(ForwardBatch.build(toks, states, dev))  # noqa: E731  (no commit: same position)
    def timed():
        with torch.no_grad():                   # thread-local: entered in the thread that runs
            return clock.time(run, None, a.forward_warmup, a.forward_reps, FORWARD_MAX_SECONDS)
    t = timed()
    out.update(eager=t.to_dict(), step_ms=t.median_ms, basis="eager median")
    if not clock.cuda:
        # On the CPU the forward's speed depends on the thread running it (its OpenMP team): the async
        # engine runs it on a worker thread, so time it there too and keep the faster.
        with ThreadPoolExecutor(1, thread_name_prefix="throughput-forward") as pool:
            w = pool.submit(timed).result()
        out["eager_worker_thread"] = w.to_dict()
        if w.median_ms < out["step_ms"]:
            out.update(step_ms=w.median_ms, basis="eager median on a worker thread")
    if graphs_in_use(llm, dev, a):
        try:
            g = cuda_graph_timing(model, ForwardBatch.build(toks, states, dev), clock,
                                  max(a.forward_reps, 10), FORWARD_MAX_SECONDS)
            out["cuda_graph"] = {"status": "ok", **g.to_dict()}
            if g.median_ms < out["step_ms"]:
                out.update(step_ms=g.median_ms, basis="CUDA graph replay median")
        except Exception as e:                  # a sync inside the forward: the eager time stands
            out["cuda_graph"] = {"status": failure_status(e)}
            sync(dev)
    del cache


# ---- one row ----------------------------------------------------------------------------------------

def measure(llm: Any, a: argparse.Namespace, num_prompts: int, concurrency: int, mode: bool | None,
            forward: dict | None, profile_path: Path | None) -> dict[str, Any]:
    """Warm-up + measured generate of `num_prompts` prompts, the figures, and the comparison with the
    forward-only step (`forward`, measured once per concurrency)."""
    row: dict[str, Any] = {"concurrency": concurrency, "num_prompts": num_prompts, "async_scheduling": mode,
                           "input_len": a.input_len, "output_len": a.output_len, "status": "ok"}
    vocab, device = llm.vocab_size, a.device
    try:
        warm = make_prompts(num_prompts, a.input_len, vocab, a.seed + 7 * num_prompts + 1)
        _, row["warmup_s"] = timed_generate(llm, warm, sampling(a, max(1, a.warmup_output_len)), device)
        prompts = make_prompts(num_prompts, a.input_len, vocab, a.seed + num_prompts)
        params = sampling(a, a.output_len)
        eng0, steps0 = _engine(llm), engine_steps(llm)
        outs, elapsed = timed_generate(llm, prompts, params, device)
        steps1 = engine_steps(llm)
        row["async_effective"] = engine_async(llm)
        # an LLM that builds an engine per call counts from 0, a long-lived engine keeps counting
        same = _engine(llm) is eng0 and steps0 is not None and steps1 is not None
        row["engine_steps"] = steps1 - steps0 if same else steps1
        short = sum(len(o.outputs[0].token_ids) != a.output_len for o in outs)
        if short:
            row["status"] = f"warning: {short} requests did not generate {a.output_len} tokens"
        row.update(TM.request_metrics(outs, elapsed))
        row["steady"] = TM.steady_state([o.metrics.token_times for o in outs])
        if profile_path is not None:
            row["profile"] = profile_generate(llm, prompts, params, device, profile_path)
    except Exception as e:
        row["status"] = failure_status(e)
        free(device)
    row["forward"] = forward
    steady = row.get("steady") or {}
    fwd_ms = forward.get("step_ms") if forward and forward.get("status") == "ok" else None
    row["vs_forward"] = TM.compare(steady.get("step_ms"), concurrency, fwd_ms, steady.get("concurrency"))
    return row


def profile_path_for(a: argparse.Namespace, concurrency: int, mode: bool | None, many: bool) -> Path | None:
    """--profile PATH as given for a single measurement, PATH_c<concurrency>_<async|sync> for several."""
    if not a.profile:
        return None
    p = Path(a.profile)
    if not many:
        return p
    tag = {True: "async", False: "sync", None: "env"}[mode]
    return p.with_name(f"{p.stem}_c{concurrency}_{tag}{p.suffix or '.prof'}")
