"""Prefill / decode benchmark sweep of DeepInfer (whatever backend the plugin manager picks: the
NVIDIA one on an SM90+ GPU) against transformers' DeepseekV4ForCausalLM on the same config and the
same random weights, in one process.

The model is V4-Flash at full width with `--layers` layers (CSA/HCA alternating, FP8 dense weights
and FP8 experts, random values; `sweep_model`). A DeepSeek-V4.1 `--config` (model_type deepseek_v41,
e.g. tests/data/deepseek-v4.1-flash) is cut by the shared V4.1 cut (`v41_cut`: window-only, C2
and C1 layers with their sources, FP4 experts, Engram tables of at most `--engram-rows` rows),
costed by `roofline_v41`, extrapolated to the config's own depth and never compared with
transformers (which has no V4.1 model). Decode steps run at fabricated state of the wanted
context (no prefill of batch x context tokens); prefill runs one prompt from position 0. Every shape
gets its roofline (`roofline`: the bytes and FLOPs the step must move) and per-layer and 43-layer
figures (`sweep_report`). Prints tables, writes benchmarks/results/sweep_<gpu>.json and a PNG.

    python benchmarks/sweep.py                                   # the H200 sweep (see examples/sweep)
    python benchmarks/sweep.py --device cpu --tiny --layers 1 --batches 1,2 --contexts 64 --prefill 128
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the sibling modules, run as a script

import roofline as RL  # noqa: E402
import roofline_v41 as RL41  # noqa: E402
from sweep_model import (  # noqa: E402
    bench_config, build_random_model, cache_layout, default_expert_dtype, finish_model, full_config,
    load_base_config, prefill_cache, random_ids, use_cuda_core_moe, weight_bytes)
from sweep_report import (  # noqa: E402
    extrapolate, fractions, print_tables, print_verdicts, sweep_assumptions, verdicts)
from sweep_timing import Clock, free, run_decode, run_prefill  # noqa: E402
from v41_cut import DEFAULT_ENGRAM_ROWS, cut_notes, family, text_keys  # noqa: E402

from deepinfer_core.config import ModelConfig  # noqa: E402
from deepinfer_core.model import ForwardBatch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def sizes(text: str) -> list[int]:
    """'1,8,64' or '1k,32k' -> ints (k = 1024)."""
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--device", default=None, help="torch device (default: the detected platform's)")
    m.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16 | float32")
    m.add_argument("--no-qat", action="store_true", help="simulate_qat=False (default: the engine's True)")
    m.add_argument("--tiny", action="store_true", help="tiny dimensions (deepinfer_core/tools/tiny_config.py)")
    m.add_argument("--config", default=None, help="config.json to take the width from (default: the real V4-Flash config in tests/data)")
    m.add_argument("--layers", type=int, default=4,
                   help="main layers built and run (V4: CSA/HCA alternating; V4.1: the shared V4.1 "
                        "cut, benchmarks/v41_cut.py)")
    m.add_argument("--full-layers", type=int, default=None,
                   help="depth the figures are extrapolated to (default: 43; V4.1: the config's)")
    m.add_argument("--expert-dtype", default=None, choices=("fp8", "fp4", "bf16"),
                   help="routed experts (default: fp8; V4.1: fp4, set by its quantization_config)")
    m.add_argument("--engram-rows", type=int, default=DEFAULT_ENGRAM_ROWS,
                   help="V4.1: Engram table rows per head and n-gram order at most "
                        "(engram_vocab_size; real tables need ~100 GB a layer; 0: the config's)")
    m.add_argument("--experts", type=int, default=None,
                   help="routed experts per layer (default: the config's); the figures then extrapolate to "
                        "a model with as many (fewer experts: fewer distinct ones hit at batch > 1)")
    m.add_argument("--fp4-experts", action="store_true",
                   help="with --expert-dtype fp4: keep the experts FP4 in the fused MoE (LLM(fp4_experts=True)) "
                        "instead of re-encoding them to FP8 at load")
    m.add_argument("--cuda-core-moe", type=float, default=None, metavar="ROWS",
                   help="fused MoE on its CUDA-core kernels up to ROWS mean rows per expert, either weight form "
                        "(0: tensor cores only; unset: the engine's choice, moe.GEMV_TILES)")
    m.add_argument("--vocab", type=int, default=None, help="override vocab_size (CPU smoke runs)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--batch-invariant", action="store_true", help="batch-invariant kernels (DEEPINFER_BATCH_INVARIANT)")
    m.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8"),
                   help="storage of the window and compressed KV rows, as LLM(kv_cache_dtype=...)")
    s = ap.add_argument_group("shapes and timing")
    s.add_argument("--batches", type=sizes, default=sizes("1,8,64,256"))
    s.add_argument("--contexts", type=sizes, default=sizes("1k,4k,16k,32k"))
    s.add_argument("--prefill", type=sizes, default=sizes("4k,16k"), help="prompt lengths")
    s.add_argument("--prefill-chunk", type=int, default=16384, help="max_num_batched_tokens per forward")
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--max-shape-seconds", type=float, default=20.0, help="stop repeating a shape after this")
    s.add_argument("--cuda-graph", action="store_true", help="also time decode steps replayed from a CUDA graph")
    s.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for the whole run; shapes not started by then are recorded as not run (0: no limit)")
    h = ap.add_argument_group("transformers")
    h.add_argument("--no-hf", action="store_true", help="skip transformers")
    h.add_argument("--hf-max-prefill", type=int, default=4096)
    h.add_argument("--hf-max-batch", type=int, default=8)
    h.add_argument("--hf-max-context", type=int, default=4096)
    h.add_argument("--hf-max-tokens", type=int, default=8192, help="HF decode needs a real prefill of batch x context")
    h.add_argument("--hf-reps", type=int, default=3)
    p = ap.add_argument_group("peaks and output")
    p.add_argument("--peak-bw", type=float, default=None, help="HBM bytes/s (default: by GPU, roofline.Peaks.for_device)")
    p.add_argument("--peak-bf16", type=float, default=None, help="bf16 FLOP/s (default: by GPU)")
    p.add_argument("--peak-fp8", type=float, default=None, help="FP8 FLOP/s (default: by GPU)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--no-plot", action="store_true")
    return ap


def _err(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return "failed: out of memory"
    traceback.print_exc(file=sys.stderr)
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def over_budget(a) -> str | None:
    """The 'not run' status once --time-budget is spent (checked before every shape)."""
    if a.time_budget and time.perf_counter() - a.t_start > a.time_budget:
        return f"not run: --time-budget {a.time_budget:.0f} s spent"
    return None


# ---- transformers --------------------------------------------------------------------------------

def hf_build(a, cfg_dict: dict, built) -> tuple[object | None, dict]:
    """transformers' model on our checkpoint-format weights (call before `finish_model`)."""
    import sweep_hf as H
    info: dict = {}
    t0 = time.perf_counter()
    try:
        import transformers
        info["version"] = transformers.__version__
        hf = H.build_hf(dict(built.model.state_dict()), cfg_dict, built.ctx.device, built.ctx.torch_dtype,
                        built.cfg.weight_block_size or (128, 128))
    except Exception as e:
        info["status"] = f"not run: could not build transformers' model: {_err(e)}"
        return None, info
    info.update(status="ok", build_s=time.perf_counter() - t0,
                weight_bytes=sum(p.numel() * p.element_size() for p in hf.state_dict().values()))
    return hf, info


