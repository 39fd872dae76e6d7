"""The MTP block (no external oracle exists: transformers has no MTP): it runs on the main model's
final streams, keeps its own window state, and gives the same logits however the tokens are chunked."""
from __future__ import annotations

import torch

from deepinfer_core.model import ForwardBatch
from oracle_utils import Ours, max_rel_err


def mtp_logits(ours: Ours, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """MTP logits at every position t (predicting t+2 from main streams at t and token t+1)."""
    state, outs, i = ours.new_state(), [], 0
    with torch.no_grad():
        for n in chunks:
            batch = ForwardBatch.build([ids[i:i + n]], [state], all_logits=True)
            main = ours.model(batch)
            outs.append(ours.model.forward_mtp(main.streams, torch.tensor(ids[i + 1:i + n + 1]), batch))
            batch.commit()
            i += n
    return torch.cat(outs)


def test_mtp_logits_are_chunk_invariant(tiny_ckpt_dir):
    ours = Ours(tiny_ckpt_dir)
    ids = torch.randint(2, 129280, (61,), generator=torch.Generator().manual_seed(3)).tolist()
    full = mtp_logits(ours, ids, [60])
    assert full.shape == (60, 129280) and torch.isfinite(full).all()
    assert len(ours.new_state().mtp_layers) == 1
    for chunks in ([17, 1, 1, 41], [1] * 30 + [30]):
        err = max_rel_err(mtp_logits(ours, ids, chunks), full)
        assert err.max() <= 1e-4, f"chunks {chunks[:4]}: {err.max():.2e}"
    # it depends on the next token (its e_proj input), not only on the main streams
    other = ids[:60] + [ids[60] + 1]
    assert not torch.allclose(mtp_logits(ours, other, [60])[-1], full[-1])
