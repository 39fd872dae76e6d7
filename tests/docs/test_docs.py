"""Every command and Python block of the user docs runs as written (or is skipped with the reason
CI cannot run it), so a newcomer's clone works as the docs say; and the README stays a user's page.

Which pages and what is collected: tests/docs/docs_snippets.py. Each shell command must be in
`TABLE`, keyed by its text as written (less a trailing `# comment`): `Run` (executed, must exit 0
unless the entry expects otherwise, and its check looks at what the docs promise) or `Skip` with
the reason it cannot run in CI. Each Python block must match exactly one key of `PYTHON` (a
substring of the block). Anything unclassified fails `test_every_docs_command_is_classified`,
naming the page and line; an entry no longer on any page fails
`test_the_table_has_no_stale_entries`.

The offline example (it builds the bundled model into the empty cache, as a newcomer's first
command does) and the checkpoint maker run first, then the rest, two at a time; a command written
in several places runs once. A command with optional arguments in brackets
(`cmd [--off]`) runs the expansions its entry lists. The checks never depend on the random
model's text or on floating-point rounding: only on formats, grammars, exit codes and counts that
hold on any machine.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from docs_commands import PYTHON, TABLE
from docs_snippets import (
    OPTIONAL,
    REPO,
    TINY,
    Job,
    Result,
    Run,
    Snippet,
    all_snippets,
    clean_env,
    execute,
    expansions,
    markdown_pages,
    page_snippets,
    scanned_pages,
)

README = REPO / "README.md"
WORKERS = 2
# a newcomer's first command: builds the bundled model
FIRST = "python examples/offline_inference.py"


def python_key(snippet: Snippet) -> list[str]:
    return [k for k in PYTHON if k in snippet.text]


def jobs(snippets: list[Snippet]) -> list[Job]:
    out = []
    for s in snippets:
        if s.kind == "python":
            keys = python_key(s)
            if len(keys) == 1:
                out.append(Job(keys[0], "python", s.text, s.where, PYTHON[keys[0]]))
        elif isinstance(entry := TABLE.get(s.text), Run):
            for text in entry.variants or (s.text,):
                out.append(Job(s.text, "shell", text, s.where, entry.check, entry.status))
    return out


SNIPPETS = all_snippets()
JOBS = jobs(SNIPPETS)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[Job, Result]:
    """The result of every selected Run job (and of the checkpoint maker when a selected job reads
    its checkpoint): the offline example (it builds the bundled model into the empty cache) beside
    the maker, then the others, two at a time."""
    selected = {
        item.callspec.params["job"]
        for item in request.session.items
        if "job" in getattr(getattr(item, "callspec", None), "params", {})
    }
    maker = [j for j in JOBS if j.kind == "shell" and "make_tiny_checkpoint" in j.text]
    needed = [
        j for j in JOBS if j in selected or (j in maker and any(TINY in s.text for s in selected))
    ]
    builder = [j for j in needed if j.text == FIRST][:1]
    first = builder + [j for j in maker if j in needed]
    rest = [j for j in needed if j not in first]
    root = tmp_path_factory.mktemp("docs")
    env, tiny = clean_env(root), root / "tiny-v4"
    # a command written on several pages runs once; each place checks that one result
    ran: dict[tuple[str, str], Result] = {}

    def run(batch: list[Job]) -> None:
        todo = list({(j.kind, j.text): j for j in batch if (j.kind, j.text) not in ran}.values())
        ran.update(zip(((j.kind, j.text) for j in todo),
                       pool.map(lambda j: execute(j, env, tiny), todo)))
    with ThreadPoolExecutor(WORKERS) as pool:
        run(first)
        run(rest)
    return {j: ran[j.kind, j.text] for j in needed}


# ---- the tests -----------------------------------------------------------------------------------
def test_every_docs_command_is_classified():
    unclassified = []
    for s in SNIPPETS:
        if s.kind == "python":
            keys = python_key(s)
            if len(keys) != 1:
                unclassified.append(
                    f"{s.where}: Python block matches {len(keys)} keys of PYTHON "
                    f"{keys}: add one substring that identifies it, with its check"
                )
        elif s.text not in TABLE:
            unclassified.append(f"{s.where}: {s.text!r}")
        elif isinstance(entry := TABLE[s.text], Run):
            if OPTIONAL.search(s.text) and not entry.variants:
                unclassified.append(
                    f"{s.where}: {s.text!r} has [optional] parts: list the "
                    f"expansions to run in its Run(variants=...)"
                )
            if bad := [v for v in entry.variants if v not in expansions(s.text)]:
                unclassified.append(
                    f"{s.where}: variants {bad} are not expansions of {s.text!r}"
                )
    assert not unclassified, (
        "docs commands not classified: add each to TABLE in tests/docs/test_docs.py as "
        "Run(check) (run from the repository root; must exit 0) or Skip('why it cannot run in "
        "CI'):\n  " + "\n  ".join(unclassified)
    )


def test_the_table_has_no_stale_entries():
    commands = {s.text for s in SNIPPETS if s.kind == "shell"}
    blocks = [s.text for s in SNIPPETS if s.kind == "python"]
    stale = [k for k in TABLE if k not in commands] + [
        k for k in PYTHON if not any(k in b for b in blocks)
    ]
    assert not stale, f"entries of tests/docs/test_docs.py no longer on any page: {stale}"


def test_every_page_is_scanned_and_reachable_from_the_readme():
    """A new Markdown page is scanned unless listed with a reason; every docs/ page is linked from
    README.md or from a page the README links to."""
    pages = markdown_pages()
    assert "README.md" in scanned_pages() and all(p in pages for p in scanned_pages())
    docs = [p for p in pages if p.startswith("docs/")]
    assert docs, "docs/ has no pages"
    links = re.compile(r"\]\((?:\./)?((?:docs/)?[\w./-]+\.md)(?:#[\w-]*)?\)")
    reached, frontier = set(), ["README.md"]
    while frontier:
        page = frontier.pop()
        base = Path(page).parent
        for target in links.findall((REPO / page).read_text(encoding="utf-8")):
            rel = (base / target).as_posix()
            rel = str(Path(rel)) if not rel.startswith("..") else rel
            if rel in pages and rel not in reached:
                reached.add(rel)
                frontier.append(rel)
    assert not [p for p in docs if p not in reached], (
        f"docs pages no reader can reach from README.md: {[p for p in docs if p not in reached]}")


HISTORY = re.compile(r"\b[Ii]ssues? #?\d+|\b[Ss]essions?\b|\bblocked on\b")


def test_the_readme_is_a_users_page():
    """At most ~300 lines, and no development history: issue numbers, sessions, blocked work."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 320, f"README.md has {len(text.splitlines())} lines"
    found = [f"README.md:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
             if HISTORY.search(line)]
    assert not found, "development history in README.md:\n  " + "\n  ".join(found)