def hf_runs(a, hf, built, layout, clock: Clock, info: dict) -> tuple[dict, dict]:
    """({tokens: prefill timing}, {(batch, ctx): decode timing}) of transformers, plus an agreement
    check of one prompt's logits against ours (in `info`)."""
    import sweep_hf as H
    dev, V = built.ctx.device, built.cfg.vocab_size
    pre, dec = {}, {}
    try:                                                # same weights? compare one prompt's last logits
        n = 48
        ids = random_ids(n, V, a.seed + 7)
        cache = prefill_cache(layout, n, dev)
        with torch.no_grad():
            ours = built.model(ForwardBatch.build([ids], [cache.bind(0, list(range(cache.num_blocks)))], dev)).logits[0]
        ref = H.hf_step(hf, torch.tensor([ids], device=dev), H.new_cache(hf))[0].float()
        info["agreement"] = {"prompt_tokens": n, "max_rel_err": float((ours - ref).abs().max() / ref.abs().max()),
                             "argmax_equal": bool(ours.argmax() == ref.argmax()),
                             "note": f"last-position logits; ours {built.ctx.dtype} with simulate_qat="
                                     f"{built.ctx.simulate_qat} (FP8 activations), transformers unquantised; "
                                     "float32 without QAT they agree to ~1e-6 (tests/benchmarks)"}
    except Exception as e:
        info["agreement"] = {"status": _err(e)}
    for n in a.prefill:
        if over_budget(a):
            pre[n] = {"status": over_budget(a)}
            continue
        if n > a.hf_max_prefill:
            pre[n] = {"status": f"not run: prefill of {n} tokens > --hf-max-prefill {a.hf_max_prefill}"}
            continue
        try:
            ids = torch.tensor([random_ids(n, V, a.seed + n)], device=dev)
            t = clock.time(lambda: H.hf_step(hf, ids, H.new_cache(hf)), None, 1, a.hf_reps, a.max_shape_seconds)
            pre[n] = {"status": "ok", **t.to_dict()}
        except Exception as e:
            pre[n] = {"status": _err(e)}
    for b in a.batches:
        for c in a.contexts:
            why = [f"batch {b} > --hf-max-batch {a.hf_max_batch}"] if b > a.hf_max_batch else []
            why += [f"context {c} > --hf-max-context {a.hf_max_context}"] if c > a.hf_max_context else []
            why += [f"batch x context {b * c} > --hf-max-tokens {a.hf_max_tokens}"] if b * c > a.hf_max_tokens else []
            if why or over_budget(a):
                dec[(b, c)] = {"status": over_budget(a) or "not run: " + "; ".join(why)}
                continue
            try:
                cache = H.new_cache(hf)
                ids = torch.tensor([random_ids(c, V, a.seed + i) for i in range(b)], device=dev)
                H.hf_step(hf, ids, cache)                   # HF's own prefill of the context (not timed)
                step = torch.randint(2, V, (b, 1), device=dev)
                t = clock.time(lambda: H.hf_step(hf, step, cache), None, 1, a.hf_reps, a.max_shape_seconds)
                dec[(b, c)] = {"status": "ok", "note": f"steps at positions {c}..", **t.to_dict()}
            except Exception as e:
                dec[(b, c)] = {"status": _err(e)}
            finally:
                cache = None
                free(dev)
    return pre, dec


