"""The checks of the docs' runnable commands and blocks (tests/docs/docs_commands.py names which
check each one gets): each reads what the docs promise from a run's output, never the model's
text or floating-point rounding, only formats, grammars, exit codes and counts that hold on any
machine."""

from __future__ import annotations

import ast
import json
import re

from docs_snippets import REPO, Result

README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"


def completions(out: str) -> list[tuple[str, str, list[int]]]:
    """The CLI's completions: (text, finish_reason, token ids)."""
    found = re.findall(
        r"^  completion \d+: (.*)\n    finish_reason=(\w+) token_ids=(\[[\d, ]*\])$",
        out,
        re.MULTILINE,
    )
    return [(ast.literal_eval(text), reason, json.loads(ids)) for text, reason, ids in found]


def check_offline_inference(r: Result) -> None:
    bundled = r.cache / "deepinfer" / "tiny-v4"
    assert f"using the bundled tiny model at {bundled} (trained on Shakespeare)" in r.stdout
    assert (bundled / "config.json").is_file()  # built into the (fresh) user cache
    assert len(re.findall(r"^prompt .* \(\d+ tokens\) -> ['\"]", r.stdout, re.MULTILINE)) == 3
    # the two greedy requests have ignore_eos: exactly max_tokens=8 tokens each
    greedy = re.findall(r"ids \[(?:\d+, ){7}\d+\], finish_reason=length$", r.stdout, re.MULTILINE)
    assert len(greedy) >= 2


def check_structured_outputs(r: Result) -> None:
    lines = re.findall(r"^(json|regex|ebnf|choice) +-> (.*) \((\w+)\)$", r.stdout, re.MULTILINE)
    found = {name: (ast.literal_eval(text), reason) for name, text, reason in lines}
    assert set(found) == {"json", "regex", "ebnf", "choice"}
    assert all(reason == "stop" for _, reason in found.values()), found  # each grammar completed
    person = json.loads(found["json"][0])
    assert set(person) == {"name", "age", "role"} and person["role"] in ("admin", "user", "guest")
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", found["regex"][0])
    assert re.fullmatch(r"SELECT (id|name|age)(, (id|name|age)){0,2} FROM users;", found["ebnf"][0])
    assert found["choice"][0] in ("yes", "no")
    assert "json parses: {" in r.stdout


def check_placeholder_model_dir(r: Result) -> None:
    """A wrong DEEPINFER_HF_MODEL_DIR: one line naming it on stderr, exit status 2, no traceback."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("offline_inference.py: error: ")
    assert "DEEPINFER_HF_MODEL_DIR" in lines[0] and "/path/to/DeepSeek-V4-Flash" in lines[0]


def check_cli_hello(r: Result) -> None:
    assert "[request 0] prompt: 'Hello' (1 token)\n" in r.stdout
    ((_, reason, ids),) = completions(r.stdout)
    assert 1 <= len(ids) <= 8 and reason in ("length", "stop")
    assert "bundled tiny model" in r.stderr and "Shakespeare" in r.stderr  # no model configured


def check_cli_data_parallel(r: Result) -> None:
    """The DP 2 + EP run prints the CLI's usual output: one prompt, one completion of 1-8 tokens."""
    assert "[request 0] prompt: 'Hello' (1 token)\n" in r.stdout
    ((_, reason, ids),) = completions(r.stdout)
    assert 1 <= len(ids) <= 8 and reason in ("length", "stop")


def check_serve_data_parallel_refused(r: Result) -> None:
    """The server refuses spare expert slots without expert parallelism at start: one line naming both
    settings, no traceback."""
    assert "error: num_redundant_experts=2 needs enable_expert_parallel" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def check_plugins(r: Result) -> None:
    assert "\nactive backend: cpu " in r.stdout
    assert re.search(r"^structured_outputs +feature .* loaded", r.stdout, re.MULTILINE)


def check_env(r: Result) -> None:
    """The bug-report summary names the versions, the platform and the active backend."""
    for what in ("deepinfer-core", "torch", "Python", "cpu"):
        assert what in r.stdout, (what, r.stdout)


def check_make_tiny_checkpoint(r: Result) -> None:
    assert f"to {r.tiny}" in r.stdout and (r.tiny / "config.json").is_file()
    assert list(r.tiny.glob("*.safetensors")) and (r.tiny / "tokenizer.json").is_file()


def check_so_args_cli(r: Result) -> None:
    assert completions(r.stdout)[0][:2] in [("yes", "stop"), ("no", "stop")], r.stdout


def check_batch_invariant_cli(r: Result) -> None:
    ((_, _, ids),) = completions(r.stdout)
    assert 1 <= len(ids) <= 8


def check_deterministic_sampling(r: Result) -> None:
    """The summary counts what the lines show; a digest equal to the lone run's means no difference.
    (How many distinct outputs there are depends on the CPU's rounding; batch invariance itself is
    tested in tests/engine/test_batch_invariance.py.)"""
    runs = re.findall(
        r"^batch of +(\d+) at position +\d+: tokens (\[[\d, ]+\])  logprobs #([0-9a-f]{12})"
        r"  (.*)$",
        r.stdout,
        re.MULTILINE,
    )
    assert [int(b) for b, *_ in runs] == [1, 3, 9, 24], r.stdout
    invariant = "--off" not in r.command
    summary = re.search(
        r"^batch_invariant=(True|False): (\d+) distinct token sequence\(s\) and (\d+) "
        r"distinct logprob vector\(s\) \(bitwise\) over 4 batches$",
        r.stdout,
        re.MULTILINE,
    )
    assert summary and summary.group(1) == str(invariant), r.stdout
    assert int(summary.group(2)) == len({tokens for _, tokens, _, _ in runs})
    assert int(summary.group(3)) == len({digest for _, _, digest, _ in runs})
    alone = runs[0]
    for _, tokens, digest, versus in runs[1:]:
        if digest == alone[2]:
            assert versus == "max |logprob - alone| 0", versus
        elif tokens != alone[1]:
            assert versus == "tokens differ from the run alone", versus


