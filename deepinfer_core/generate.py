"""Command-line offline generation: `python -m deepinfer_core.generate --prompt "Hello" --max-tokens 8`.

The model is `--model` (a local directory or a repo id in the local Hugging Face cache), else
DEEPINFER_HF_MODEL_DIR, else a DeepSeek-V4 checkpoint found in the local Hugging Face cache, else the
bundled tiny model (trained on Shakespeare; one line on stderr says so). Nothing is downloaded.

Every `SamplingParams` field and every `EngineConfig` option is a flag generated from the dataclasses
themselves (`--top-p`, `--ignore-eos`, `--max-num-seqs`, ...; help from the fields' docs), so the CLI
cannot drift from the API; a flag left out keeps the dataclass default.
Errors in the input (flags, prompts, sampling values, model) print one line and exit with status 2.
Under torchrun (`--launcher torchrun`, the same command on every rank) only global rank 0 generates and
prints; the others run their engines and exit 0 (prompts files are still read on every rank first).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any, Sequence

from .api.outputs import InvalidRequestError
from .api.sampling_params import SamplingParams
from .engine_config import EngineConfig, option_fields
from .plugin_context import PluginError
from .prompts_file import PromptsFile, UsageError, collect_prompts

logger = logging.getLogger("deepinfer.generate")
PROG = "python -m deepinfer_core.generate"

# Checked in the local Hugging Face cache, in this order, when no model is configured.
KNOWN_REPO_IDS = (
    "deepseek-ai/DeepSeek-V4-Flash",
    "deepseek-ai/DeepSeek-V4-Pro",
    "deepseek-ai/DeepSeek-V4-Flash-DSpark",
    "deepseek-ai/DeepSeek-V4-Pro-DSpark",
)

# EngineConfig options without a generated engine flag, and why (a test holds every other one to a flag).
NO_ENGINE_FLAG = {
    "model": "--model, with the prompts: the CLI also falls back to a cached or the bundled model",
    "seed": "--seed is SamplingParams.seed, every request's own seed (the LLM seed is then unused)",
    "decode_sequence": "the CLI prints and writes whole RequestOutputs",
}
ENGINE_FLAGS = tuple(name for name, *_ in option_fields() if name not in NO_ENGINE_FLAG)

# Help for every SamplingParams field (the flag's type and default come from the dataclass).
SAMPLING_HELP = {
    "n": "completions per prompt",
    "temperature": "sampling temperature; 0 = greedy (argmax, lowest id on ties)",
    "top_p": "nucleus sampling: keep the most likely tokens up to this cumulative probability, in (0, 1]",
    "top_k": "keep only the k most likely tokens; 0 or -1 = off",
    "min_p": "drop tokens whose probability is below min_p times the top token's, in [0, 1]",
    "presence_penalty": "subtract this from the logits of tokens already generated, in [-2, 2]",
    "frequency_penalty": "subtract this times the count of each token already generated, in [-2, 2]",
    "repetition_penalty": "divide positive (multiply negative) logits of tokens in the prompt or output; "
                          "> 0, 1 = off",
    "seed": "per-request sampling seed (every prompt uses it); unset = derived from a request counter",
    "stop": "stop string; the completion ends before it (repeatable; needs a tokenizer)",
    "stop_token_ids": "comma-separated token ids that end the completion (repeatable)",
    "include_stop_str_in_output": "keep the matched stop string in the text",
    "ignore_eos": "keep generating after the EOS token",
    "max_tokens": "maximum tokens per completion; 'none' = up to --max-model-len",
    "min_tokens": "tokens to generate before EOS, stop ids or stop strings may end the completion",
    "logprobs": "top-K logprobs per generated token (0 = the sampled token's only); 'none' = off",
    "prompt_logprobs": "top-K logprobs per prompt token; 'none' = off",
    "detokenize": "decode the output tokens to text",
    "skip_special_tokens": "leave special tokens out of the decoded text",
    "so_args": 'structured output, a JSON object: {"schema_type": "json"|"regex"|"ebnf", "schema": ..., '
               'optional "trigger_token_ids": [...], "bound_token_id": id}',
    "structured_outputs": 'structured output in vLLM\'s spelling, a JSON object with one of "json", '
                          '"regex", "choice", "grammar", "json_object"',
    "extra_args": "free-form arguments for plugins, a JSON object",
}


class _OneLineParser(argparse.ArgumentParser):
    """argparse with single-line errors (no usage dump), still exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ---- flag value types ------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]."""
    items = [s.strip() for s in text.split(",")]
    try:
        values = [int(s, 10) for s in items]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. '1,2,3'")
    return values


def _token_id_prompt(text: str) -> dict[str, list[int]]:
    return {"prompt_token_ids": _int_list(text)}


def _optional_int(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'none'") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


# ---- the parser ------------------------------------------------------------------------------------
def _base_types(annotation: Any) -> set[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {a for a in typing.get_args(annotation) if a is not type(None)}
    return {annotation}


def _add_sampling_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per SamplingParams field; default SUPPRESS so an absent flag keeps the dataclass default."""
    hints = typing.get_type_hints(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        base = _base_types(hints[f.name])
        help_text = SAMPLING_HELP.get(f.name, f"SamplingParams.{f.name}")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if base == {bool}:
            kw.update(action=argparse.BooleanOptionalAction)
        elif base == {int}:
            kw.update(type=_optional_int if type(None) in typing.get_args(hints[f.name]) else int)
        elif base == {float}:
            kw.update(type=float)
        elif str in base:                                        # stop: str | list[str]
            kw.update(action="append", type=str, metavar="TEXT")
        elif any(typing.get_args(b) == (int,) for b in base):    # stop_token_ids: list[int]
            kw.update(action="extend", type=_int_list, metavar="IDS")
        else:                                                    # dicts and anything new: JSON
            kw.update(type=_json_object if dict in {typing.get_origin(b) or b for b in base}
                      else json.loads, metavar="JSON")
        group.add_argument(flag, help=f"{help_text} (default: {f.default!r})".replace("%", "%%"), **kw)


def _config_value(name: str, hint: Any, rule: Any) -> Any:
    """argparse type of an EngineConfig option: the text parsed by the field's type, then its rule
    (so a bad value is refused before the model loads, in the config's own words)."""
    base = _base_types(hint)

    def parse(text: str) -> Any:
        if text.strip().lower() == "none" and type(None) in typing.get_args(hint):
            return None
        try:
            value = (int(text, 10) if int in base else float(text) if float in base
                     else json.loads(text) if dict in {typing.get_origin(b) or b for b in base} else text)
        except ValueError:
            kinds = " or ".join(b.__name__ for b in base)
            raise argparse.ArgumentTypeError(f"{text!r} is not {kinds}") from None
        try:
            return rule(name, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig option (a group per section); default SUPPRESS: an absent flag keeps
    the config's default (or its environment variable's)."""
    groups: dict[str, Any] = {}
    for name, section, f, hint in option_fields():
        if name in NO_ENGINE_FLAG:
            continue
        if section not in groups:
            groups[section] = parser.add_argument_group(f"engine: {section} (EngineConfig.{section})")
        env, rule = f.metadata["env"], f.metadata["rule"]
        default = f"{env}, else {f.default!r}" if env else repr(f.default)
        base = _base_types(hint)
        allowed = "" if base == {bool} else f"; allowed: {rule.allowed}"
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                              "help": f"{f.metadata['doc']}{allowed} (default: {default})".replace("%", "%%")}
        if base == {bool}:
            kw.update(action=argparse.BooleanOptionalAction)
        else:
            metavar = "N" if int in base else "X" if float in base else "TEXT" if str in base else "JSON"
            kw.update(type=_config_value(name, hint, rule), metavar=metavar)
        groups[section].add_argument("--" + name.replace("_", "-"), **kw)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=prog, description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("model and prompts")
    src.add_argument("--model", help="checkpoint directory or repo id in the local Hugging Face cache "
                     "(default: DEEPINFER_HF_MODEL_DIR, a cached DeepSeek-V4 checkpoint, else the "
                     "bundled tiny model)")
    # All prompt sources share one list so that prompts keep their command-line order.
    src.add_argument("--prompt", dest="inputs", action="append", type=str, metavar="TEXT",
                     help="a text prompt (repeatable)")
    src.add_argument("--prompts-file", dest="inputs", action="append", type=PromptsFile, metavar="PATH",
                     help="one text prompt per line, or JSONL (.jsonl, or a JSON object on the first "
                          "line) with {\"prompt\": str} or {\"prompt_token_ids\": [int]} per line")
    src.add_argument("--prompt-token-ids", dest="inputs", action="append", type=_token_id_prompt,
                     metavar="IDS", help="a prompt as comma-separated token ids, e.g. '0,100,200' "
                                         "(repeatable; for checkpoints without a tokenizer)")

    _add_engine_flags(parser)
    _add_sampling_flags(parser.add_argument_group("sampling (SamplingParams fields)"))

    out = parser.add_argument_group("output")
    out.add_argument("--output-json", metavar="PATH", help="write every request and completion as JSON")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                     help="show a progress bar on stderr")
    return parser


# ---- model -----------------------------------------------------------------------------------------
def choose_model(model: str | None, prog: str = PROG) -> str:
    """`model` (--model, else DEEPINFER_HF_MODEL_DIR: the config's), else a cached DeepSeek-V4 checkpoint,
    else the bundled model; `prog` names the command in the line that says which."""
    if model:
        return model
    from .model.weights import CheckpointError, resolve_model_path  # never downloads
    for repo_id in KNOWN_REPO_IDS:
        try:
            path = resolve_model_path(repo_id)
        except CheckpointError:
            continue
        print(f"{prog}: no --model given; using {repo_id} from the local Hugging Face cache ({path})",
              file=sys.stderr)
        return str(path)
    from .tools.bundled_model import bundled_tiny_model_dir, default_cache_dir
    print(f"{prog}: no model configured (--model, DEEPINFER_HF_MODEL_DIR or a DeepSeek-V4 checkpoint in "
          f"the local Hugging Face cache): running the bundled tiny model at {default_cache_dir()} "
          f"(a tiny V4 trained on Shakespeare: expect Shakespearean-looking English, not sense)",
          file=sys.stderr, flush=True)
    return str(bundled_tiny_model_dir())


def load_llm(model: str, **engine_options: Any) -> Any:
    """The LLM for this run (a seam: tests replace it to share one loaded model)."""
    from .api.llm import LLM
    return LLM(model=model, **engine_options)


# ---- output ----------------------------------------------------------------------------------------
def _logprobs_json(entries: list | None) -> list | None:
    """[{token id: Logprob}] -> [[{token_id, logprob, rank}]]; the sampled token comes first."""
    if entries is None:
        return None
    return [None if e is None else [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank}
                                    for t, lp in e.items()] for e in entries]


def _metrics_json(m: Any) -> dict[str, Any] | None:
    if m is None:
        return None
    return {"time_to_first_token": m.time_to_first_token,
            "latency": None if m.finished_time is None else m.finished_time - m.arrival_time,
            "num_generated_tokens": len(m.token_times), "arrival_time": m.arrival_time,
            "first_scheduled_time": m.first_scheduled_time, "first_token_time": m.first_token_time,
            "finished_time": m.finished_time}


def output_to_json(out: Any, params: SamplingParams) -> dict[str, Any]:
    """One RequestOutput as plain JSON data; logprobs only when they were asked for."""
    completions = []
    for c in out.outputs:
        item = {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if params.logprobs is not None:
            item["cumulative_logprob"] = c.cumulative_logprob
            item["logprobs"] = _logprobs_json(c.logprobs)
        completions.append(item)
    data = {"request_id": out.request_id, "prompt": out.prompt,
            "prompt_token_ids": list(out.prompt_token_ids), "outputs": completions,
            "metrics": _metrics_json(out.metrics)}
    if params.prompt_logprobs is not None:
        data["prompt_logprobs"] = _logprobs_json(out.prompt_logprobs)
    return data


def print_outputs(outputs: Sequence[Any], file: Any = None) -> None:
    file = file or sys.stdout
    for out in outputs:
        shown = repr(out.prompt) if out.prompt is not None else f"token ids {list(out.prompt_token_ids)}"
        print(f"[request {out.request_id}] prompt: {shown} ({_count(len(out.prompt_token_ids), 'token')})",
              file=file)
        for c in out.outputs:
            print(f"  completion {c.index}: {c.text!r}", file=file)
            print(f"    finish_reason={c.finish_reason} token_ids={list(c.token_ids)}", file=file)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags given; the others keep the dataclass defaults."""
    return SamplingParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)
                             if hasattr(args, f.name)})


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """LLM keyword arguments for the engine flags given."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}


# ---- main ------------------------------------------------------------------------------------------
def _one_line(exc: BaseException) -> str:
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__


def _count(n: int, noun: str) -> str:
    """'1 token', '2 tokens'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _refused_line(failure: InvalidRequestError, output_json: str | None) -> str:
    """The CLI's one line for prompts `generate` refused, in CLI terms (prompts, not `.outputs`)."""
    reasons = []
    for i, exc in sorted(failure.errors.items()):
        reason = _one_line(exc).removeprefix("generate: ")
        reasons.append(reason if reason.startswith(f"prompt {i} ") else f"prompt {i}: {reason}")
    total, done = len(failure.outputs), len(failure.outputs) - len(failure.errors)
    line = f"{len(failure.errors)} of {_count(total, 'prompt')} refused ({'; '.join(reasons)})"
    if not done:
        return f"{line}; no prompt completed" + (f" ({output_json} lists the errors)" if output_json else "")
    where = "printed" + (f" and written to {output_json}" if output_json else "")
    others = "the other prompt's output was" if done == 1 else f"the other {done} prompts' outputs were"
    return f"{line}; {others} {where}"


