"""Starting the engine processes with Python's spawn, and saying why one could not start.

Spawn starts a fresh interpreter per rank, which imports the program's main module again (as
`__mp_main__`) before it runs the rank. Two kinds of program cannot work that way, and both used to
end in a bare "rank 0 of 2 died (exit code 1)":

* a main module that is not a file (a program piped into `python -`): the child cannot import it
  (FileNotFoundError '<stdin>'). `check_spawnable` refuses before anything is spawned;
* a main module that creates the LLM when imported (no `if __name__ == "__main__":` guard): every
  child would create its own LLM, which would spawn again. `check_spawnable` raises in the child,
  where the import runs the LLM's construction a second time.

What a child prints before the rank's own code runs (the import of the main module, the unpickling
of its arguments) goes through a pipe (`StartupOutput`): the front end forwards it to its own stderr
and keeps the end, so a rank that dies there is reported with the last exception of its traceback.
Once the rank's code runs (`worker_main`), it writes to the front end's stderr directly
(`restore_stderr`) and reports its failures itself.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.process
import os
import sys
import threading
from collections.abc import Iterator
from multiprocessing import reduction

KEEP_BYTES = 64 * 1024         # the end of a rank's start-up output kept for its error
GUARD = 'if __name__ == "__main__":'
DOCS = "\"Safe importing of main module\" in Python's multiprocessing docs"


def check_spawnable(what: str) -> None:
    """Raise a RuntimeError naming the cause and the remedy when spawned ranks cannot import the
    program's main module, or when this process is such a rank importing it (no guard in it).
    `what` names the option that starts processes, e.g. "data_parallel_size=2"."""
    # multiprocessing's flag while a spawned child imports the parent's main module
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        main_file = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main module"
        raise RuntimeError(f"LLM({what}) ran again inside one of its own engine processes: "
                           f"Python's spawn imports the program's main module ({main_file}) in "
                           f"every engine process, and this program creates the LLM when "
                           f"imported; put the code that creates and uses the LLM under `{GUARD}` "
                           f"(see {DOCS})")
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return                  # `python -m module`: the children import it by name
    path = getattr(main, "__file__", None)
    if path is None:
        return                  # python -c, the interactive prompt, a notebook: nothing is imported
    original_dir = multiprocessing.process.ORIGINAL_DIR or ""    # spawn resolves a relative path
    if not os.path.isfile(os.path.join(original_dir, path)):
        raise RuntimeError(f"LLM({what}) starts its engine processes with Python's spawn, which "
                           f"imports the program's main module in each of them, and this program's "
                           f"main module ({path!r}) is not a file that can be imported again (a "
                           f"program read from standard input, `python -`, or a file since "
                           f"removed); save the program to a file, with the code that creates and "
                           f"uses the LLM under `{GUARD}`, and run that file (see {DOCS})")


class InheritedFd:
    """A file descriptor given to a spawned child (pickled with multiprocessing's fd passing): the
    child's argument is the descriptor's number there."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup_fd) -> int:
    return dup_fd.detach()


def _flush_stderr() -> None:
    if sys.stderr is not None:
        sys.stderr.flush()


def restore_stderr(fd: int | None) -> None:
    """In the rank: write to the front end's stderr directly from now on (ends the start-up
    pipe)."""
    if fd is None:
        return
    _flush_stderr()
    os.dup2(fd, 2)
    os.close(fd)


def exception_text(output: str, max_lines: int = 3) -> str:
    """The exception that ended the last traceback in `output`, on one line ('' when none)."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines)
              if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return ""
    block = lines[starts[-1] + 1:]
    # the frames are indented; the exception is the first line that is not
    first = next((i for i, line in enumerate(block) if line and not line[0].isspace()), None)
    if first is None:
        return ""
    text = []
    for line in block[first:first + max_lines]:
        if not line.strip():
            break
        text.append(line.strip())
    return " ".join(text)


class StartupOutput:
    """A spawned rank's stderr until its own code runs: a pipe, forwarded to this process's stderr
    by a thread that keeps the last KEEP_BYTES (`cause`)."""

    def __init__(self) -> None:
        self._tail = b""
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[InheritedFd | None]:
        """Around `Process.start()`: fd 2 is the pipe (the child inherits it), then this process's
        again. Yields the real stderr for the child to return to (None: not captured, e.g. this
        process has no fd 2)."""
        if os.name != "posix":
            yield None
            return
        try:
            sink = os.dup(2)
        except OSError:
            yield None
            return
        read_fd, write_fd = os.pipe()
        self._thread = threading.Thread(target=self._pump, args=(read_fd, sink), daemon=True,
                                        name="deepinfer-rank-stderr")
        self._thread.start()      # before the switch: what this process writes meanwhile flows too
        _flush_stderr()
        os.dup2(write_fd, 2)
        try:
            yield InheritedFd(sink)
        finally:
            _flush_stderr()
            os.dup2(sink, 2)
            os.close(write_fd)

    def _pump(self, read_fd: int, sink: int) -> None:
        try:
            while chunk := os.read(read_fd, 65536):
                self._tail = (self._tail + chunk)[-KEEP_BYTES:]
                with contextlib.suppress(OSError):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(sink, view):]
        finally:
            os.close(read_fd)
            os.close(sink)

    def cause(self, timeout_s: float = 2.0) -> str:
        """The exception that ended the rank's start-up output (after up to `timeout_s` for the
        pipe to close), '' when it printed none."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return exception_text(self._tail.decode("utf-8", "replace"))
