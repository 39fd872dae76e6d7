"""OpenAI-compatible request bodies (pydantic) and their mapping onto `SamplingParams`.

Fields are spelled as OpenAI and vLLM spell them. Unknown fields are refused (400 naming them), never
ignored; values are checked by `SamplingParams`, whose ValueError names the field. `extra_args`
(alias `vllm_xargs`, vLLM's spelling) is an object handed to plugins as
`SamplingParams.extra_args`: a plugin that claims a request checks its keys at submission (a 400
naming the key).
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ..api.sampling_params import SamplingParams
from ..api.structured_outputs import structured_outputs_to_so_args
from .tool_grammar import tool_call_grammar


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The sampling fields both APIs share."""
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured outputs as vLLM spells them: the new object, or the older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # free-form arguments for plugins (SamplingParams.extra_args); vLLM's clients send vllm_xargs
    extra_args: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # prefix caching (vLLM's field): only requests with the same salt share cached prompt prefixes
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's field: the answer carries the generated token ids and the prompt's
    return_token_ids: bool = False

    def _structured(self) -> tuple[str, dict[str, Any]] | None:
        """(field given, so_args) of `structured_outputs` or one guided_* field; None when none is given."""
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        given = ["structured_outputs"] if self.structured_outputs is not None else []
        given += [f"guided_{k}" for k in guided]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give one of structured_outputs, guided_json, guided_regex, guided_choice, "
                             f"guided_grammar (got {', '.join(given)})")
        if not given:
            return None
        try:
            so_args = structured_outputs_to_so_args(self.structured_outputs if guided == {} else guided)
        except ValueError as exc:      # SamplingParams' wording: name the request field instead
            raise ValueError(f"{given[0]}: {str(exc).removeprefix('SamplingParams: ')}") from None
        return given[0], so_args

    def _params(self, **more: Any) -> SamplingParams:
        shared = ("temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens",
                  "include_stop_str_in_output")
        if self.extra_args is not None and self.vllm_xargs is not None:
            raise ValueError("vllm_xargs: give it or extra_args (its alias), not both")
        extra = self.extra_args if self.extra_args is not None else self.vllm_xargs
        return SamplingParams(**{k: getattr(self, k) for k in shared}, extra_args=extra, **more)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# Token ids are strict ints (no "7", 7.0 or true). The union is tried left to right: a 6,000-id
# prompt validates in 0.08 ms, where pydantic's smart mode took 1.2 ms.
TokenIds = list[StrictInt]


