"""The ranks' reports to the front end: one pipe per rank, written by the rank's engine thread itself.

Not a `multiprocessing.Queue`: its `put` hands the message to a feeder thread that pickles and writes it,
and that thread needs the GIL. A rank whose engine loop is host-bound (fast decode steps, the host path
the bottleneck) releases the GIL only at the interpreter's switch interval (5 ms), so each report waited
5 ms or more and a backlog built up at hundreds of reports a second. `Connection.send` pickles and
writes in the calling thread; the front end waits on all the ranks' pipes at once.

Commands (front end -> rank) stay on queues: a large add (a whole `generate` batch) must never block the
front end while its rank is blocked writing a report the front end is not reading yet.

Ranks in other torchrun processes (launcher='torchrun', torchrun.py) report over their socket
connection instead, added with `add`; their commands go the other way on the same connection, read on
the rank by a thread of their own, so neither side's send waits on the other side's engine loop.
"""
from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any


class ReportSender:
    """A rank's end: `put` pickles and writes the message now (it blocks only if the pipe is full)."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def put(self, msg: Any) -> None:
        self._conn.send(msg)

    def close(self) -> None:
        self._conn.close()


class ReportReceiver:
    """The front end's end over every rank's pipe, read like a queue (`get(timeout)`, `get_nowait()`,
    both raising `queue.Empty`). A rank that died leaves an empty, closed pipe: it is dropped here, and
    the front end's liveness checks report the rank."""

    def __init__(self, ctx, world: int):
        pairs = [ctx.Pipe(duplex=False) for _ in range(world)]
        self._readers: list[Connection] = [r for r, _ in pairs]
        self.senders = [ReportSender(w) for _, w in pairs]
        self._ready: deque = deque()
        self._on_end: dict[Connection, Callable[[], None]] = {}

    def add(self, conn: Connection, on_end: Callable[[], None]) -> None:
        """Read a remote rank's reports from `conn` too; `on_end()` runs when the connection ends."""
        self._readers.append(conn)
        self._on_end[conn] = on_end

    def started(self) -> None:
        """The ranks have their copies of the write ends: close ours (a dead rank's pipe then ends)."""
        for s in self.senders:
            s.close()

    def close(self) -> None:
        for conn in self._readers:
            conn.close()
        self._readers = []

    def get(self, timeout: float) -> Any:
        if not self._ready:
            self._read(timeout)
        if not self._ready:
            raise queue.Empty
        return self._ready.popleft()

    def get_nowait(self) -> Any:
        return self.get(0.0)

    def _read(self, timeout: float) -> None:
        self._readers = [c for c in self._readers if not c.closed]     # a remote rank's, closed by kill()
        for conn in wait(self._readers, timeout):
            try:
                while conn.poll():
                    self._ready.append(conn.recv())
            except (EOFError, OSError):        # the rank is gone; its last messages are already read
                self._readers.remove(conn)
                on_end = self._on_end.pop(conn, None)
                if on_end is not None:
                    on_end()
