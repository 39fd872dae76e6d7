"""`python -m deepinfer_core.generate`, run in-process through `main()` on the session tiny checkpoint.

Loading the tiny model takes seconds, so the CLI's `load_llm` is wrapped to keep one loaded LLM per
(checkpoint, engine options) for the module; its first call is the real load.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from deepinfer_core import generate
from deepinfer_core.api.sampling_params import SamplingParams
from deepinfer_core.tools import bundled_model

ENGINE = ["--max-model-len", "64", "--no-progress"]


@pytest.fixture(scope="module", autouse=True)
def shared_llms():
    cache: dict = {}
    real_load = generate.load_llm

    def load(model, **options):
        # A symlinked copy of the fixture (the bundled-model test) shares the fixture's entry.
        key = (str((Path(model) / "config.json").resolve()), tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = real_load(model, **options)
        return cache[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate, "load_llm", load)
        yield cache


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = generate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def greedy_run(tiny_ckpt_dir, tmp_path_factory):
    """One CLI run: a text prompt and a token-id prompt, 2 greedy tokens, logprobs, JSON output."""
    path = tmp_path_factory.mktemp("cli") / "out.json"
    rc = generate.main(["--model", str(tiny_ckpt_dir), "--prompt", "Hello", "--prompt-token-ids", "5, 6",
                        "--max-tokens", "2", "--temperature", "0", "--ignore-eos", "--logprobs", "1",
                        "--output-json", str(path), *ENGINE])
    return rc, json.loads(path.read_text()) if path.exists() else None


def test_output_json_structure_and_greedy_tokens_equal_llm_generate(greedy_run, tiny_ckpt_dir):
    rc, data = greedy_run
    assert rc == 0 and isinstance(data, list) and len(data) == 2
    assert [d["prompt"] for d in data] == ["Hello", None]
    assert data[1]["prompt_token_ids"] == [5, 6]
    for d in data:
        assert set(d) == {"request_id", "prompt", "prompt_token_ids", "outputs", "metrics"}
        assert isinstance(d["metrics"]["time_to_first_token"], float)
        (c,) = d["outputs"]
        assert {"text", "token_ids", "finish_reason", "logprobs"} <= set(c)
        assert len(c["token_ids"]) == 2 and c["finish_reason"] == "length"
        assert len(c["logprobs"]) == 2
        for tok, entries in zip(c["token_ids"], c["logprobs"]):
            assert set(entries[0]) == {"token_id", "logprob", "rank"}
            assert entries[0]["token_id"] == tok and entries[0]["rank"] == 1   # greedy = rank 1

    # The same requests through the API, on an independently loaded LLM.
    from deepinfer_core import LLM
    llm = LLM(str(tiny_ckpt_dir), max_model_len=64)
    ref = llm.generate(["Hello", {"prompt_token_ids": [5, 6]}],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [d["outputs"][0]["token_ids"] for d in data] == [r.outputs[0].token_ids for r in ref]
    assert data[0]["prompt_token_ids"] == ref[0].prompt_token_ids
    assert data[0]["outputs"][0]["text"] == ref[0].outputs[0].text


def test_stdout_shows_each_completion(capsys, tiny_ckpt_dir):
    rc, out, err = run_cli(capsys, "--model", tiny_ckpt_dir, "--prompt-token-ids", "5,6",
                           "--max-tokens", "1", "--temperature", "0", *ENGINE)
    assert rc == 0 and "Traceback" not in err
    assert "[request" in out and "completion 0" in out and "finish_reason=length" in out


def test_prompt_token_counts_are_singular_or_plural(capsys):
    from types import SimpleNamespace
    generate.print_outputs([SimpleNamespace(request_id="0", prompt="Hi", prompt_token_ids=[7], outputs=[]),
                            SimpleNamespace(request_id="1", prompt=None, prompt_token_ids=[5, 6], outputs=[])])
    out = capsys.readouterr().out
    assert "prompt: 'Hi' (1 token)\n" in out and "prompt: token ids [5, 6] (2 tokens)\n" in out


@pytest.mark.parametrize("name, content, expected", [
    ("prompts.txt", "Hello\n\n  \nHi there\n", ["Hello", "Hi there"]),
    ("prompts.jsonl", '{"prompt": "Hello"}\n\n{"prompt_token_ids": [5, 6]}\n', ["Hello", [5, 6]]),
    ("prompts.txt", '{"prompt_token_ids": [7]}\n{"prompt": "x", "prompt_token_ids": [8]}\n',
     [[7], "x"]),                                                  # JSONL detected by its first line
])
def test_prompts_file(capsys, tmp_path, tiny_ckpt_dir, name, content, expected):
    prompts = tmp_path / name
    prompts.write_text(content)
    out_json = tmp_path / "out.json"
    rc, _, err = run_cli(capsys, "--model", tiny_ckpt_dir, "--prompts-file", prompts, "--max-tokens", "1",
                         "--temperature", "0", "--output-json", out_json, *ENGINE)
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    got = [d["prompt"] if d["prompt"] is not None else d["prompt_token_ids"] for d in data]
    assert got == expected
    assert all(len(d["outputs"][0]["token_ids"]) == 1 for d in data)


def test_prompt_sources_keep_command_line_order():
    args = generate.build_parser().parse_args(["--prompt-token-ids", "1,2", "--prompt", "a"])
    assert generate.collect_prompts(args.inputs) == [{"prompt_token_ids": [1, 2]}, "a"]


# ---- errors: exit status 2, one line naming the problem, no traceback -----------------------------
@pytest.fixture
def bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    return path


@pytest.mark.parametrize("argv, needle", [
    (["--prompt", "a", "--temperature", "abc"], "--temperature"),
    (["--prompt", "a", "--no-such-flag"], "--no-such-flag"),
    (["--prompt", "a", "--dtype", "float16"], "--dtype"),
    (["--prompt", "a", "--max-model-len", "0"], "--max-model-len"),
    (["--prompt", "a", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--prompt", "a", "--stop-token-ids", "x"], "--stop-token-ids"),
    (["--prompt", "a", "--extra-args", "[1]"], "--extra-args"),
    (["--prompt", "a", "--temperature", "-1"], "temperature"),
    (["--prompt", "a", "--top-p", "0"], "top_p"),
    (["--prompt", "a", "--min-tokens", "5", "--max-tokens", "2"], "min_tokens"),
    ([], "no prompt given"),
    (["--prompt-token-ids", "1,,x"], "--prompt-token-ids"),
    (["--prompts-file", "{tmp}/missing.txt"], "no such file"),
    (["--prompts-file", "{bad_jsonl}"], "bad.jsonl:2"),
    (["--prompt", "a", "--model", "{tmp}/no-model"], "not found"),
    (["--prompt", "a", "--output-json", "{tmp}/no-dir/out.json"], "--output-json"),
    (["--model", "{ckpt}", "--prompt-token-ids", "999999999", *ENGINE], "vocab_size"),   # from LLM.generate
])
def test_errors_exit_2_with_one_line(capsys, tmp_path, bad_jsonl, tiny_ckpt_dir, argv, needle):
    argv = [a.format(tmp=tmp_path, bad_jsonl=bad_jsonl, ckpt=tiny_ckpt_dir) for a in argv]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert needle in err and "error" in err


def test_a_requested_platform_without_its_hardware_exits_2_with_one_line(capsys, monkeypatch,
                                                                         tiny_ckpt_dir):
    """DEEPINFER_ACCELERATOR names a backend whose hardware this machine lacks: one line, no trace."""
    from deepinfer_core import plugins
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    monkeypatch.setattr(plugins, "_cached", None)     # rebuilt from this environment, restored after
    # options of their own: the module's shared LLMs are keyed by them, and this one must load
    rc, _, err = run_cli(capsys, "--model", tiny_ckpt_dir, "--prompt", "a", "--max-model-len", "48",
                         "--no-progress")
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "DEEPINFER_ACCELERATOR=ascend" in err


def test_invalid_model_env_and_llm_type_error_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "missing"))
    rc, _, err = run_cli(capsys, "--prompt", "a")
    assert rc == 2 and "DEEPINFER_HF_MODEL_DIR" in err and len(err.strip().splitlines()) == 1

    rc, _, err = run_cli(capsys, "--prompt", "a", "--model", tmp_path)   # read even with --model: invalid
    assert rc == 2 and "DEEPINFER_HF_MODEL_DIR" in err and len(err.strip().splitlines()) == 1
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR")

    def raise_type_error(model, **options):
        raise TypeError("LLM: unexpected keyword argument(s) ['bogus']")
    monkeypatch.setattr(generate, "load_llm", raise_type_error)
    rc, _, err = run_cli(capsys, "--prompt", "a", "--model", tmp_path)
    assert rc == 2 and "unexpected keyword" in err and "Traceback" not in err


def test_help_exits_0(capsys):
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0 and "--repetition-penalty" in out and "--prompts-file" in out


# ---- flags generated from SamplingParams ----------------------------------------------------------
def test_every_sampling_field_is_a_flag_with_explicit_help():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(generate.SAMPLING_HELP) == fields
    option_strings = {s for a in generate.build_parser()._actions for s in a.option_strings}
    assert {"--" + name.replace("_", "-") for name in fields} <= option_strings


def test_flags_map_to_sampling_params_and_absent_flags_keep_defaults():
    parser = generate.build_parser()
    args = parser.parse_args(["--stop", "a", "--stop", "b", "--stop-token-ids", "1,2",
                              "--stop-token-ids", "3", "--ignore-eos", "--no-skip-special-tokens",
                              "--max-tokens", "none", "--logprobs", "2", "--top-k", "5", "--seed", "7",
                              "--extra-args", '{"x": 1}', "--n", "2"])
    p = generate.sampling_params_from_args(args)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == (["a", "b"], [1, 2, 3], True)
    assert p.skip_special_tokens is False
    assert (p.max_tokens, p.logprobs, p.top_k, p.seed, p.extra_args, p.n) == (None, 2, 5, 7, {"x": 1}, 2)
    assert generate.sampling_params_from_args(parser.parse_args([])) == SamplingParams()
    assert generate.engine_options_from_args(parser.parse_args([])) == {}
    eng = generate.engine_options_from_args(parser.parse_args(["--dtype", "bfloat16", "--no-simulate-qat",
                                                               "--enforce-eager"]))
    assert eng == {"dtype": "bfloat16", "simulate_qat": False, "enforce_eager": True}


def test_engine_flags_are_generated_from_the_config_with_its_docs_and_defaults(capsys):
    from deepinfer_core.engine_config import option_fields
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0
    help_text = "".join(out.split())                  # argparse wraps lines (also after hyphens)
    for name, _, f, _ in option_fields():
        if name not in generate.NO_ENGINE_FLAG:
            assert f"--{name.replace('_', '-')}" in out
            assert "".join(f.metadata["doc"].split()) in help_text, name
    assert "(default:8192)" in help_text
    assert "(default:DEEPINFER_ZERO_OVERHEAD_SCHEDULING,elseTrue)" in help_text


# ---- the bundled tiny model -----------------------------------------------------------------------
@pytest.fixture
def fake_builder(monkeypatch, tiny_ckpt_dir):
    """make_trained_checkpoint replaced by symlinks to the session checkpoint (one fixture for all)."""
    calls = []

    def build(out_dir, **kw):
        calls.append(Path(out_dir))
        for f in Path(tiny_ckpt_dir).iterdir():
            os.symlink(f, Path(out_dir) / f.name)
        return Path(out_dir)

    monkeypatch.setattr("deepinfer_core.tools.trained_model.make_trained_checkpoint", build)
    return calls


@pytest.fixture
def no_model_configured(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.setattr(generate, "KNOWN_REPO_IDS", ("deepinfer-test/no-such-model",))
    return tmp_path / "cache" / "deepinfer" / "tiny-v4"


def test_no_model_runs_the_bundled_tiny_model_with_one_line_notice(capsys, fake_builder,
                                                                   no_model_configured):
    rc, out, err = run_cli(capsys, "--prompt-token-ids", "5,6", "--max-tokens", "1", *ENGINE)
    assert rc == 0 and "completion 0" in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "bundled tiny model" in lines[0] and str(no_model_configured) in lines[0]
    assert bundled_model.is_complete(no_model_configured) and len(fake_builder) == 1
    assert bundled_model.bundled_tiny_model_dir() == no_model_configured and len(fake_builder) == 1  # reused
    assert not [p for p in no_model_configured.parent.iterdir() if p.name != "tiny-v4"]   # no temp dirs


def test_bundled_build_failure_leaves_nothing_and_stale_model_is_rebuilt(monkeypatch, fake_builder,
                                                                         no_model_configured):
    def crash(out_dir, **kw):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt
    with monkeypatch.context() as mp:
        mp.setattr("deepinfer_core.tools.trained_model.make_trained_checkpoint", crash)
        with pytest.raises(KeyboardInterrupt):
            bundled_model.bundled_tiny_model_dir()
    assert not list(no_model_configured.parent.iterdir())

    first = bundled_model.bundled_tiny_model_dir()
    (first / bundled_model.STAMP_FILE).write_text('{"fingerprint": "old"}')   # an older format
    assert bundled_model.bundled_tiny_model_dir() == first and len(fake_builder) == 2
    assert bundled_model.is_complete(first, bundled_model.fingerprint())
    assert sorted(p.name for p in no_model_configured.parent.iterdir()) == ["tiny-v4"]


def test_a_bad_prompt_beside_good_ones_fails_but_keeps_their_outputs(capsys, tmp_path, tiny_ckpt_dir):
    path = tmp_path / "out.json"
    rc, out, err = run_cli(capsys, "--model", tiny_ckpt_dir, "--prompt-token-ids", "5,6",
                           "--prompt-token-ids", "999999999", "--max-tokens", "2", "--temperature", "0",
                           "--ignore-eos", "--output-json", path, *ENGINE)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "prompt 1 " in err and "vocab_size" in err
    # CLI terms: where the other outputs went, not the Python exception's `.outputs`.
    assert "1 of 2 prompts refused" in err and f"output was printed and written to {path}" in err
    assert ".outputs" not in err and "request 1" not in err
    assert "token ids [5, 6] (2 tokens)" in out
    good, bad = json.loads(path.read_text())
    assert len(good["outputs"][0]["token_ids"]) == 2 and "vocab_size" in bad["error"] and bad["index"] == 1


def test_so_args_and_structured_outputs_flags(tiny_ckpt_dir, tmp_path, capsys):
    """--so-args and --structured-outputs reach the grammar; a bad grammar exits with status 2 naming it."""
    path = tmp_path / "out.json"
    rc, _, err = run_cli(capsys, "--model", tiny_ckpt_dir, "--prompt", "Hello", "--prompt", "Bye",
                         "--max-tokens", "30", "--temperature", "1", "--seed", "3",
                         "--so-args", '{"schema_type": "regex", "schema": "[0-9]{3}-[a-z]{2}"}',
                         "--output-json", path, *ENGINE)
    assert rc == 0, err
    import re
    for d in json.loads(path.read_text()):
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", d["outputs"][0]["text"]) and d["outputs"][0]["finish_reason"] == "stop"
    rc, out, _ = run_cli(capsys, "--model", tiny_ckpt_dir, "--prompt", "Hello", "--max-tokens", "8",
                         "--structured-outputs", '{"choice": ["red", "green"]}', *ENGINE)
    assert rc == 0 and ("'red'" in out or "'green'" in out), out
    rc, _, err = run_cli(capsys, "--model", tiny_ckpt_dir, "--prompt", "Hello",
                         "--so-args", '{"schema_type": "regex", "schema": "(ab"}', *ENGINE)
    assert rc == 2 and "invalid regex" in err and "Traceback" not in err
