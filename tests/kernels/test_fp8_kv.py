"""FP8 KV rows (DeepSeek-V4 "MODEL1": e4m3 nope dims with a UE8M0 scale per 64, bf16 RoPE dims;
`deepinfer_core.ops.kv_fp8`): the packed format is exactly the model's FP8 fake-quant, storing an
already fake-quantised row loses nothing, the Triton writers store pack_kv_fp8's bytes, sparse
attention over packed pools is bit-identical to attention over bf16 pools holding the same rows, and the
tiny model's attention layers give bit-identical outputs with a kv_fp8 cache (portable and batched
backends). Interpreter on CPU, compiled on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import deepinfer_kernels.compressor as kc
import deepinfer_kernels.sparse_attention as sa
from deepinfer_core.cache.sequence_state import BlockTable, CompressorState, LayerState
from deepinfer_core.cache.state_cache import CacheLayout, StateCache
from deepinfer_core.ops.kv_fp8 import kv_row_bytes, pack_kv_fp8, packed_rope_dim, unpack_kv_fp8
from deepinfer_core.ops.portable_attention import PortableAttentionBackend as Ref
from deepinfer_core.ops.quant import fake_quant_fp8
from deepinfer_kernels.compressor import write_ring, write_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sparse_attention import SMALL, build, reference  # noqa: E402

I32 = dict(dtype=torch.int32)


def bits(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so -0.0 vs 0.0 and every last bit count."""
    return x.contiguous().view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[x.dtype])


def fake_quant_row(x: torch.Tensor, rope: int) -> torch.Tensor:
    """What the model caches with the QAT simulation on (Attention.forward, Compressor.finalize)."""
    nope = x.shape[-1] - rope
    return torch.cat([fake_quant_fp8(x[..., :nope], 64), x[..., nope:]], -1)


def edge_rows(n: int, D: int, seed: int, dtype=torch.bfloat16, rope: int = 64) -> torch.Tensor:
    """Random rows whose 64-tiles span 2^-30 .. 2^20, and hand-made nope tiles k = 0..6 (row k // nt,
    tile k % nt, `special(k, nt)`): all zero, all -0, below the 1e-4 amax floor, amax 230 (e4m3
    rounds it to 224: re-quantising drops a binade), amax 447 (rounds up to 448), amax exactly
    448 * 2^-3, a single tiny negative value."""
    g = torch.Generator().manual_seed(seed)
    tiles = -(-D // 64)
    x = torch.randn(n, tiles, 64, generator=g) * torch.exp2(torch.randint(-30, 21, (n, tiles, 1), generator=g).float())
    specials = [torch.zeros(64), torch.full((64,), -0.0), torch.randn(64, generator=g) * 1e-7,
                torch.cat([torch.tensor([230.0]), torch.rand(63, generator=g) * 200]),
                torch.cat([torch.tensor([-447.0]), torch.rand(63, generator=g) * 300]),
                torch.cat([torch.tensor([56.0]), torch.randn(63, generator=g)]),
                torch.cat([torch.tensor([-1e-30]), torch.zeros(63)])]
    nt = (D - rope) // 64
    for k, t in enumerate(specials):
        if k // nt < n:
            x[special(k, nt)] = t
    return x.reshape(n, tiles * 64)[:, :D].to(dtype)


def special(k: int, nt: int) -> tuple[int, int]:
    return k // nt, k % nt


def test_row_bytes_and_rope_inference():
    assert kv_row_bytes(512, 64) == 584 == 448 + 128 + 7 + 1          # V4-Flash's 512-wide rows
    assert kv_row_bytes(128, 64) == 200 and kv_row_bytes(256, 64) == 328 and kv_row_bytes(64, 0) == 72
    for D in (64, 128, 256, 512):
        for r in range(D % 64, D, 64):
            assert kc.kv_row_bytes(D, r) == kv_row_bytes(D, r) and kv_row_bytes(D, r) % 8 == 0
            assert packed_rope_dim(D, kv_row_bytes(D, r)) == r == kc.packed_rope_dim(D, kv_row_bytes(D, r))
    assert packed_rope_dim(512, 1024) is None and kc.packed_rope_dim(512, 583) is None
    with pytest.raises(ValueError, match="multiple of 64"):
        kv_row_bytes(512, 32)


def test_packed_layout_by_hand():
    """Tile 0: amax 1 -> scale 2^-8 (byte 119), 1.0 -> code 256 = 0x78; rope bf16 bytes; zero pad."""
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 64], x[0, 65] = 1.0, -0.5, 3.0, -2.0
    p = pack_kv_fp8(x, 64)[0]
    assert p.shape == (200,) and p[0] == 0x78 and p[1] == 0x80 | 0x70 and (p[2:64] == 0).all()
    assert torch.equal(p[64:192].view(torch.bfloat16), x[0, 64:])
    assert p[192] == 119 and (p[193:] == 0).all()


