"""Decode graphs (aclgraph: the simulated `torch.npu.NPUGraph`) over the Ascend attention backend.

1. One window-only, one CSA (ratio 4, lightning indexer, top-4) and one HCA (ratio 128) layer of the
   documented dims (D 512, indexer D 128, 8 indexer heads), in a stand-in model whose per-token
   inputs are tables of the token id and position: prefills run eagerly, then decode and verify
   steps run once eagerly on one cache and once through `DecodeGraphs` (captured in the fake
   NPUGraph and replayed) on a second cache of the same contents. Outputs agree step by step and
   the caches end equal -- rings, tails, compressed rows and indexer keys -- over blocks that close
   during the graph steps, a rollback, padding sequences and kv_fp8 rings.
2. The tiny V4 model (head_dim 512) through the engine on the `ascend` platform: the engine captures
   decode graphs and replays them, and greedy tokens equal `enforce_eager=True`'s.

A host sync in the graph path would make the capture fail (the runner then stays eager), which
both parts assert against."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.cache.state_cache import CacheLayout, StateCache
from deepinfer_core.model.attention import AttentionInputs
from deepinfer_core.model.forward_batch import ForwardBatch
from deepinfer_core.runner.cuda_graphs import DecodeGraphs

BACKEND = Path(__file__).resolve().parents[2] / "backends" / "ascend950"
BF16 = torch.bfloat16
H, D, DI, HI, W, TOPK, VOCAB, BACKTRACK = 2, 512, 128, 8, 8, 4, 50, 4
RATIOS = (0, 4, 128)
TABLES = {0: [3, 0], 1: [1, 4], 2: [5, 2]}          # slot -> its blocks (spare block: 6)


@pytest.fixture
def ascend_attention(fake_npu, monkeypatch):
    monkeypatch.syspath_prepend(str(BACKEND))
    import torch_npu
    from deepinfer_ascend.attention import AscendAttentionBackend
    return AscendAttentionBackend(torch_npu)


class StandIn:
    """A model of the three layers: each layer's inputs are sums of token-id and position tables
    (bf16-exact; indexer queries and key inputs positive, so no two rows tie at a zero score), its
    attention the backend's; the logits are every layer's output, flattened."""

    def __init__(self, backend, g: torch.Generator):
        self.backend = backend
        self.attns, self.tables = [], []
        for i, r in enumerate(RATIOS):
            attn = SimpleNamespace(window=W, scale=D ** -0.5, attn_sink=torch.randn(H, generator=g),
                                   ratio=r, layer_id=i, index_source=i if r == 4 else -1,
                                   yoco_consumer=False, compressor=None, indexer=None)
            if r:
                attn.compressor = SimpleNamespace(finalize=lambda x, starts: x.to(BF16))
            if r == 4:
                attn.indexer = SimpleNamespace(wk=None, topk=TOPK, compressor=SimpleNamespace(
                    finalize=lambda x, starts: x.to(BF16)))
            c = 2 if r == 4 else 1
            shapes = {"q": (H, D), "kv": (D,)}
            if r:
                shapes.update(comp_kv=(c * D,), comp_z=(c * D,))
            if r == 4:
                shapes.update(idx_kv=(2 * DI,), idx_z=(2 * DI,), idx_q=(HI, DI), idx_w=(HI,))
            self.tables.append({k: [(torch.randn(n, *s, generator=g) * 0.5).to(BF16).float()
                                    for n in (VOCAB, 256)] for k, s in shapes.items()})
            self.attns.append(attn)

    def inputs(self, i: int, ids: torch.Tensor, pos: torch.Tensor) -> AttentionInputs:
        got = {k: tok[ids] + at[pos] for k, (tok, at) in self.tables[i].items()}
        for k in ("idx_q", "idx_kv"):
            if k in got:
                got[k] = got[k].abs()
        for k in ("q", "kv", "idx_q", "idx_w"):
            if k in got:
                got[k] = got[k].to(BF16)
        return AttentionInputs(**got)

    def __call__(self, batch):
        outs = [self.backend.forward(attn, self.inputs(i, batch.input_ids, batch.positions), batch,
                                     [st.layers[i] for st in batch.states]).flatten(1)
                for i, attn in enumerate(self.attns)]
        logits = torch.cat(outs, dim=1).float()
        return SimpleNamespace(logits=logits, streams=logits)


def make_cache(kv_fp8: bool) -> StateCache:
    layout = CacheLayout(RATIOS, len(RATIOS), D, DI, W, BACKTRACK, BF16, kv_fp8=kv_fp8)
    cache = StateCache(layout, num_slots=3, num_blocks=6, spare=True)
    for t in cache.tensors():
        t.zero_()
    return cache


# (sequence slots, new tokens each): decode steps over the CSA block closing at positions 11/31,
# HCA's at 127; a verify step of 3 (rolled back by 2), padding (3 sequences in bucket 4)
PROMPTS = {0: 10, 1: 29, 2: 125}
STEPS = [((0, 1, 2), 1), ((0, 1, 2), 1), ((0, 2), 3, 2), ((0, 1, 2), 1), ((1,), 1),
         ((0, 1, 2), 2), ((0, 1, 2), 1)]


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16", "kv_fp8"])
def test_graph_steps_equal_the_eager_path(ascend_attention, fake_npu, kv_fp8):
    g = torch.Generator().manual_seed(0)
    model = StandIn(ascend_attention, g)
    eager_cache, graph_cache = make_cache(kv_fp8), make_cache(kv_fp8)
    eager = {s: eager_cache.bind(s, TABLES[s]) for s in TABLES}
    graph = {s: graph_cache.bind(s, TABLES[s]) for s in TABLES}
    for states in (eager, graph):                                  # the same eager prefills
        seqs = [states[s] for s in PROMPTS]
        ids = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(s)).tolist()
               for s, n in PROMPTS.items()]
        batch = ForwardBatch.build(ids, seqs)
        model(batch)
        batch.commit()
    graphs = DecodeGraphs(model, graph_cache, ascend_attention, max_seqs=4, max_blocks=2,
                          max_query_len=3)
    for step in STEPS:
        slots, q = step[0], step[1]
        ids = [torch.randint(0, VOCAB, (q,), generator=g).tolist() for _ in slots]
        batch = ForwardBatch.build(ids, [eager[s] for s in slots])
        want = model(batch).logits
        batch.commit()
        got = graphs.run(ids, [graph[s] for s in slots])
        assert got is not None, graphs.failed                       # captured, no host sync
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-5)
        for s in slots:
            graph[s].num_tokens += q
            if len(step) > 2:                                       # drafts rejected
                for states in (eager, graph):
                    states[s].rollback(states[s].num_tokens - step[2])
    real_blocks = [b for t in TABLES.values() for b in t]
    for i in range(len(RATIOS)):
        assert torch.equal(eager_cache.rings[i][:3], graph_cache.rings[i][:3])
        for pools in (eager_cache.comp[i], eager_cache.index[i]):
            if pools is None:
                continue
            other = graph_cache.comp[i] if pools is eager_cache.comp[i] else graph_cache.index[i]
            assert torch.equal(pools["tail_kv"][:3], other["tail_kv"][:3])
            assert torch.equal(pools["tail_z"][:3], other["tail_z"][:3])
            assert torch.equal(pools["rows"][real_blocks], other["rows"][real_blocks])
            assert pools["rows"][real_blocks].any()
    names = [e[0] for e in fake_npu.state.log]
    assert names.count("NPUGraph.replay") == len(STEPS)
    assert sorted(graphs.graphs) == [(1, 1), (2, 3), (4, 1), (4, 2)]
    cap = graphs.graphs[(4, 1)].graph
    assert isinstance(cap, torch.npu.NPUGraph)
    assert cap.fused_ops.count("npu_sparse_flash_attention") == 3
    assert cap.fused_ops.count("npu_lightning_indexer") == 1


def test_a_host_sync_in_the_graph_path_fails_the_capture(ascend_attention, monkeypatch):
    """What the tests here rest on: a host read in the layer's graph path (the window gather
    reading a start position) fails the capture on the fake NPUGraph; the runner says why."""
    from deepinfer_ascend import attention_graph
    real = attention_graph.window_keys

    def syncing(meta, *args):
        int(meta.starts[0])
        return real(meta, *args)
    monkeypatch.setattr(attention_graph, "window_keys", syncing)
    cache = make_cache(kv_fp8=False)
    model = StandIn(ascend_attention, torch.Generator().manual_seed(0))
    graphs = DecodeGraphs(model, cache, ascend_attention, max_seqs=2, max_blocks=2)
    assert graphs.run([[1], [2]], [cache.bind(s, TABLES[s]) for s in (0, 1)]) is None
    assert "HostSyncError" in graphs.failed

# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ascend_ckpt(tmp_path_factory) -> Path:
    """A tiny V4 the Ascend attention serves (head_dim 512): window-only, CSA and HCA layers and an
    MTP block."""
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
    cfg = {"head_dim": 512, "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 0, 0]}
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ascend_graphs_ckpt"), cfg, seed=0)


@pytest.fixture
def ascend_platform(fake_npu, monkeypatch, tmp_path):
    """DEEPINFER_ACCELERATOR=ascend resolved by a fresh plugin manager, the backend registered on
    the simulated device (model_fixtures.install_backend: alias mode)."""
    from model_fixtures import install_backend, use_accelerator

    from deepinfer_core import plugins
    install_backend(monkeypatch, tmp_path)       # makes deepinfer_ascend importable
    from deepinfer_ascend import runtime
    use_accelerator(monkeypatch, "ascend")
    yield fake_npu
    runtime.reset()
    monkeypatch.delenv("DEEPINFER_ACCELERATOR")
    plugins.get_plugin_manager(refresh=True)


MAX_TOKENS = 6


def greedy(llm, prompts) -> list[list[int]]:
    from deepinfer_core import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("drafts", [0, 2], ids=["decode", "mtp2"])
def test_the_engine_replays_npu_graphs_with_the_eager_tokens(ascend_ckpt, ascend_platform, drafts):
    """Decode steps (q = 1) or MTP-2 verify steps (q = 3) and the drafter's own graphs: captured
    on first use, replayed at every later step, the tokens of the eager engine. The first prompt
    runs past the window (16), closes CSA blocks and, decoding, HCA's first block (position 127)."""
    from deepinfer_ascend.attention import AscendAttentionBackend

    from deepinfer_core import LLM
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,), generator=g).tolist() for n in (124, 9)]
    opts = dict(model=str(ascend_ckpt), dtype="bfloat16", device="cpu", max_num_seqs=2,
                max_model_len=256, num_cache_blocks=8, num_speculative_tokens=drafts)
    llm = LLM(**opts)
    runner = llm.runner
    assert isinstance(runner.loaded.ops.attention, AscendAttentionBackend)
    got = greedy(llm, prompts)
    every = [runner.graphs]
    if drafts:
        mtp = llm.engine.executor.speculator._graphs
        every += [mtp.observe_graphs, mtp.step_graphs]
    for graphs in every:                      # captured (a host sync would have failed it)
        assert graphs.failed is None and graphs.graphs, graphs.failed
        assert all(isinstance(c.graph, torch.npu.NPUGraph) for c in graphs.graphs.values())
    assert sorted(runner.graphs.graphs) == [(2, drafts + 1)]
    names = [e[0] for e in ascend_platform.state.log]
    captures = names.count("NPUGraph.capture_begin")
    replays = names.count("NPUGraph.replay")
    assert captures == len(every)
    if drafts:           # every verify step replays its graph and the drafter's observe and step
        assert replays > 0 and replays % len(every) == 0, replays
    else:                # every step after the prefill's is a decode step
        assert replays == MAX_TOKENS - 1
    eager = LLM(**opts, enforce_eager=True)
    assert eager.runner.graphs is None
    assert got == greedy(eager, prompts)
