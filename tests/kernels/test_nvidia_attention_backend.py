"""The NVIDIA attention backend (batched kernels over device metadata) inside the whole tiny model,
against the portable backend: same greedy tokens and near-identical logits through chunked prefill,
decode across compressor block boundaries (ratio 4 and 128) and a ragged continuous batch. Then the
fixed-shape batches the decode / verification CUDA graphs run (`capture=False`) against plain eager.
Runs under TRITON_INTERPRET=1 on CPU in CI and compiled on a GPU."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.model.attention import Attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
from deepinfer_nvidia.attention import NvidiaAttentionBackend  # noqa: E402
from deepinfer_nvidia.plugin import model_ratios  # noqa: E402


def use_nvidia_attention(llm: LLM) -> None:
    """The backend as the plugin builds it for this engine (its numerics included)."""
    backend = NvidiaAttentionBackend(model_ratios(llm.runner.model_config),
                                     official=llm.runner.loaded.ctx.simulate_qat)
    for m in llm.runner.model.modules():
        if isinstance(m, Attention):
            m.backend = backend


@contextmanager
def runner_graphs(runner, graphs):
    """The runner with `graphs` (None: plain eager) instead of the graphs its engine installed over
    the engine's own cache (on a GPU), which must not run on the tests' caches."""
    saved, runner.graphs = runner.graphs, graphs
    try:
        yield
    finally:
        runner.graphs = saved


# max_backtracking_tokens: room for the q = 3 verify batches below (the suite runs without speculation,
# whose default room is 1)
OPTS = dict(dtype="float32", simulate_qat=False, max_num_batched_tokens=96, num_cache_blocks=16,
            max_num_seqs=4, async_scheduling=False, max_backtracking_tokens=6)


@pytest.fixture(scope="module")
def ours(tiny_ckpt_dir, kdev):
    """The tiny model on the nvidia attention backend (shared: the tests below that build their own
    caches leave its engine alone)."""
    llm = LLM(model=str(tiny_ckpt_dir), device=kdev, **OPTS)
    use_nvidia_attention(llm)
    return llm


@pytest.fixture(scope="module")
def pair(tiny_ckpt_dir, kdev, ours):
    return LLM(model=str(tiny_ckpt_dir), device=kdev, **OPTS), ours


def test_greedy_tokens_and_logprobs_match_the_portable_backend(pair):
    ref, ours = pair
    g = torch.Generator().manual_seed(3)
    # 130 tokens: chunked at 96, closes the first ratio-128 block; decode closes a ratio-4 block
    # (position 131) beside a short sequence's decode
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (130, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    want = ref.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    got = ours.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    for w, o in zip(want, got):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lo in zip(w.outputs[0].logprobs, o.outputs[0].logprobs):
            for tok, v in lw.items():
                assert abs(lo[tok].logprob - v.logprob) < 1e-3


def test_padded_static_decode_batches_equal_eager_decode(ours, kdev):
    """What a decode CUDA graph runs, without the graph: batches padded to their bucket with padding
    sequences in the cache's spare slot, fixed-shape metadata refilled in place (closed-block lists
    padded with -1, block tables to the longest). Same logits as the plain eager path, step by step,
    from two identical caches."""
    from deepinfer_core.cache.state_cache import StateCache
    from deepinfer_core.runner.cuda_graphs import DecodeGraphs

    runner = ours.runner
    backend = runner.model.layers[0].attn.backend
    layout = runner.cache_layout()
    eager_cache = StateCache(layout, 4, 8, kdev)
    static_cache = StateCache(layout, 4, 8, kdev, spare=True)
    graphs = DecodeGraphs(runner.model, static_cache, backend, max_seqs=4, max_blocks=3, capture=False)
    g = torch.Generator().manual_seed(11)
    # decode positions 7..9 / 6..8 close ratio-4 blocks in some steps and not in others
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (7, 6, 3)]
    blocks = [[5], [3], [7]]               # shuffled physical blocks
    eager = [eager_cache.bind(i, b) for i, b in enumerate(blocks)]
    static = [static_cache.bind(i, b) for i, b in enumerate(blocks)]
    with runner_graphs(runner, None):
        want = runner.forward_batch(prompts, eager)
        runner.forward_batch(prompts, static)
        for step in range(3):              # 3 sequences -> bucket 4 (one padding sequence)
            toks = [[int(t)] for t in want.argmax(-1)]
            want = runner.forward_batch(toks, eager)
            got = graphs.run(toks, static)
            for st in static:
                st.num_tokens += 1
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), step
    assert sorted(graphs.graphs) == [(4, 1)]


def derived_meta(starts: list[int], slots: list[int], tables: list[list[int]], q: int, width: int):
    """StaticMeta of a fixed-q batch refilled on the device, as a graph replay does: positions in
    place, block tables gathered by slot from a per-slot table `width` blocks wide, extras from the host."""
    from deepinfer_nvidia.batch_meta import StaticMeta

    per_slot = torch.zeros(max(slots) + 1, width, dtype=torch.int32)
    for s, t in zip(slots, tables):
        per_slot[s, :len(t)] = torch.tensor(t, dtype=torch.int32)
    m = StaticMeta((4, 128), len(starts), width, torch.zeros(len(starts) * q, dtype=torch.int64))
    m.meta.positions.copy_(torch.tensor([s + i for s in starts for i in range(q)]))
    m.derive(torch.tensor(slots), per_slot, torch.tensor(m.extra_inputs(starts)))
    return m


def test_static_meta_of_a_verify_batch():
    """Token-level arrays of a fixed-q batch, and closed-block lists sized to the exact bound:
    q positions close at most ceil(q / ratio) blocks of each ratio (reached: 3..7 closes two)."""
    m = derived_meta([3, 126], [1, 0], [[4], [6, 2]], q=5, width=3)      # q read off positions: 5
    assert m.query_len == 5 and m.blocks_len == {4: 4, 128: 2}
    a = m.meta
    assert a.cu_seqlens.tolist() == [0, 5, 10] and a.token_seq.tolist() == [0] * 5 + [1] * 5
    assert a.seq_start.tolist() == [3, 126] and a.slots.tolist() == [1, 0]
    assert a.block_table.tolist() == [[4, 0, 0], [6, 2, 0]]
    # 3..7 closes ratio-4 blocks 0 and 1; 126..130 closes 31 and the first ratio-128 block
    assert a.new_blocks[4].seq.tolist() == [0, 0, 1, 1] and a.new_blocks[4].idx.tolist() == [0, 1, 31, -1]
    assert a.new_blocks[128].seq.tolist() == [0, 1] and a.new_blocks[128].idx.tolist() == [-1, 0]
    from deepinfer_nvidia.batch_meta import StaticMeta
    with pytest.raises(ValueError, match="positions"):
        StaticMeta((4,), 2, 3, torch.zeros(5, dtype=torch.int64), query_len=3)
    with pytest.raises(ValueError, match="blocks wide"):
        m.derive(torch.tensor([1, 0]), torch.zeros(2, 4, dtype=torch.int32), torch.tensor(m.extra_inputs([3, 126])))


def test_padded_static_verify_batches_equal_eager_verify(ours, kdev):
    """What a verification CUDA graph runs (q = 3 tokens per sequence, the logits of every row),
    without the graph, through the runner's forward_batch: 3 sequences padded to bucket 4, against
    plain eager forward_batch(all_logits=True) on a second cache. Both caches start from the same
    random state instead of a prefill (the comparison needs identical state, not meaningful state),
    so the sequences can start at positions 126, 2, 9: the first step closes ratio-4 blocks 31, 0, 2
    and the first ratio-128 block, the second ratio-4 blocks 32 and 1."""
    from deepinfer_core.cache.state_cache import StateCache
    from deepinfer_core.runner.cuda_graphs import DecodeGraphs

    runner = ours.runner
    backend = runner.model.layers[0].attn.backend
    layout = runner.cache_layout()
    eager_cache = StateCache(layout, 4, 8, kdev)
    static_cache = StateCache(layout, 4, 8, kdev, spare=True)
    graphs = DecodeGraphs(runner.model, static_cache, backend, max_seqs=4, max_blocks=2, capture=False)
    assert graphs.max_query_len == min(8, layout.backtrack) >= 3
    starts, blocks = (126, 2, 9), [[5, 2], [3], [7]]
    eager = [eager_cache.bind(i, b) for i, b in enumerate(blocks)]
    static = [static_cache.bind(i, b) for i, b in enumerate(blocks)]
    g = torch.Generator().manual_seed(12)
    for e, s in zip(eager_cache.tensors(), static_cache.tensors()):     # spare slot/block last
        s.copy_(torch.randn(s.shape, generator=g).to(s.dtype))
        e.copy_(s[:e.shape[0]])
    for st, n in zip(eager + static, starts * 2):
        st.num_tokens = n
    for step in range(1, 3):
        toks = [torch.randint(2, 129280, (3,), generator=g).tolist() for _ in starts]
        with runner_graphs(runner, None):
            want = runner.forward_batch(toks, eager, all_logits=True)
        assert graphs.fits(toks, static, True, None) and not graphs.fits(toks, static, False, None)
        with runner_graphs(runner, graphs):
            got = runner.forward_batch(toks, static, all_logits=True)
        assert got.shape == want.shape == (9, runner.model_config.vocab_size)
        # not bitwise: CPU GEMMs round differently for 9 and 12 rows (padding); ~5e-6 seen
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (step, (got - want).abs().max().item())
        assert [st.num_tokens for st in static] == [st.num_tokens for st in eager] == [n + 3 * step for n in starts]
    assert sorted(graphs.graphs) == [(4, 3)]


@pytest.mark.parametrize("q", [1, 3, 5])
def test_static_meta_derived_on_the_device_equals_the_eager_host_meta(q):
    """What a decode/verify graph records (`derive`: block tables gathered by slot from the engine's
    per-slot table, closed blocks from host extras) describes the same batch as the eager path's
    host-built metadata (`build_meta`): same starts, block tables, token arrays and closed
    (sequence, block) pairs."""
    from deepinfer_nvidia.batch_meta import build_meta

    starts, slots, tables = [3, 126, 9], [1, 0, 2], [[3, 4, 5], [0, 1, 2], [6, 7, 8]]
    states = [SimpleNamespace(slot=s, table=SimpleNamespace(ids=t)) for s, t in zip(slots, tables)]
    eager = SimpleNamespace(starts=starts, lens=[q] * 3, states=states, slot_tables=None, slot_ids=None,
                            positions=torch.tensor([s + i for s in starts for i in range(q)]))
    host, derived = build_meta(eager, (4, 128)), derived_meta(starts, slots, tables, q, width=3).meta

    def closed(m) -> dict:
        return {r: sorted((int(s), int(i)) for s, i in zip(m.new_blocks[r].seq, m.new_blocks[r].idx) if i >= 0)
                for r in (4, 128)}

    assert closed(derived) == closed(host)
    for name in ("seq_start", "slots", "block_table", "cu_seqlens", "token_seq"):
        assert getattr(derived, name).tolist() == getattr(host, name).tolist(), name


def test_the_batch_invariant_variant_keeps_the_numerics():
    for official in (False, True):
        variant = NvidiaAttentionBackend((4, 128), official=official).batch_invariant_variant()
        assert variant.batch_invariant and variant.official is official
        assert variant.ratios == (4, 128)
