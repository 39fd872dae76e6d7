"""The Ascend attention backend (`deepinfer_ascend.attention`) on the simulated device: V4's window
+ compressed sparse attention with the sink on `npu_sparse_flash_attention`, the CSA top-k on
`npu_lightning_indexer`, against the core's `PortableAttentionBackend` layer by layer.

One layer, the documented head dims (attention D 512 with a zero 64-wide rope part, indexer D 128,
8 indexer heads), few heads, a window of 8, over multi-step batches that share paged pools
(shuffled blocks): prompts shorter and longer than the window, a later prefill chunk, decode steps
that close compressor blocks; SWA only, CSA (ratio 4, top-4) and HCA (ratio 128).
float32: the portable backend in float32 on the same (bf16-exact) values equals ours to the bf16
rounding of the op's output; bfloat16: within the nvidia attention tests' tolerance (2e-2 of each
head's largest output, tests/kernels/test_sparse_attention.py)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.cache.sequence_state import BlockTable, CompressorState, LayerState
from deepinfer_core.model.attention import AttentionInputs
from deepinfer_core.model.forward_batch import ForwardBatch
from deepinfer_core.ops.kv_fp8 import kv_row_bytes
from deepinfer_core.ops.portable_attention import PortableAttentionBackend

BACKEND = Path(__file__).resolve().parents[2] / "backends" / "ascend950"
BF16, F32 = torch.bfloat16, torch.float32
H, D, DI, HI, W, TOPK = 2, 512, 128, 8, 8, 4
SFA, LI = "npu_sparse_flash_attention", "npu_lightning_indexer"

# steps of (sequence, new tokens): prompts 30 (> window) and 5 (< window), a second chunk of 6,
# decode steps; positions 31 / 11 close ratio-4 blocks, 128 / 256 ratio-128 ones
SHORT = [[(0, 30), (1, 5)], [(0, 1), (1, 6)], [(0, 1), (1, 1)], [(0, 1)]]
HCA_STEPS = [[(0, 200), (1, 3)], [(0, 57), (1, 1)], [(0, 1)]]


@pytest.fixture
def backend(fake_npu, monkeypatch):
    monkeypatch.syspath_prepend(str(BACKEND))
    import torch_npu
    from deepinfer_ascend.attention import AscendAttentionBackend

    def make(official=False):
        return AscendAttentionBackend(torch_npu, official=official)
    return make


def calls(fake, op):
    return [args for name, args in fake.calls if name == op]


def bf16_exact(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF16).float()


def make_layer(ratio: int, dtype, g, block_size: int, kv_fp8: bool = False):
    """A V4 layer (`attn`) and two sequences' states over pools shared by both (shuffled blocks);
    `kv_fp8`: packed uint8 window rings."""
    def fin(pooled, starts):       # finalize: rows rounded to bf16 (identical in both dtypes)
        return pooled.to(BF16).to(dtype)
    attn = SimpleNamespace(window=W, scale=D ** -0.5, attn_sink=torch.randn(H, generator=g),
                           ratio=ratio, layer_id=0, index_source=0 if ratio == 4 else -1,
                           yoco_consumer=False, candidate=None, cfg=SimpleNamespace(topology=None),
                           compressor=SimpleNamespace(finalize=fin) if ratio else None,
                           indexer=None)
    if ratio == 4:
        attn.indexer = SimpleNamespace(wk=None, topk=TOPK, compressor=SimpleNamespace(finalize=fin))
    c = 2 if ratio == 4 else 1
    tables = [[5, 2, 7, 1, 8], [3, 6, 0, 9, 4]] if block_size < 128 else [[4, 1, 3], [0, 2, 5]]
    nblocks = 10
    pools = {}
    if ratio:
        pools["kv"] = torch.zeros(nblocks, block_size // ratio, D, dtype=dtype)
        pools["ix"] = torch.zeros(nblocks, block_size // ratio, DI, dtype=dtype)

    def comp_state(pool, d, table):
        return CompressorState(ratio=ratio, overlap=c == 2,
                               tail_kv=torch.zeros(c * ratio, c * d),
                               tail_z=torch.full((c * ratio, c * d), float("-inf")),
                               pool=pool, table=BlockTable(table, "cpu"))
    states = []
    for t in tables:
        ring = torch.zeros(W, kv_row_bytes(D, 64), dtype=torch.uint8) if kv_fp8 else \
            torch.zeros(W, D, dtype=dtype)
        st = LayerState(ring=ring)
        if ratio:
            st.compressor = comp_state(pools["kv"], D, t)
        if ratio == 4:
            st.indexer = comp_state(pools["ix"], DI, t)
        states.append(st)
    return attn, states


def make_inputs(step, done, ratio, g):
    """A batch of `step` [(sequence, n)] and its per-token inputs (bf16-exact float32)."""
    starts = [done[s] for s, _ in step]
    lens = [n for _, n in step]
    pos = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens)])
    T, c = pos.numel(), 2 if ratio == 4 else 1
    batch = ForwardBatch(pos.clone(), pos, starts, lens, [], torch.arange(T))
    inp = AttentionInputs(q=bf16_exact(T, H, D, g=g, scale=2.0), kv=bf16_exact(T, D, g=g))
    if ratio:
        inp.comp_kv, inp.comp_z = bf16_exact(T, c * D, g=g), bf16_exact(T, c * D, g=g)
    if ratio == 4:
        inp.idx_kv, inp.idx_z = bf16_exact(T, 2 * DI, g=g), bf16_exact(T, 2 * DI, g=g)
        inp.idx_q, inp.idx_w = bf16_exact(T, HI, DI, g=g), bf16_exact(T, HI, g=g, scale=0.1)
    return batch, inp


def cast(inp, dtype):
    """The model's dtype for q, kv, indexer q and weights (compressor inputs stay fp32)."""
    out = AttentionInputs(**vars(inp))
    for name in ("q", "kv", "idx_q", "idx_w"):
        t = getattr(inp, name)
        if t is not None:
            setattr(out, name, t.to(dtype))
    return out


