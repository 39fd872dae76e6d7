"""What a trained artifact does through the engine, as a user runs it.

    python -m tools.train_tiny.check OUT_DIR corpus.npz [--device cuda] [--json OUT.json]

1. Builds the official checkpoint from OUT_DIR/artifact.safetensors (deepinfer_core.tools.trained_model)
   and re-measures the held-out NLL the training tool reported, through `LLM.generate` with
   `prompt_logprobs` over the same held-out windows (float32, QAT simulation off, as trained).
2. Prints greedy continuations of a few prompts in the corpus's style.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np

PROMPTS = ("ROMEO.\nBut soft, what light", "HAMLET.\nTo be, or not to be,", "KING.\nMy lord, the",
           "First Citizen.\nWhat say you to", "Enter a Messenger.\n\nMESSENGER.\n")


def engine_nll(llm, windows: list[list[int]]) -> float:
    from deepinfer_core import SamplingParams
    outs = llm.generate(prompt_token_ids=windows, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    total, count = 0.0, 0
    for w, o in zip(windows, outs):
        for tok, entry in zip(w[1:], o.prompt_logprobs[1:]):
            total -= entry[tok].logprob
            count += 1
    return total / count


def main(argv: list[str] | None = None) -> dict:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.tools.trained_model import (
        make_trained_checkpoint,
        read_artifact,
    )
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the training tool's OUT_DIR")
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--prompts", type=Path, help="greedy prompts (JSON: {\"prompts\": [...]}; default: a few Shakespeare lines)")
    a = ap.parse_args(argv)
    _, _, report = read_artifact(a.out / "artifact.safetensors")
    held = np.load(a.corpus)["heldout"]
    spec = report["heldout_windows"]
    starts = spec["starts"][:a.max_windows]
    windows = [held[s:s + spec["length"]].tolist() for s in starts]
    result: dict = {"tool_heldout_nll": report["exported_heldout"]["main_nll"],
                    "tool_mtp_top1": report["exported_heldout"].get("mtp_top1"), "windows": len(windows)}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_trained_checkpoint(Path(tmp) / "ckpt", a.out / "artifact.safetensors")
        qat = not report["args"].get("no_qat", True)        # as trained (runs before --no-qat existed: clean)
        result["simulate_qat"] = qat
        llm = LLM(model=str(ckpt), dtype="float32", simulate_qat=qat, device=a.device,
                  max_model_len=max(1024, spec["length"] + 64))
        result["engine_heldout_nll"] = engine_nll(llm, windows)
        result["random_model_nll"] = math.log(129280)
        greedy = SamplingParams(temperature=0.0, max_tokens=32)
        prompts = json.loads(a.prompts.read_text())["prompts"][:5] if a.prompts else list(PROMPTS)
        result["continuations"] = {p: o.outputs[0].text for p, o in
                                   zip(prompts, llm.generate(prompts, greedy, use_tqdm=False))}
    if a.max_windows is None:
        result["agree_1e-3"] = abs(result["engine_heldout_nll"] - result["tool_heldout_nll"]) < 1e-3
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
