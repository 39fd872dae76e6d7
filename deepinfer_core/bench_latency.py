"""`deepinfer bench latency`: the end-to-end latency of one batch through `LLM.generate` (like
`vllm bench latency`).

One batch of `--batch-size` prompts of `--input-len` random token ids (seeded), each generating
exactly `--output-len` tokens (`ignore_eos`), runs `--num-iters-warmup` times unmeasured, then
`--num-iters` times measured: the wall time of each whole `generate` call (prefill of the batch,
every decode step, sampling, detokenizing). Prints the average and the percentiles and writes a JSON
(the settings, the device, the versions, every latency) to
benchmarks/results/latency_<device>_<label>.json in a source checkout, else to the current folder,
or to `--output-json`.

It ships inside the package (unlike the scripts under benchmarks/): it runs from an installed wheel.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .api.sampling_params import SamplingParams
from .engine_config import EngineConfig
from .generate import (
    _add_engine_flags,
    _fail,
    _OneLineParser,
    choose_model,
    engine_options_from_args,
    load_llm,
)

PROG = "deepinfer bench latency"
PERCENTILES = (10, 25, 50, 75, 90, 99)
POSITIVE = ("batch_size", "input_len", "output_len", "num_iters")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    w = parser.add_argument_group("workload")
    w.add_argument("--model", help="checkpoint directory or repo id in the local Hugging Face "
                   "cache (default: as `deepinfer generate`)")
    w.add_argument("--batch-size", type=int, default=8,
                   help="prompts per generate call (default: 8)")
    w.add_argument("--input-len", type=int, default=32,
                   help="prompt length in tokens (default: 32)")
    w.add_argument("--output-len", type=int, default=128,
                   help="generated tokens per prompt (default: 128)")
    w.add_argument("--num-iters-warmup", type=int, default=10,
                   help="unmeasured generate calls first (default: 10)")
    w.add_argument("--num-iters", type=int, default=30,
                   help="measured generate calls (default: 30)")
    w.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 = greedy (default: 1.0, as vLLM's)")
    w.add_argument("--seed", type=int, default=0, help="seeds the prompts and the LLM (default: 0)")
    o = parser.add_argument_group("output")
    o.add_argument("--label", default=None, help="name of the run in the JSON file name "
                   "(default: the model folder's name)")
    o.add_argument("--output-json", metavar="PATH", default=None,
                   help="result path (default: benchmarks/results/latency_<device>_<label>.json "
                   "in a source checkout, else latency_<device>_<label>.json here)")
    _add_engine_flags(parser)
    return parser


def _check(args: argparse.Namespace) -> None:
    for name in POSITIVE:
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}={getattr(args, name)}; allowed: an int >= 1")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup={args.num_iters_warmup}; allowed: an int >= 0")
    if args.output_json and not Path(args.output_json).expanduser().parent.is_dir():
        raise ValueError(f"--output-json: folder {Path(args.output_json).parent} does not exist")


def summarize(latencies: Sequence[float], batch_size: int, output_len: int) -> dict[str, Any]:
    import numpy as np
    avg = statistics.fmean(latencies)
    return {"avg_latency": avg, "latencies": list(latencies),
            "percentiles": {str(q): float(np.percentile(latencies, q)) for q in PERCENTILES},
            "output_tokens_per_s": batch_size * output_len / avg}


def default_json_path(device: str, label: str) -> Path:
    from .env_report import source_checkout
    root = source_checkout()
    folder = root / "benchmarks" / "results" if root else Path.cwd()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{device}_{label}")
    return folder / f"latency_{safe}.json"


def run(llm: Any, args: argparse.Namespace) -> list[float]:
    """The latencies (seconds) of the measured generate calls."""
    rng = random.Random(args.seed)
    vocab = int(llm.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.batch_size)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True)
    latencies = []
    for i in range(args.num_iters_warmup + args.num_iters):
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        got = [len(o.outputs[0].token_ids) for o in outputs]
        if got != [args.output_len] * args.batch_size:    # the time would be of other work
            raise RuntimeError(f"generate returned {got} tokens per prompt, not {args.output_len}")
        if i >= args.num_iters_warmup:
            latencies.append(elapsed)
        else:
            print(f"warm-up {i + 1}/{args.num_iters_warmup}: {elapsed:.4f} s", file=sys.stderr)
    return latencies


def _run_info(llm: Any) -> dict[str, Any]:
    """Where it ran: device, its name, dtype, versions, commit (in a source checkout), date."""
    import torch

    from . import __version__
    from .env_report import git_commit, source_checkout
    root = source_checkout()
    device = str(llm.device)
    return {"device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "dtype": str(llm.config.model.dtype), "deepinfer_version": __version__,
            "torch_version": torch.__version__, "commit": git_commit(root) if root else "",
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    engine_options = engine_options_from_args(args)
    try:
        _check(args)
        # the whole config checked before the (slow) load
        config = EngineConfig.from_options(model=args.model, **engine_options)
        model = choose_model(config.model.model, PROG)
        start = time.perf_counter()
        llm = load_llm(model, seed=args.seed, **engine_options)
        startup = time.perf_counter() - start
        try:
            latencies = run(llm, args)
        finally:
            if llm.config.parallel.in_processes:
                llm.close()
    except ValueError as exc:
        return _fail(str(exc), PROG)
    settings = (*POSITIVE, "num_iters_warmup", "temperature", "seed")
    result = {"benchmark": "latency", "model": model, **_run_info(llm),
              **{k: getattr(args, k) for k in settings},
              "engine_options": engine_options, "startup_s": startup,
              **summarize(latencies, args.batch_size, args.output_len),
              "command": ["deepinfer", "bench", "latency", *argv]}
    print(f"Avg latency: {result['avg_latency']:.4f} s ({result['output_tokens_per_s']:.1f} output "
          f"tok/s; batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
          f"{result['device']})")
    for q, v in result["percentiles"].items():
        print(f"{q}% percentile latency: {v:.4f} s")
    path = (Path(args.output_json).expanduser() if args.output_json
            else default_json_path(result["device"], args.label or Path(model).name))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