def check(got, want, tol):
    """tests/kernels/test_sparse_attention.py's agreement: per head, the largest error relative to
    that head's largest output."""
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = (got.float() - want.float()).abs().amax(dim=(0, 2))
    assert (err <= tol * want.float().abs().amax(dim=(0, 2))).all(), err


def run(ours, ref, ratio, steps, ref_dtype, block_size=64, seed=0, kv_fp8=False):
    """Both backends over the same steps, each on its own states: [(ours, ref)] per step."""
    g = torch.Generator().manual_seed(seed)
    attn_o, st_o = make_layer(ratio, BF16, g, block_size, kv_fp8)
    g2 = torch.Generator().manual_seed(seed)
    attn_r, st_r = make_layer(ratio, ref_dtype, g2, block_size, kv_fp8)
    done = [0, 0]
    results = []
    for step in steps:
        batch, inp = make_inputs(step, done, ratio, g)
        seqs = [s for s, _ in step]
        got = ours.forward(attn_o, cast(inp, BF16), batch, [st_o[s] for s in seqs])
        batch_r = ForwardBatch(batch.input_ids, batch.positions, batch.starts, batch.lens, [],
                               batch.logits_rows)
        want = ref.forward(attn_r, cast(inp, ref_dtype), batch_r, [st_r[s] for s in seqs])
        results.append((got, want))
        for s, n in step:
            done[s] += n
    for a, b in zip(st_o, st_r):             # the inherited cache writes agree too
        assert torch.equal(a.ring.float(), b.ring.float())
        if a.compressor is not None:
            assert a.compressor.n_rows == b.compressor.n_rows
            assert torch.equal(a.compressor.read_rows().float(), b.compressor.read_rows().float())
    return results


CASES = [pytest.param(0, SHORT, 64, id="swa"), pytest.param(4, SHORT, 64, id="csa"),
         pytest.param(128, HCA_STEPS, 128, id="hca")]


@pytest.mark.parametrize("ratio,steps,block_size", CASES)
def test_float32_portable_equals_ours_to_bf16_rounding(backend, ratio, steps, block_size):
    """Same bf16-exact values: the portable backend in float32 vs the op's fp32 math + bf16 out."""
    for got, want in run(backend(), PortableAttentionBackend(), ratio, steps, F32, block_size):
        assert got.dtype == BF16
        torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("ratio,steps,block_size", CASES)
def test_bf16_within_the_nvidia_tolerance(backend, ratio, steps, block_size):
    for got, want in run(backend(), PortableAttentionBackend(), ratio, steps, BF16, block_size):
        check(got, want, 2e-2)


def test_kv_fp8_window_ring(backend):
    """A packed uint8 (kv_fp8) window ring is unpacked as the portable backend does."""
    for got, want in run(backend(), PortableAttentionBackend(), 0, SHORT, BF16, kv_fp8=True):
        check(got, want, 2e-2)


def test_official_numerics_within_the_nvidia_tolerance(backend):
    """The QAT numerics' sink-softmax rounding order is not the op's; the result stays close."""
    ref = PortableAttentionBackend(official=True)
    for got, want in run(backend(official=True), ref, 128, HCA_STEPS, BF16, 128):
        check(got, want, 2e-2)


def test_csa_picks_equal_the_portable_indexer(backend, fake_npu):
    """The lightning indexer's picks per query token are the portable top-k's rows."""
    g = torch.Generator().manual_seed(1)
    ours = backend()
    attn, states = make_layer(4, BF16, g, 64)
    batch, inp = make_inputs(SHORT[0], [0, 0], 4, g)
    inp = cast(inp, BF16)
    ours.forward(attn, inp, batch, states)
    (li,) = calls(fake_npu, LI)
    picks = fake_npu.module.npu_lightning_indexer(**li)[0][:, 0]      # the same call again
    ref = PortableAttentionBackend()
    for (a, b), st, sl in zip([(0, 30), (30, 35)], states, batch.seq_slices()):
        mask = ref.index_select(inp.idx_q[sl], inp.idx_w[sl], st.indexer.read_rows(),
                                batch.positions[sl], 4, TOPK)
        for t in range(b - a):
            want = set(mask[t].nonzero().flatten().tolist())
            have = {int(i) for i in picks[a + t] if i >= 0}
            assert have == want, (sl, t)


