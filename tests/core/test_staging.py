"""A step's int64 inputs go to the device in one copy, each part starting 16-byte aligned: Triton
compiles one kernel variant per pointer alignment, so positions packed right after an odd number of
token ids compiled `_sparse_attn_kernel` again mid-serving (seconds per variant)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.model import ForwardBatch
from deepinfer_core.ops.transfer import to_device_parts


def aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def test_parts_keep_their_values_and_start_aligned():
    parts = [[7, 8, 9], [100, 101, 102], [], [5], [1, 2]]
    out = to_device_parts(parts, "cpu")
    assert [t.tolist() for t in out] == parts
    assert all(t.dtype == torch.int64 for t in out)
    assert all(aligned(t) for t in out if t.numel())


def test_forward_batch_positions_aligned_for_odd_token_counts():
    states = [SimpleNamespace(num_tokens=4), SimpleNamespace(num_tokens=0)]    # build reads num_tokens
    b = ForwardBatch.build([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                         22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]], states)
    assert b.input_ids.numel() == 34 and aligned(b.positions) and aligned(b.logits_rows)
    b = ForwardBatch.build([[1, 2, 3]], states[:1])
    assert b.positions.tolist() == [4, 5, 6] and aligned(b.positions) and b.logits_rows.tolist() == [2]


def test_engine_steps_pass_aligned_positions(tiny_ckpt_dir, monkeypatch):
    """Every forward of a served mix (odd prompt lengths, decode steps of odd batch sizes)."""
    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, max_model_len=256)
    seen: list[tuple[int, bool, bool]] = []
    model = llm.runner.model
    plain = model.forward

    def forward(batch, *args, **kw):
        seen.append((batch.positions.numel(), aligned(batch.positions), aligned(batch.logits_rows)))
        return plain(batch, *args, **kw)
    monkeypatch.setattr(model, "forward", forward)
    prompts = [[3 + i for i in range(n)] for n in (1, 5, 17, 34)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 3, 4, 5)])
    assert any(n % 2 for n, _, _ in seen), seen          # odd token counts were served
    assert all(p and r for _, p, r in seen), seen
