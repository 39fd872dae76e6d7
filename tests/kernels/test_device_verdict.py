"""Verdicts that stay on the device (speculative/device_verdict.py): a step of greedy verify chunks is
verified and drafted without the host, and the next one is launched at the device's positions before
the host reads the verdict (Scheduler.schedule_blind). Without a GPU: the engine's CUDA-graph path
with `capture=False` (the same padded static batches, run eagerly) on the NVIDIA attention backend
under Triton's interpreter, the trained tiny model's MTP block (or the replay drafter) drafting.

The device path must produce what the host path (verdict read before the next launch) produces on
the same graphs: the same tokens, the same accepted counts, step by step."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from test_nvidia_attention_backend import use_nvidia_attention

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.engine import Engine
from deepinfer_core.runner import cuda_graphs, model_runner
from deepinfer_core.speculative import mtp_graphs
from deepinfer_core.speculative.engine_step import Speculator
from deepinfer_core.speculative.replay import ReplayDrafter
from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint

PROMPTS = ["HAMLET.\nTo be, or not to be,", "KING.\nMy lord, the", "ROMEO.\nBut soft, what light",
           "QUEEN.\nAlas, my lord,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory) -> str:
    return str(make_trained_checkpoint(tmp_path_factory.mktemp("trained") / "ckpt", ARTIFACT))


@pytest.fixture(scope="module")
def graphs_without_a_gpu(kdev):
    """Without a GPU: the engine builds its decode / verification graphs and the MTP drafter's with
    `capture=False` (for the module's lifetime: the drafter builds its graphs on first use)."""
    mp = pytest.MonkeyPatch()
    if kdev == "cpu":
        static = functools.partial(cuda_graphs.DecodeGraphs, capture=False)
        mp.setattr(model_runner, "DecodeGraphs", static)
        mp.setattr(mtp_graphs, "DecodeGraphs", static)
        mp.setattr(model_runner.ModelRunner, "_graphs_wanted", lambda self: True)
    yield
    mp.undo()


def graphed(ckpt: str, kdev: str, **opts) -> LLM:
    """The trained model on the nvidia attention backend with the engine's graphs."""
    llm = LLM(model=ckpt, device=kdev, dtype="float32", max_model_len=256, max_num_seqs=4, num_cache_blocks=24,
              **opts)
    use_nvidia_attention(llm)
    llm.runner.loaded.ops.attention = llm.runner.model.layers[0].attn.backend
    llm.runner._cache_request = None              # a new cache, its graphs, engine and speculator
    llm.engine
    assert llm.runner.graphs is not None
    return llm


@pytest.fixture(scope="module")
def graphed_llm(trained_ckpt, kdev, graphs_without_a_gpu):
    """MTP-3."""
    return graphed(trained_ckpt, kdev, num_speculative_tokens=3)


def run(llm, prompts, on_device: bool, params=GREEDY):
    """Outputs, per-request accepted counts and the number of device-verified and blind launches."""
    engine = llm.engine
    launches = {"on_device": 0, "blind": 0}
    real_launch, real_choice = engine.executor.launch, Engine._verifies_on_device

    def launch(chunks, updates, previous=None, on_device=False, blind=False):
        launches["on_device"] += on_device
        launches["blind"] += blind
        return real_launch(chunks, updates, previous, on_device, blind)
    engine.executor.launch = launch
    engine._verifies_on_device = (lambda chunks: real_choice(engine, chunks)) if on_device else (lambda chunks: False)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del engine.executor.launch, engine._verifies_on_device
    return ([o.outputs[0].token_ids for o in outs],
            [o.metrics.spec.num_accepted_tokens if o.metrics.spec else 0 for o in outs], launches)


@pytest.fixture(scope="module")
def prompts(graphed_llm):
    return [graphed_llm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def host_run(graphed_llm, prompts):
    """The host path's greedy run (verdict read before the next launch), shared by the tests."""
    return run(graphed_llm, prompts, on_device=False)


def test_mtp_drafts_verified_on_the_device_give_the_host_paths_tokens(graphed_llm, prompts, host_run):
    host_tokens, host_accepted, host_launches = host_run
    tokens, accepted, launches = run(graphed_llm, prompts, on_device=True)
    assert host_launches == {"on_device": 0, "blind": 0}
    assert launches["on_device"] > 0 and launches["blind"] > 0, launches
    assert tokens == host_tokens
    assert accepted == host_accepted and sum(accepted) > 0


def test_requests_that_need_the_host_fall_back_per_step(graphed_llm, prompts):
    """A request that stops early (max_tokens), one with logprobs and a sampled one beside a greedy
    one: the same outputs as the host path; once those are done, the greedy one goes on the device."""
    params = [dataclasses.replace(GREEDY, max_tokens=14), dataclasses.replace(GREEDY, max_tokens=5), dataclasses.replace(GREEDY, max_tokens=6, logprobs=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=7, ignore_eos=True)]
    host_tokens, _, _ = run(graphed_llm, prompts, on_device=False, params=params)
    tokens, _, launches = run(graphed_llm, prompts, on_device=True, params=params)
    assert tokens == host_tokens
    assert [len(t) for t in tokens] == [14, 5, 6, 7]
    assert launches["on_device"] > 0, launches


def test_replay_drafts_drawn_on_the_device_equal_the_host_drafters(trained_ckpt, kdev, graphs_without_a_gpu,
                                                                   prompts):
    """The replay drafter installed on an engine built without a drafter (as benchmarks/spec_replay.py
    does: the slot tables hold drafts for the rollback room) proposes the same drafts from device
    positions: the same accepted counts as its host path at a chosen acceptance (the coins are keyed
    by the request's seed: fixed here, not drawn per run)."""
    llm = graphed(trained_ckpt, kdev, num_speculative_tokens=0, max_backtracking_tokens=4)
    seeded = [dataclasses.replace(GREEDY, seed=i) for i in range(len(prompts))]
    recorded, _, _ = run(llm, prompts, on_device=False)
    drafter = ReplayDrafter({tuple(p): r for p, r in zip(prompts, recorded)}, [0.9, 0.7, 0.5],
                            llm.runner.model_config.vocab_size, seed=5)
    llm.engine.use_speculator(Speculator(llm.runner.model, 3, replay=drafter), llm.runner.backtrack)
    host = run(llm, prompts, on_device=False, params=seeded)
    device = run(llm, prompts, on_device=True, params=seeded)
    assert host[0] == device[0] == recorded
    assert host[1] == device[1] and sum(host[1]) > 0
    assert device[2]["blind"] > 0


def test_device_replay_drafts_equal_host_proposals():
    drafter = ReplayDrafter({(1, 2, 3): [7, 8, 9, 10, 11, 12]}, [0.9, 0.5], vocab_size=50, seed=1)
    prompt = [1, 2, 3]
    want = drafter.propose([prompt, prompt], [4, 9], [2, 5])
    got = drafter.propose_on_device([prompt, prompt], [4, 9], [3, 1], torch.tensor([3, 1]), torch.tensor([2, 5]),
                                    num_slots=4)
    assert got.tolist() == want


def test_closed_block_extras_from_device_starts_equal_the_host_ones():
    """StaticMeta's closed-block list of a step, derived from device starts, is the host list."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
    from deepinfer_nvidia.batch_meta import StaticMeta
    g = torch.Generator().manual_seed(0)
    for q in (1, 2, 4, 6, 9):
        starts = torch.randint(0, 600, (5,), generator=g).tolist() + [124, 127, 128, 0]
        meta = StaticMeta((4, 128), len(starts), 8, torch.zeros(len(starts) * q, dtype=torch.int64), query_len=q)
        assert meta.extra_inputs_device(torch.tensor(starts)).tolist() == meta.extra_inputs(starts)


def online(llm, prompts, stop: int | None, on_device: bool) -> tuple[dict[str, list[int]], int]:
    """Three requests; at the 4th step one is aborted and one added; one stops on `stop` (None:
    it runs to max_tokens)."""
    engine = llm.engine
    real_choice = Engine._verifies_on_device
    engine._verifies_on_device = (lambda chunks: real_choice(engine, chunks)) if on_device else (lambda chunks: False)
    engine.add_request("keep", prompts[0], GREEDY.clone())
    engine.add_request("stops", prompts[1], dataclasses.replace(GREEDY, stop_token_ids=[] if stop is None
                                                                else [stop]))
    engine.add_request("drop", prompts[2], GREEDY.clone())
    got, blind = {}, engine.num_blind_launches
    try:
        for i in range(200):
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if i == 3:
                blind = engine.num_blind_launches - blind        # launched blind so far
                engine.abort_request("drop")
                engine.add_request("late", prompts[3], GREEDY.clone())
            if not engine.has_unfinished_requests():
                break
    finally:
        del engine._verifies_on_device
    assert engine.scheduler.blocks.allocator.reclaim()
    return got, blind


def test_online_abort_and_a_stop_with_a_blind_step_in_flight(graphed_llm, prompts):
    """Online: a request aborted while a step launched at the device's positions is in flight, one
    that stops on a token it emits, and one added meanwhile: every output is the host path's for the
    same events (not a batch run's: without batch-invariant kernels the batches must match too, so
    the stop token is one the same events make that request emit, late and for the first time)."""
    free, _ = online(graphed_llm, prompts, None, on_device=False)
    seq = free["stops"]
    firsts = [t for i, t in enumerate(seq) if i >= 5 and t not in seq[:i]]
    assert firsts, f"the request repeats every token after its 5th: {seq}; choose other prompts"
    stop = firsts[0]
    host, _ = online(graphed_llm, prompts, stop, on_device=False)
    device, blind = online(graphed_llm, prompts, stop, on_device=True)
    assert blind > 0
    assert device == host
    assert "drop" not in device or len(device["drop"]) < GREEDY.max_tokens
    assert device["stops"][-1] == stop and stop not in device["stops"][:-1]
