"""Prefix caching on a multi-turn chat workload through `LLM.generate` or the OpenAI server: time
to first token, throughput and hit rate per turn with `enable_prefix_caching` off and on, over one
loaded model.

Workload `shared`: C conversations x T turns (`--conversations`, `--turns`). Conversation c starts
with a random history of H_c ids (uniform in `--history MIN,MAX`, seeded); turn 1's prompt is it +
a user message of `--user-len` random ids; turn k's is turn k-1's prompt + its output
(`--output-len` tokens, greedy, ignore_eos) + a new user message: the whole history resent. Every
conversation's turn k runs in one `generate` call (at most `--max-num-seqs` at once, default C), so
turn k+1 can hit what turn k left: its prompt-end checkpoint (the last multiple of 128 before its
last prompt token) and its decode checkpoint (the last multiple of 128 its output passed).
`--no-shared` adds T rounds of C fresh random prompts of the same lengths (nothing to share:
caching should cost no throughput there).

The model is built once, as benchmarks/throughput.py builds it (`throughput_run`): a checkpoint
(`--model`), random weights of `--config` (default V4-Flash) cut to `--layers` (default 4) or of
`--tiny`; or `--ci`: a tiny checkpoint from make_tiny_checkpoint (seed 0; window, window, CSA, HCA
layers; no MTP block, so no speculative decoding, as the dummy models) and a CPU-sized workload.
Both modes are LLMs over its runner (`LLM.from_runner(runner, config=...replace(
enable_prefix_caching=...))`) with the same cache blocks (the built LLM's, or
`--num-cache-blocks`); caching on adds `--checkpoint-slots` (default the engine's: max_num_seqs).
Each re-sizes the runner's state cache, which must then be empty: the caching LLM's cache is reset
(`reset_prefix_cache()`) after each of its workloads. Order: shared off, shared on, [no-shared on,
no-shared off]; each change of mode first runs a warm-up (C other prompts of turn 1's lengths; with
caching on, then the same prompts extended, so restores run too; then a reset).

Per turn and mode: TTFT p50 / p99 (`RequestOutput.metrics`, first token - arrival), output and
total tok/s of the call (total counts every prompt token, cached or not), the hit rate (sum of
`num_cached_tokens` / prompt tokens) and the best possible (turn k >= 2: the previous turn's
computed positions, prompt + output - 1, rounded down to 128 and capped at the last multiple of
128 before this prompt's last token; turn 1: 0); the scheduler's PrefixCacheStats per call (why a
lookup was cut short: `checkpoint_slots_full` asks for more `--checkpoint-slots`). Figures, the
table and the agreement check: `prefix_cache_report`.

Greedy outputs with caching on must be those with it off: with `--batch-invariant` (or
DEEPINFER_BATCH_INVARIANT=1) a difference raises AssertionError after the JSON is written;
otherwise the agreement is reported.

`--server`: the same turns through the OpenAI server instead (prefix_cache_server.py): each mode's
LLM is served in this process (after its warm-up) while its workload runs, and a turn is one
streamed `/v1/completions` request per conversation, all sent at once from a client process of
its own, with token-id prompts and `return_token_ids` (the next turn resends the exact history);
TTFT is the client's, from the send to the first streamed chunk; the hits are the usage's
`cached_tokens`. JSON: `"through"`: "llm" or "server" (label suffix `_server`), in
benchmarks/results/prefix_cache_<device>_<label>.json, rewritten after every call, so a run cut short by `--time-budget` keeps what it measured.

    python benchmarks/prefix_cache.py --ci --batch-invariant --no-shared
    python benchmarks/prefix_cache.py --ci --server
    python benchmarks/prefix_cache.py --layers 4 --checkpoint-slots 128 --no-shared \\
        --time-budget 420
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the sibling modules, run as a script

import prefix_cache_report as PR
import throughput as TP
import throughput_run as TR
from v41_cut import family

BLOCK = 128                   # the cache block (read from the runner when it says)
GPU_PRESET = {"conversations": 64, "turns": 8, "history": (2048, 8192), "output_len": 128,
              "user_len": 64}
CI_PRESET = {"conversations": 4, "turns": 3, "history": (200, 400), "output_len": 16,
             "user_len": 32}
# --ci's tiny checkpoint: window, window, CSA, HCA layers (every state a checkpoint holds)
CI_LAYERS = {"num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128]}


def int_pair(text: str) -> tuple[int, int]:
    """'2048,8192' -> (2048, 8192); one number: both ends."""
    parts = [int(p) for p in text.split(",") if p.strip()]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN,MAX with 1 <= MIN <= MAX")
    return parts[0], parts[1]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model (as benchmarks/throughput.py)")
    TP.add_model_args(m, seed_help="seeds the prompts and the LLM")
    m.add_argument("--ci", action="store_true", help="CPU preset: a tiny checkpoint "
                   "(make_tiny_checkpoint, seed 0; 4 layers: window, window, CSA, HCA; --layers N: "
                   f"the tiny's own N-layer schedule), and the workload {CI_PRESET} (each "
                   "overridable); --load-format auto")
    e = ap.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=None,
                   help="concurrency limit (default: --conversations, a whole round at once)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None, help="default: the longest "
                   "conversation (history max + turns x (user + output))")
    e.add_argument("--gpu-memory-utilization", type=float, default=None)
    e.add_argument("--num-cache-blocks", type=int, default=None, help="cache blocks of both modes "
                   "(default: what the built LLM sized)")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--batch-invariant", action="store_true", help="LLM(batch_invariant=True): "
                   "outputs on and off are then asserted identical")
    e.add_argument("--checkpoint-slots", type=int, default=None,
                   help="prefix_checkpoint_slots (default: the engine's, 2 x max_num_seqs)")
    e.add_argument("--checkpoint-interval", type=int, default=0,
                   help="prefix_checkpoint_interval (0 or a multiple of 128)")
    w = ap.add_argument_group("workload (defaults: the GPU preset, or --ci's)")
    w.add_argument("--conversations", type=int, default=None, help="default 64")
    w.add_argument("--turns", type=int, default=None, help=f"default {GPU_PRESET['turns']}")
    w.add_argument("--history", type=int_pair, default=None, help="first history length MIN,MAX "
                   "(uniform; default 2048,8192)")
    w.add_argument("--output-len", type=int, default=None, help="tokens per turn (default 128)")
    w.add_argument("--user-len", type=int, default=None, help="user message per turn (default 64)")
    w.add_argument("--warmup-output-len", type=int, default=4,
                   help="tokens of each warm-up request")
    w.add_argument("--no-shared", action="store_true", help="also run the no-shared workload")
    w.add_argument("--no-detokenize", action="store_true", help="SamplingParams(detokenize=False)")
    w.add_argument("--server", action="store_true", help="through the OpenAI server (in this "
                   "process, streamed /v1/completions requests over HTTP) instead of LLM.generate")
    o = ap.add_argument_group("output")
    o.add_argument("--label", default=None,
                   help="name in the JSON file name (default: the model's)")
    o.add_argument("--json", default=None, help="result path (default: benchmarks/results/"
                   "prefix_cache_<device>_<label>.json)")
    o.add_argument("--time-budget", type=float, default=0.0, help="seconds: calls not started by "
                   "then are recorded as not run (0: no limit)")
    return ap


def resolve(argv: list[str] | None) -> argparse.Namespace:
    a = parser().parse_args(argv)
    if a.ci and (a.model or a.tiny or a.config or a.load_format == "dummy"):
        raise SystemExit("prefix_cache: --ci builds its own tiny checkpoint; drop --model/--tiny/"
                         "--config/--load-format dummy")
    for k, v in (CI_PRESET if a.ci else GPU_PRESET).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.server and a.no_detokenize:
        raise SystemExit("prefix_cache: the server always detokenizes; drop --no-detokenize")
    for flag in ("conversations", "turns", "output_len", "user_len", "warmup_output_len"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"prefix_cache: --{flag.replace('_', '-')} must be >= 1")
    if a.device is None:
        from deepinfer_core.plugins import get_plugin_manager
        a.device = get_plugin_manager().detect_platform().device_type
    a.dtype = a.dtype or ("bfloat16" if torch.device(a.device).type == "cuda" else "float32")
    a.max_num_seqs = a.max_num_seqs or a.conversations
    a.longest = a.history[1] + a.turns * (a.user_len + a.output_len)
    a.max_model_len = a.max_model_len or -(-a.longest // BLOCK) * BLOCK
    a.ci_dir = None
    return a


# ---- the workload ------------------------------------------------------------------------------

def ids(vocab: int, n: int, *seed: int) -> list[int]:
    """`n` random ids in [2, vocab) (0 and 1 are BOS/EOS), seeded by the tuple."""
    return np.random.default_rng(list(seed)).integers(2, vocab, size=n).tolist()


def history_lengths(a: argparse.Namespace) -> list[int]:
    return np.random.default_rng([a.seed, 1]).integers(a.history[0], a.history[1] + 1,
                                                      size=a.conversations).tolist()


def prompt_lengths(a: argparse.Namespace, turn: int) -> list[int]:
    """Turn `turn`'s (1-based) prompt lengths (every output has output_len tokens: ignore_eos)."""
    return [h + turn * a.user_len + (turn - 1) * a.output_len for h in history_lengths(a)]


