"""The options and the workload of `benchmarks/prefix_cache.py` (its docstring says what they
mean): the presets, the parser and its checks, and the seeded prompts of every turn.
"""
from __future__ import annotations

import argparse

import numpy as np
import throughput as TP
import torch

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


def parser(doc: str = "") -> argparse.ArgumentParser:
    """prefix_cache.py's options; `doc`: its docstring (the help's description)."""
    ap = argparse.ArgumentParser(description=doc,
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
    w.add_argument("--server", action="store_true", help="through the OpenAI server (python -m "
                   "deepinfer_core.serve, one per mode; streamed /v1/completions requests over "
                   "HTTP) instead of LLM.generate")
    w.add_argument("--launch", default="", help="--server: more flags for the server command, e.g. "
                   "--launch=--no-engine-process (one flag needs the '=')")
    o = ap.add_argument_group("output")
    o.add_argument("--label", default=None,
                   help="name in the JSON file name (default: the model's)")
    o.add_argument("--json", default=None, help="result path (default: benchmarks/results/"
                   "prefix_cache_<device>_<label>.json)")
    o.add_argument("--time-budget", type=float, default=0.0, help="seconds: calls not started by "
                   "then are recorded as not run (0: no limit)")
    return ap


def resolve(argv: list[str] | None, doc: str = "") -> argparse.Namespace:
    a = parser(doc).parse_args(argv)
    if a.ci and (a.model or a.tiny or a.config or a.load_format == "dummy"):
        raise SystemExit("prefix_cache: --ci builds its own tiny checkpoint; drop --model/--tiny/"
                         "--config/--load-format dummy")
    for k, v in (CI_PRESET if a.ci else GPU_PRESET).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.server and a.no_detokenize:
        raise SystemExit("prefix_cache: the server always detokenizes; drop --no-detokenize")
    if a.launch and not a.server:
        raise SystemExit("prefix_cache: --launch gives flags to --server's server; add --server")
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
