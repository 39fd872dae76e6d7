"""The batched KV compressor and state writes against the core reference, driven side by side.

`Twin` holds one compressor layer of a `StateCache` twice: the core reference
(`PortableAttentionBackend.compress` / `.write_ring`, identity finalize) updates the CPU pools one
sequence at a time; the kernels update copies of the same pools over the whole ragged batch. After
every batch the pooled rows must agree to fp32 rounding, and the tails, the ring and the paged rows
(written from the reference's pooled rows) bit for bit. Batches mix decode and prefill chunks that
start and end mid-block, chunks longer than the tail and the ring, sequences in an order other than
their slots, shuffled physical blocks, and -1 padding of the block list.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.cache.state_cache import CacheLayout, StateCache, coff
from deepinfer_core.ops.portable_attention import PortableAttentionBackend as Ref
from deepinfer_kernels.compressor import compress_blocks, new_blocks, update_tails, write_ring, write_rows

PAD = 3          # -1 entries appended to every block list (CUDA-graph padding)


class Twin:
    def __init__(self, dev: str, ratio: int, seqs: list[tuple[int, list[int]]], *, d: int = 8,
                 window: int = 6, backtrack: int = 3, num_slots: int = 4, num_blocks: int = 16,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
        layout = CacheLayout(ratios=(ratio,), num_main_layers=1, head_dim=d, index_head_dim=8, window=window,
                             backtrack=backtrack, dtype=dtype)
        self.cache = StateCache(layout, num_slots, num_blocks, device="cpu")
        for t in self.ref_pools().values():      # torch.empty pools: unbound slots could hold NaN
            t.zero_()
        self.states = [self.cache.bind(slot, blocks) for slot, blocks in seqs]
        self.dev, self.ratio, self.d, self.c = dev, ratio, d, coff(ratio)
        self.k = {name: t.clone().to(dev) for name, t in self.ref_pools().items()}
        self.pos = [0] * len(seqs)
        self.g = torch.Generator().manual_seed(seed)

    def ref_pools(self) -> dict[str, torch.Tensor]:
        return {"ring": self.cache.rings[0], **self.cache.comp[0]}

    @property
    def tail_len(self) -> int:
        return self.cache.comp[0]["tail_kv"].shape[1]

    def step(self, batch: list[tuple[int, int]]) -> torch.Tensor:
        """Run one ragged batch [(sequence, new tokens)] through both; returns the kernel's pooled rows."""
        ids, lens = [i for i, _ in batch], [n for _, n in batch]
        starts = [self.pos[i] for i in ids]
        T, cd, dev = sum(lens), self.c * self.d, self.dev
        # kv and z as column slices of one projection output (row stride 2*C*d)
        kvz = torch.randn(T, 2 * cd, generator=self.g)
        kvz[:, cd:] *= 3.0
        kv, z = kvz[:, :cd], kvz[:, cd:]
        ring_kv = torch.randn(T, self.d, generator=self.g)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)

        pooled = []
        finalize = lambda rows, first_pos: (pooled.append(rows.clone()), rows)[1]  # noqa: E731
        for j, i in enumerate(ids):
            sl, st = slice(cu[j], cu[j + 1]), self.states[i]
            Ref.compress(st.layers[0].compressor, kv[sl], z[sl], starts[j], finalize)
            Ref.write_ring(st.layers[0], ring_kv[sl], starts[j])
            self.pos[i] += lens[j]
        want = torch.cat(pooled) if pooled else torch.empty(0, self.d)

        i32 = dict(dtype=torch.int32, device=dev)
        meta = dict(cu_seqlens=torch.tensor(cu, **i32), seq_start=torch.tensor(starts, **i32),
                    slots=torch.tensor([self.states[i].slot for i in ids], **i32))
        tokens = dict(token_seq=torch.tensor([j for j, n in enumerate(lens) for _ in range(n)], **i32),
                      positions=torch.tensor([p for s, n in zip(starts, lens) for p in range(s, s + n)],
                                             dtype=torch.int64, device=dev))
        ids_of = [self.states[i].table.ids for i in ids]
        width = max(len(t) for t in ids_of)
        table = torch.tensor([t + [0] * (width - len(t)) for t in ids_of], **i32)      # 0-padded
        bseq, bidx = new_blocks(starts, lens, self.ratio)
        nb = len(bidx)
        assert nb == want.shape[0]
        blk = dict(blk_seq=torch.tensor(bseq + [-1] * PAD, **i32), blk_idx=torch.tensor(bidx + [-1] * PAD, **i32))

        k = self.k
        kvz_d = kvz.to(dev)
        kv_d, z_d = kvz_d[:, :cd], kvz_d[:, cd:]
        out = compress_blocks(kv_d, z_d, k["tail_kv"], k["tail_z"], ratio=self.ratio, **blk, **meta)
        assert out.shape == (nb + PAD, self.d) and out.dtype == torch.float32
        torch.testing.assert_close(out[:nb].cpu(), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(out[nb:].cpu(), torch.zeros(PAD, self.d))
        # the reference's own rows, so the store is checked bit for bit; padding rows are NaN and
        # must never land anywhere
        rows = torch.cat([want, torch.full((PAD, self.d), float("nan"))]).to(dev)
        write_rows(rows, k["rows"], table, **blk)
        update_tails(kv_d, z_d, k["tail_kv"], k["tail_z"], **meta, **tokens)
        write_ring(ring_kv.to(dev), k["ring"], **meta, **tokens)
        for name, ref in self.ref_pools().items():
            assert torch.equal(k[name].cpu(), ref), f"{name} differs after batch {batch}"
        return out[:nb]


SEQS = [(3, [7, 2, 9, 12, 4]), (0, [11, 0, 8, 3, 14]), (2, [1, 6, 5, 15, 10])]   # (slot, shuffled blocks)
NARROW = [(3, [5, 2]), (0, [1, 3])]


def test_new_blocks_lists_every_closed_block_in_sequence_order():
    assert new_blocks([0, 3, 8, 5], [3, 6, 1, 0], 4) == ([1, 1], [0, 1])
    assert new_blocks([6, 0], [11, 4], 4) == ([0, 0, 0, 1], [1, 2, 3, 0])
    assert new_blocks([127, 0], [2, 127], 128) == ([0], [0])
    assert new_blocks([], [], 4) == ([], [])
    with pytest.raises(ValueError, match="ratio"):
        new_blocks([0], [1], 0)
    with pytest.raises(ValueError, match="lens"):
        new_blocks([0, 1], [1], 4)


@pytest.mark.parametrize("ratio,dtype", [(4, torch.float32), (4, torch.bfloat16), (16, torch.float32),
                                         (128, torch.bfloat16)])
def test_chunked_prefill_over_a_ragged_batch_matches_the_reference(kdev, ratio, dtype):
    tw = Twin(kdev, ratio, SEQS, dtype=dtype, seed=ratio)
    L, R = tw.tail_len, tw.cache.rings[0].shape[1]
    steps = [
        [(0, 5), (1, 2 * L + 3)],                  # mid-block end; a chunk longer than the tail
        [(2, 1), (1, 1), (0, ratio + 2)],          # decode beside prefill; batch order != slot order
        [(0, 1), (2, 2 * ratio - 1), (1, L)],
        [(1, 3), (0, 1)],
        [(2, 130), (0, 2 * L + ratio)],            # into the second 128-position block
        [(0, 1), (1, 1), (2, 1)],
        [(1, R + 1)],
    ]
    closed = 0
    for batch in steps:
        closed += tw.step(batch).shape[0]
    assert closed > 3 and max(tw.pos) > 128 + ratio


def test_overlap_decode_one_token_at_a_time(kdev):
    """Ratio 4 from block 0 on, one token per step: the tails carry every block, and wrap."""
    tw = Twin(kdev, 4, SEQS[:2], seed=1)
    tw.step([(1, 3)])
    n = tw.tail_len + 5                          # past the tail's wrap-around
    got = [tw.step([(0, 1), (1, 1)]).shape[0] for _ in range(n)]
    assert sum(got) == n // 4 + (3 + n) // 4


def test_decode_across_a_block_boundary(kdev):
    """Rows 31 and 32 of ratio 4 (and row 0 / 1 of ratio 128) live in different physical blocks."""
    for ratio in (4, 128):
        tw = Twin(kdev, ratio, SEQS[1:], dtype=torch.bfloat16, seed=ratio + 7)
        tw.step([(1, 126), (0, 252)])
        for _ in range(6):
            tw.step([(0, 1), (1, 1)])
        assert tw.pos == [258, 132]


@pytest.mark.parametrize("ratio,d", [(4, 512), (128, 64)])
def test_one_block_per_program(kdev, ratio, d):
    """Widths at which a program pools one block (d = 512 as in the model; at ratio 128 d = 64 already
    gives one block and two channel tiles per program)."""
    tw = Twin(kdev, ratio, NARROW, d=d, num_blocks=6, dtype=torch.bfloat16, seed=9)
    tw.step([(1, ratio + 3), (0, ratio - 1)])
    tw.step([(0, 2), (1, 1)])


def test_only_padding_writes_nothing(kdev):
    tw = Twin(kdev, 4, SEQS, seed=2)
    tw.step([(0, 2), (1, 2)])                    # no block closes: the block list is all padding


def test_pooling_math_on_a_hand_made_block(kdev):
    """Overlap, block 1 read half from the tails: softmax over 8 slots per channel, by hand."""
    d, L = 2, 8
    kv = torch.arange(8 * 2 * d, dtype=torch.float32).view(8, 2 * d) / 10
    z = torch.linspace(-2, 2, 8 * 2 * d).view(8, 2 * d)
    tail_kv = torch.zeros(1, L, 2 * d)
    tail_z = torch.full((1, L, 2 * d), float("-inf"))
    tail_kv[0, :2], tail_z[0, :2] = kv[:2], z[:2]          # positions 0, 1 in the tails
    i32 = dict(dtype=torch.int32, device=kdev)
    out = compress_blocks(kv[2:].to(kdev), z[2:].to(kdev), tail_kv.to(kdev), tail_z.to(kdev), ratio=4,
                          blk_seq=torch.tensor([0, 0], **i32), blk_idx=torch.tensor([0, 1], **i32),
                          cu_seqlens=torch.tensor([0, 6], **i32), seq_start=torch.tensor([2], **i32),
                          slots=torch.tensor([0], **i32)).cpu()
    w0 = torch.softmax(z[0:4, d:], 0)
    torch.testing.assert_close(out[0], (w0 * kv[0:4, d:]).sum(0), rtol=1e-6, atol=1e-7)
    slot_z, slot_kv = torch.cat([z[0:4, :d], z[4:8, d:]]), torch.cat([kv[0:4, :d], kv[4:8, d:]])
    torch.testing.assert_close(out[1], (torch.softmax(slot_z, 0) * slot_kv).sum(0), rtol=1e-6, atol=1e-7)


def test_bf16_stores_round_like_torch(kdev):
    """Ties (to even, both ways), overflow to inf, subnormals, -0, inf and NaN: the ring and row
    stores equal torch's `.to(bfloat16)` bit for bit (NaN as NaN)."""
    odd = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3961e38, torch.finfo(torch.float32).max, -0.0,
           1e-40, -3e-39, float("inf"), float("-inf"), float("nan"), 0.1, -7.77]
    kv = torch.cat([torch.tensor(odd), torch.randn(19, generator=torch.Generator().manual_seed(5))]).view(2, 16)
    i32 = dict(dtype=torch.int32, device=kdev)
    ring = torch.zeros(3, 4, 16, dtype=torch.bfloat16, device=kdev)
    write_ring(kv.to(kdev), ring, cu_seqlens=torch.tensor([0, 2], **i32), seq_start=torch.tensor([5], **i32),
               slots=torch.tensor([2], **i32), token_seq=torch.zeros(2, **i32),
               positions=torch.tensor([5, 6], device=kdev))
    pool = torch.zeros(4, 32, 16, dtype=torch.bfloat16, device=kdev)
    write_rows(kv.to(kdev), pool, torch.tensor([[0, 3]], **i32), blk_seq=torch.zeros(2, **i32),
               blk_idx=torch.tensor([33, 40], **i32))
    want = kv.to(torch.bfloat16)
    for got in (ring[2, 1:3].cpu(), pool[3, [1, 8]].cpu()):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert ring.float().abs().sum(-1).count_nonzero() == 2 and pool.float().abs().sum(-1).count_nonzero() == 2


