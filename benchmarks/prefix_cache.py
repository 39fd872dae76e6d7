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

`--server`: the same turns through the OpenAI server instead (prefix_cache_server.py): each mode
is a `python -m deepinfer_core.serve` started with the same engine options (+ `--launch`'s flags;
its engine in a child process on CUDA, as the server's default), warmed up over HTTP, and a turn
is one streamed `/v1/completions` request per conversation, all sent at once from a client
process of its own, with token-id prompts and `return_token_ids` (the next turn resends the exact
history); TTFT is the client's, from the send to the first streamed chunk; the hits are the
usage's `cached_tokens`, the cache's counters the server's /metrics. JSON: `"through"`: "llm"
or "server" (label suffix `_server`), in benchmarks/results/prefix_cache_<device>_<label>.json,
rewritten after every call, so a run cut short by `--time-budget` keeps what it measured.

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
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the sibling modules, run as a script

import prefix_cache_report as PR
import prefix_cache_workload as W
import throughput as TP
import throughput_run as TR
from v41_cut import family


class Local:
    """One mode in this process: an LLM over the shared runner, a turn = one generate call."""

    def __init__(self, llm: Any, a: argparse.Namespace):
        self.llm, self.a = llm, a

    def turn(self, prompts: list[list[int]], output_len: int) -> tuple[list, float]:
        params = TR.sampling(self.a, output_len)
        return TR.timed_generate(self.llm, prompts, params, self.a.device)

    def stats(self) -> dict[str, Any] | None:
        """The scheduler's PrefixCacheStats as a dict (None: no prefix cache)."""
        prefix = getattr(getattr(self.llm.engine, "scheduler", None), "prefix", None)
        if prefix is None:
            return None
        out = dataclasses.asdict(prefix.stats)
        out["cut_short"] = dict(out.get("cut_short") or {})
        return out

    def reset(self) -> bool:
        return self.llm.reset_prefix_cache()

    @property
    def warmup_seconds(self) -> float | None:
        return getattr(self.llm.runner, "warmup_seconds", None)

    def close(self) -> None:
        self.llm.close()


class Bench:
    def __init__(self, a: argparse.Namespace, argv: list[str] | None):
        self.a, self.argv, self.t0 = a, argv, time.perf_counter()
        self.load_start = TP.host_load()
        self.ci_layers: int | None = None
        if a.ci:
            from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
            a.ci_dir = Path(tempfile.mkdtemp(prefix="deepinfer-prefix-cache-"))
            over = {"num_nextn_predict_layers": 0, **(  # no MTP (as a dummy model): no speculation
                {"num_hidden_layers": a.layers} if a.layers else W.CI_LAYERS)}
            a.model = str(make_tiny_checkpoint(a.ci_dir, over, seed=0))
            self.ci_layers, a.layers = a.layers, None
        self.spec = TR.prepare_model(a)
        self.label = a.label or ((f"ci{'_' + str(self.ci_layers) + 'L' if self.ci_layers else ''}"
                                  if a.ci else self.spec.label) + ("_server" if a.server else ""))
        self.dev_name = TP.device_name(a.device)
        default = TP.RESULTS / f"prefix_cache_{self.dev_name.replace(' ', '_')}_{self.label}.json"
        self.path = Path(a.json) if a.json else default
        self.base: Any = None
        self.modes: dict[bool, Any] = {}        # caching -> Local, or the running Served
        self.current: bool | None = None
        self.client: contextlib.ExitStack = contextlib.ExitStack()
        self.pool: Any = None                    # --server: the client's process
        self.startup_s: float | None = None
        self.info: dict = {}
        self.vocab = 0
        self.block = W.BLOCK
        self.num_blocks: int | None = a.num_cache_blocks
        self.runs: dict[str, dict[str, dict]] = {w: {} for w in PR.WORKLOADS}
        self.outputs: dict[tuple[str, bool], list[list[list[int]]]] = {}
        self.agreement: dict[str, Any] = {}
        self.invariant: bool | None = None
        self.warmups: list[dict] = []

    # ---- the modes -----------------------------------------------------------------------------
    def build(self) -> None:
        """In this process: one LLM and a `Local` per mode over its runner. --server: the model's
        vocabulary and the client's process (each mode's server starts in `use`)."""
        a = self.a
        if a.server:
            import prefix_cache_server as PS  # aiohttp, its client's, is the test extra's
            self.pool = self.client.enter_context(PS.client())
            cfg = self.spec.config or json.loads((Path(self.spec.path) / "config.json").read_text())
            self.vocab, self.invariant = int(cfg["vocab_size"]), a.batch_invariant
            self.info = {"servers": []}
            return
        invariant = {"DEEPINFER_BATCH_INVARIANT": "1"} if a.batch_invariant else {}
        with mock.patch.dict(os.environ, invariant):     # (TR.build_llm passes no such option)
            self.base, self.startup_s = TR.build_llm(a, self.spec, None)
        print(f"[prefix_cache] LLM built in {self.startup_s:.1f} s", flush=True)
        self.info = TP.engine_info(self.base)
        self.invariant = bool(self.base.config.model.batch_invariant)
        self.vocab = self.base.vocab_size
        cache = self.base.runner.cache
        self.block = int(getattr(getattr(cache, "layout", None), "block_size", W.BLOCK))
        self.num_blocks = a.num_cache_blocks or cache.allocator.num_blocks
        from deepinfer_core import LLM
        for caching in (False, True):
            opts: dict[str, Any] = {"num_cache_blocks": self.num_blocks,
                                    "enable_prefix_caching": caching}
            if caching:
                opts.update(prefix_checkpoint_slots=a.checkpoint_slots,
                            prefix_checkpoint_interval=a.checkpoint_interval)
            llm = LLM.from_runner(self.base.runner, tokenizer=self.base.tokenizer,
                                  config=self.base.config.replace(**opts))
            self.modes[caching] = Local(llm, a)

    def launch(self, caching: bool) -> None:
        """--server: stop the other mode's server, start this mode's (the first one sizes the
        cache; later ones get as many blocks)."""
        import prefix_cache_server as PS
        for old in self.modes.values():
            old.close()
        self.modes = {}
        flags = PS.engine_flags(self.a, self.spec, caching, self.num_blocks)
        log = self.path.with_name(f"{self.path.stem}_server_{self.mode(caching)}.log")
        served = PS.Served(self.pool, flags, log)
        self.modes[caching] = served
        blocks = served.num_blocks()
        self.num_blocks = self.num_blocks or blocks
        self.startup_s = self.startup_s or served.startup_s
        self.info["servers"].append({"caching": caching, "command": served.srv.launched,
                                     "startup_s": served.startup_s, "log": str(log),
                                     "num_cache_blocks": blocks})
        print(f"[prefix_cache] server with caching {self.mode(caching)} up in "
              f"{served.startup_s:.1f} s", flush=True)

    def use(self, caching: bool) -> Any:
        """The mode, warmed up when the mode changed (the cache was re-sized: new pools, CUDA
        graphs captured again; or a new server)."""
        if self.current is caching:
            return self.modes[caching]
        self.current = None
        if self.a.server:
            self.launch(caching)
        mode, a, t0 = self.modes[caching], self.a, time.perf_counter()
        prompts = [W.ids(self.vocab, n, a.seed, 7, c) for c, n in enumerate(W.prompt_lengths(a, 1))]
        mode.turn(prompts, a.warmup_output_len)
        if caching:
            more = [p + W.ids(self.vocab, a.user_len, a.seed, 8, c) for c, p in enumerate(prompts)]
            mode.turn(more, a.warmup_output_len)
            self.reset(mode)
        self.current = caching
        dt = time.perf_counter() - t0
        self.warmups.append({"caching": caching, "seconds": dt,
                             "runner_warmup_s": mode.warmup_seconds})
        print(f"[prefix_cache] warm-up with caching {self.mode(caching)}: {dt:.1f} s", flush=True)
        return mode

    @staticmethod
    def reset(mode: Any) -> None:
        """Empty the prefix cache (the other mode re-sizes the shared state cache)."""
        if not mode.reset():
            raise RuntimeError("prefix_cache: reset_prefix_cache() left cached blocks")

    def over_budget(self) -> bool:
        return bool(self.a.time_budget) and time.perf_counter() - self.t0 > self.a.time_budget

    @property
    def not_run(self) -> str:
        return f"not run: --time-budget {self.a.time_budget:.0f} s spent"

    # ---- one call ------------------------------------------------------------------------------
    def call(self, mode: Any, turn: int, prompts: list[list[int]],
             best: list[int]) -> tuple[dict, list]:
        """One round: its row of figures and each request's output ids."""
        before = mode.stats()
        try:
            outs, elapsed = mode.turn(prompts, self.a.output_len)
        except Exception as e:  # noqa: BLE001  (a failed call is a row)
            TR.free(self.a.device)
            return {"turn": turn, "status": TR.failure_status(e)}, []
        row = PR.call_row(turn, outs, elapsed, prompts, best, self.a.output_len)
        row["prefix_stats"] = PR.stats_delta(before, mode.stats())
        if self.a.server:
            row["timeline"] = mode.last
        return row, [list(o.outputs[0].token_ids) for o in outs]

    # ---- the workloads -------------------------------------------------------------------------
    def workload(self, name: str, caching: bool) -> None:
        """Every turn of workload `name` with caching on or off, one generate call (or one round of
        requests to the server) per turn."""
        a, mode = self.a, self.use(caching)
        vocab, b = self.vocab, self.block
        run = self.runs[name][self.mode(caching)] = {"rows": [], "elapsed_s": None}
        outs = self.outputs[(name, caching)] = []
        prompts = [W.ids(vocab, h, a.seed, 2, c) + W.ids(vocab, a.user_len, a.seed, 3, c, 1)
                   for c, h in enumerate(W.history_lengths(a))]
        done = [0] * a.conversations            # positions the previous turn computed
        t0 = time.perf_counter()
        for k in range(1, a.turns + 1):
            if self.over_budget():
                run["rows"].append({"turn": k, "status": self.not_run})
                continue
            if name == "no_shared":             # fresh prompts of the shared turn's lengths
                prompts = [W.ids(vocab, n, a.seed, 4, k, c)
                           for c, n in enumerate(W.prompt_lengths(a, k))]
            best = [min(d // b * b, (len(p) - 1) // b * b) for d, p in zip(done, prompts)]
            row, toks = self.call(mode, k, prompts, best)
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
                prompts = [p + t + W.ids(vocab, a.user_len, a.seed, 3, c, k + 1)
                           for c, (p, t) in enumerate(zip(prompts, toks))]
        run["elapsed_s"] = time.perf_counter() - t0
        run["prefix_stats_total"] = mode.stats()

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
                self.workload(workload, caching)
                if caching:
                    self.reset(self.modes[caching])
            except Exception as e:  # noqa: BLE001  (the other phases may still run)
                run = self.runs[workload].setdefault(self.mode(caching), {"rows": []})
                run["status"] = TR.failure_status(e)
                self.current = None                 # warm up again
                if caching and caching in self.modes:
                    with contextlib.suppress(Exception):
                        self.modes[caching].reset()
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
        if torch.device(a.device).type == "cuda" and not a.server:
            dev = torch.device(a.device)
            out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        return out

    def write(self, complete: bool) -> dict[str, Any]:
        res = self.result(complete)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        return res

    def close(self) -> None:
        for mode in self.modes.values():
            mode.close()
        if self.base is not None:
            self.base.close()
        self.modes, self.base = {}, None
        self.client.close()
        for d in (self.spec.tmp_dir, self.a.ci_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = W.resolve(argv, __doc__)
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
