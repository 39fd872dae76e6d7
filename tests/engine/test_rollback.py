"""Rollback of rejected speculative tokens (the groundwork of speculative
decoding): a verification chunk [anchor, d_1..d_g] whose drafts after the j-th are rejected, then
`SequenceState.rollback`, leaves a state that computes exactly what a run that only ever saw
[anchor, d_1..d_j] computes: the logits of every later step and the live state (window ring entries,
compressor tails, compressed rows, indexer keys) are bitwise equal. Checked for every j in 0..g at the
window edge, across a CSA (ratio 4) and an HCA (ratio 128) block boundary, with batch-invariant ops
(row results independent of how many rows share a chunk), float32 on the CPU."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.runner.model_runner import ModelRunner

GAMMA = 3            # drafts per verification
CONTINUATION = 6     # decode steps compared after the rollback
PLACES = {"window edge": 14, "CSA block boundary": 5, "HCA block boundary": 125}   # the anchor's position


@pytest.fixture(scope="module")
def runner(tiny_ckpt_dir):
    return ModelRunner(tiny_ckpt_dir, dtype="float32", batch_invariant=True, max_backtracking_tokens=GAMMA + 1,
                       device="cpu")


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def live_state(st, window: int) -> list[torch.Tensor]:
    """What any later step of the main layers can read (the runner's forward never runs the MTP
    block): ring entries of the last `window` positions, each compressor's tail entries of its last
    c*ratio positions, its rows and the indexer's keys."""
    n, out = st.num_tokens, []
    for layer in st.layers:
        ring = layer.ring
        out.append(ring[torch.arange(max(0, n - window), n) % ring.shape[0]])
        for cs in (layer.compressor, layer.indexer):
            if cs is not None:
                pos = torch.arange(max(0, n - (2 if cs.overlap else 1) * cs.ratio), n) % cs.tail_len
                out += [cs.tail_kv[pos], cs.tail_z[pos], cs.read_rows()]
    return out


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("accepted", range(GAMMA + 1))
def test_rejected_drafts_leave_no_trace(runner, place, accepted):
    n = PLACES[place]
    prompt, chunk, later = ids(n, 1), ids(GAMMA + 1, 2), ids(CONTINUATION, 3)
    spec, ref = runner.new_sequence(), runner.new_sequence()
    try:
        for st in (spec, ref):
            runner.forward_batch([prompt], [st])
        runner.forward_batch([chunk], [spec], all_logits=True)          # verify anchor + GAMMA drafts
        spec.rollback(n + 1 + accepted)                                  # keep the anchor and j drafts
        runner.forward_batch([chunk[:accepted + 1]], [ref], all_logits=True)
        assert spec.num_tokens == ref.num_tokens
        for step, tok in enumerate(later):
            got, want = (runner.forward_batch([[tok]], [st]) for st in (spec, ref))
            assert torch.equal(got, want), (place, accepted, step)
        window = runner.model_config.sliding_window
        for a, b in zip(live_state(spec, window), live_state(ref, window)):
            assert torch.equal(a, b), (place, accepted)
    finally:
        runner.release(spec)
        runner.release(ref)


def test_rollback_is_bounded_by_the_backtrack_room(runner):
    st = runner.new_sequence()
    try:
        runner.forward_batch([ids(10, 4)], [st])
        with pytest.raises(ValueError, match="backtrack=4"):
            st.rollback(10 - GAMMA - 2)
        with pytest.raises(ValueError, match="rollback to 11"):
            st.rollback(11)
        st.rollback(10 - GAMMA - 1)
        assert st.num_tokens == 10 - GAMMA - 1
    finally:
        runner.release(st)