@pytest.mark.parametrize("D,rope,dtype", [(512, 64, torch.bfloat16), (128, 64, torch.bfloat16),
                                          (256, 64, torch.float32)])
def test_unpack_of_pack_is_the_fp8_fake_quant(D, rope, dtype):
    x = edge_rows(300, D, seed=D, dtype=dtype)
    got = unpack_kv_fp8(pack_kv_fp8(x, rope), D, rope, dtype)
    want = torch.cat([fake_quant_fp8(x[:, :D - rope], 64), x[:, D - rope:].to(torch.bfloat16).to(dtype)], 1)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("D,rope", [(512, 64), (128, 64)])
def test_storing_fake_quantised_rows_is_lossless(D, rope):
    """pack(fq(x)) unpacks to fq(x) bit for bit. Its scale is fq's own or one binade lower (max|code|
    was 224: the codes double), never anything else; both cases occur here."""
    x = edge_rows(2000, D, seed=7)
    y = fake_quant_row(x, rope)
    px, py = pack_kv_fp8(x, rope), pack_kv_fp8(y, rope)
    assert torch.equal(bits(unpack_kv_fp8(py, D, rope)), bits(y))
    nope, nt = D - rope, (D - rope) // 64
    ex, ey = (p[:, nope + 2 * rope:nope + 2 * rope + nt].long() for p in (px, py))
    assert ((ey == ex) | (ey == ex - 1)).all()
    dropped = ey == ex - 1
    assert dropped[special(3, nt)] and dropped.sum() >= 10 and (~dropped).sum() > 1000
    cx, cy = (p[:, :nope].view(torch.float8_e4m3fn).float().view(-1, nt, 64) for p in (px, py))
    assert torch.equal(cy[dropped], 2 * cx[dropped]) and torch.equal(cy[~dropped], cx[~dropped])
    for k in (0, 1, 2, 4, 5):          # zero, -0, floored: the floor's scale; 447 -> 448 and 448 * 2^-3 keep theirs
        assert not dropped[special(k, nt)]


def test_state_cache_rows_and_ring_round_trip():
    """A kv_fp8 StateCache: paged rows through a scattered table and the portable ring writer."""
    layout = CacheLayout(ratios=(4,), num_main_layers=1, head_dim=128, index_head_dim=64, window=6,
                         backtrack=2, dtype=torch.bfloat16, kv_fp8=True)
    cache = StateCache(layout, num_slots=2, num_blocks=4)
    assert cache.rings[0].dtype == torch.uint8 and cache.comp[0]["rows"].shape == (4, 32, 200)
    assert cache.index[0]["rows"].dtype == torch.bfloat16 and cache.comp[0]["tail_kv"].shape[-1] == 256
    st = cache.bind(1, [3, 0])
    rows = fake_quant_row(edge_rows(40, 128, seed=3), 64)
    st.layers[0].compressor.write_rows(0, rows[:33])
    st.layers[0].compressor.write_rows(33, rows[33:])
    st.layers[0].compressor.n_rows = 40
    assert torch.equal(bits(st.layers[0].compressor.read_rows()), bits(rows))
    kv = fake_quant_row(edge_rows(11, 128, seed=4), 64)
    Ref.write_ring(st.layers[0], kv, 5)               # positions 5..15 into 8 slots: the last 8 stay
    ring = unpack_kv_fp8(cache.rings[0][1], 128, 64)
    assert torch.equal(bits(ring[torch.arange(8, 16) % 8]), bits(kv[3:]))


