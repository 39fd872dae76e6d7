"""The commands and Python blocks of the user docs, and how tests/docs/test_docs.py runs them.

Which pages: every Markdown file of the repository (README.md, docs/*.md, the packages' READMEs,
CHANGELOG.md, ...) except those in `NOT_SCANNED`, each with the reason it holds nothing to run.

What is collected from a page:
- every line of a ```bash / ```sh / ```shell / ```console block, and of a ``` block without a
  language when one of its lines looks like a command (see `COMMAND`; a directory tree does not);
  a ```text block is never collected;
- every inline code span of the prose that looks like a command (`python ...`, `./build.sh ...`,
  `VAR=value python ...`, `deepinfer ...`), also when it wraps a line;
- every ```python block, whole.

How they run: from the repository root, in a subprocess (`bash -c` for shell lines, each Python
block written to a file of its own and run as `python FILE`), with a fresh temporary HOME and XDG_CACHE_HOME (so the bundled tiny
model is built into an empty user cache, as on a newcomer's machine, and no Hugging Face cache of
this machine is seen), no other DEEPINFER_* / HF_* variables and DEEPINFER_ACCELERATOR=cpu;
`python` is this interpreter. One substitution: the docs' checkpoint path /tmp/tiny-v4 (written by
the `make_tiny_checkpoint` command, read by the Python blocks) is replaced, in every command and
block alike, by a path in this run's temporary directory, so that parallel runs cannot collide.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = "/tmp/tiny-v4"  # the docs' checkpoint path, replaced by a temporary one
TIMEOUT_S = 600

# Markdown files that hold nothing a user runs, with the reason; every other one is scanned.
NOT_SCANNED = {
    "tests/data/deepseek-v4-flash/README.md": "a copy of the model card of the official checkpoint",
}
SKIP_DIRS = {".git", "build", "dist", "node_modules", ".venv", "venv", "__pycache__"}

# A command: optional VAR=value assignments, then python/pip/pytest/bash/sh/deepinfer or a ./script.
COMMAND = re.compile(
    r"^(?:[A-Z][A-Z0-9_]*=(?:\"[^\"]*\"|'[^']*'|\S*)\s+)*"
    r"(?:(?:python3?|pip3?|pytest|bash|sh|\./\S+)(?:\s|$)|deepinfer\s+[a-z])"
)
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")  # opens a block (with its language, if any)
CLOSE = re.compile(r"^\s*```\s*$")
OPTIONAL = re.compile(r" \[([^\]]+)\]")  # `cmd [--off]`: an optional argument


def markdown_pages() -> list[str]:
    """Every Markdown file of the repository, relative to it, README.md first."""
    found = []
    for path in REPO.rglob("*.md"):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        found.append(rel.as_posix())
    return sorted(found, key=lambda p: (p != "README.md", p.count("/"), p))


def scanned_pages() -> list[str]:
    return [p for p in markdown_pages() if p not in NOT_SCANNED]


# ---- parsing -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snippet:
    kind: str  # "shell" or "python"
    text: str  # a shell command without its trailing comment, or a whole Python block
    page: str  # the Markdown file, relative to the repository
    line: int  # where it starts in that file

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def strip_comment(line: str) -> str:
    """`cmd args  # comment` -> `cmd args` (a # inside quotes or a word is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def normalize(command: str) -> str:
    return " ".join(command.split())


def page_snippets(text: str, page: str = "README.md") -> list[Snippet]:
    lines = text.splitlines()
    found: list[Snippet] = []
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        lang, start, body = fence.group(1).lower(), i + 1, []
        i += 1
        while i < len(lines) and not CLOSE.match(lines[i]):
            body.append((i + 1, lines[i]))
            i += 1
        assert i < len(lines), f"{page}:{start}: code block never closed"
        i += 1
        if lang == "python":
            found.append(Snippet("python", "\n".join(t for _, t in body) + "\n", page, start + 1))
        elif lang in SHELL_LANGS or (not lang and any(COMMAND.match(t.strip()) for _, t in body)):
            pending, first = "", 0
            for n, t in body:
                if not pending and (not t.strip() or t.strip().startswith("#")):
                    continue
                first = first or n
                if t.rstrip().endswith("\\"):  # continued on the next line
                    pending += t.rstrip()[:-1] + " "
                    continue
                found.append(Snippet("shell", normalize(strip_comment(pending + t)), page, first))
                pending, first = "", 0
    # Inline code spans, paragraph by paragraph (a span may wrap onto the next line).
    paragraph: list[tuple[int, str]] = []
    for n, t in prose + [(0, "")]:
        if t.strip():
            paragraph.append((n, t))
            continue
        joined, starts = "", []
        for pn, pt in paragraph:
            starts.append((len(joined), pn))
            joined += pt + " "
        for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
            span = normalize(m.group(1))
            if COMMAND.match(span):
                line = max(pn for offset, pn in starts if offset <= m.start())
                found.append(Snippet("shell", span, page, line))
        paragraph = []
    return sorted(found, key=lambda s: s.line)


def all_snippets() -> list[Snippet]:
    return [s for page in scanned_pages()
            for s in page_snippets((REPO / page).read_text(encoding="utf-8"), page)]


def expansions(command: str) -> set[str]:
    """Every command `cmd [--a] [--b]` stands for: each bracketed part left out or kept."""
    parts = OPTIONAL.split(command)  # text, optional, text, optional, ..., text
    choices = [[p] if k % 2 == 0 else ["", " " + p] for k, p in enumerate(parts)]
    return {normalize("".join(c)) for c in itertools.product(*choices)}


# ---- what a run gives ----------------------------------------------------------------------------
@dataclass
class Result:
    command: str  # as run (after the /tmp/tiny-v4 substitution)
    rc: int | None  # None: timed out
    stdout: str
    stderr: str
    seconds: float
    tiny: Path  # what /tmp/tiny-v4 became
    cache: Path  # XDG_CACHE_HOME

    def describe(self) -> str:
        return (
            f"$ {self.command}\nexit status {self.rc} after {self.seconds:.0f} s\n"
            f"--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"
        )


Check = Callable[[Result], None]


@dataclass(frozen=True)
class Run:
    check: Check
    variants: tuple[str, ...] = ()  # the expansions to run, for a command with [optional] parts
    status: int = 0  # the exit status the docs imply


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Job:
    key: str  # TABLE or PYTHON key
    kind: str
    text: str  # the command or block as written (an expansion for [optional] parts)
    where: str  # page:line
    check: Check
    status: int = 0

    @property
    def id(self) -> str:
        return f"{self.where}:{self.key if self.kind == 'python' else self.text}"[:100]


def clean_env(root: Path) -> dict[str, str]:
    """A fresh HOME and cache under `root`; `python` on PATH is this interpreter (a wrapper script,
    since a symlink would lose a virtual environment)."""
    home, bin_dir = root / "home", root / "bin"
    home.mkdir()
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    drop = ("DEEPINFER_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        DEEPINFER_ACCELERATOR="cpu",
        PYTHONIOENCODING="utf-8",
        PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]),
    )
    return env


def execute(job: Job, env: dict[str, str], tiny: Path) -> Result:
    text = job.text.replace(TINY, str(tiny))
    if job.kind == "shell":
        argv = ["bash", "-c", text]
    else:  # from a file, as a user runs it (spawn re-imports the main module: `python -` cannot)
        script = tiny.parent / f"block_{hashlib.sha1(job.where.encode()).hexdigest()[:12]}.py"
        script.write_text(text, encoding="utf-8")
        argv = [sys.executable, str(script)]
    start = time.monotonic()
    try:
        p = subprocess.run(argv, check=False, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, encoding="utf-8", errors="replace",
                           timeout=TIMEOUT_S)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, str(exc.stdout or "")
        err = f"timed out after {TIMEOUT_S} s\n{exc.stderr or ''}"
    shown = text if job.kind == "shell" else f"python {argv[-1]}  # holding:\n{text}"
    return Result(shown, rc, out, err, time.monotonic() - start, tiny,
                  Path(env["XDG_CACHE_HOME"]))