class CompletionRequest(_Sampling):
    prompt: Annotated[str | TokenIds | list[str] | list[TokenIds], Field(union_mode="left_to_right")]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    # the prompt returned before the completion, with its tokens' logprobs when `logprobs` is given
    # (the first token's null); max_tokens=0 then scores the prompt without generating
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or token ids, one per entry of a batched `prompt`."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: empty; give a string, a list of strings, token ids or lists of them")
        if isinstance(p[0], int):
            return [p]
        return list(p)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens=0: the answer is the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters. With echo, the prompt's logprobs are asked for (as many top
        entries as `logprobs`). max_tokens=0 (echo only) runs the engine for one token, which the
        answer leaves out (as vLLM does): the engine always samples at least one."""
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo=true (scoring the prompt); "
                             "allowed: max_tokens >= 1, or 0 with echo=true")
        if self.prompt_only and self.min_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} with max_tokens=0; allowed: 0")
        structured = self._structured()
        return self._params(max_tokens=1 if self.prompt_only else self.max_tokens,
                            logprobs=None if self.prompt_only else self.logprobs,
                            prompt_logprobs=self.logprobs if self.echo else None,
                            so_args=structured[1] if structured else None)


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = None
    # thinking / enable_thinking / thinking_mode / reasoning_effort
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: Any = None          # checked by tool_settings, whose errors name the tool and the key
    tool_choice: Any = None

    def thinking_mode(self) -> tuple[str, str | None]:
        """(thinking_mode, reasoning_effort) from chat_template_kwargs and the top-level field."""
        kw = dict(self.chat_template_kwargs or {})
        unknown = sorted(set(kw) - {"thinking", "enable_thinking", "thinking_mode", "reasoning_effort"})
        if unknown:
            raise ValueError(f"chat_template_kwargs: unknown keys {unknown}; allowed: thinking, enable_thinking, "
                             f"thinking_mode, reasoning_effort")
        on = kw.get("thinking", kw.get("enable_thinking"))
        mode = kw.get("thinking_mode") or ("thinking" if on else "chat")
        return mode, self.reasoning_effort or kw.get("reasoning_effort")

    def tool_settings(self) -> tuple[list[dict[str, Any]] | None, bool, str | None]:
        """(the tools to render into the prompt, whether to parse DSML tool calls out of the answer, the
        EBNF that forces a call or None).

        tool_choice "none" still renders the tools and only turns the parsing off, as vLLM does by default
        (its --exclude-tools-when-tool-choice-none is off): the prompt does not depend on tool_choice.
        "required" (one or more calls of any tool) and a named function ({"type": "function", "function":
        {"name": ...}}: one call of it) constrain the answer with a DSML grammar (serve/tool_grammar.py)."""
        if self.tools is not None:
            check_tools(self.tools)
        tools = self.tools or None           # [] renders no tools block, as in render_chat
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        forced = _forced_name(choice)
        if forced is not None or choice == "required":
            if tools is None:
                raise ValueError(f"tool_choice: {choice!r} needs `tools`")
            return tools, True, tool_call_grammar(tools, forced)
        if choice not in ("none", "auto"):
            raise ValueError(f"tool_choice: {choice!r} is not valid; allowed: 'none', 'auto', 'required', "
                             "{'type': 'function', 'function': {'name': NAME}}")
        if choice == "auto" and tools is None:
            raise ValueError("tool_choice: 'auto' needs `tools`")
        return tools, choice == "auto", None

    def sampling_params(self, grammar_after: list[int] | None, tool_grammar: str | None = None) -> SamplingParams:
        """`grammar_after`: the token ids that end the reasoning (thinking mode): a response_format or
        tool-call grammar applies from there on. `tool_grammar`: tool_settings' EBNF of a forced call."""
        if self.logprobs is False and self.top_logprobs is not None:
            raise ValueError("top_logprobs: needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: give it or max_tokens, not both")
        so_args = None
        structured = self._structured()
        if tool_grammar is not None:
            other = "response_format" if self.response_format is not None else structured and structured[0]
            if other:
                raise ValueError(f"{other}: cannot be combined with tool_choice {self.tool_choice!r} (both "
                                 "constrain the answer)")
            so_args = {"schema_type": "ebnf", "schema": tool_grammar}
        elif self.response_format is not None:
            if structured is not None:
                raise ValueError(f"{structured[0]}: give it or response_format, not both")
            so_args = response_format_so_args(self.response_format)
        elif structured is not None:
            so_args = structured[1]
        if so_args is not None and grammar_after:
            so_args["trigger_token_ids"] = list(grammar_after)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens=max_tokens, logprobs=logprobs, so_args=so_args)


_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def _forced_name(choice: Any) -> str | None:
    """The function a tool_choice object names ({"type": "function", "function": {"name": NAME}}), else None."""
    if not isinstance(choice, dict):
        return None
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or set(choice) - {"type", "function"} or set(fn) - {"name"}:
        raise ValueError(f"tool_choice: {choice!r} is not valid; a named choice is "
                         "{'type': 'function', 'function': {'name': NAME}}")
    return fn["name"]


def check_tools(tools: Any) -> None:
    """OpenAI's `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(tools, list):
        raise ValueError("tools: a list of {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    for i, tool in enumerate(tools):
        problem = _tool_problem(tool)
        if problem:
            raise ValueError(f"tools: tools[{i}]: {problem}")


def _tool_problem(tool: Any) -> str | None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return "needs 'type': 'function'"
    if set(tool) - _TOOL_KEYS:
        return f"unknown keys {sorted(set(tool) - _TOOL_KEYS)}; allowed: {sorted(_TOOL_KEYS)}"
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return "'function' must be an object"
    if set(fn) - _FUNCTION_KEYS:
        return f"unknown keys in 'function': {sorted(set(fn) - _FUNCTION_KEYS)}; allowed: {sorted(_FUNCTION_KEYS)}"
    name = fn.get("name")
    # The name is written into a DSML attribute (name="..."), which has no escapes.
    if not isinstance(name, str) or not name or any(c in name for c in '"<>') or name != "".join(name.split()):
        return "function.name must be a non-empty string without quotes, angle brackets or whitespace"
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        return "function.parameters must be a JSON schema object"
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        return "function.description must be a string"
    if fn.get("strict"):
        return "function.strict=true is not supported (the arguments are not constrained to the schema)"
    return None


def response_format_so_args(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format as structured-output arguments (None: plain text)."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema_type": "json", "schema": {"type": "object"}}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema.schema: a JSON schema object is required")
        return {"schema_type": "json", "schema": spec["schema"]}
    raise ValueError(f"response_format.type: {kind!r}; allowed: 'text', 'json_object', 'json_schema'")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