def test_recorded_arguments_are_documented(backend, fake_npu):
    """One indexer and one SFA call per layer forward, with the documented arguments, and every
    sparse index inside its sequence's KV (the fake would mask one past it silently)."""
    ours = backend()
    run(ours, PortableAttentionBackend(), 4, SHORT, BF16)
    sfa, li = calls(fake_npu, SFA), calls(fake_npu, LI)
    assert len(sfa) == len(SHORT) and len(li) == len(SHORT)
    for a, step in zip(li, SHORT):
        T = sum(n for _, n in step)
        assert a["layout_query"] == "TND" and a["layout_key"] == "PA_BSND"
        assert a["sparse_count"] == TOPK and a["sparse_mode"] == 0
        assert a["query"].shape == (T, HI, DI) and a["weights"].dtype == BF16
        assert a["key"].shape[1:] == (16, 1, DI) and a["block_table"].shape[0] == T
        assert torch.equal(a["actual_seq_lengths_query"], torch.arange(1, T + 1, dtype=torch.int32))
    for a, step in zip(sfa, SHORT):
        T = sum(n for _, n in step)
        assert a["attention_mode"] == 2 and a["sparse_mode"] == 0 and a["sparse_block_size"] == 1
        assert a["layout_query"] == a["layout_kv"] == "TND"
        assert a["query"].shape == (T, H, D) and a["key"].shape[1:] == (1, D)
        assert a["value"] is a["key"]
        assert a["query_rope"].shape == (T, H, 64) and not a["query_rope"].any()
        assert a["key_rope"].shape == (a["key"].shape[0], 1, 64) and not a["key_rope"].any()
        assert a["sinks"].dtype == F32 and a["sinks"].shape == (H,)
        assert a["scale_value"] == D ** -0.5
        si = a["sparse_indices"]
        assert si.dtype == torch.int32 and si.shape[:2] == (T, 1)
        cu = a["actual_seq_lengths_kv"].long()
        lkv = (cu - torch.cat([cu.new_zeros(1), cu[:-1]])).repeat_interleave(
            torch.tensor([n for _, n in step]))
        assert (si[:, 0] < lkv[:, None]).all() and (si >= -1).all()
        assert torch.equal(a["actual_seq_lengths_query"],
                           torch.tensor([n for _, n in step], dtype=torch.int32).cumsum(0).int())


def test_mutations_are_refused(backend, fake_npu):
    """The fake refuses what the mapping must never pass: -1 before a valid index, int64 indices,
    sinks of the wrong width; an indexer key pool of 8 rows per block (block_size 32 at ratio 4)."""
    import torch_npu
    run(backend(), PortableAttentionBackend(), 0, SHORT[:1], BF16)
    (a,) = calls(fake_npu, SFA)
    bad = a["sparse_indices"].clone()
    bad[0, 0, 0], bad[0, 0, 1] = -1, 0
    for change in ({"sparse_indices": bad}, {"sparse_indices": a["sparse_indices"].long()},
                   {"sinks": torch.zeros(H + 1)}):
        with pytest.raises(ValueError, match=SFA):
            torch_npu.npu_sparse_flash_attention(**{**a, **change})
    with pytest.raises(ValueError, match="block_size"):
        run(backend(), PortableAttentionBackend(), 4, SHORT[:1], BF16, block_size=32)


def test_refuses_a_float32_query(backend):
    g = torch.Generator().manual_seed(0)
    attn, states = make_layer(0, F32, g, 64)
    batch, inp = make_inputs(SHORT[0], [0, 0], 0, g)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        backend().forward(attn, inp, batch, states)


@pytest.mark.parametrize("fake_npu", [223], indirect=True)
def test_a2_refuses_the_sink(backend, fake_npu):
    """Why the backend is A5-only: SFA takes no `sinks` on A2/A3, and V4 needs its sink."""
    with pytest.raises(ValueError, match="sinks"):
        run(backend(), PortableAttentionBackend(), 0, SHORT[:1], BF16)


def test_unsupported_names_why(backend):
    from deepinfer_ascend.attention import unsupported

    from deepinfer_core.config import ModelConfig
    from deepinfer_core.tools.tiny_config import tiny_config_dict

    def cfg(**kw):
        return ModelConfig.from_dict(tiny_config_dict(**{"head_dim": 512, **kw}))
    assert unsupported("A5", BF16, cfg(), 128) is None
    assert "sinks" in unsupported("A3", BF16, cfg(), 128)
    assert "bfloat16" in unsupported("A5", F32, cfg(), 128)
    assert "head_dim 512" in unsupported("A5", BF16, cfg(head_dim=128), 128)
    assert "indexer" in unsupported("A5", BF16, cfg(index_n_heads=4), 128)
    assert "rows per block" in unsupported("A5", BF16, cfg(), 32)
