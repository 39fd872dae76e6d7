"""End to end on the nvidia backend (FP8 weights in the Triton linear layers, bf16) against the CPU
backend: greedy tokens of the tiny model for 64 steps on 16 prompts. Where they diverge, the CPU
logits at the first differing position must show a near-tie between the two tokens.

QAT simulation off: with it on, FP8 rounding of activations is a step function, and on the random
tiny model a last-bit difference that flips one rounding (or one MoE top-2 choice) moves logits by
up to ~50% -- even between the same portable ops on CPU and CUDA (see the README status table).
Run on a GPU machine with the backend installed: `python -m pytest -q -s -m gpu tests/gpu`."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

pytestmark = pytest.mark.gpu
STEPS, NEAR_TIE = 64, 0.02      # a tie: logit gap <= 2% of the largest |logit|


def prompts(n: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def test_greedy_on_the_nvidia_backend_matches_the_cpu_backend(tiny_ckpt_dir):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    gpu = LLM(model=str(tiny_ckpt_dir), dtype="bfloat16", simulate_qat=False)
    assert gpu.device == "cuda" and gpu.runner.loaded.ctx.platform.name == "nvidia"
    methods = {type(m.method).__name__ for m in gpu.runner.model.modules() if getattr(m, "fmt", None) == "fp8"}
    assert "Fp8LinearMethod" in methods
    cpu = LLM(model=str(tiny_ckpt_dir), dtype="bfloat16", simulate_qat=False, device="cpu")
    assert {type(m.method).__name__ for m in cpu.runner.model.modules() if getattr(m, "fmt", None) == "fp8"} \
        == {"PortableLinearMethod"}
    ps = prompts(16, [3, 17, 40, 140, 9, 64, 200, 25], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in cpu.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)]
    diverged = 0
    for p, a, b in zip(ps, got, want):
        if a == b:
            continue
        diverged += 1
        d = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        state = cpu.runner.new_sequence()
        logits = cpu.runner.forward(state, p + b[:d])[-1].float()
        cpu.runner.release(state)
        gap = float(logits[b[d]] - logits[a[d]])
        print(f"[gpu] prompt of {len(p)}: diverges at step {d}, CPU logit gap {gap:.4f} "
              f"(max |logit| {float(logits.abs().max()):.2f})")
        assert gap <= NEAR_TIE * float(logits.abs().max()), f"not a near-tie at step {d}: gap {gap}"
    print(f"[gpu] {len(ps) - diverged}/{len(ps)} prompts identical for {STEPS} greedy tokens")