def test_the_docs_carry_no_development_history():
    found = []
    for page in scanned_pages():
        if page == "CHANGELOG.md" or not (page == "README.md" or page.startswith("docs/")):
            continue
        for n, line in enumerate((REPO / page).read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{page}:{n}: {line.strip()[:120]}")
    assert not found, "issue numbers or session history in the user docs:\n  " + "\n  ".join(found)


def test_the_parser_finds_each_kind_of_command():
    """Fenced lines (comment stripped), blocks without a language, inline spans wrapping a line,
    Python blocks; a directory tree in a plain block is not a command, nor a ```text block."""
    text = (
        "x\n```bash\nA=1 python a.py   # note\n\n./b.sh --x \\\n  --y\n```\n"
        "See `python -m c\n--z` and `not a command`.\n"
        "```\npkg/\n  mod.py   python files\n```\n"
        "```\npython d.py [--e]\n```\n"
        'Held: `X="a b" python f.py`, `deepinfer env`.\n\n'
        "```python\nprint(1)\n```\n"
        "```text\npython g.py\n```\n"
    )
    assert [(s.kind, s.text, s.line) for s in page_snippets(text, "p.md")] == [
        ("shell", "A=1 python a.py", 3),
        ("shell", "./b.sh --x --y", 5),
        ("shell", "python -m c --z", 8),
        ("shell", "python d.py [--e]", 15),
        ("shell", 'X="a b" python f.py', 17),
        ("shell", "deepinfer env", 17),
        ("python", "print(1)\n", 20),
    ]
    assert expansions("python d.py [--e] [--f 1]") == {
        "python d.py",
        "python d.py --e",
        "python d.py --f 1",
        "python d.py --e --f 1",
    }


@pytest.mark.parametrize("job", JOBS, ids=[j.id for j in JOBS])
def test_docs_command_runs_as_written(job: Job, results):
    r = results[job]
    assert r.rc == job.status, f"{job.where}: expected exit status {job.status}\n{r.describe()}"
    try:
        job.check(r)
    except AssertionError as exc:
        raise AssertionError(
            f"{job.where}: the output is not what the docs promise: {exc}\n{r.describe()}"
        ) from None
