"""The tiny DeepSeek-V4.1 on a CUDA device (the nvidia backend's pointwise, mHC, linear and MoE
methods, the core's portable attention): greedy tokens and log-probs against the independent
float32 reference, bounded replay, Engram tables in pinned host memory (the default) or on the
device, and an Engram step that never synchronises with the host.
Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.model.forward_batch import ForwardBatch

pytestmark = pytest.mark.gpu  # deselected in CI; on a machine without CUDA these fail, not skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v41_reference.reference import ReferenceV41  # noqa: E402


def _prompts(lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128000, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("mode", ["off", "compact"])
def test_greedy_tokens_match_the_reference_on_cuda(tiny_v41_dir, mode):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    llm = LLM(
        str(tiny_v41_dir),
        dtype="float32",
        simulate_qat=False,
        device="cuda",
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=40,
        max_num_batched_tokens=128,
    )
    ops = llm.runner.loaded.ops
    assert type(ops.attention).__name__ == "PortableAttentionBackend"
    assert type(ops.pointwise).__name__ == "NvidiaPointwise"
    model = llm.runner.loaded.model
    table = model.layers[model.cfg.engram.layer_ids[0]].engram.embed
    assert table.weight.device.type == "cpu" and table.weight.is_pinned()
    prompts = _prompts((33, 200, 480))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=24, temperature=0, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    ref = ReferenceV41.from_dir(tiny_v41_dir)
    for p, o in zip(prompts, outs):
        toks = o.outputs[0].token_ids
        rect = max(0, len(p) - 40) if mode == "compact" else None
        logp = torch.log_softmax(ref.forward(p + toks[:-1], rect_lo=rect).double(), -1)[
            len(p) - 1 :
        ]
        if mode == "off":  # compact approximates 'mask' only up to its skipped rows' rounding
            assert logp.argmax(-1).tolist() == toks
        ours = [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
        err = max(abs(a - logp[j, t].item()) for j, (a, t) in enumerate(zip(ours, toks)))
        assert err < 1e-3, f"{mode}: max |logprob difference| {err:.2e}"


@pytest.mark.parametrize("force_gpu", [False, True])
def test_an_engram_step_never_synchronises(tiny_v41_dir, force_gpu):
    """Engram's hashing (compressed ids, n-gram ring, hash), its table gather (from pinned host
    memory by default, else from the device) and its gate run without a host synchronisation."""
    from deepinfer_core.cache.state_cache import new_sequence_state
    from deepinfer_core.runner.model_loader import load_model

    model = load_model(
        tiny_v41_dir, dtype="bfloat16", device="cuda", engram_force_gpu_storage=force_gpu
    ).model
    layer = model.layers[model.cfg.engram.layer_ids[0]]
    assert layer.engram.embed.weight.device.type == ("cuda" if force_gpu else "cpu")
    st = new_sequence_state(model.cfg, torch.bfloat16, device="cuda", max_tokens=64)
    batch = ForwardBatch.build([_prompts((20,))[0]], [st], device="cuda")
    h = torch.randn(
        20, model.cfg.hc_mult, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = model.engram_inputs.rows(batch)
        out = layer.engram(h, rows[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == h.shape and torch.isfinite(out.float()).all()


def test_host_and_device_tables_give_the_same_outputs(tiny_v41_dir):
    """The pinned-host gather and the device one read the same bytes: equal greedy log-probs."""
    runs = []
    for force_gpu in (False, True):
        llm = LLM(str(tiny_v41_dir), dtype="bfloat16", device="cuda",
                  engram_force_gpu_storage=force_gpu, max_num_batched_tokens=128)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts((17, 150))],
            SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True),
            use_tqdm=False,
        )
        runs.append([[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])
        del llm
    assert runs[0] == runs[1]
