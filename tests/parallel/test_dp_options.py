"""`data_parallel_size` / `enable_expert_parallel` as options of `LLM(...)` and the CLI.

Oracle: the same call in one process (data_parallel_size=1). `LLM(..., data_parallel_size=2,
enable_expert_parallel=True)` runs `generate` and `chat` on DataParallelLLM's two ranks (experts sharded,
with replicas); the greedy tokens must be identical (float32, QAT off, batch-invariant GEMMs, as in
test_dp_engine.py). The in-process engine APIs refuse naming data_parallel_size; leaving the `with` block
stops the ranks. The CLI with `--data-parallel-size 2 --enable-expert-parallel` prints what DP 1 prints.
"""

from __future__ import annotations

import pytest

from deepinfer_core import LLM, SamplingParams, generate

COMMON = dict(dtype="float32", simulate_qat=False, batch_invariant=True, num_speculative_tokens=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter", "O Romeo"]
CHAT = [[{"role": "user", "content": "Who is Hamlet?"}], [{"role": "user", "content": "Speak the speech."}]]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def oracle(tiny_ckpt_dir) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(tiny_ckpt_dir), **COMMON)
    return (_tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)), _tokens(llm.chat(CHAT, GREEDY, use_tqdm=False)))


def test_llm_dp2_ep_generate_and_chat_equal_one_process(oracle, tiny_ckpt_dir):
    with LLM(
        str(tiny_ckpt_dir), data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2, **COMMON
    ) as llm:
        p = llm.config.parallel
        assert (p.data_parallel_size, p.enable_expert_parallel, p.num_redundant_experts) == (2, True, 2)
        out = llm.generate(PROMPTS, GREEDY)
        assert [o.request_id for o in out] == ["0", "1", "2", "3"] and [o.prompt for o in out] == PROMPTS
        assert _tokens(out) == oracle[0]
        assert all(len(t) == GREEDY.max_tokens for t in _tokens(out))
        assert _tokens(llm.chat(CHAT, GREEDY)) == oracle[1]
        # APIs of the in-process engine refuse, naming the option
        with pytest.raises(RuntimeError, match=r"LLM.engine .*data_parallel_size=2"):
            llm.engine
        with pytest.raises(AttributeError, match=r"LLM.runner .*data_parallel_size=2"):
            llm.runner
        assert llm.max_model_len == llm.model_config.max_position_embeddings
        procs = list(llm._dp._procs)
        assert len(procs) == 2 and all(proc.exitcode is None for proc in procs)
    assert all(proc.exitcode is not None for proc in procs)  # leaving the block stopped the ranks
    with pytest.raises(RuntimeError, match="has stopped"):
        llm.generate(PROMPTS[:1], GREEDY)


def test_engine_process_generates_what_the_in_process_engine_does(oracle, tiny_ckpt_dir):
    """engine_process=True: one engine in a child process."""
    with LLM(str(tiny_ckpt_dir), engine_process=True, **COMMON) as llm:
        assert llm.config.parallel.data_parallel_size == 1 and llm.device == "cpu"
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == oracle[0]
        assert _tokens(llm.chat(CHAT, GREEDY)) == oracle[1]
        with pytest.raises(AttributeError, match=r"LLM.runner .*engine_process=True"):
            llm.runner
        procs = list(llm._dp._procs)
        assert len(procs) == 1 and procs[0].exitcode is None
    assert procs[0].exitcode is not None


def test_engine_process_false_with_data_parallel_is_refused():
    with pytest.raises(ValueError, match=r"engine_process=False with data_parallel_size=2.*allowed: engine_process"):
        LLM(data_parallel_size=2, engine_process=False, device="cpu")


def test_from_runner_refuses_data_parallel():
    with pytest.raises(ValueError, match=r"from_runner with data_parallel_size > 1 or engine_process=True"):
        LLM.from_runner(object(), data_parallel_size=2)


def test_unsupported_combinations_are_refused_before_any_rank_starts(tiny_ckpt_dir):
    with pytest.raises(ValueError, match="data_parallel_size=2 with device='cuda'"):
        LLM(str(tiny_ckpt_dir), data_parallel_size=2, device="cuda")
    with pytest.raises(ValueError, match="num_redundant_experts=2 needs enable_expert_parallel"):
        LLM(str(tiny_ckpt_dir), data_parallel_size=2, num_redundant_experts=2)
    with pytest.raises(ValueError, match="enable_eplb=True needs enable_expert_parallel=True"):
        LLM(str(tiny_ckpt_dir), data_parallel_size=2, enable_eplb=True)


def test_cli_dp2_and_engine_process_print_what_dp1_prints(tiny_ckpt_dir, capsys):
    argv = [
        "--model",
        str(tiny_ckpt_dir),
        "--prompt",
        "To be, or not to be",
        "--prompt",
        "O Romeo",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--ignore-eos",
        "--no-progress",
        "--dtype",
        "float32",
        "--no-simulate-qat",
        "--batch-invariant",
        "--num-speculative-tokens",
        "0",
    ]
    assert generate.main(argv) == 0
    one = capsys.readouterr().out
    assert generate.main(argv + ["--data-parallel-size", "2", "--enable-expert-parallel"]) == 0
    two = capsys.readouterr().out
    assert one.count("completion 0:") == 2 and two == one
    assert generate.main(argv + ["--engine-process"]) == 0     # one engine in a child process
    assert capsys.readouterr().out == one


def test_cli_refuses_eplb_without_expert_parallel(tiny_ckpt_dir, capsys):
    rc = generate.main(["--model", str(tiny_ckpt_dir), "--prompt", "x", "--data-parallel-size", "2", "--enable-eplb"])
    assert rc == 2
    assert "enable_eplb=True needs enable_expert_parallel=True" in capsys.readouterr().err
