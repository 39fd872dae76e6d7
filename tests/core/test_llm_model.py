"""The public entry points on the tiny model: LLM(model=PATH, dtype=..., simulate_qat=...) and
generate(prompt_token_ids=..., SamplingParams(temperature=0, max_tokens, logprobs, ignore_eos)).
Greedy tokens are checked against transformers' own greedy generation (independent oracle)."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, Logprob, SamplingParams
from oracle_utils import load_hf, write_hf_copy


PROMPTS = [[0, 4, 100, 2000, 77], list(range(300, 340)), [129279, 3, 3, 3, 9, 12000, 5, 8]]
N, K = 6, 3


@pytest.fixture(scope="module")
def llm_fp32(tiny_ckpt_dir):
    return LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False)


@pytest.fixture(scope="module")
def llm_fp32_qat(tiny_ckpt_dir):
    return LLM(model=str(tiny_ckpt_dir), dtype="float32")   # simulate_qat defaults to True


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, logprobs=K, ignore_eos=True)


def test_generate_contract_and_greedy_tokens_match_transformers(llm_fp32, tiny_ckpt_dir, tmp_path):
    outs = llm_fp32.generate(prompt_token_ids=PROMPTS, sampling_params=greedy_params(), use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    hf = load_hf(write_hf_copy(tiny_ckpt_dir, tmp_path / "hf"))
    for prompt, out in zip(PROMPTS, outs):
        comp = out.outputs[0]
        assert out.prompt_token_ids == prompt and len(comp.token_ids) == N
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert comp.token_ids == want.tolist()
        # one dict per generated token: the top-K (ranks 1..K) plus the sampled token
        assert isinstance(comp.logprobs, list) and len(comp.logprobs) == N
        for tok, entry in zip(comp.token_ids, comp.logprobs):
            assert isinstance(entry[tok], Logprob) and entry[tok].rank == 1
            ranks = sorted(lp.rank for lp in entry.values())
            assert ranks == list(range(1, K + 1))
            assert all(isinstance(lp.logprob, float) and lp.logprob <= 0 for lp in entry.values())


def test_logprob_values_equal_log_softmax_of_the_model_logits(llm_fp32):
    prompt = PROMPTS[1]
    out = llm_fp32.generate(prompt_token_ids=[prompt], sampling_params=greedy_params(), use_tqdm=False)[0]
    runner = llm_fp32.runner
    seq = runner.new_sequence()
    logits = runner.forward(seq, prompt)[-1]
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        ref = torch.log_softmax(logits.float(), -1)
        top = torch.topk(ref, K)
        assert [entry[i].logprob for i in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-5)
        logits = runner.forward(seq, [tok])[-1]
    runner.release(seq)


def test_qat_simulation_is_on_by_default_and_changes_the_function(llm_fp32_qat, llm_fp32):
    qat = llm_fp32_qat
    assert qat.runner.loaded.ctx.simulate_qat and not llm_fp32.runner.loaded.ctx.simulate_qat
    a, b = qat.runner.new_sequence(), llm_fp32.runner.new_sequence()
    la, lb = qat.runner.forward(a, PROMPTS[1]), llm_fp32.runner.forward(b, PROMPTS[1])
    rel = ((la - lb).abs().max() / lb.abs().max()).item()
    assert 1e-4 < rel < 0.5, rel      # fake-quant moves logits by a few percent, not more


@pytest.mark.parametrize("simulate_qat", [True, False])
def test_bfloat16_runs_on_cpu_and_tracks_float32(tiny_ckpt_dir, llm_fp32, llm_fp32_qat, simulate_qat):
    bf = LLM(model=str(tiny_ckpt_dir), dtype="bfloat16", simulate_qat=simulate_qat)
    assert bf.runner.loaded.ctx.dtype == "bfloat16"
    out = bf.generate(prompt_token_ids=PROMPTS, sampling_params=greedy_params(), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == N for o in out)
    fp32 = llm_fp32_qat if simulate_qat else llm_fp32
    s32, s16 = fp32.runner.new_sequence(), bf.runner.new_sequence()
    l32, l16 = fp32.runner.forward(s32, PROMPTS[1]), bf.runner.forward(s16, PROMPTS[1])
    assert torch.isfinite(l16).all()
    cos = torch.nn.functional.cosine_similarity(l16.flatten(), l32.flatten(), dim=0).item()
    assert cos > 0.98, cos     # bf16 rounding, not a different function


def test_bad_dtype_is_named(tiny_ckpt_dir):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(tiny_ckpt_dir), dtype="float16x")


def test_checkpoint_without_tokenizer_files_works_with_token_ids(tiny_ckpt_dir, tmp_path):
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    for f in tiny_ckpt_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            (bare / f.name).symlink_to(f)
    llm = LLM(model=str(bare), dtype="float32", simulate_qat=False)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=greedy_params(), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == N and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("text needs a tokenizer", greedy_params(), use_tqdm=False)


def test_ring_room_for_rollback_comes_from_the_env_table(llm_fp32, monkeypatch):
    from deepinfer_core.envs import read_settings
    room = read_settings().effective_max_backtracking_tokens       # max(value, nextn + 1)
    state = llm_fp32.runner.new_sequence()
    cfg = llm_fp32.runner.model_config
    assert state.layers[0].ring.shape[0] == cfg.sliding_window + room
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")       # the suite sets 0 (tests/conftest.py)
    assert read_settings().effective_max_backtracking_tokens == 6      # the table's: max(0, 5 + 1)
