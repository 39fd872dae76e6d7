"""DeepSeek-V4.1 SWA bounded replay (yoco_prefill_truncation_mode): what 'compact' changes, saves.

    python benchmarks/bounded_replay.py agreement [--model DIR]            # default: a tiny V4.1
    python benchmarks/bounded_replay.py prefill --width [--tokens 16384] [--device cuda]

`agreement` runs 16 random prompts (64-700 tokens) with 'off' and with 'compact' (KEEP 40 on the
tiny model's window of 16, else --keep) through `LLM.generate`, 32 greedy tokens each, float32,
and reports the greedy agreement (each continuation counted up to its first divergence, as a
fraction of 32, averaged) and the first token's log-prob difference.

`prefill` times one prompt of --tokens tokens (max_tokens=1, after one warm-up request) per mode
through `LLM.generate`. `--width`: dummy weights of tests/data/deepseek-v4.1-flash (V4.1-Flash
width from third-party values) cut to --per-half C2 and C1 layers (plus the two window-only
layers) and --experts routed experts, Engram tables of --engram-rows rows per head.

Both print a table and write benchmarks/results/bounded_replay_<what>_<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling modules, run as a script
WIDTH_CONFIG = HERE.parent / "tests" / "data" / "deepseek-v4.1-flash" / "config.json"


def commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=HERE,
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU {platform.machine()}"


def tiny_model(out: Path) -> Path:
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(out, seed=0, family="v41")


def cut_width_config(per_half: int, experts: int, engram_rows: int) -> dict:
    """The V4.1-width config with 2 window-only layers, `per_half` C2 layers (a KV source every 6
    as in the full model) and `per_half` C1 layers (an index source every 4): the benchmarks'
    shared cut (`v41_cut.cut_v41`)."""
    from v41_cut import cut_v41

    base = json.loads(WIDTH_CONFIG.read_text())
    return cut_v41(base, 2 + 2 * per_half, experts=experts, engram_rows=engram_rows,
                   flag="--per-half")


def make_llm(path: Path, mode: str, a: argparse.Namespace, dummy: bool):
    from deepinfer_core.api.llm import LLM

    kw = dict(
        dtype=a.dtype,
        simulate_qat=not a.no_qat,
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=a.keep,
        seed=0,
    )
    if a.device:
        kw["device"] = a.device
    if dummy:
        kw.update(load_format="dummy", max_num_seqs=2, max_model_len=a.tokens + 64)
    return LLM(str(path), **kw)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(a: argparse.Namespace, path: Path) -> dict:
    from deepinfer_core.api.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 700, (16,), generator=gen).tolist()
    prompts = [torch.randint(3, 128000, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=0, ignore_eos=True)
    runs = {}
    for mode in ("off", "compact"):
        llm = make_llm(path, mode, a, dummy=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[mode] = [
            (o.outputs[0].token_ids, next(iter(o.outputs[0].logprobs[0].values())).logprob)
            for o in outs
        ]
        del llm
    agree = [first_divergence(x[0], y[0]) / 32 for x, y in zip(runs["off"], runs["compact"])]
    lp = [abs(x[1] - y[1]) for x, y in zip(runs["off"], runs["compact"])]
    rows = [
        {"prompt_tokens": n, "agreement": g, "first_logprob_abs_diff": d}
        for n, g, d in zip(lengths, agree, lp)
    ]
    print(f"{'prompt':>7} {'agreement':>10} {'|dlogp| tok 1':>14}")
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} {r['agreement']:>10.3f} {r['first_logprob_abs_diff']:>14.2e}"
        )
    summary = {
        "mean_agreement": sum(agree) / len(agree),
        "max_first_logprob_abs_diff": max(lp),
        "mean_first_logprob_abs_diff": sum(lp) / len(lp),
    }
    print(
        f"mean greedy agreement {summary['mean_agreement']:.3f}; first-token |dlogp| mean "
        f"{summary['mean_first_logprob_abs_diff']:.2e}, "
        f"max {summary['max_first_logprob_abs_diff']:.2e}"
    )
    return {"rows": rows, **summary}


def prefill(a: argparse.Namespace, path: Path, dummy: bool) -> dict:
    from deepinfer_core.api.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 128000, (a.tokens,), generator=gen).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    for mode in ("off", "compact"):
        llm = make_llm(path, mode, a, dummy)
        llm.generate(
            [{"prompt_token_ids": prompt[: min(len(prompt), 512)]}], params, use_tqdm=False
        )
        times = []
        for _ in range(a.repeats):
            if a.device and a.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            if a.device and a.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        cfg = llm.model_config
        rows.append(
            {
                "mode": mode,
                "seconds": min(times),
                "tokens_per_s": a.tokens / min(times),
                "layers": cfg.num_hidden_layers,
                "consumer_layers": cfg.num_hidden_layers - cfg.n_prefill_layer,
            }
        )
        del llm
        if a.device and a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    base = rows[0]["seconds"]
    print(f"{'mode':>8} {'prefill s':>10} {'tok/s':>10} {'time saved':>11}")
    for r in rows:
        r["saved"] = 1 - r["seconds"] / base
        print(
            f"{r['mode']:>8} {r['seconds']:>10.3f} {r['tokens_per_s']:>10.0f} {r['saved']:>10.1%}"
        )
    share = rows[0]["consumer_layers"] / rows[0]["layers"]
    print(
        f"consumer half: {rows[0]['consumer_layers']} of {rows[0]['layers']} layers ({share:.0%})"
    )
    return {"rows": rows, "consumer_layer_share": share, "tokens": a.tokens}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("agreement", "prefill"))
    ap.add_argument(
        "--model",
        default=None,
        help="a V4.1 checkpoint (default: the tiny V4.1, written to a temp dir)",
    )
    ap.add_argument(
        "--width", action="store_true", help="prefill: dummy weights at V4.1-Flash width"
    )
    ap.add_argument(
        "--per-half", type=int, default=4, help="--width: C2 and C1 layers each (default 4)"
    )
    ap.add_argument("--experts", type=int, default=32, help="--width: routed experts (default 32)")
    ap.add_argument(
        "--engram-rows", type=int, default=100003, help="--width: Engram table rows per head"
    )
    ap.add_argument(
        "--tokens", type=int, default=2048, help="prefill: prompt tokens (default 2048)"
    )
    ap.add_argument(
        "--keep", type=int, default=None, help="KEEP (default 40 on the tiny model, else 140)"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--no-qat", action="store_true")
    a = ap.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.device and a.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        dummy = a.width
        if a.width:
            path = Path(tmp) / "v41_width"
            path.mkdir()
            (path / "config.json").write_text(
                json.dumps(cut_width_config(a.per_half, a.experts, a.engram_rows))
            )
            label = f"width_{2 + 2 * a.per_half}L"
        else:
            path = Path(a.model) if a.model else tiny_model(Path(tmp) / "tiny_v41")
            label = Path(a.model).name if a.model else "tiny_v41"
        a.keep = a.keep or (140 if a.width or a.model else 40)
        result = agreement(a, path) if a.what == "agreement" else prefill(a, path, dummy)
    device = a.device or "cpu"
    out = HERE / "results" / f"bounded_replay_{a.what}_{label}_{device.split(':')[0]}.json"
    record = {
        "what": a.what,
        "model": label,
        "keep": a.keep,
        "dtype": a.dtype,
        "simulate_qat": not a.no_qat,
        "device": device_name(device),
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/bounded_replay.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        **result,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