# ---- the Triton writers ------------------------------------------------------------------------
@pytest.mark.parametrize("D,rope", [(512, 64), (128, 64)])
def test_write_kernels_store_the_bytes_of_pack(kdev, D, rope):
    """write_ring over a ragged batch (a chunk longer than the ring, a wrapping decode) and write_rows
    with -1 padding into a shuffled table: same bytes as the portable writers (pack_kv_fp8)."""
    g = torch.Generator().manual_seed(1)
    rb, R = kv_row_bytes(D, rope), 7
    specs, slots = [(0, 9), (20, 1), (3, 4)], [2, 0, 3]
    T = sum(n for _, n in specs)
    kv = edge_rows(T, D, seed=5)
    ring = torch.randint(0, 256, (4, R, rb), generator=g, dtype=torch.uint8)
    want_ring, cu = ring.clone(), [0]
    for (start, n), slot in zip(specs, slots):
        Ref.write_ring(LayerState(ring=want_ring[slot]), kv[cu[-1]:cu[-1] + n], start)
        cu.append(cu[-1] + n)
    meta = dict(cu_seqlens=torch.tensor(cu, **I32), seq_start=torch.tensor([s for s, _ in specs], **I32),
                slots=torch.tensor(slots, **I32), token_seq=torch.tensor([i for i, (_, n) in enumerate(specs)
                                                                          for _ in range(n)], **I32),
                positions=torch.tensor([p for s, n in specs for p in range(s, s + n)]))
    got_ring = ring.to(kdev)
    write_ring(kv.to(kdev), got_ring, **{k: v.to(kdev) for k, v in meta.items()})
    assert torch.equal(got_ring.cpu(), want_ring)

    rows = edge_rows(7, D, seed=6, dtype=torch.float32)      # row 6: padding; fp32 RoPE dims round to bf16
    pool = torch.randint(0, 256, (5, 8, rb), generator=g, dtype=torch.uint8)     # ratio 16: 8 rows per block
    tables = [[4, 1], [2]]
    want_pool = pool.clone()
    for s, (first, idx) in enumerate([(5, [0, 1, 2, 3]), (2, [4, 5])]):
        cs = CompressorState(ratio=16, overlap=False, tail_kv=torch.zeros(1, D), tail_z=torch.zeros(1, D),
                             pool=want_pool, table=BlockTable(tables[s], "cpu"), fp8_dims=(D, rope))
        cs.write_rows(first, rows[idx])
    got_pool = pool.to(kdev)
    write_rows(rows.to(kdev), got_pool, torch.tensor([[4, 1], [2, 0]], **I32, device=kdev),
               blk_seq=torch.tensor([0, 0, 0, 0, 1, 1, 0], **I32, device=kdev),
               blk_idx=torch.tensor([5, 6, 7, 8, 2, 3, -1], **I32, device=kdev))
    assert torch.equal(got_pool.cpu(), want_pool)


def test_writer_validation(kdev):
    kv = torch.zeros(2, 128, device=kdev)
    meta = dict(cu_seqlens=torch.tensor([0, 2], **I32, device=kdev), seq_start=torch.zeros(1, **I32, device=kdev),
                slots=torch.zeros(1, **I32, device=kdev), token_seq=torch.zeros(2, **I32, device=kdev),
                positions=torch.arange(2, device=kdev))
    with pytest.raises(ValueError, match="ring is uint8 .*kv_row_bytes"):
        write_ring(kv, torch.zeros(1, 4, 192, dtype=torch.uint8, device=kdev), **meta)
    with pytest.raises(ValueError, match="pool is uint8 .*kv_row_bytes"):
        write_rows(kv, torch.zeros(2, 32, 584, dtype=torch.uint8, device=kdev), torch.zeros(1, 1, **I32, device=kdev),
                   blk_seq=torch.zeros(2, **I32, device=kdev), blk_idx=torch.zeros(2, **I32, device=kdev))


