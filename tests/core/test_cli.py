"""The `deepinfer` command (deepinfer_core/cli.py), run as `python -m deepinfer_core.cli` in a
subprocess (what the console script runs): every command and benchmark answers --help with its
flags; `env` prints the report's sections and masks secrets; `chat` holds a conversation read from
a pipe, on a local model and through a server, with the answers `LLM.chat` gives; `bench latency`
writes its JSON; `bench throughput|serve|sweep` run the checkout's scripts, and without a checkout
say where they ship."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core import __version__, cli, env_report

REPO = Path(__file__).resolve().parents[2]
MASKED = env_report.MASKED


def deepinfer(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer_core.cli", *args], input=stdin,
                          text=True, capture_output=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from deepinfer_core.tools.bundled_model import bundled_tiny_model_dir
    return str(bundled_tiny_model_dir(tmp_path_factory.mktemp("bundled")))


# ---- the command tree -------------------------------------------------------------------------
def test_help_lists_every_command_on_one_line_and_version():
    done = deepinfer("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: deepinfer [-h] [--version] COMMAND ...")
    names = [name for name, *_ in cli.COMMANDS]
    assert names == ["serve", "generate", "chat", "bench", "plugins", "env"]
    for name in names:
        assert re.search(rf"^    {name} +\S", done.stdout, re.MULTILINE), (name, done.stdout)
    version = deepinfer("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"deepinfer {__version__}")
    assert deepinfer("nope").returncode == 2
    assert deepinfer("--bogus", "env").returncode == 2    # a flag before the command is not its


HELP = {   # command -> (the usage line's start, flags its help must name)
    ("serve",): ("usage: deepinfer serve",
                 ["--model", "--port", "--api-key", "--data-parallel-size"]),
    ("generate",): ("usage: deepinfer generate",
                    ["--prompt", "--prompts-file", "--max-tokens", "--dtype"]),
    ("chat",): ("usage: deepinfer chat", ["--model", "--dtype", "--max-tokens", "--temperature",
                                          "--system", "--thinking", "--url", "--api-key"]),
    ("plugins",): ("usage: deepinfer plugins", ["--json"]),
    ("env",): ("usage: deepinfer env", ["--json"]),
    ("bench",): ("usage: deepinfer bench", ["throughput", "serve", "sweep", "latency"]),
    ("bench", "throughput"): ("usage: throughput.py",
                              ["--input-len", "--output-len", "--num-prompts"]),
    ("bench", "serve"): ("usage: serve_bench.py", ["--base-url", "--launch", "--concurrency"]),
    ("bench", "sweep"): ("usage: sweep.py", ["--batches", "--contexts", "--layers"]),
    ("bench", "latency"): ("usage: deepinfer bench latency",
                           ["--batch-size", "--input-len", "--output-len", "--num-iters-warmup",
                            "--num-iters", "--output-json", "--dtype"]),
}


@pytest.mark.parametrize("command", list(HELP), ids=" ".join)
def test_every_command_has_help_with_its_flags(command):
    usage, flags = HELP[command]
    done = deepinfer(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(usage), done.stdout[:200]
    missing = [f for f in flags if f not in done.stdout]
    assert not missing, (missing, done.stdout)


def test_bench_scripts_come_from_the_checkout_or_a_clear_message(tmp_path, monkeypatch, capsys):
    assert env_report.source_checkout() == REPO
    # an installed wheel: deepinfer_core/ in site-packages, no benchmarks/ beside it
    monkeypatch.setattr(env_report, "PACKAGE_DIR", tmp_path / "site-packages" / "deepinfer_core")
    assert env_report.source_checkout() is None
    for name in cli.BENCH_SCRIPTS:
        assert cli.main(["bench", name, "--help"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"deepinfer bench {name}: the benchmark scripts ship with the "
                              "source repository"), err
        assert len(err.splitlines()) == 1 and "deepinfer bench latency" in err, err


# ---- env --------------------------------------------------------------------------------------
def test_env_prints_the_sections_and_masks_secrets():
    secret = "hf_not-a-real-token-1234"
    env = {"HF_TOKEN": secret, "DEEPINFER_TEST_SETTING": "on", "CUDA_VISIBLE_DEVICES": "0,1"}
    done = deepinfer("env", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for section in ("DeepInfer packages", "Python and platform", "PyTorch", "GPUs", "Libraries",
                    "Plugins", "Environment variables"):
        assert f"== {section}\n" in out, section
    assert re.search(r"^deepinfer-core +\S+ +(editable: |installed)", out, re.MULTILINE), out
    assert f"HF_TOKEN={MASKED}" in out and secret not in out
    assert "DEEPINFER_TEST_SETTING=on" in out and "CUDA_VISIBLE_DEVICES=0,1" in out
    assert "\nactive backend: " in out
    assert re.search(r"^core +core +deepinfer-core", out, re.MULTILINE), out
    report = json.loads(deepinfer("env", "--json", env=env).stdout)
    assert report["environment"]["HF_TOKEN"] == MASKED and secret not in json.dumps(report)
    assert "deepinfer-core" in [p["name"] for p in report["deepinfer"]["packages"]]
    assert report["torch"]["version"] and report["plugins"]["active"]["name"]


def test_env_variables_kept_and_masked():
    environ = {"HF_TOKEN": "a", "DEEPINFER_API_KEY": "b", "NCCL_DEBUG": "INFO", "HOME": "/root",
               "DEEPINFER_DP_AUTHKEY": "c", "PATH": "/bin"}
    assert env_report.environment_variables(environ) == {
        "DEEPINFER_API_KEY": MASKED, "DEEPINFER_DP_AUTHKEY": MASKED, "HF_TOKEN": MASKED,
        "NCCL_DEBUG": "INFO"}


# ---- chat -------------------------------------------------------------------------------------
SYSTEM = "Answer as a player would."
LINES = ["HAMLET. To be, or not to be", "KING. My lord, the"]
CHAT_FLAGS = ["--max-tokens", "4", "--temperature", "0", "--system", SYSTEM]


@pytest.fixture(scope="module")
def chat_llm(model_dir):
    from deepinfer_core import LLM
    return LLM(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def expected_chat(chat_llm) -> str:
    """What two turns of `deepinfer chat` with CHAT_FLAGS must print: LLM.chat's answers, the
    second one to the whole conversation."""
    from deepinfer_core import SamplingParams
    greedy = SamplingParams(max_tokens=4, temperature=0)

    def answer(messages):
        return chat_llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text

    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LINES[0]}]
    first = answer(conversation)
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": LINES[1]}]
    second = answer(conversation)
    # the test can tell a kept conversation from a lost one
    assert second != answer([conversation[0], conversation[-1]])
    return f"assistant> {first}\nassistant> {second}\n"


def test_chat_on_a_local_model_keeps_the_conversation(model_dir, expected_chat):
    too_long = "word " * 400              # refused (context): the conversation is left as it was
    stdin = "\n".join([LINES[0], too_long, "", LINES[1], "/exit", "never read"]) + "\n"
    done = deepinfer("chat", "--model", model_dir, "--dtype", "float32", "--max-model-len", "128",
                     *CHAT_FLAGS, stdin=stdin)
    assert done.stdout == expected_chat, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines()
              if line.startswith("deepinfer chat: error:")]
    assert len(errors) == 1 and "/clear starts a new conversation" in errors[0], done.stderr
    assert done.returncode == 1


def test_chat_with_a_server(chat_llm, expected_chat):
    pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    import socket
    import threading
    import time

    from deepinfer_core.serve.app import build_app
    from deepinfer_core.serve.engine_loop import EngineLoop

    loop = EngineLoop(chat_llm.serving_engine(), max_requests=8)
    loop.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(chat_llm, loop, "tiny", api_key="sk-test")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1"
        done = deepinfer("chat", "--url", url, *CHAT_FLAGS, stdin="\n".join(LINES) + "\n",
                         env={"OPENAI_API_KEY": "sk-test"})
        assert (done.returncode, done.stdout) == (0, expected_chat), done.stderr
        refused = deepinfer("chat", "--url", url, "--api-key", "wrong", stdin="Hi\n")
        assert refused.returncode == 2 and "401" in refused.stderr, refused.stderr
    finally:
        server.should_exit = True
        thread.join(30)
        loop.stop(30)
    flags = deepinfer("chat", "--url", "http://127.0.0.1:9/v1", "--dtype", "float32", stdin="")
    assert flags.returncode == 2
    assert "--dtype: engine flags apply to a local model" in flags.stderr, flags.stderr


# ---- bench latency ----------------------------------------------------------------------------
def test_bench_latency_writes_its_json(model_dir, tmp_path):
    out = tmp_path / "latency.json"
    done = deepinfer("bench", "latency", "--model", model_dir, "--dtype", "float32",
                     "--batch-size", "2", "--input-len", "6", "--output-len", "3",
                     "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    settings = {"benchmark": "latency", "batch_size": 2, "input_len": 6, "output_len": 3,
                "num_iters": 3, "num_iters_warmup": 1, "device": "cpu", "dtype": "float32"}
    assert {k: result[k] for k in settings} == settings
    latencies = result["latencies"]
    assert len(latencies) == 3 and all(t > 0 for t in latencies)
    assert result["avg_latency"] == pytest.approx(statistics.fmean(latencies))
    p = result["percentiles"]
    assert list(p) == ["10", "25", "50", "75", "90", "99"]
    assert p["50"] == pytest.approx(statistics.median(latencies))
    assert min(latencies) <= p["10"] <= p["50"] <= p["99"] <= max(latencies)
    assert result["output_tokens_per_s"] == pytest.approx(2 * 3 / result["avg_latency"])
    assert f"Avg latency: {result['avg_latency']:.4f} s" in done.stdout
    assert f"wrote {out}" in done.stdout
    bad = deepinfer("bench", "latency", "--num-iters", "0")
    assert bad.returncode == 2 and "--num-iters=0; allowed: an int >= 1" in bad.stderr
