"""`deepinfer chat`: a conversation in the terminal with a local model (`LLM.chat`), or with a
running server (`--url http://HOST:PORT/v1`, its OpenAI-compatible /chat/completions, via httpx).

Each line read from standard input is one user message; the whole conversation goes with every
turn. `/exit` or the end of the input ends the chat, `/clear` starts a new conversation (the system
message kept). Answers are printed as `assistant> TEXT` (in thinking mode the reasoning first, as
`thinking> TEXT`), so a pipe works as well as a terminal:
`printf 'Hi\\nAnd then?\\n' | deepinfer chat`. A turn the engine or the server refuses (e.g. a
conversation longer than the model's context) prints one line on stderr and leaves the conversation
as it was; the exit status is then 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .api.chat import THINK_END
from .api.sampling_params import SamplingParams
from .engine_config import EngineConfig
from .generate import (
    _add_engine_flags,
    _fail,
    _OneLineParser,
    choose_model,
    engine_options_from_args,
    load_llm,
)

logger = logging.getLogger("deepinfer.chat")
PROG = "deepinfer chat"
COMMANDS = {"/exit": "end the chat",
            "/clear": "start a new conversation (the system message kept)"}


class TurnError(Exception):
    """A turn the engine or the server refused; the chat goes on without it."""


def build_parser() -> argparse.ArgumentParser:
    commands = "; ".join(f"{k}: {v}" for k, v in COMMANDS.items())
    parser = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"commands: {commands}")
    chat = parser.add_argument_group("chat")
    chat.add_argument("--model", help="checkpoint directory or repo id in the local Hugging Face "
                      "cache (default: as `deepinfer generate`); with --url: the served model's "
                      "name (default: the first of the server's /v1/models)")
    chat.add_argument("--url", help="chat with a running server instead of loading a model, e.g. "
                      "http://127.0.0.1:8000/v1 (needs httpx)")
    chat.add_argument("--api-key", default=None,
                      help="the server's API key (default: OPENAI_API_KEY)")
    chat.add_argument("--system", metavar="TEXT",
                      help="a system message that opens the conversation")
    chat.add_argument("--thinking", action="store_true", help="thinking mode: the model reasons "
                      "first (printed as `thinking> ...`), then answers")
    chat.add_argument("--max-tokens", type=int, default=256,
                      help="maximum tokens per answer (default: 256)")
    chat.add_argument("--temperature", type=float, default=1.0,
                      help="sampling temperature; 0 = greedy (default: 1.0)")
    chat.add_argument("--seed", type=int, default=None,
                      help="sampling seed of every turn (default: unset)")
    _add_engine_flags(parser)
    return parser


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, answer) of a completion: in thinking mode the text up to `</think>` is the
    reasoning."""
    if not thinking:
        return "", text
    reasoning, sep, answer = text.partition(THINK_END)
    return (reasoning, answer) if sep else (text, "")


class LocalChat:
    """Turns through `LLM.chat` on a model loaded in this process."""

    def __init__(self, llm: Any, params: SamplingParams, thinking: bool):
        self.llm, self.params, self.thinking = llm, params, thinking

    def reply(self, messages: list[dict]) -> tuple[str, str]:
        try:
            mode = "thinking" if self.thinking else "chat"
            out = self.llm.chat(messages, self.params, thinking_mode=mode, use_tqdm=False)[0]
        except ValueError as exc:         # InvalidRequestError too: e.g. longer than max_model_len
            raise TurnError(str(exc)) from None
        return split_reasoning(out.outputs[0].text, self.thinking)

    def close(self) -> None:
        if self.llm.config.parallel.in_processes:
            self.llm.close()


class ServerChat:
    """Turns through a server's OpenAI-compatible /chat/completions (not streamed)."""

    def __init__(self, url: str, api_key: str | None, model: str | None, body: dict[str, Any],
                 thinking: bool):
        try:
            import httpx
        except ImportError:
            raise RuntimeError("--url needs httpx: pip install httpx") from None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=None)
        self.transport_error = httpx.TransportError
        self.body = dict(body, model=model or self._first_model(url))
        if thinking:
            self.body["chat_template_kwargs"] = {"thinking": True}

    def _request(self, method: str, path: str, **kw: Any) -> dict:
        try:
            r = self.client.request(method, path, **kw)
        except self.transport_error as exc:
            raise TurnError(f"cannot reach {self.client.base_url}{path}: {exc}") from None
        try:
            data = r.json()
        except ValueError:
            data = {}
        if r.status_code != 200:
            message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            raise TurnError(f"{path}: the server answered {r.status_code}: "
                            f"{message or r.text[:200]}")
        return data

    def _first_model(self, url: str) -> str:
        try:
            models = self._request("GET", "/models").get("data") or []
        except TurnError as exc:
            raise RuntimeError(f"--url {url}: {exc}") from None
        if not models:
            raise RuntimeError(f"--url {url}: the server lists no model; pass --model NAME")
        return models[0]["id"]

    def reply(self, messages: list[dict]) -> tuple[str, str]:
        data = self._request("POST", "/chat/completions", json=dict(self.body, messages=messages))
        message = data["choices"][0]["message"]
        return message.get("reasoning_content") or "", message.get("content") or ""

    def close(self) -> None:
        self.client.close()


def _lines(interactive: bool):
    """The user's lines: a prompt on a terminal, plain lines from a pipe."""
    while True:
        try:
            line = input("user> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and not line:
            return
        yield line.strip()


def run_chat(backend: Any, system: str | None, interactive: bool) -> int:
    """The conversation loop; 0, or 1 when a turn was refused."""
    start = [{"role": "system", "content": system}] if system else []
    messages, status = list(start), 0
    for line in _lines(interactive):
        if not line:
            continue
        if line == "/exit":
            break
        if line == "/clear":
            messages = list(start)
            continue
        try:
            reasoning, answer = backend.reply(messages + [{"role": "user", "content": line}])
        except TurnError as exc:
            print(f"{PROG}: error: {exc} (/clear starts a new conversation)", file=sys.stderr,
                  flush=True)
            status = 1
            continue
        if reasoning:
            print(f"thinking> {reasoning}")
        print(f"assistant> {answer}", flush=True)
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine_options = engine_options_from_args(args)
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        body["seed"] = args.seed
    try:
        params = SamplingParams(**body)       # the values checked here, for both backends
        if args.url:
            if engine_options:
                flags = ", ".join("--" + k.replace("_", "-") for k in engine_options)
                raise ValueError(f"{flags}: engine flags apply to a local model; with --url the "
                                 f"server's own flags apply")
            backend: Any = ServerChat(args.url, args.api_key or os.environ.get("OPENAI_API_KEY"),
                                      args.model, body, args.thinking)
        else:
            # the whole config checked before the (slow) load
            config = EngineConfig.from_options(model=args.model, **engine_options)
            llm = load_llm(choose_model(config.model.model, PROG), **engine_options)
            backend = LocalChat(llm, params, args.thinking)
    except (ValueError, TypeError, RuntimeError) as exc:
        logger.debug("chat start-up failed", exc_info=True)
        return _fail(str(exc), PROG)
    try:
        return run_chat(backend, args.system, sys.stdin.isatty())
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        backend.close()


if __name__ == "__main__":
    raise SystemExit(main())