# ---- sparse attention over packed pools --------------------------------------------------------
def vary_tiles(x: torch.Tensor) -> torch.Tensor:
    """Every 64-tile of every row scaled by its own 2^-4 .. 2^2, so tiles get different UE8M0 scales."""
    g = torch.Generator().manual_seed(x.numel())
    k = torch.randint(-4, 3, (*x.shape[:-1], x.shape[-1] // 64, 1), generator=g).float()
    return (x.float().unflatten(-1, (-1, 64)) * torch.exp2(k)).flatten(-2).to(x.dtype)


def run(args, dev, **hooks):
    moved = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return sa._sparse_attention(**moved, **hooks).cpu()


@pytest.mark.parametrize("comp,D,ratio,split", [("csa", 128, 4, False), ("csa", 128, 4, True),
                                                ("hca", 256, 16, False), ("hca", 256, 16, True),
                                                (None, 512, 4, True)])
def test_sparse_attention_over_packed_pools_is_bitwise(kdev, monkeypatch, comp, D, ratio, split):
    """Packed ring and rows vs bf16 pools holding the fake-quantised rows: identical bits. A decode
    that wraps the ring and a prefill chunk from mid-sequence that wraps it too; CSA indices with
    padding / HCA prefix rows; split-KV and single-pass."""
    monkeypatch.setattr(sa, "MIN_SPLIT_KEYS", 16)
    specs = [(37, 1), (13, 4)] if D < 512 else [(37, 1), (20, 1)]
    args, n_rows = build(specs, D=D, dtype=torch.bfloat16, comp=comp, ratio=ratio, K=6, window=8, R=11, seed=D)
    args["ring"] = fake_quant_row(vary_tiles(args["ring"]), 64)
    packed = dict(args, ring=pack_kv_fp8(args["ring"], 64))
    if comp:
        args["comp_rows"] = fake_quant_row(vary_tiles(args["comp_rows"]), 64)
        packed["comp_rows"] = pack_kv_fp8(args["comp_rows"], 64)
        assert max(n_rows) > 0
    want = run(args, kdev, split=split, config=SMALL)
    assert torch.equal(bits(run(packed, kdev, split=split, config=SMALL)), bits(want))
    # the portable reference reads the packed ring through unpack_kv_fp8: the same bits as well
    assert torch.equal(bits(reference(dict(args, ring=packed["ring"]), n_rows)), bits(reference(args, n_rows)))


def test_sparse_attention_pool_validation():
    args, _ = build([(3, 2)], D=128, dtype=torch.bfloat16, comp="csa", K=4)
    with pytest.raises(ValueError, match="ring must be .*packed kv_fp8"):
        sa.sparse_attention(**dict(args, ring=torch.zeros(4, 11, 199, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="comp_rows must be .*packed kv_fp8"):
        sa.sparse_attention(**dict(args, comp_rows=torch.zeros(4, 32, 584, dtype=torch.uint8)))


# ---- the whole model and the batched backend --------------------------------------------------
@pytest.fixture(scope="module")
def runner(tiny_ckpt_dir, kdev):
    from deepinfer_core.runner.model_runner import ModelRunner
    return ModelRunner(str(tiny_ckpt_dir), dtype="bfloat16", simulate_qat=True, device=kdev,
                       max_backtracking_tokens=2)


def caches(runner, kdev, num_blocks=4):
    """A bf16 and a kv_fp8 cache of the runner's model, zeroed (pools are torch.empty)."""
    cfg, bt = runner.model_config, runner.backtrack
    out = [StateCache(CacheLayout.from_config(cfg, torch.bfloat16, bt, kv_fp8=f), 2, num_blocks, kdev)
           for f in (False, True)]
    for c in out:
        for t in c.tensors():
            t.zero_()
    return out


def run_layers(runner, layers: list[int], backend, states, lens: list[int], x: torch.Tensor) -> list:
    """Attention layers of the tiny model (each on x) over one ragged batch, `backend` bound for the
    call; then the sequences advance past the batch."""
    from deepinfer_core.model import ForwardBatch
    batch = ForwardBatch.build([[0] * n for n in lens], states, x.device)
    outs = []
    for layer in layers:
        attn = runner.model.layers[layer].attn
        saved, attn.backend = attn.backend, backend
        try:
            with torch.no_grad():
                outs.append(attn(x, batch, [s.layers[layer] for s in states]))
        finally:
            attn.backend = saved
    batch.commit()
    return outs


def test_portable_layers_are_bitwise_equal_with_a_kv_fp8_cache(runner, kdev):
    """A window-only, a CSA and an HCA layer of the tiny model (QAT simulation on): prefill of 131 and
    7 tokens (CSA rows, the first HCA row), decode steps that read the ring and close ratio-4 blocks,
    a chunk that starts mid-sequence: the same bits from a bf16 and a kv_fp8 cache."""
    cfg = runner.model_config
    layers = [next(i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == r) for r in (0, 4, 128)]
    plain, fp8 = caches(runner, kdev)
    assert fp8.nbytes() < plain.nbytes()
    states = [[c.bind(i, [2 * i, 2 * i + 1]) for i in range(2)] for c in (plain, fp8)]
    g = torch.Generator().manual_seed(2)
    for lens in ([131, 7], [1, 1], [3, 1]):
        x = torch.randn(sum(lens), cfg.hidden_size, generator=g).to(torch.bfloat16).to(kdev)
        want, got = (run_layers(runner, layers, Ref(), st, lens, x) for st in states)
        for layer, w, o in zip(layers, want, got):
            assert torch.equal(bits(w), bits(o)), (lens, layer)
    assert fp8.comp[layers[2]]["rows"][0, 0].any()         # the HCA row was written (packed) and read back


def test_nvidia_backend_with_kv_fp8_pools(runner, kdev):
    """One CSA layer (compressor, indexer, sparse attention, ring) over a ragged batch: the batched
    kernels give the same bits with kv_fp8 pools as with bf16 pools (so do the portable ops), store the
    same ring bytes as the portable backend, and agree with it to bf16 rounding (as with bf16 pools)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
    from deepinfer_nvidia.attention import NvidiaAttentionBackend

    cfg = runner.model_config
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 4)
    backends = [Ref(), NvidiaAttentionBackend((4,)), NvidiaAttentionBackend((4,))]
    pools = caches(runner, kdev)[1:] + caches(runner, kdev)           # fp8 (portable), bf16, fp8
    states = [[c.bind(i, [2 * i, 2 * i + 1]) for i in range(2)] for c in pools]
    g = torch.Generator().manual_seed(5)
    for lens in ([9, 3], [1, 1], [1, 2]):        # positions 9 / 12 .. 13 close ratio-4 blocks
        x = torch.randn(sum(lens), cfg.hidden_size, generator=g).to(torch.bfloat16).to(kdev)
        ref, plain, got = (run_layers(runner, [layer], b, st, lens, x)[0] for b, st in zip(backends, states))
        assert torch.equal(bits(plain), bits(got))
        assert (got.float() - ref.float()).abs().max() <= 5e-2 * ref.float().abs().max()
    assert torch.equal(pools[0].rings[layer], pools[2].rings[layer]) and pools[2].rings[layer].any()
    # rows 0, 1 of sequence 0 (block 0) and row 0 of sequence 1 (block 2)
    rows = [c.comp[layer]["rows"][[0, 0, 2], [0, 1, 0]] for c in pools]
    assert torch.equal(rows[2], pack_kv_fp8(rows[1], 64)) and rows[2].any()