def _fail(message: str, prog: str = PROG) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """`prog`: the command's name in the help and the messages (`deepinfer generate` from the CLI)."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:          # --help (0) or a bad flag (2, message already printed)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        # Everything cheap is checked before the (slow) model load.
        prompts = collect_prompts(args.inputs)
        params = sampling_params_from_args(args)
        if args.output_json and not Path(args.output_json).expanduser().parent.is_dir():
            raise UsageError(f"--output-json: directory {Path(args.output_json).parent} does not exist")
        engine_options = engine_options_from_args(args)
        # the whole config (cross-field checks, the environment's values) before the slow load
        config = EngineConfig.from_options(model=args.model, **engine_options)
        llm = load_llm(choose_model(config.model.model, prog), **engine_options)
        failure = None
        try:
            outputs = llm.generate(prompts, params, use_tqdm=args.progress)
        except InvalidRequestError as exc:     # the valid prompts completed: show them, then fail
            outputs, failure = exc.outputs, exc
        finally:
            if config.parallel.in_processes:     # stop the engine processes cleanly (the seam's LLM is in-process)
                llm.close()
    except (ValueError, TypeError, PluginError) as exc:     # PluginError: no usable platform
        logger.debug("generate failed", exc_info=True)   # the traceback, for DEBUG logging only
        return _fail(_one_line(exc), prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    print_outputs([o for o in outputs if o is not None])
    if args.output_json:
        errors = failure.errors if failure is not None else {}
        data = [output_to_json(o, params) if o is not None else {"index": i, "error": _one_line(errors[i])}
                for i, o in enumerate(outputs)]
        try:
            Path(args.output_json).expanduser().write_text(
                json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as exc:
            return _fail(f"--output-json: cannot write {args.output_json}: {exc}", prog)
    return _fail(_refused_line(failure, args.output_json), prog) if failure is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
