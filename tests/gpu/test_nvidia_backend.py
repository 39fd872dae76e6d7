"""End to end on the nvidia backend (FP8 weights through the Triton linear layers) against the CPU
backend: greedy tokens of the tiny model for 64 steps on 16 prompts, float32, QAT simulation off,
where both backends compute the same function to ~1e-6 and the tokens must be identical.

bf16 and the QAT simulation are not compared token by token here: on the random tiny model a
last-bit difference that flips one MoE top-2 choice or one FP8 activation rounding moves logits by up
to ~50%, even between the same portable ops on CPU and CUDA. `benchmarks/backend_agreement.py`
measures those agreements instead (README status table).
Run on a GPU machine with the backend installed: `python -m pytest -q -s -m gpu tests/gpu`."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

pytestmark = pytest.mark.gpu
STEPS = 64


def prompts(n: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def test_greedy_on_the_nvidia_backend_matches_the_cpu_backend(tiny_ckpt_dir):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    gpu = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False)
    assert gpu.device == "cuda" and gpu.runner.loaded.ctx.platform.name == "nvidia"
    fp8 = [m for m in gpu.runner.model.modules() if getattr(m, "fmt", None) in ("fp8", "fp4") and not m.grouped]
    assert any(m.fmt == "fp4" for m in fp8)            # routed experts: FP4 in the checkpoint, FP8 on the GPU
    assert fp8 and all(type(m.method).__name__ == "Fp8LinearMethod" and m.weight.dtype == torch.float8_e4m3fn
                       for m in fp8)
    cpu = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, device="cpu")
    ps = prompts(16, [3, 17, 40, 140, 9, 64, 200, 25], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in cpu.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(got, want))
    print(f"[gpu] nvidia backend vs CPU, float32: {same}/{len(ps)} prompts identical for {STEPS} greedy tokens")
    assert got == want
