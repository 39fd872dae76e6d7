"""End to end through the real ModelRunner on the session's tiny checkpoint (slow: a few tokens only)."""
import pytest

from deepinfer_core import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_llm(tiny_ckpt_dir):
    return LLM(str(tiny_ckpt_dir), max_model_len=64)


def test_text_prompt_greedy_chunked_prefill_and_logprobs(tiny_llm):
    assert tiny_llm.get_tokenizer().eos_token_id == tiny_llm.eos_token_id == 1
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = tiny_llm.generate("Hello world, this is", params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt_token_ids == tiny_llm.get_tokenizer().encode("Hello world, this is")
    assert len(c.token_ids) == 3 and c.finish_reason == "length"
    # Greedy picks the rank-1 token of the raw logits at every step.
    assert all(entry[t].rank == 1 for entry, t in zip(c.logprobs, c.token_ids))
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    # prefill in chunks of 2 (an LLM over the same runner): same tokens
    chunked = LLM.from_runner(tiny_llm.runner, tokenizer=tiny_llm.tokenizer, max_model_len=64,
                              max_num_batched_tokens=2)
    again = chunked.generate("Hello world, this is", params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == c.token_ids


def test_seeded_sampling_is_reproducible(tiny_llm):
    p = SamplingParams(seed=5, max_tokens=2, ignore_eos=True, top_p=0.9)
    a = tiny_llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p, use_tqdm=False)
    b = tiny_llm.generate(prompt_token_ids=[[9], [5, 6, 7]], sampling_params=[SamplingParams(max_tokens=1), p],
                          use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids
