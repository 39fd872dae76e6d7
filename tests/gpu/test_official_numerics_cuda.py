"""The QAT numerics (DeepSeek's order of rounding) on the nvidia backend, against the portable ops
with the same numerics (`official=True`) run on the same GPU:

* op by op, bf16: the head norm (+ RoPE), mHC pre / post / head and the indexer scores come out
  with the portable ops' bits but for a few elements one bf16 unit apart (a GEMM's or a reduction's
  fp32 sum added in another order); mHC post is bitwise. Where the clean (`official=False`) op
  rounds elsewhere in bf16 (head norm, indexer), the check also shows it further from the reference.
* the whole engine on the bundled trained model (bf16 + QAT): the nvidia backend's logits along its
  own greedy continuations against the portable ops on CUDA, top-1 nearly always the same.

Batch invariance of these kernels is asserted by test_batch_invariant_cuda.py (its engine runs the
QAT numerics, the default). Run on a GPU machine: `python -m pytest -q -s -m gpu tests/gpu`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.model.rope import RotaryTable
from deepinfer_core.ops.portable_mhc import PortableMHC
from deepinfer_core.ops.portable_pointwise import PortablePointwise
from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint

pytestmark = pytest.mark.gpu
BF16, EPS = torch.bfloat16, 1e-6
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["HAMLET.\nTo be, or not to be,", "KING.\nMy lord, the", "ROMEO.\nBut soft, what light",
           "First Citizen.\nWhat say you to", "QUEEN.\nAlas, my lord,", "FOOL.\nNuncle,"]


def nvidia(module: str):
    """A deepinfer_nvidia module, imported at run time (never at collection: importing triton before
    tests/kernels' conftest sets TRITON_INTERPRET=1 would break a CPU run of the whole suite)."""
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    sys.path.insert(0, str(ROOT / "backends" / "nvidia_sm100"))
    return __import__(f"deepinfer_nvidia.{module}", fromlist=["_"])


def agreement(got: torch.Tensor, want: torch.Tensor, other: torch.Tensor | None = None,
              atol=0.0) -> float:
    """The share of got's elements equal to want's, after checking every element within one bf16
    unit of want (relative, plus `atol` where a result may cancel to ~0) and that `other` (the clean
    op, where it rounds elsewhere in bf16) shares fewer."""
    got, want = got.float().cpu(), want.float().cpu()
    assert ((got - want).abs() <= want.abs() * 2.0 ** -7 + atol).all(), (got - want).abs().max()
    same = (got == want).float().mean().item()
    if other is not None:
        assert same > (other.float().cpu() == want).float().mean().item(), same
    return same


def test_head_norm_and_rope():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 8, 128, generator=g) * 3).to(BF16).cuda()
    pos = torch.randint(0, 4096, (64,), generator=g).cuda()
    rope = RotaryTable(64, 10000.0, None, "cuda", official=True)
    ours = nvidia("pointwise").NvidiaPointwise(official=True)
    got = ours.norm_rope_quant(x, pos, rope, norm="head")
    want = PortablePointwise(official=True).norm_rope_quant(x, pos, rope, norm="head")
    clean = PortablePointwise(official=False).norm_rope_quant(x, pos, rope, norm="head")
    w = want.float().cpu()
    pair = (w[..., 0::2].abs() + w[..., 1::2].abs()).repeat_interleave(2, -1)   # a rotated pair
    assert agreement(got, want, clean, atol=pair * 2.0 ** -8) > 0.99


def mhc_site(T: int, D: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, 4, D, generator=g) * torch.linspace(0.5, 3.0, 4)[None, :, None]).to(BF16)
    fn = torch.randn(n, 4 * D, generator=g) / (4 * D) ** 0.5
    scale = torch.tensor([0.8]) if n == 4 else torch.tensor([0.9, 0.7, 1.6])
    return [t.cuda() for t in (x, fn, scale, torch.randn(n, generator=g) * 0.5)]