def test_input_validation_names_the_argument(kdev):
    i32 = dict(dtype=torch.int32, device=kdev)
    kv = torch.zeros(4, 16, device=kdev)
    tails = torch.zeros(2, 11, 16, device=kdev)
    meta = dict(cu_seqlens=torch.tensor([0, 4], **i32), seq_start=torch.tensor([0], **i32),
                slots=torch.tensor([1], **i32))
    blk = dict(blk_seq=torch.tensor([0], **i32), blk_idx=torch.tensor([0], **i32))
    tok = dict(token_seq=torch.zeros(4, **i32), positions=torch.arange(4, device=kdev))

    def comp(**kw):
        args = dict(kv=kv, z=kv, tail_kv=tails, tail_z=tails, ratio=4, **meta, **blk)
        args.update(kw)
        return compress_blocks(args.pop("kv"), args.pop("z"), args.pop("tail_kv"), args.pop("tail_z"), **args)

    cases = [
        ("ratio", lambda: comp(ratio=3)),
        ("kv", lambda: comp(kv=kv.double())),
        ("z", lambda: comp(z=kv[:3])),
        ("tail_kv", lambda: comp(tail_kv=tails[:, :, :8], tail_z=tails[:, :, :8])),      # 8 channels, kv 16
        ("tail_kv", lambda: comp(tail_kv=tails[:, :7], tail_z=tails[:, :7])),              # 7 < 2 * ratio
        ("tail_z", lambda: comp(tail_z=tails[:1])),
        ("cu_seqlens", lambda: comp(cu_seqlens=meta["cu_seqlens"].long())),
        ("slots", lambda: comp(slots=torch.tensor([1, 2], **i32))),
        ("blk_idx", lambda: comp(blk_idx=torch.tensor([0, 1], **i32))),
        ("blk_seq", lambda: comp(blk_seq=torch.tensor([[0]], **i32))),
        ("kv", lambda: comp(kv=torch.zeros(4, 32, device=kdev)[:, ::2])),
        ("rows", lambda: write_rows(torch.zeros(2, 8, device=kdev), torch.zeros(3, 32, 8, device=kdev),
                                    torch.zeros(1, 2, **i32), **blk)),
        ("block_table", lambda: write_rows(torch.zeros(1, 8, device=kdev), torch.zeros(3, 32, 8, device=kdev),
                                           torch.zeros(1, 2, dtype=torch.int64, device=kdev), **blk)),
        ("pool", lambda: write_rows(torch.zeros(1, 8, device=kdev), torch.zeros(3, 3, 8, device=kdev),
                                    torch.zeros(1, 2, **i32), **blk)),
        ("positions", lambda: update_tails(kv, kv, tails, tails, **meta, token_seq=tok["token_seq"],
                                           positions=tok["positions"].int())),
        ("token_seq", lambda: update_tails(kv, kv, tails, tails, **meta, token_seq=tok["token_seq"][:2],
                                           positions=tok["positions"])),
        ("ring", lambda: write_ring(kv, torch.zeros(2, 9, 8, device=kdev), **meta, **tok)),
        ("ring", lambda: write_ring(kv, torch.zeros(2, 9, 16, dtype=torch.int32, device=kdev), **meta, **tok)),
        ("pool", lambda: write_rows(torch.zeros(1, 8, device=kdev), torch.zeros(3, 32, 8, dtype=torch.float64,
                                    device=kdev), torch.zeros(1, 2, **i32), **blk)),
        ("seq_start", lambda: write_ring(kv, torch.zeros(2, 9, 16, device=kdev), cu_seqlens=meta["cu_seqlens"],
                                         seq_start=torch.tensor([0, 0], **i32), slots=meta["slots"], **tok)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
