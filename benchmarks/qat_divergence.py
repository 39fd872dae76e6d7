"""Why bf16 and float32 greedy tokens part with the QAT simulation on (issue 16's agreement analysis).

    python benchmarks/qat_divergence.py

On the bundled trained tiny model, CPU, over one held-out passage (benchmarks/data/heldout_prompts.json,
joined): for every FP8-quantised linear input in forward order, the share of elements whose FP8 value
differs between a bfloat16 and a float32 run, and their median relative difference; then, with QAT
on and off, the RMS difference of the chosen token's log-prob (teacher-forced, every position) and
how often the argmax differs. Prints both, writes benchmarks/results/qat_divergence_cpu.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

import deepinfer_core.ops.portable_linear as portable_linear
from deepinfer_core.api.tokenizer import load_tokenizer
from deepinfer_core.runner.model_runner import ModelRunner
from deepinfer_core.tools.bundled_model import bundled_tiny_model_dir

HERE = Path(__file__).parent
QUANT = portable_linear.fake_quant_fp8


def run(model: str, ids: list[int], dtype: torch.dtype, qat: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(log-probs [T, V], the inputs of every FP8-quantised linear, in call order)."""
    seen: list[torch.Tensor] = []

    def recording(x, block):
        seen.append(x.detach().float().clone())
        return QUANT(x, block)

    portable_linear.fake_quant_fp8 = recording
    try:
        runner = ModelRunner(model, dtype=dtype, simulate_qat=qat, device="cpu")
        logits = runner.forward(runner.new_sequence(), ids, all_logits=True).float()
    finally:
        portable_linear.fake_quant_fp8 = QUANT
    return torch.log_softmax(logits, -1), seen


def main() -> None:
    model = str(bundled_tiny_model_dir())
    text = "\n\n".join(json.loads((HERE / "data" / "heldout_prompts.json").read_text())["prompts"])
    ids = load_tokenizer(model).encode(text)[:256]
    out: dict = {"tokens": len(ids)}
    f32, f32_in = run(model, ids, torch.float32, True)
    b16, b16_in = run(model, ids, torch.bfloat16, True)
    sites = []
    for a, b in zip(f32_in, b16_in):
        if a.shape == b.shape:
            flipped = (QUANT(a, 128) != QUANT(b, 128)).float().mean().item()
            rel = ((b - a).abs() / a.abs().clamp_min(1e-6)).median().item()
            sites.append(dict(fp8_values_differing=round(flipped, 4), median_relative_difference=round(rel, 5)))
    out["qat_sites"] = sites
    print(f"{len(sites)} FP8-quantised linear inputs; share of FP8 values differing bf16 vs float32, first 4: "
          f"{[s['fp8_values_differing'] for s in sites[:4]]}, last 4: {[s['fp8_values_differing'] for s in sites[-4:]]}; "
          f"median relative activation difference over the sites: "
          f"{sorted(s['median_relative_difference'] for s in sites)[len(sites) // 2]:.4f}")
    for qat in (True, False):
        a, b = (f32, b16) if qat else (run(model, ids, torch.float32, False)[0], run(model, ids, torch.bfloat16, False)[0])
        top = a.argmax(-1)
        d = (b - a).gather(1, top[:, None]).squeeze(1)
        row = dict(rms_logprob_difference=d.pow(2).mean().sqrt().item(),
                   argmax_agreement=(b.argmax(-1) == top).float().mean().item())
        out[f"qat_{'on' if qat else 'off'}"] = row
        print(f"QAT {'on ' if qat else 'off'}: RMS log-prob difference of float32's top token {row['rms_logprob_difference']:.4f} "
              f"nats; argmax agrees at {row['argmax_agreement']:.1%} of {len(ids)} positions")
    path = HERE / "results" / "qat_divergence_cpu.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
