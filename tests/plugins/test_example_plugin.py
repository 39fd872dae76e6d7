"""The example third-party plugin (examples/plugins/deepinfer-example-plugin) end to end, installed
with pip into a temporary directory and seen only by subprocesses that have it on PYTHONPATH:
discovered through its entry point by the plugin listing; through `LLM.generate` (run_offline.py,
and the docs' own block) a banned word leaves the output and the rest of the batch is unchanged,
sampled and speculative requests included; bad settings refuse only their request; a live server
carries `extra_args` / `vllm_xargs` (the docs' curl body and openai call as written) and answers
400 naming the field."""
from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from plugin_cases import PLUGINS_PAGE, PROMPTS, REPO, choose_word, env_with, occurs, sequences

DOCS_WORDS = ["thee", "thou", "my lord"]          # what the docs' examples ban


def run(args: list[str], site, stdin: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], check=False, env=env_with(site), cwd=REPO,
                       input=stdin, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def words_of(text: str) -> str:
    """Text with its words separated by single spaces, so a phrase is found by ` phrase `."""
    return " " + " ".join(re.findall(r"[A-Za-z]+", text)) + " "


def page_text() -> str:
    return PLUGINS_PAGE.read_text(encoding="utf-8")


# ---- discovery ---------------------------------------------------------------------------------
def test_listed_where_installed_and_nowhere_else(example_site):
    listing = json.loads(run(["-m", "deepinfer_core.plugins", "--json"], example_site).stdout)
    rec = next(p for p in listing["plugins"] if p["name"] == "banned_words")
    assert {k: rec[k] for k in ("kind", "dist", "version", "status", "info_status")} == {
        "kind": "feature", "dist": "deepinfer-example-plugin", "version": "0.1.0",
        "status": "loaded", "info_status": "example"}
    table = run(["-m", "deepinfer_core.cli", "plugins"], example_site).stdout  # deepinfer plugins
    assert re.search(r"^banned_words +feature +deepinfer-example-plugin +0\.1\.0 +"
                     r"loaded \(example\) +extra_args banned_words", table, re.MULTILINE), table
    plain = json.loads(run(["-m", "deepinfer_core.plugins", "--json"], None).stdout)
    assert "banned_words" not in {p["name"] for p in plain["plugins"]}


# ---- LLM.generate --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def offline(example_site) -> dict:
    return json.loads(run(["tests/plugins/run_offline.py"], example_site).stdout.splitlines()[-1])


def test_a_banned_word_leaves_the_output_and_the_batch_is_unchanged(offline):
    word, seqs = offline["word"], offline["sequences"]
    before, after = offline["before"], offline["after"]
    assert f" {word} " in words_of(before["text"][0])
    assert any(occurs(s, before["tokens"][0][0]) for s in seqs)
    assert f" {word} " not in words_of(after["text"][0]), after["text"][0]
    assert not any(occurs(s, after["tokens"][0][0]) for s in seqs)
    assert after["tokens"][1:] == before["tokens"][1:]        # the plain requests of the batch


def test_sampled_completions_never_complete_a_banned_sequence(offline):
    assert len(offline["sampled"]) == 3 and len(set(map(tuple, offline["sampled"]))) > 1
    for ids in offline["sampled"]:
        assert not any(occurs(s, ids) for s in offline["sequences"])


def test_banned_requests_draft_and_match_the_engine_without_speculation(offline):
    assert offline["after"]["tokens"][0] == offline["reference"]
    assert offline["after"]["drafted"] > 0 and offline["after"]["accepted"] > 0


def test_bad_settings_refuse_only_their_request(offline):
    refused = offline["refused"]
    assert refused is not None and len(refused["good"][0]) == 4
    errors = refused["errors"]
    assert ("extra_args.banned_words: must be a list of non-blank strings, got 'thee'"
            in errors["not_a_list"])
    assert ("extra_args.banned_word: unknown key of the banned_words plugin; allowed: "
            "banned_words, banned_words_ignore_case") in errors["unknown_key"]
    assert ("extra_args.banned_words: cannot be combined with structured outputs"
            in errors["with_so_args"])


