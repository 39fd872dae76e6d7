"""Programs whose engine processes cannot start say why (parallel/rank_start.py).

Python's spawn imports the program's main module in every engine process. A program piped into
`python -` has no file to import: `LLM(data_parallel_size=2)` must refuse before spawning anything,
naming '<stdin>' and the remedy. A script that creates the LLM without an
`if __name__ == "__main__":` guard would create it again in every rank: the ranks must fail with
that remedy, and the front end's error must carry it (not a bare exit code). Any other exception
while a rank imports the main module is reported the same way, from the rank's start-up output.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from deepinfer_core.parallel.rank_start import exception_text

GUARD = 'if __name__ == "__main__":'
FRONT_END = "RuntimeError: DataParallelLLM: data-parallel rank 0 of 2 died during start-up "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from deepinfer_core.tools.bundled_model import bundled_tiny_model_dir
    return str(bundled_tiny_model_dir(tmp_path_factory.mktemp("bundled")))


def _llm_code(model_dir: str) -> str:
    return (f"llm = LLM({model_dir!r}, data_parallel_size=2, dtype='float32')\n"
            "print('generated', llm.generate(['Hi'])[0].outputs[0].text is not None, flush=True)\n"
            "llm.close()\n")


def _run(args: list[str], cwd, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, timeout=240, check=False)


def test_program_on_stdin_is_refused_before_spawning(model_dir, tmp_path):
    code = "from deepinfer_core import LLM\n" + _llm_code(model_dir)
    t0 = time.monotonic()
    done = _run(["-"], tmp_path, stdin=code)
    elapsed = time.monotonic() - t0
    assert done.returncode == 1 and "generated" not in done.stdout, done
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: LLM(data_parallel_size=2) starts its engine processes"), \
        last
    for part in ("('<stdin>')", "`python -`", "save the program to a file", GUARD):
        assert part in last, last
    # refused by the check, not by a dead rank (a child would print spawn's FileNotFoundError)
    assert "FileNotFoundError" not in done.stderr and "died" not in done.stderr, done.stderr
    assert elapsed < 60, elapsed


def test_script_without_main_guard_fails_with_the_remedy(model_dir, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from deepinfer_core import LLM\n" + _llm_code(model_dir))
    done = _run([str(script)], tmp_path)
    assert done.returncode == 1 and "generated" not in done.stdout, done
    lines = done.stderr.strip().splitlines()
    head = next(line for line in lines if line.startswith("RuntimeError: DataParallelLLM:"))
    assert head.startswith(FRONT_END + "(exit code 1): RuntimeError: LLM(data_parallel_size=2) ran "
                           "again inside one of its own engine processes"), head
    assert str(script) in head and GUARD in head, head
    assert lines[-1] == "  rank 1 died during start-up (exit code 1): the same", lines[-3:]


def test_a_rank_that_fails_importing_the_main_module_reports_the_exception(model_dir, tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(textwrap.dedent(f"""\
        import sys
        from deepinfer_core import LLM

        if __name__ == "__mp_main__":          # spawn's import of this file in a rank
            print("a line before the failure", file=sys.stderr)
            raise ValueError("no config file in the rank's folder")

        {GUARD}
        """) + textwrap.indent(_llm_code(model_dir), "    "))
    done = _run([str(script)], tmp_path)
    assert done.returncode == 1, done
    assert "a line before the failure" in done.stderr     # the rank's output still reaches stderr
    assert (FRONT_END + "(exit code 1): ValueError: no config file in the rank's folder; the "
            "engine has stopped") in done.stderr, done.stderr


def test_exception_text_takes_the_last_traceback():
    output = textwrap.dedent("""\
        some warning
        Traceback (most recent call last):
          File "a.py", line 1, in <module>
        KeyError: 'x'

        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "b.py", line 2, in <module>
            raise ValueError("bad")
            ^^^^^^^^^^^^^^^^^^^^^^^
        ValueError: bad
        """)
    assert exception_text(output) == "ValueError: bad"
    assert exception_text("only a warning\n") == ""
    assert exception_text("Traceback (most recent call last):\n  File \"x\"\n") == ""