# ---- rows ----------------------------------------------------------------------------------------

def finish_row(row: dict, roof, full_roof, ratios, full_ratios, peaks, hf: dict | None, n_tokens: int) -> None:
    """The row's roofline, transformers' timing and figures; `ratios` / `full_ratios`: each layer's
    kind for the extrapolation (V4: its ratio; V4.1: roofline_v41.layer_kind)."""
    row["roofline"] = {"bench": roof.to_dict(peaks), "full": full_roof.to_dict(peaks)}
    row["hf"] = hf or {"status": "not run: --no-hf"}
    if row.get("status") != "ok":
        return
    ms = row["step_ms"]
    row.update(fractions(ms, roof, peaks))
    ex = extrapolate(ms, row.get("split"), ratios, full_ratios, roof, peaks)
    row["extrapolated"] = ex
    row["per_layer_ms"] = ex["per_layer_ms"]
    full = fractions(ex["full_ms"], full_roof, peaks)
    row.update({f"full_{k}": v for k, v in full.items()})          # full_x_roofline, full_hbm_frac, ...
    if row["hf"].get("status") == "ok":
        row["speedup_vs_hf"] = row["hf"]["median_ms"] / ms
    if "batch" in row:
        row.update(tpot_ms=ex["full_ms"], output_tok_s=row["batch"] / (ex["full_ms"] / 1e3),
                   output_tok_s_measured_model=row["batch"] / (ms / 1e3))
    else:
        row.update(ttft_ms=ex["full_ms"], prefill_tok_s=n_tokens / (ms / 1e3),
                   prefill_tok_s_full=n_tokens / (ex["full_ms"] / 1e3))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return ""


