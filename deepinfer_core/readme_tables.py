"""Tables a docs page carries between two marker comments, generated from the code that owns them
(envs.py: the environment variables; engine_config.py: the engine options; both in
docs/configuration.md), and the small CLI each offers (`--markdown`, `--update PATH`). A test per
table keeps the page current."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

DOCS_PAGE = "docs/configuration.md"  # the page both tables live in, relative to the repository root


def section(text: str, begin: str, end: str) -> str | None:
    """The text between the markers, or None when they are missing."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        return None
    return text[start + len(begin):stop]


def update(path: str | Path, begin: str, end: str, table: str) -> bool:
    """Rewrite the text between the markers of `path` with `table`; True if the file changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if section(text, begin, end) is None:
        raise ValueError(f"{path} lacks the markers {begin} ... {end}")
    start, stop = text.find(begin) + len(begin), text.find(end)
    new = text[:start] + "\n" + table + "\n" + text[stop:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def cli(prog: str, description: str, render: Callable[[], str], begin: str, end: str,
        argv: list[str] | None, default: Callable[[], int] | None = None,
        page: str = DOCS_PAGE) -> int:
    """`--markdown` prints the table, `--update PATH` (alias `--update-readme`) rewrites it in a
    docs page; with neither, `default()` (or the table when there is no default)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--update", "--update-readme", dest="update", metavar="PATH",
                        help=f"rewrite the table between {begin} and {end} in the docs page PATH "
                             f"(this one lives in {page})")
    args = parser.parse_args(argv)
    if args.update:
        changed = update(args.update, begin, end, render())
        print(f"{args.update}: {'updated' if changed else 'already up to date'}")
        return 0
    if args.markdown or default is None:
        print(render())
        return 0
    return default()
