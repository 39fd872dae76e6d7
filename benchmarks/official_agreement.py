"""Greedy agreement of the engine with DeepSeek's official V4 inference code, on the same checkpoint.

    python benchmarks/official_agreement.py --official-dir PATH [--device cuda] [--model DIR]

PATH is a copy of the `inference/` folder of the Hugging Face repo deepseek-ai/DeepSeek-V4-Flash
(model.py, kernel.py, ...; nothing of it is part of this repository). Its model.py runs on the CPU
in bf16, as DeepSeek ships it, with CPU stand-ins for its TileLang kernels and for
fast_hadamard_transform (benchmarks/official_kernels.py); the checkpoint (default: the bundled
trained tiny model) is loaded the way the official convert.py prepares it. Each of backend_agreement's
16 prompts runs alone with the official loop's shapes: the whole prompt in one forward, then one token
per forward, 32 greedy tokens. The engine (`LLM.generate`, no speculation, the prompt prefilled in one
step, one token per step after) runs the same prompts per setting: bf16 + simulate_qat, bf16, float32.

Reported per setting: the greedy agreement (each continuation counted up to its first divergence from
the official one, as a fraction of 32, averaged) and the mean / max |difference| of the log-prob of
the official's chosen token, the engine teacher-forced along the official path with the same shapes
(ModelRunner: the prompt, then the official tokens one per forward). Prints a table and writes
benchmarks/results/official_agreement_<device>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import official_kernels
from backend_agreement import GREEDY_PROMPTS, first_divergence
from sweep_hf import default_dtype

SETTINGS = {"bf16-qat": ("bfloat16", True), "bf16": ("bfloat16", False), "fp32": ("float32", False)}
REQUIRED = ("model.py", "kernel.py")


# ---- the official code ---------------------------------------------------------------------------
def check_official_dir(path: Path) -> Path:
    missing = [f for f in REQUIRED if not (path / f).is_file()]
    if missing:
        raise SystemExit(
            f"--official-dir {path}: no {' or '.join(missing)} there. Point it at the inference/ "
            "folder of the Hugging Face repo deepseek-ai/DeepSeek-V4-Flash, e.g. after "
            "`huggingface-cli download deepseek-ai/DeepSeek-V4-Flash --include \"inference/*\" "
            "--local-dir DIR`: --official-dir DIR/inference")
    return path


@contextlib.contextmanager
def stand_ins():
    """`kernel` and `fast_hadamard_transform` in sys.modules as the CPU stand-ins (model.py imports
    the latter inside its forward), the previous entries restored after."""
    fakes = official_kernels.fake_modules()
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def load_official_module(official_dir: Path):
    """model.py of `official_dir`, imported with the stand-ins as its kernels."""
    path = check_official_dir(official_dir) / "model.py"
    spec = importlib.util.spec_from_file_location("deepseek_official_model", path)
    module = importlib.util.module_from_spec(spec)
    with stand_ins():
        spec.loader.exec_module(module)
    return module


def official_args(module, hf_config: dict, max_seq_len: int):
    """ModelArgs from the checkpoint's Hugging Face config.json (the names of inference/config.json)."""
    c, rope = hf_config, hf_config.get("rope_scaling") or {}
    quant = c.get("quantization_config") or {}
    return module.ModelArgs(
        max_batch_size=1, max_seq_len=max_seq_len,
        dtype="fp8" if quant.get("quant_method") == "fp8" else "bf16", scale_fmt=quant.get("scale_fmt"),
        expert_dtype=c.get("expert_dtype"), vocab_size=c["vocab_size"], dim=c["hidden_size"],
        moe_inter_dim=c["moe_intermediate_size"], n_layers=c["num_hidden_layers"],
        n_hash_layers=c.get("num_hash_layers", 0), n_mtp_layers=0, n_heads=c["num_attention_heads"],
        n_routed_experts=c["n_routed_experts"], n_shared_experts=c["n_shared_experts"],
        n_activated_experts=c["num_experts_per_tok"], score_func=c["scoring_func"],
        route_scale=c["routed_scaling_factor"], swiglu_limit=c.get("swiglu_limit", 0.0),
        q_lora_rank=c["q_lora_rank"], head_dim=c["head_dim"], rope_head_dim=c["qk_rope_head_dim"],
        norm_eps=c["rms_norm_eps"], o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
        window_size=c["sliding_window"], compress_ratios=tuple(c["compress_ratios"]),
        compress_rope_theta=c["compress_rope_theta"], rope_theta=c["rope_theta"],
        original_seq_len=rope.get("original_max_position_embeddings", 0),
        rope_factor=rope.get("factor", 1.0),
        beta_fast=rope.get("beta_fast", 32), beta_slow=rope.get("beta_slow", 1),
        index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"], index_topk=c["index_topk"],
        hc_mult=c["hc_mult"], hc_sinkhorn_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"])


def checkpoint_tensors(model_dir: Path, expert_fp4: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as convert.py hands them to model.py: wo_a dequantised to bf16 (its
    scale dropped), FP4 expert weights viewed as float4_e2m1fn_x2; the MTP drafter left out."""
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update((k, v) for k, v in load_file(f).items() if not k.startswith("mtp."))
    for name in [k for k in out if k.endswith("wo_a.weight")]:
        w, s = out[name], out.pop(name.replace("weight", "scale")).float()
        w = w.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)).float() * s[:, None, :, None]
        out[name] = w.flatten(2, 3).flatten(0, 1).bfloat16()
    for name, t in out.items():
        if expert_fp4 and ".experts." in name and t.dtype == torch.int8:
            out[name] = t.view(torch.float4_e2m1fn_x2)
    return out


def load_official_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy every tensor into the official parameters in place (Linear.weight.scale aliases stay)."""
    params = model.state_dict(keep_vars=True)
    if missing := sorted(set(params) - set(tensors)):
        raise SystemExit(f"the checkpoint lacks {len(missing)} official parameters, e.g. {missing[:4]}")
    if extra := sorted(set(tensors) - set(params)):
        raise SystemExit(f"the checkpoint has {len(extra)} tensors model.py does not know, "
                         f"e.g. {extra[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if p.shape != t.shape:
                raise SystemExit(f"{name}: checkpoint shape {tuple(t.shape)}, "
                                 f"model.py wants {tuple(p.shape)}")
            if p.element_size() == 1 and p.dtype.is_floating_point:    # fp8, e8m0, fp4 x2: bytes
                if t.dtype != p.dtype:
                    raise SystemExit(f"{name}: checkpoint dtype {t.dtype}, model.py wants {p.dtype}")
                p.data.view(torch.uint8).copy_(t.view(torch.uint8))
            else:
                p.data.copy_(t)


class Official:
    """model.py's Transformer in bf16 on `device` (the CPU by default) with the checkpoint loaded."""

    def __init__(self, official_dir: Path, model_dir: Path, max_seq_len: int, device: str = "cpu"):
        self.module, self.device = load_official_module(official_dir), torch.device(device)
        config = json.loads((model_dir / "config.json").read_text())
        args = official_args(self.module, config, max_seq_len)
        with default_dtype(torch.bfloat16), self.device:
            self.model = self.module.Transformer(args)
        load_official_weights(self.model, checkpoint_tensors(model_dir, args.expert_dtype == "fp4"))
        self.fresh = {k: v.clone() for k, v in self.model.named_buffers() if "freqs_cis" not in k}

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
        """generate.py's loop for one prompt: (tokens, their log-probs, top-2 log-prob gaps)."""
        for k, v in self.model.named_buffers():              # a fresh state per prompt
            if k in self.fresh:
                v.copy_(self.fresh[k])
        toks, lps, gaps, seq, pos = [], [], [], list(ids), 0
        with default_dtype(torch.bfloat16), stand_ins(), official_kernels.CudaBf16Rsqrt(), self.device:
            for _ in range(n):
                logits = self.model(torch.tensor([seq[pos:]]), pos)[0].float().cpu()
                pos = len(seq)
                lp = torch.log_softmax(logits, -1)
                toks.append(int(logits.argmax()))                  # generate.py's greedy choice
                lps.append(float(lp[toks[-1]]))
                top2 = lp.topk(2).values
                gaps.append(float(top2[0] - top2[1]))
                seq.append(toks[-1])
        return toks, lps, gaps


# ---- the engine ----------------------------------------------------------------------------------
def engine_setting(model_dir: Path, dtype: str, qat: bool, device: str, prompts: list[list[int]],
                   official: list[dict], n: int) -> dict:
    """LLM.generate one prompt at a time; then the runner teacher-forced along the official tokens."""
    from deepinfer_core import LLM, SamplingParams
    llm = LLM(model=str(model_dir), dtype=dtype, simulate_qat=qat, device=device,
              num_speculative_tokens=0, max_model_len=max(map(len, prompts)) + n + 1,
              engine_process=False)                     # its runner, in this process, for the log-probs
    if llm.max_num_batched_tokens < max(map(len, prompts)):
        raise SystemExit("max_num_batched_tokens is below the prompt length: the prefill would be "
                         "chunked")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    generated = [llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                 .outputs[0].token_ids for ids in prompts]
    runner, deltas, forced = llm.runner, [], []
    attention = type(runner.loaded.ops.attention)
    for ids, off in zip(prompts, official):
        state, feed, d = runner.new_sequence(), list(ids), []
        try:
            for i, tok in enumerate(off["tokens"]):
                lp = torch.log_softmax(runner.forward(state, feed)[-1].float().cpu(), -1)
                d.append(abs(float(lp[tok]) - off["logprobs"][i]))
                if len(forced) == len(deltas) and int(lp.argmax()) != tok:
                    forced.append(i)
                feed = [tok]
        finally:
            runner.release(state)
        if len(forced) == len(deltas):
            forced.append(n)
        deltas.append(d)
    llm.close()
    prefix = [first_divergence(list(g), o["tokens"], n) for g, o in zip(generated, official)]
    flat = [x for d in deltas for x in d]
    return {"agreement": sum(prefix) / (n * len(prefix)), "identical": sum(p == n for p in prefix),
            "first_divergence": prefix, "teacher_forced_first_divergence": forced,
            "official_gap_at_divergence": [round(o["gaps"][p], 4)
                                           for o, p in zip(official, prefix) if p < n],
            "mean_abs_logprob_diff": sum(flat) / len(flat), "max_abs_logprob_diff": max(flat),
            "attention_backend": f"{attention.__module__}.{attention.__qualname__}",
            "engine_tokens": [list(g) for g in generated]}


def git_state() -> dict:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=False)
        return done.stdout.rstrip()
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "modified": git("status", "--porcelain").splitlines()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--official-dir", type=Path, required=True,
                    help="the inference/ folder of deepseek-ai/DeepSeek-V4-Flash (model.py, kernel.py)")
    ap.add_argument("--device", default="cpu", help="the engine's device")
    ap.add_argument("--official-device", default="cpu",
                    help="the device DeepSeek's code runs on, with the same stand-ins (default: cpu)")
    ap.add_argument("--model", type=Path,
                    help="checkpoint directory (default: the bundled trained tiny model)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, of {', '.join(SETTINGS)}")
    args = ap.parse_args()
    settings = args.settings.split(",")
    if bad := [s for s in settings if s not in SETTINGS]:
        ap.error(f"--settings: unknown {bad}; allowed: {', '.join(SETTINGS)}")
    check_official_dir(args.official_dir)
    from deepinfer_core.api.tokenizer import load_tokenizer
    from deepinfer_core.tools.bundled_model import bundled_tiny_model_dir
    model_dir = args.model or Path(bundled_tiny_model_dir())
    n, tok = args.tokens, load_tokenizer(str(model_dir))
    prompts = [tok.encode(p) for p in GREEDY_PROMPTS]

    t0, git = time.time(), git_state()
    official = Official(args.official_dir, model_dir, max(map(len, prompts)) + n + 1,
                        args.official_device)
    runs = [dict(zip(("tokens", "logprobs", "gaps"), official.greedy(ids, n))) for ids in prompts]
    print(f"official code ({args.official_device}, bf16, stand-in kernels): {len(prompts)} prompts x {n} tokens in "
          f"{time.time() - t0:.0f} s", flush=True)
    rows = []
    for name in settings:
        dtype, qat = SETTINGS[name]
        t0 = time.time()
        row = {"setting": name, "dtype": dtype, "simulate_qat": qat,
               **engine_setting(model_dir, dtype, qat, args.device, prompts, runs, n)}
        rows.append(row)
        print(f"{name:9} agreement {row['agreement']:.3f} "
              f"({row['identical']}/{len(prompts)} identical), "
              f"mean |dlogprob| {row['mean_abs_logprob_diff']:.4f}, "
              f"max {row['max_abs_logprob_diff']:.4f} "
              f"({time.time() - t0:.0f} s)", flush=True)
    print(f"\n{'engine vs official':27} {'agreement':>9} {'identical':>9} {'mean|dlp|':>10} "
          f"{'max|dlp|':>9}")
    for r in rows:
        label = f"{r['dtype']}, simulate_qat {'on' if r['simulate_qat'] else 'off'}"
        print(f"{label:27} {r['agreement']:9.3f} {r['identical']:>6}/{len(prompts):<2} "
              f"{r['mean_abs_logprob_diff']:10.4f} {r['max_abs_logprob_diff']:9.4f}")
    on_gpu = "cuda" in (args.device, args.official_device)
    gpu = torch.cuda.get_device_name() if on_gpu else None
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    result = {
        "model": str(args.model or "bundled trained tiny model"), "device": args.device, "gpu": gpu,
        "official": f"model.py on {args.official_device}, bf16, the stand-ins of "
                    "benchmarks/official_kernels.py",
        "prompts": len(prompts), "tokens": n, "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), **git, "command": command,
        "logprob_diff": "|engine - official| log-prob of the official's chosen token, teacher-forced "
                        "along the official tokens with the official shapes, over every step",
        "official_tokens": [r["tokens"] for r in runs], "rows": rows}
    stem = f"official_agreement_{args.device.split(':')[0]}"
    if args.official_device != "cpu":
        stem += f"_official-{args.official_device.split(':')[0]}"
    out = HERE / "results" / f"{stem}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