def versions() -> dict:
    """Installed versions, read from the package metadata (importing transformers costs seconds)."""
    from importlib import metadata
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for dist in ("triton", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: list[str] | None = None) -> dict:
    a = parser().parse_args(argv)
    a.t_start = t_start = time.perf_counter()
    base, source = load_base_config(a.config, a.tiny)
    fam = family(base)
    if a.vocab:
        text_keys(base)["vocab_size"] = a.vocab
    a.expert_dtype = a.expert_dtype or default_expert_dtype(base)
    own_depth = int(text_keys(base)["num_hidden_layers"])
    a.full_layers = a.full_layers or (own_depth if fam == "v41" else 43)
    try:
        cfg_dict = bench_config(base, a.layers, a.expert_dtype, a.engram_rows or None, a.experts)
        full_dict = full_config(base, cfg_dict, a.full_layers)
    except ValueError as e:               # a V4.1 cut's --layers / --expert-dtype / --engram-rows / --experts
        raise SystemExit(f"sweep: {e}") from None
    if a.cuda_core_moe is not None:
        use_cuda_core_moe(a.cuda_core_moe)
    try:                                  # refused before any weight is made when they cannot fit
        built = build_random_model(cfg_dict, a.device, a.dtype, not a.no_qat, a.seed,
                                   batch_invariant=a.batch_invariant, options=dict(fp4_experts=a.fp4_experts))
    except ValueError as e:
        raise SystemExit(f"sweep: {e}") from None
    plan = built.weight_plan or {}
    if plan.get("status") == "ok":
        print(f"[sweep] weights: {plan['checkpoint_bytes'] / 1e9:.2f} GB checkpoint, "
              f"{plan['runtime_bytes'] / 1e9:.2f} GB runtime ({plan['device_bytes'] / 1e9:.2f} GB on the device); "
              f"MoE layers fused: "
              f"{plan['moe_layers_fused']} of {plan['moe_layers']}", flush=True)
    dev, cfg = built.ctx.device, built.cfg
    full_cfg = ModelConfig.from_dict(full_dict)
    ratios = [cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)]
    full_ratios = [full_cfg.layer_ratio(i) for i in range(full_cfg.num_hidden_layers)]
    kinds, full_kinds = ratios, full_ratios                 # what the extrapolation tells apart
    if fam == "v41":
        kinds = [RL41.layer_kind(cfg, i) for i in range(len(ratios))]
        full_kinds = [RL41.layer_kind(full_cfg, i) for i in range(len(full_ratios))]
    clock = Clock(dev)
    gpu = torch.cuda.get_device_name(torch.device(dev)) if clock.cuda else "cpu"
    known = RL.Peaks.for_device(gpu)
    peaks = RL.Peaks(a.peak_bw or known.bw, a.peak_bf16 or known.bf16, a.peak_fp8 or known.fp8)
    ops = built.ops_summary()
    print(f"[sweep] {gpu}: {a.layers}-layer model ({source}), ratios {ratios}, fp8 linear {ops['linear']['fp8']}, "
          f"attention {ops['attention']}, moe {ops['moe']}", flush=True)
    ckpt_bytes = weight_bytes(built.model)
    layout = cache_layout(cfg, built.ctx.torch_dtype, built.ctx.simulate_qat, a.kv_cache_dtype)
    if a.no_hf or fam == "v41":
        hf, hf_info = None, {"status": "not run: --no-hf" if a.no_hf else "not run: transformers "
                             "has no DeepSeek-V4.1 model (model_type deepseek_v41)"}
    else:
        hf, hf_info = hf_build(a, cfg_dict, built)
    hf_none = {"status": hf_info["status"]} if fam == "v41" else None     # V4: "not run: --no-hf"
    finish_model(built)                                  # the weights in our runtime form from here on
    hf_pre, hf_dec = {}, {}
    if hf is not None:
        hf_pre, hf_dec = hf_runs(a, hf, built, layout, clock, hf_info)
        hf = None                                        # free transformers' copy before our sweep
        free(dev)
    # bytes per cached KV element (584/512 with FP8 rows; the indexer keys, bf16, are counted at this
    # rate too, which makes the roofline slightly faster than the truth: conservative for us)
    elem = layout.kv_row_bytes / layout.head_dim
    prefill_rows, decode_rows = [], []
    for n in a.prefill:
        row = {"tokens": n, "chunk": a.prefill_chunk, "label": f"prefill {n}", "status": over_budget(a) or "ok"}
        try:
            if row["status"] == "ok":
                row.update(run_prefill(built, layout, n, a.prefill_chunk, clock, a))
        except Exception as e:
            row["status"] = _err(e)
        free(dev)
        finish_row(row, RL.prefill_roofline(cfg, ratios, n, a.prefill_chunk, elem),
                   RL.prefill_roofline(full_cfg, full_ratios, n, a.prefill_chunk, elem), kinds,
                   full_kinds, peaks, None if a.no_hf else hf_pre.get(n, hf_none), n)
        prefill_rows.append(row)
        print(f"[sweep] prefill {n}: {row['status']} {row.get('step_ms', float('nan')):.3f} ms", flush=True)
    graph_note: dict = {}
    for b in a.batches:
        for c in a.contexts:
            row = {"batch": b, "context": c, "label": f"decode b{b} c{c}", "status": over_budget(a) or "ok"}
            try:
                if row["status"] == "ok":
                    row.update(run_decode(built, layout, b, c, clock, a, graph_note))
            except Exception as e:
                row["status"] = _err(e)
            free(dev)
            finish_row(row, RL.decode_roofline(cfg, ratios, b, c, elem),
                       RL.decode_roofline(full_cfg, full_ratios, b, c, elem), kinds, full_kinds,
                       peaks, None if a.no_hf else hf_dec.get((b, c), hf_none), b)
            decode_rows.append(row)
            print(f"[sweep] decode b{b} c{c}: {row['status']} {row.get('step_ms', float('nan')):.3f} ms", flush=True)
    vs = verdicts(decode_rows, prefill_rows)
    print_tables(decode_rows, prefill_rows, a.full_layers, a.layers)
    print_verdicts(vs)
    result = {
        "schema": "deepinfer-sweep/1", "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": gpu, "device": str(dev), "commit": _git("rev-parse", "HEAD") or None,
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")), "versions": versions(),
        "command": [sys.executable, *sys.argv] if argv is None else ["sweep.py", *argv],
        "family": fam, "config_source": source, "config": cfg_dict, "layers": a.layers,
        "ratios": ratios,
        "full_layers": a.full_layers, "full_ratios": full_ratios, "ops": built.ops_summary(),
        "weights": {"checkpoint_format_bytes": ckpt_bytes, "runtime_bytes": weight_bytes(built.model),
                    "plan": built.weight_plan, "note": "MTP block not built (never run)"},
        "routed_experts": {"bench": cfg.n_routed_experts, "config": int(text_keys(base)["n_routed_experts"])},
        "cache": {"dtype": str(layout.dtype), "kv_fp8": layout.kv_fp8, "backtrack": layout.backtrack, "slot_bytes": layout.slot_bytes,
                  "block_bytes": layout.block_bytes},
        "peaks": {"bw": peaks.bw, "bf16": peaks.bf16, "fp8": peaks.fp8},
        "assumptions": sweep_assumptions(fam),
        "settings": {k: getattr(a, k) for k in ("warmup", "reps", "max_shape_seconds", "time_budget", "prefill_chunk",
                                                "cuda_graph", "seed", "dtype", "no_qat", "kv_cache_dtype", "batch_invariant", "expert_dtype",
                                                "experts", "fp4_experts", "cuda_core_moe", "hf_max_prefill",
                                                "hf_max_batch", "hf_max_context", "hf_max_tokens", "hf_reps")},
        "hf": hf_info, "prefill": prefill_rows, "decode": decode_rows, "verdicts": vs,
    }
    if fam == "v41":
        result.update(layer_kinds=kinds, full_layer_kinds=full_kinds,
                      v41_cut=cut_notes(base, cfg_dict))
        result["weights"]["note"] = "DSpark drafter stages dropped by the V4.1 cut (never run)"
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "sweep_" + gpu.replace(" ", "_") + ("_v41" if fam == "v41" else "") \
        + ("_tiny" if a.tiny else "") + ("_kvfp8" if layout.kv_fp8 else "") \
        + ("_invariant" if a.batch_invariant else "") + ("_fp4experts" if a.fp4_experts else "") \
        + ("" if a.cuda_core_moe is None else f"_ccmoe{a.cuda_core_moe:g}")
    png = out_dir / f"{stem}.png"
    if a.no_plot:
        result["plot"] = "not drawn: --no-plot"
    else:
        try:
            from plot_sweep import plot
            result["plot"] = plot(result, png)
        except Exception as e:                             # the plot never takes the sweep down
            result["plot"] = f"not drawn: {type(e).__name__}: {e}"
        print(f"[sweep] plot: {result['plot']}")
    result["elapsed_s"] = time.perf_counter() - t_start
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"[sweep] wrote {path} ({result['elapsed_s']:.0f} s)")
    result["json_path"] = str(path)
    return result


if __name__ == "__main__":
    main()
