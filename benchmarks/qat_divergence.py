"""Why bf16 and float32 greedy tokens part with the QAT simulation on.

    python benchmarks/qat_divergence.py

On the bundled trained tiny model, CPU, over one held-out passage (benchmarks/data/heldout_prompts.json,
joined): for every FP8-quantised linear input in forward order, the share of elements whose FP8 value
differs between a bfloat16 and a float32 run, and their median relative difference; then, with QAT
on and off, the RMS difference of the chosen token's log-prob (teacher-forced, every position) and
how often the argmax differs. Prints both, writes benchmarks/results/qat_divergence_cpu.json.

    python benchmarks/qat_divergence.py --ablate

Which part of the QAT simulation makes the greedy continuations part: bf16 against float32 greedy
agreement (backend_agreement.py's 16 prompts x 32 tokens, each counted to its first divergence, no
speculation) with every part on, then with one part off in both runs: the FP8 activation rounding
before the quantised linears, the FP8 KV rounding, the indexer's Hadamard + FP4 keys and queries.
Writes benchmarks/results/qat_ablation_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import deepinfer_core.ops.portable_linear as portable_linear
import deepinfer_core.ops.portable_pointwise as portable_pointwise
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


ABLATIONS = {"all parts on": set(), "no FP8 activations": {"activations"}, "no FP8 KV": {"fp8_nope"},
             "no indexer FP4": {"hadamard_fp4"}}


def greedy_prefix_agreement(model: str, off: set[str]) -> dict:
    """bf16 vs float32 greedy agreement with the QAT parts in `off` switched off in both runs (the
    portable ops patched for the duration: CPU only)."""
    sys.path.insert(0, str(HERE))
    from backend_agreement import GREEDY_PROMPTS, first_divergence

    from deepinfer_core import LLM, SamplingParams
    pointwise = portable_pointwise.PortablePointwise.norm_rope_quant

    def norm_rope_quant(self, *args, quant="none", **kwargs):
        return pointwise(self, *args, quant="none" if quant in off else quant, **kwargs)

    n, runs = 32, {}
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    portable_pointwise.PortablePointwise.norm_rope_quant = norm_rope_quant
    if "activations" in off:
        portable_linear.fake_quant_fp8 = lambda x, block: x
    try:
        for dtype in ("float32", "bfloat16"):
            llm = LLM(model=model, dtype=dtype, simulate_qat=True, device="cpu", max_model_len=256,
                      num_speculative_tokens=0)
            runs[dtype] = [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)]
    finally:
        portable_pointwise.PortablePointwise.norm_rope_quant = pointwise
        portable_linear.fake_quant_fp8 = QUANT
    prefix = [first_divergence(f, h, n) for f, h in zip(runs["float32"], runs["bfloat16"])]
    return dict(agreement=sum(prefix) / (n * len(prefix)), first_divergence=prefix)


def ablate() -> None:
    model, rows = str(bundled_tiny_model_dir()), {}
    for name, off in ABLATIONS.items():
        rows[name] = greedy_prefix_agreement(model, off)
        print(f"{name:20} bf16 vs float32 greedy agreement {rows[name]['agreement']:.1%} "
              f"(first divergence per prompt: {rows[name]['first_divergence']})", flush=True)
    path = HERE / "results" / "qat_ablation_cpu.json"
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ablate", action="store_true", help="greedy agreement with each QAT part off in turn")
    if ap.parse_args().ablate:
        return ablate()
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