def test_mhc():
    ref = PortableMHC(4, 20, EPS, EPS, official=True)
    ours = nvidia("mhc").NvidiaMHC(4, 20, EPS, EPS, official=True)
    x, fn, scale, base = mhc_site(50, 512, 24, seed=1)
    (y, post, comb), want = ours.pre(x, fn, scale, base), ref.pre(x, fn, scale, base)
    torch.testing.assert_close(post, want[1], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(comb, want[2], rtol=1e-5, atol=2e-6)
    assert agreement(y, want[0], atol=1e-5) > 0.95          # (atol: a sum that cancels to ~0)
    f = torch.randn(50, 512, generator=torch.Generator().manual_seed(2)).to(BF16).cuda()
    assert torch.equal(ours.post(f, x, want[1], want[2]), ref.post(f, x, want[1], want[2]))
    hx, hfn, hscale, hbase = mhc_site(50, 512, 4, seed=3)
    head = ours.head(hx, hfn, hscale, hbase)
    assert agreement(head, ref.head(hx, hfn, hscale, hbase), atol=1e-5) > 0.95


def test_indexer_scores():
    from deepinfer_kernels.indexer import indexer_scores
    g = torch.Generator().manual_seed(4)
    T, H, D, n = 16, 8, 128, 500                  # one sequence; the queries see all n rows
    q = torch.randn(T, H, D, generator=g).to(BF16).cuda()
    w = (torch.randn(T, H, generator=g) * 0.1).to(BF16).cuda()
    keys = torch.randn(n, D, generator=g).to(BF16).cuda()
    pool = torch.zeros(16, 32, D, dtype=BF16, device="cuda")
    pool.view(-1, D)[:n] = keys
    # block table, token -> sequence, positions (every query sees all n rows)
    meta = (torch.arange(16, dtype=torch.int32, device="cuda")[None],
            torch.zeros(T, dtype=torch.int32, device="cuda"),
            torch.full((T,), 4 * n, device="cuda"))
    got = indexer_scores(q, w, pool, *meta, ratio=4, max_rows=n, official=True)
    heads = torch.einsum("thd,bd->thb", q, keys).relu() * w[..., None]          # bf16 steps
    want = heads.sum(dim=1)
    clean = indexer_scores(q, w, pool, *meta, ratio=4, max_rows=n)
    # a score may cancel to ~0: one unit of its largest head term (the heads' own roundings)
    atol = heads.abs().amax(dim=1).float().cpu() * 2.0 ** -7
    assert agreement(got, want, clean, atol=atol) > 0.97


def teacher_forced(runner, ids: list[int]) -> torch.Tensor:
    state = runner.new_sequence()
    try:
        return runner.forward(state, ids, all_logits=True).float().cpu()
    finally:
        runner.release(state)


def test_engine_agrees_with_the_portable_ops_on_cuda(tmp_path, monkeypatch):
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.plugins import get_plugin_manager
    from deepinfer_core.runner.model_runner import ModelRunner

    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    ckpt = str(make_trained_checkpoint(tmp_path / "trained", ARTIFACT))
    llm = LLM(model=ckpt, dtype="bfloat16", simulate_qat=True, device="cuda", max_model_len=256)
    layer = llm.runner.model.layers[0]
    assert type(layer.attn.backend).__name__ == "NvidiaAttentionBackend"
    assert layer.attn.backend.official and layer.mhc.official and layer.attn.pointwise.official
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    ours = [teacher_forced(llm.runner, ids) for ids in seqs]
    del llm
    monkeypatch.setenv("DEEPINFER_DISABLE_PLUGINS", "nvidia")
    get_plugin_manager(refresh=True)
    try:
        runner = ModelRunner(ckpt, dtype="bfloat16", simulate_qat=True, device="cuda")
        assert type(runner.model.layers[0].attn.backend).__name__ == "PortableAttentionBackend"
        want = [teacher_forced(runner, ids) for ids in seqs]
    finally:
        monkeypatch.delenv("DEEPINFER_DISABLE_PLUGINS")
        get_plugin_manager(refresh=True)
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ours, want)])
    dist = torch.cat([(a - b).norm(dim=-1) / b.norm(dim=-1) for a, b in zip(ours, want)])
    print(f"[gpu] bf16 + QAT numerics, trained tiny model, {len(seqs)} greedy continuations: "
          f"nvidia backend vs portable ops on CUDA, top-1 agreement {top1.mean():.3f}, mean "
          f"relative logit distance {dist.mean():.4f}")
    assert top1.mean() >= 0.95, top1.mean()