def test_the_docs_generate_block_as_written(example_site):
    """The ```python block of docs/plugins.md that bans words, run with the plugin installed."""
    blocks = re.findall(r"```python\n(.*?)```", page_text(), re.DOTALL)
    (block,) = [b for b in blocks if '"banned_words": ["thee", "thou", "my lord"]' in b]
    out = run(["-"], example_site, stdin=block).stdout
    plain, banned = (ast.literal_eval(line) for line in out.splitlines())
    assert not any(f" {w} " in words_of(banned) for w in DOCS_WORDS), banned
    assert (plain != banned) == any(f" {w} " in words_of(plain) for w in DOCS_WORDS)


# ---- the server --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(example_site):
    """The docs' server command (plus a free port), where the plugin is installed."""
    port = _free_port()
    command = ["-m", "deepinfer_core.serve", "--served-model-name", "tiny", "--port", str(port)]
    proc = subprocess.Popen([sys.executable, *command], env=env_with(example_site), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def complete(url: str, **body) -> str:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_server_bans_a_word_of_its_own_reply(server):
    def encode(text: str) -> list[int]:
        r = httpx.post(f"{server}/tokenize", json={"prompt": text, "add_special_tokens": False})
        return r.json()["tokens"]

    greedy = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = complete(server, prompt=PROMPTS[0], **greedy)
    word = choose_word(plain, encode(plain), encode)
    banned = complete(server, prompt=PROMPTS[0], extra_args={"banned_words": [word]}, **greedy)
    assert f" {word} " in words_of(plain) and f" {word} " not in words_of(banned), (plain, banned)
    assert not any(occurs(s, encode(banned)) for s in sequences(word, encode))
    assert complete(server, prompt=PROMPTS[0], **greedy) == plain     # nothing left behind
    # vLLM's spelling on the chat route: accepted, and handed to the plugin
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Speak."}], "max_tokens": 8}
    r = httpx.post(f"{server}/v1/chat/completions", timeout=300,
                   json={**chat, "vllm_xargs": {"banned_words": [word]}})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/v1/chat/completions", timeout=300,
                   json={**chat, "vllm_xargs": {"banned_words": word}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "extra_args.banned_words: must be a list of non-blank strings"), r.text


def test_the_docs_curl_body_and_openai_call_as_written(server):
    page = page_text()
    (body,) = re.findall(r"^curl -s localhost:8000/v1/completions .* -d '(.*)'$", page,
                         re.MULTILINE)
    (call,) = re.findall(r"`(client\.completions\.create\(.*?extra_body=.*?\))`", page, re.DOTALL)
    body = json.loads(body)
    banned = complete(server, **body)
    plain = complete(server, **{k: v for k, v in body.items() if k != "extra_args"})
    assert not any(f" {w} " in words_of(banned) for w in DOCS_WORDS), banned
    assert (plain != banned) == any(f" {w} " in words_of(plain) for w in DOCS_WORDS)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    assert eval(" ".join(call.split()), {"client": client}).choices[0].text == banned


@pytest.mark.parametrize("route, fields, param, message", [
    ("completions", {"extra_args": "thee"}, "extra_args", "extra_args: "),
    ("completions", {"extra_args": {"banned_words": [""]}}, "extra_args.banned_words",
     "extra_args.banned_words: must be a list of non-blank strings"),
    ("completions", {"extra_args": {"banned_wrods": ["x"]}}, "extra_args.banned_wrods",
     ("extra_args.banned_wrods: unknown key of the banned_words plugin; allowed: banned_words, "
      "banned_words_ignore_case")),
    ("completions", {"extra_args": {"banned_words": ["x"]}, "vllm_xargs": {"banned_words": ["y"]}},
     "vllm_xargs", "vllm_xargs: give it or extra_args (its alias), not both"),
    ("chat/completions",
     {"extra_args": {"banned_words": ["x"]}, "response_format": {"type": "json_object"}},
     "extra_args.banned_words", "extra_args.banned_words: cannot be combined with structured outputs"),
])
def test_bad_extra_args_are_400s_naming_the_field(server, route, fields, param, message):
    prompt = ({"prompt": "Hello"} if route == "completions"
              else {"messages": [{"role": "user", "content": "Hi"}]})
    r = httpx.post(f"{server}/v1/{route}", timeout=300,
                   json={"model": "tiny", "max_tokens": 4, **prompt, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(message) and error["param"] == param, error
