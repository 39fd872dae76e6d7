"""Offline inference with DeepInfer.

    python examples/offline_inference.py                       # bundled tiny model (trained on Shakespeare)
    DEEPINFER_HF_MODEL_DIR=/path/to/DeepSeek-V4-Flash python examples/offline_inference.py

With no checkpoint configured, a tiny DeepSeek-V4 trained on Shakespeare's plays (tools/train_tiny;
real tokenizer, official FP8/FP4 tensor format) is built once from the weights shipped in the package
into the user cache
(`$XDG_CACHE_HOME/deepinfer/tiny-v4` or `~/.cache/deepinfer/tiny-v4`) and reused.
The same from the command line: `python -m deepinfer_core.generate --prompt "..." --max-tokens 8`.

`model_path` and `run_example` are shared by the other examples.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from deepinfer_core import LLM, SamplingParams, envs


def model_path() -> str:
    """DEEPINFER_HF_MODEL_DIR, else the bundled tiny model (built on first use)."""
    env_dir = envs.get("DEEPINFER_HF_MODEL_DIR")   # a ValueError naming the variable when invalid
    if env_dir:
        return str(env_dir)
    from deepinfer_core.tools.bundled_model import bundled_tiny_model_dir
    out = bundled_tiny_model_dir()   # built once into ~/.cache/deepinfer/tiny-v4, then reused
    print(f"DEEPINFER_HF_MODEL_DIR is not set: using the bundled tiny model at {out} (trained on Shakespeare)")
    return str(out)


def run_example(main: Callable[[], None]) -> None:
    """Run `main`; a bad model or input (a ValueError) prints one line naming the problem on stderr
    and exits with status 2, as `python -m deepinfer_core.generate` does."""
    try:
        main()
    except ValueError as exc:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    llm = LLM(model=model_path())
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=1234)
    outputs = llm.generate(["HAMLET.\nTo be, or not to be,", "KING.\nMy lord, the"], [greedy, sampled])
    outputs += llm.generate(prompt_token_ids=[[0, 100, 200, 300]], sampling_params=greedy)
    for out in outputs:
        comp = out.outputs[0]
        print(f"prompt {out.prompt!r} ({len(out.prompt_token_ids)} tokens) -> {comp.text!r}")
        print(f"  token ids {comp.token_ids}, finish_reason={comp.finish_reason}")


if __name__ == "__main__":
    run_example(main)
