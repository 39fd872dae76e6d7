"""Shared by the example plugin's tests: its install into a temporary directory (never into this
environment, whose other tests list the installed plugins), the environment of a subprocess that
sees it, and how a test picks the word to ban from an unconstrained output."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "plugins" / "deepinfer-example-plugin"
PLUGINS_PAGE = REPO / "docs" / "plugins.md"
PROMPTS = ["ROMEO.\nBut soft, what light", "KING.\nMy lord, the", "HAMLET.\nTo be, or not to be,"]


def install_example(root: Path) -> Path:
    """pip-install the example from a copy of its sources (an in-tree build writes build/ and
    *.egg-info beside them) into root/site; returns root/site."""
    src, site = root / "src", root / "site"
    shutil.copytree(EXAMPLE, src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target", str(site),
                    str(src)], check=True, capture_output=True, text=True)
    return site


def env_with(site: Path | None) -> dict[str, str]:
    """This environment (CPU, no DEEPINFER_* settings) with `site` first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["DEEPINFER_ACCELERATOR"] = "cpu"
    paths = [str(site)] if site is not None else []
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def occurs(seq: Sequence[int], ids: Sequence[int]) -> bool:
    """Whether `seq` is a contiguous run of `ids`."""
    n = len(seq)
    return any(list(ids[i:i + n]) == list(seq) for i in range(len(ids) - n + 1))


def sequences(word: str, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences the plugin forbids for `word`: as written and after a space."""
    return [encode(word), encode(" " + word)]


def choose_word(text: str, ids: Sequence[int], encode: Callable[[str], list[int]]) -> str:
    """A word of the output (4+ letters) that the output spells with one of its banned sequences,
    preferring one of several tokens (the multi-token matching is then exercised)."""
    found = []
    for word in dict.fromkeys(re.findall(r"[A-Za-z]{4,}", text)):
        seqs = [s for s in sequences(word, encode) if occurs(s, ids)]
        if seqs:
            found.append((max(len(s) for s in seqs) < 2, word))
    assert found, f"no word of {text!r} is spelled with its own tokens"
    return min(found)[1]
