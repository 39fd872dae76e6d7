"""Speculative decoding's own cost and speed-up on the V4-Flash-width dummy model (random weights, cut
to 4 layers as benchmarks/sweep.py cuts it), with the replay drafter: it proposes the
continuation an earlier greedy run of the same prompts produced, each draft right with probability
--acceptance, so the verify steps run as with a drafter of that quality (drafting itself costs
nothing here: this measures verification, the scheduler and the host path, not the MTP block).

    python benchmarks/spec_replay.py [--concurrency 1,16,64,256] [--gammas 1,3,5]
                                     [--acceptance 0.6,0.8] [--input-len 256] [--output-len 128]
                                     [--no-varlen] [--curve-rows 8] [--no-batch-invariant]
                                     [--repeats 3] [--cprofile C] [--trace C] [--append]
                                     [--host-verdict]

First the verify step-time curve: a CUDA-graph replay per (batch 1..256, rows per request
1..--curve-rows), random ids (runner/step_times.py, the table VARLEN profiles at start-up). Then per
concurrency: one greedy run without speculation records the outputs and gives the baseline output
tok/s (CUDA graphs, async scheduling: the engine as users run it); then, per acceptance, the same
prompts with the replay drafter at each static gamma and with VARLEN (confidence-scheduled
verification up to the largest gamma; the replay drafter's confidences are its true acceptance),
bf16, graphs, async scheduling as configured (speculative steps pipelined: step N+1 is launched
before step N is post-processed). Batch-invariant kernels for every run (default; the
engine refuses VARLEN with invariance, so the policy is installed directly here: the kernels are
the ones the recorded run used, so the drafts land, and static and VARLEN rows compare the same
kernels). Each setting is warmed up once with the same batch, then timed (median of --repeats runs;
every request has a fixed seed, so every run replays the same coins and plans the same steps). Reports output tok/s, the
speed-up over no speculation, the measured tau, VARLEN's chosen lengths and how many steps were
verified on the device (and launched before the previous verdict reached the host). Writes
benchmarks/results/spec_replay_<device>.json (`--host-verdict`: ..._host_verdict.json) after every row.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sweep_model import bench_config, load_base_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.runner.step_times import profile_step_times  # noqa: E402
from deepinfer_core.speculative.engine_step import Speculator  # noqa: E402
from deepinfer_core.speculative.replay import ReplayDrafter  # noqa: E402
from deepinfer_core.speculative.varlen import VarlenPolicy  # noqa: E402

HERE = Path(__file__).parent


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def timed(llm: LLM, prompts, params, repeats: int) -> tuple[list, float]:
    """One warm-up, then the median seconds of `repeats` runs (fixed seeds: every run plans the same steps)."""
    params = [dataclasses.replace(params, seed=i) for i in range(len(prompts))]
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)       # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return outs, statistics.median(times)


def gpu_idle(llm: LLM, prompts, params) -> dict:
    """One traced run: the GPU's busy time (the union of its kernel intervals), its idle gaps between
    the first and the last kernel, and the host ops that cost most (self time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    params = [dataclasses.replace(params, seed=i) for i in range(len(prompts))]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, gaps, end = 0.0, [], spans[0][0] if spans else 0.0
    for lo, hi in spans:
        if lo > end:
            gaps.append(lo - end)
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    span = end - spans[0][0] if spans else 0.0
    big = [g for g in gaps if g >= 50]
    out = dict(kernels=len(spans), span_ms=round(span / 1e3, 2), busy_ms=round(busy / 1e3, 2),
               idle_ms=round((span - busy) / 1e3, 2), gaps_over_50us=len(big), idle_in_those_ms=round(sum(big) / 1e3, 2))
    print(f"trace: {out}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64, 256])
    ap.add_argument("--gammas", type=ints, default=[1, 3, 5])
    ap.add_argument("--acceptance", type=lambda t: [float(x) for x in t.split(",")], default=[0.6, 0.8])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="batch-invariant kernels (default on): a verify chunk then computes what decode steps "
                         "computed, so the target reproduces the recorded run; without them a random model's "
                         "greedy path flips at near-ties as soon as the step's token count changes the tiles")
    ap.add_argument("--varlen", action=argparse.BooleanOptionalAction, default=True,
                    help="also run confidence-scheduled verification (up to the largest gamma)")
    ap.add_argument("--curve-rows", type=int, default=8, help="rows per request of the step-time curve (0: none)")
    ap.add_argument("--trace", type=int, default=0, metavar="C",
                    help="torch.profiler over one run of the largest static gamma at concurrency C, last acceptance: "
                         "how long the GPU sits idle between kernels (the host path it waits for)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="C",
                    help="cProfile the largest static gamma and VARLEN at concurrency C, first acceptance")
    ap.add_argument("--host-verdict", action="store_true",
                    help="read every verdict on the host before the next launch (the path before verdicts stayed "
                         "on the device: speculative/device_verdict.py), for comparison")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of other concurrencies already in the results file")
    a = ap.parse_args()
    base, _ = load_base_config()
    cfg = bench_config(base, a.layers)
    cfg["num_nextn_predict_layers"] = 0                 # the replay drafter needs no MTP block
    tmp = Path(tempfile.mkdtemp(prefix="deepinfer-spec-replay-"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    gamma_max = max(a.gammas)
    t0 = time.perf_counter()
    max_seqs = max(a.concurrency)
    llm = LLM(model=str(tmp), load_format="dummy", dtype="bfloat16", num_speculative_tokens=0,
              batch_invariant=a.batch_invariant, max_backtracking_tokens=max(gamma_max + 1, a.curve_rows),
              max_num_seqs=max_seqs, max_model_len=a.input_len + a.output_len + 8,
              num_cache_blocks=max_seqs * -(-(a.input_len + a.output_len + 8) // 128) + 8)
    print(f"start-up {time.perf_counter() - t0:.1f} s", flush=True)
    device = torch.device(llm.runner.device).type
    result = dict(model=f"V4-Flash width, {a.layers} layers, random weights (dummy)", dtype="bfloat16",
                  batch_invariant=a.batch_invariant, input_len=a.input_len, output_len=a.output_len,
                  device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", rows=[])
    out = HERE / "results" / f"spec_replay_{device}{'_host_verdict' if a.host_verdict else ''}.json"
    if a.append and out.exists():
        old = json.loads(out.read_text())
        result["rows"] = [r for r in old["rows"] if r["concurrency"] not in a.concurrency]
        if "step_time_curve" in old:
            result["step_time_curve"] = old["step_time_curve"]

    def save() -> None:
        out.write_text(json.dumps(result, indent=1) + "\n")

    llm.engine            # the cache and the decode graphs
    if a.host_verdict:
        llm.engine._verifies_on_device = lambda chunks: False
    result["verdict"] = "host" if a.host_verdict else "device where it can"
    if a.curve_rows:
        curve = profile_step_times(llm.runner, max_seqs, a.curve_rows)
        result["step_time_curve"] = curve.table()
        save()
        print("verify step time (ms) by batch x rows per request")
        print("batch " + "".join(f"{q:>8}" for q in range(1, a.curve_rows + 1)))
        for b, times in zip(curve.buckets, curve.ms):
            print(f"{b:5} " + "".join(f"{t:8.3f}" for t in times), flush=True)
    times = profile_step_times(llm.runner, max_seqs, gamma_max + 1) if a.varlen else None
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True, detokenize=False)
    rows = result["rows"]
    for c in a.concurrency:
        prompts = torch.randint(1000, int(cfg["vocab_size"]), (c, a.input_len), generator=gen).tolist()
        llm.engine.executor.speculator = None                      # the plain engine (async on)
        llm.engine.varlen = llm.engine.scheduler.draft_length = None
        llm.engine.async_scheduling = llm.config.scheduler.async_scheduling
        outs, seconds = timed(llm, prompts, params, a.repeats)
        recorded = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
        base_tok_s = c * a.output_len / seconds
        rows.append(dict(concurrency=c, gamma=0, acceptance=None, output_tok_s=round(base_tok_s, 1), speedup=1.0,
                         tau=None))
        print(f"c={c:4} no speculation: {base_tok_s:9.1f} tok/s", flush=True)
        for acc in a.acceptance:
            for g in a.gammas + (["varlen"] if a.varlen else []):
                k = gamma_max if g == "varlen" else g
                drafter = ReplayDrafter(recorded, [acc] * k, int(cfg["vocab_size"]))
                llm.engine.varlen = llm.engine.scheduler.draft_length = None
                llm.engine.use_speculator(Speculator(llm.runner.model, k, replay=drafter), llm.runner.backtrack)
                if g == "varlen":
                    llm.engine.use_varlen(VarlenPolicy(times, k))
                if a.cprofile == c and acc == a.acceptance[0] and g in (gamma_max, "varlen"):
                    import cProfile
                    import pstats
                    with cProfile.Profile() as prof:
                        timed(llm, prompts, params, 1)
                    print(f"cProfile, gamma {g}, acceptance {acc}, concurrency {c}")
                    stats = pstats.Stats(prof)
                    stats.sort_stats("tottime").print_stats(22)
                    stats.sort_stats("cumtime").print_stats("deepinfer_core", 30)   # the host path
                if a.trace == c and acc == a.acceptance[-1] and g == gamma_max:
                    row_trace = gpu_idle(llm, prompts, params)
                e = llm.engine
                before = (e.num_steps, e.num_verified_on_device, e.num_blind_launches)
                outs, seconds = timed(llm, prompts, params, a.repeats)
                steps, on_device, blind = (x - y for x, y in zip(
                    (e.num_steps, e.num_verified_on_device, e.num_blind_launches), before))
                m = llm.engine.spec_metrics
                tok_s = c * a.output_len / seconds
                same = sum(o.outputs[0].token_ids == recorded[tuple(p)] for p, o in zip(prompts, outs))
                row = dict(concurrency=c, gamma=g, acceptance=acc, output_tok_s=round(tok_s, 1),
                           speedup=round(tok_s / base_tok_s, 3), tau=round(m.acceptance_length, 3),
                           identical=f"{same}/{c}", steps_on_device=f"{on_device}/{steps}",
                           blind_launches=blind)
                if a.trace == c and acc == a.acceptance[-1] and g == gamma_max:
                    row["gpu_trace"] = row_trace
                if g == "varlen":
                    row["chosen_lengths"] = list(llm.engine.varlen.chosen)
                    row["measured_over_table"] = round(llm.engine.varlen.scale, 3)
                rows.append(row)
                save()
                extra = f"  lengths {row['chosen_lengths']}" if g == "varlen" else ""
                print(f"c={c:4} gamma {g} acceptance {acc}: {tok_s:9.1f} tok/s  x{tok_s / base_tok_s:.2f}  "
                      f"tau {m.acceptance_length:.2f} (two runs)  identical {same}/{c}  on device "
                      f"{on_device}/{steps} (blind {blind}){extra}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