def check_envs_markdown(r: Result) -> None:
    assert r.stdout.startswith("| variable | type | default |")
    assert "| `DEEPINFER_HF_MODEL_DIR` |" in r.stdout
    # docs/configuration.md: "generated by `python -m deepinfer_core.envs --markdown`"
    assert r.stdout.strip() in CONFIGURATION.read_text(encoding="utf-8")


def check_options_markdown(r: Result) -> None:
    assert r.stdout.startswith("| option | config | default | allowed values | meaning |")
    assert "| `max_num_seqs` | `scheduler.max_num_seqs` |" in r.stdout
    # docs/configuration.md: "generated by `python -m deepinfer_core.engine_config --markdown`"
    assert r.stdout.strip() in CONFIGURATION.read_text(encoding="utf-8")


def check_engine_config_snippet(r: Result) -> None:
    """docs/configuration.md: the resolved options, then the refusal naming the option's values."""
    resolved, refused = r.stdout.strip().splitlines()
    assert resolved == "64 bfloat16", r.stdout
    assert refused == "kv_cache_dtype='fp16'; allowed: 'auto', 'bfloat16', 'fp8'", r.stdout


def check_generate_snippet(r: Result) -> None:
    # 8 token ids, then the first position's logprobs (top-2)
    assert re.match(r"\[(\d+, ){7}\d+\] \{\d+: Logprob\(logprob=", r.stdout), r.stdout


def check_chat_snippet(r: Result) -> None:
    prompt, *replies = r.stdout.splitlines()
    assert prompt == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the capital "
        "of France?<｜Assistant｜></think>"
    )
    assert len(replies) == 2 and all(isinstance(ast.literal_eval(t), str) for t in replies), replies


def check_speculative_snippet(r: Result) -> None:
    # tau of one MTP-3 request on the bundled trained model: between 1 and k + 1, well above 1
    tau = float(r.stdout.strip().splitlines()[-1])
    assert 1.3 < tau <= 4.0, r.stdout


def check_openai_client(r: Result) -> None:
    # the example's server answered a completion and a streamed thinking-mode chat reply
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert {"completion", "reasoning", "answer"} <= set(lines), r.stdout
    assert isinstance(ast.literal_eval(lines["completion"]), str) and ast.literal_eval(lines["reasoning"]), r.stdout


def check_small_tiny_checkpoint(r: Result) -> None:
    # docs/models.md: the maker's options reach config.json (the path is /tmp/tiny-v4-small, substituted)
    config = json.loads((r.tiny.parent / f"{r.tiny.name}-small" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["n_routed_experts"], config["sliding_window"]) == (4, 4, 32)


def check_v41_checkpoint(r: Result) -> None:
    # docs/models.md: --family v41 writes a tiny DeepSeek-V4.1 (the path is /tmp/tiny-v41, substituted)
    config = json.loads((r.tiny.parent / f"{r.tiny.name}1" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["text_config"]["engram_layer_ids"], config


def check_bounded_replay_snippet(r: Result) -> None:
    # docs/bounded_replay.md: compact bounded replay on the tiny V4.1 prints 4 token ids
    ids = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert len(ids) == 4 and all(isinstance(t, int) for t in ids), r.stdout


def check_prefix_caching_snippet(r: Result) -> None:
    # docs/prefix_caching.md: a 300-token prompt sent twice: no hit, then a hit at 256; the reset
    assert r.stdout.split() == ["0", "256", "True"], r.stdout


def check_checkpoint_snippet(r: Result) -> None:
    # docs/models.md: the tiny checkpoint matches the model built from its config, tensor for tensor
    assert r.stdout.strip() == "[]", r.stdout


def check_data_parallel_snippet(r: Result) -> None:
    # docs/multi_gpu.md: a guarded script over 2 data-parallel ranks prints one completion per prompt
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(isinstance(ast.literal_eval(t), str) for t in lines), r.stdout


def exits_0(r: Result) -> None:
    """Nothing printed to check: the block builds objects only (it must still run)."""


def check_plugins_disabled(r: Result) -> None:
    assert re.search(r"^structured_outputs +feature +\S+ +\S+ +blocked +DEEPINFER_DISABLE_PLUGINS$",
                     r.stdout, re.MULTILINE), r.stdout


def check_plugin_reference(r: Result) -> None:
    """--markdown prints the generated section of docs/plugins.md; --update finds it current."""
    if "--update" in r.command:
        assert r.stdout.strip() == "docs/plugins.md: already up to date", r.stdout
    else:
        page = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
        assert r.stdout.startswith("### Hook specs") and r.stdout.strip() in page, r.stdout[:300]


def check_banned_words_snippet(r: Result) -> None:
    """Two completions printed as Python strings. The example plugin is not installed where the
    docs run; tests/plugins/test_example_plugin.py runs this block with it and checks the ban."""
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(isinstance(ast.literal_eval(t), str) for t in lines), r.stdout