def stats_of(llm: Any) -> dict[str, Any] | None:
    """The scheduler's PrefixCacheStats as a dict (None: no prefix cache)."""
    prefix = getattr(getattr(llm.engine, "scheduler", None), "prefix", None)
    if prefix is None:
        return None
    out = dataclasses.asdict(prefix.stats)
    out["cut_short"] = dict(out.get("cut_short") or {})
    return out


class Bench:
    def __init__(self, a: argparse.Namespace, argv: list[str] | None):
        self.a, self.argv, self.t0 = a, argv, time.perf_counter()
        self.load_start = TP.host_load()
        self.ci_layers: int | None = None
        if a.ci:
            from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
            a.ci_dir = Path(tempfile.mkdtemp(prefix="deepinfer-prefix-cache-"))
            over = {"num_nextn_predict_layers": 0, **(  # no MTP (as a dummy model): no speculation
                {"num_hidden_layers": a.layers} if a.layers else CI_LAYERS)}
            a.model = str(make_tiny_checkpoint(a.ci_dir, over, seed=0))
            self.ci_layers, a.layers = a.layers, None
        self.spec = TR.prepare_model(a)
        self.label = a.label or ((f"ci{'_' + str(self.ci_layers) + 'L' if self.ci_layers else ''}"
                                  if a.ci else self.spec.label) + ("_server" if a.server else ""))
        self.dev_name = TP.device_name(a.device)
        default = TP.RESULTS / f"prefix_cache_{self.dev_name.replace(' ', '_')}_{self.label}.json"
        self.path = Path(a.json) if a.json else default
        self.base: Any = None
        self.llms: dict[bool, Any] = {}
        self.current: bool | None = None
        # --server, while a workload runs: one turn over HTTP, (prompts, output_len) -> (outputs, s)
        self.server_turn: Callable[[list[list[int]], int], tuple[list, float]] | None = None
        self.startup_s: float | None = None
        self.info: dict = {}
        self.block = BLOCK
        self.num_blocks: int | None = None
        self.runs: dict[str, dict[str, dict]] = {w: {} for w in PR.WORKLOADS}
        self.outputs: dict[tuple[str, bool], list[list[list[int]]]] = {}
        self.agreement: dict[str, Any] = {}
        self.invariant: bool | None = None
        self.warmups: list[dict] = []

    # ---- the LLMs ------------------------------------------------------------------------------
    def build(self) -> None:
        a = self.a
        invariant = {"DEEPINFER_BATCH_INVARIANT": "1"} if a.batch_invariant else {}
        with mock.patch.dict(os.environ, invariant):     # (TR.build_llm passes no such option)
            self.base, self.startup_s = TR.build_llm(a, self.spec, None)
        print(f"[prefix_cache] LLM built in {self.startup_s:.1f} s", flush=True)
        self.info = TP.engine_info(self.base)
        self.invariant = bool(self.base.config.model.batch_invariant)
        cache = self.base.runner.cache
        self.block = int(getattr(getattr(cache, "layout", None), "block_size", BLOCK))
        self.num_blocks = a.num_cache_blocks or cache.allocator.num_blocks
        from deepinfer_core import LLM
        for caching in (False, True):
            opts: dict[str, Any] = {"num_cache_blocks": self.num_blocks,
                                    "enable_prefix_caching": caching}
            if caching:
                opts.update(prefix_checkpoint_slots=a.checkpoint_slots,
                            prefix_checkpoint_interval=a.checkpoint_interval)
            self.llms[caching] = LLM.from_runner(self.base.runner, tokenizer=self.base.tokenizer,
                                                 config=self.base.config.replace(**opts))

    def use(self, caching: bool) -> Any:
        """The LLM of that mode, warmed up when the mode changed (the cache was re-sized: new pools,
        CUDA graphs captured again)."""
        llm = self.llms[caching]
        if self.current is caching:
            return llm
        a, vocab, t0 = self.a, llm.vocab_size, time.perf_counter()
        prompts = [ids(vocab, n, a.seed, 7, c) for c, n in enumerate(prompt_lengths(a, 1))]
        params = TR.sampling(a, a.warmup_output_len)
        TR.timed_generate(llm, prompts, params, a.device)
        if caching:
            more = [p + ids(vocab, a.user_len, a.seed, 8, c) for c, p in enumerate(prompts)]
            TR.timed_generate(llm, more, params, a.device)
            self.reset(llm)
        self.current = caching
        dt = time.perf_counter() - t0
        self.warmups.append({"caching": caching, "seconds": dt, "runner_warmup_s":
                             getattr(llm.runner, "warmup_seconds", None)})
        print(f"[prefix_cache] warm-up with caching {self.mode(caching)}: {dt:.1f} s", flush=True)
        return llm

    @staticmethod
    def reset(llm: Any) -> None:
        """Empty the prefix cache (the other mode re-sizes the shared state cache)."""
        if not llm.reset_prefix_cache():
            raise RuntimeError("prefix_cache: reset_prefix_cache() left cached blocks")

    def over_budget(self) -> bool:
        return bool(self.a.time_budget) and time.perf_counter() - self.t0 > self.a.time_budget

    @property
    def not_run(self) -> str:
        return f"not run: --time-budget {self.a.time_budget:.0f} s spent"

    @contextlib.contextmanager
    def served(self, llm: Any) -> Iterator[None]:
        """--server: `llm` behind an OpenAI server in this process while the block runs (the calls
        then go over HTTP, from a client process); otherwise nothing."""
        if not self.a.server:
            yield
            return
        import prefix_cache_server as PS  # aiohttp, its client's, is the test extra's
        with PS.client() as pool, PS.serving(llm, self.a.conversations) as url:
            self.server_turn = functools.partial(PS.turn, pool, url)
            try:
                yield
            finally:
                self.server_turn = None

    # ---- one call ------------------------------------------------------------------------------
    def call(self, llm: Any, turn: int, prompts: list[list[int]],
             best: list[int]) -> tuple[dict, list]:
        """One round: its row of figures and each request's output ids."""
        a, before = self.a, stats_of(llm)
        try:
            if self.server_turn is None:
                params = TR.sampling(a, a.output_len)
                outs, elapsed = TR.timed_generate(llm, prompts, params, a.device)
            else:
                outs, elapsed = self.server_turn(prompts, a.output_len)
        except Exception as e:  # noqa: BLE001  (a failed call is a row)
            TR.free(a.device)
            return {"turn": turn, "status": TR.failure_status(e)}, []
        row = PR.call_row(turn, outs, elapsed, prompts, best, a.output_len)
        row["prefix_stats"] = PR.stats_delta(before, stats_of(llm))
        return row, [list(o.outputs[0].token_ids) for o in outs]

    # ---- the workloads -------------------------------------------------------------------------
    def workload(self, name: str, caching: bool) -> None:
        """Every turn of workload `name` with caching on or off, one generate call (or one round of
        requests to the server) per turn."""
        a, llm = self.a, self.use(caching)
        vocab, b = llm.vocab_size, self.block
        run = self.runs[name][self.mode(caching)] = {"rows": [], "elapsed_s": None}
        outs = self.outputs[(name, caching)] = []
        prompts = [ids(vocab, h, a.seed, 2, c) + ids(vocab, a.user_len, a.seed, 3, c, 1)
                   for c, h in enumerate(history_lengths(a))]
        done = [0] * a.conversations            # positions the previous turn computed
        t0 = time.perf_counter()
        for k in range(1, a.turns + 1):
            if self.over_budget():
                run["rows"].append({"turn": k, "status": self.not_run})
                continue
            if name == "no_shared":             # fresh prompts of the shared turn's lengths
                prompts = [ids(vocab, n, a.seed, 4, k, c)
                           for c, n in enumerate(prompt_lengths(a, k))]
            best = [min(d // b * b, (len(p) - 1) // b * b) for d, p in zip(done, prompts)]
            row, toks = self.call(llm, k, prompts, best)
            run["rows"].append(row)
            ttft = (row.get("ttft_ms") or {}).get("p50", float("nan"))
            print(f"[prefix_cache] {name} caching {self.mode(caching)} turn {k}: {row['status']}; "
                  f"TTFT p50 {ttft:.1f} ms, hit {100 * row.get('hit_rate', 0.0):.1f} %", flush=True)
            self.write(complete=False)
            if not toks:
                break
            outs.append(toks)
            if name == "shared":
                done = [len(p) + len(t) - 1 for p, t in zip(prompts, toks)]
                prompts = [p + t + ids(vocab, a.user_len, a.seed, 3, c, k + 1)
                           for c, (p, t) in enumerate(zip(prompts, toks))]
        run["elapsed_s"] = time.perf_counter() - t0
        run["prefix_stats_total"] = stats_of(llm)

    @staticmethod
    def mode(caching: bool) -> str:
        return "on" if caching else "off"

    def measure_all(self) -> None:
        self.build()
        phases = [("shared", False), ("shared", True)]
        if self.a.no_shared:
            phases += [("no_shared", True), ("no_shared", False)]   # the current mode first
        for workload, caching in phases:
            if self.over_budget():
                self.runs[workload][self.mode(caching)] = {"rows": [], "status": self.not_run}
                continue
            try:
                with self.served(self.use(caching)):
                    self.workload(workload, caching)
                if caching:
                    self.reset(self.llms[caching])
            except Exception as e:  # noqa: BLE001  (the other phases may still run)
                run = self.runs[workload].setdefault(self.mode(caching), {"rows": []})
                run["status"] = TR.failure_status(e)
                self.current = None                 # warm up again
                if caching:
                    self.llms[caching].reset_prefix_cache()
        self.agreement = PR.agreement(self.outputs, self.a.conversations)

    def result(self, complete: bool) -> dict[str, Any]:
        a, spec = self.a, self.spec
        out = {
            "schema": "deepinfer-prefix-cache/1", "complete": complete,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": str(a.device), "device_name": self.dev_name,
            "commit": TP._git("rev-parse", "HEAD") or None,
            "dirty": bool(TP._git("status", "--porcelain", "--untracked-files=no")),
            "versions": TP.versions(),
            "command": ([sys.executable, *sys.argv] if self.argv is None
                        else ["benchmarks/prefix_cache.py", *self.argv]),
            "settings": dict(vars(a)), "label": self.label,
            "through": "server" if a.server else "llm",
            "model": {"path": None if spec.tmp_dir or a.ci else spec.path,
                      "load_format": spec.load_format,
                      "config_source": "make_tiny_checkpoint (seed 0)" if a.ci else spec.source,
                      "config": spec.config, "notes": spec.notes,
                      "family": family(spec.config) if spec.config else None},
            "engine": self.info, "startup_s": self.startup_s, "block_size": self.block,
            "num_cache_blocks": self.num_blocks, "batch_invariant": self.invariant,
            "turns": PR.compare_rows(self.runs["shared"], a.turns),
            "no_shared": (PR.compare_rows(self.runs["no_shared"], a.turns)
                          if self.runs["no_shared"] else None),
            "summary": PR.summary(self.runs, a.turns), "agreement": self.agreement,
            "warmups": self.warmups, "runs": self.runs, "definitions": PR.definitions(a.server),
            "elapsed_s": time.perf_counter() - self.t0,
            "host": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "loadavg_start": self.load_start, "loadavg_now": TP.host_load()},
        }
        if torch.device(a.device).type == "cuda":
            dev = torch.device(a.device)
            out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        return out

    def write(self, complete: bool) -> dict[str, Any]:
        res = self.result(complete)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        return res

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()
        if self.base is not None:
            self.base.close()
        self.llms, self.base = {}, None
        for d in (self.spec.tmp_dir, self.a.ci_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = resolve(argv)
    bench = Bench(a, argv)
    try:
        print(f"[prefix_cache] {bench.dev_name}: {bench.spec.source} ({bench.spec.load_format}), "
              f"{a.dtype}; {a.conversations} conversations x {a.turns} turns, history "
              f"{a.history[0]}..{a.history[1]}, user {a.user_len}, output {a.output_len}, "
              f"max_num_seqs {a.max_num_seqs}", flush=True)
        bench.measure_all()
    finally:
        bench.close()
    result = bench.write(complete=True)
    PR.print_table(result)
    print(f"[prefix_cache] wrote {bench.path} ({result['elapsed_s']:.0f} s)")
    PR.check_agreement(bench.agreement, bool(bench.invariant), bench.path)
    result["json_path"] = str(bench.path)
    return result


if __name__ == "__main__":
    main()
