"""The CLI's prompts: `--prompt`, `--prompt-token-ids` and `--prompts-file` in command-line order, a
prompts file being plain text (one prompt per non-blank line) or JSONL (one object per line with
"prompt" and/or "prompt_token_ids"). Every problem is a `UsageError` naming the flag (and, for a
prompts file, the file and line)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


class PromptsFile(str):
    """A --prompts-file path kept in the ordered prompt list; expanded after parsing."""


class UsageError(ValueError):
    """Bad input found by this CLI (reported in one line, exit status 2)."""


def read_prompts_file(path: str | Path) -> list[Any]:
    """Prompts of a text file (one per non-blank line) or of a JSONL file (one object per line)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"--prompts-file: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts-file: cannot read {path}: {exc}") from None
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise UsageError(f"--prompts-file: {path} has no prompts")
    if not (path.suffix.lower() == ".jsonl" or _is_json_object(numbered[0][1])):
        return [line for _, line in numbered]
    prompts = []
    for lineno, line in numbered:
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"--prompts-file: {path}:{lineno}: invalid JSON ({exc})") from None
        if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & item.keys()):
            raise UsageError(f"--prompts-file: {path}:{lineno}: expected an object with \"prompt\" "
                             f"(a string) or \"prompt_token_ids\" (a list of ints)")
        ids = item.get("prompt_token_ids")
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise UsageError(f"--prompts-file: {path}:{lineno}: \"prompt_token_ids\" must be a list of ints")
        if "prompt" in item and not isinstance(item["prompt"], str):
            raise UsageError(f"--prompts-file: {path}:{lineno}: \"prompt\" must be a string")
        prompts.append(item["prompt"] if ids is None
                       else {k: item[k] for k in ("prompt", "prompt_token_ids") if k in item})
    return prompts


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def collect_prompts(inputs: Sequence[Any] | None) -> list[Any]:
    """Text prompts and {"prompt_token_ids": [...]} dicts, in command-line order."""
    prompts: list[Any] = []
    for item in inputs or ():
        prompts.extend(read_prompts_file(item) if isinstance(item, PromptsFile) else [item])
    if not prompts:
        raise UsageError("no prompt given; use --prompt TEXT, --prompts-file PATH or --prompt-token-ids IDS")
    return prompts
