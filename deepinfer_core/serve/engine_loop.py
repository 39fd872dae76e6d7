"""The engine's own thread, beside the HTTP server's event loop.

The engine steps in a dedicated thread so that neither loop waits for the other: handlers submit and
abort requests through a command queue (never touching the engine), and each request's outputs come
back on an asyncio queue of its own, put there with `call_soon_threadsafe`. The thread blocks on the
command queue when the engine is idle and drains it between steps otherwise, so a request submitted
mid-generation joins the next step. Detokenisation stays in the engine's output processing (a few
tokens per step for streamed requests); JSON and SSE framing stay in the handlers.

`engine` is the in-process `Engine`, or under data parallelism the front end of the ranks
(parallel/dp_online.py, `LLM.serving_engine()`): the same add / abort / step calls. Its `step` may also
return a ValueError carrying a `request_id` (a rank refused the request at submission), delivered to
that request's handler as the in-process engine's ValueError would have been; its `health_error()`
reports a dead rank while the system is idle.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..api.outputs import RequestOutput
from ..api.sampling_params import SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger("deepinfer.serve")


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


class QueueFull(RuntimeError):
    """More requests are waiting or running than the server admits (answered 503)."""


class EngineStopped(RuntimeError):
    """The engine thread failed; no request can be served (answered 503)."""


class EngineLoop:
    def __init__(self, engine, max_requests: int = 1024):
        self.engine = engine
        self.max_requests = max_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Submit] = {}          # the thread's view: requests in the engine
        self._admitted = 0                           # the handlers' view: submitted, not yet finished
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._stopping = threading.Event()
        self.error: BaseException | None = None      # what stopped the thread, if anything did
        self.metrics = ServerMetrics()

    # ---- the handlers' side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def num_admitted(self) -> int:
        return self._admitted

    def health_error(self) -> str | None:
        """Why no request can be served now (the engine thread stopped, a rank died), or None."""
        if self.error is not None:
            return f"engine stopped: {self.error}"
        check = getattr(self.engine, "health_error", None)
        return check() if check is not None else None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a streamed request and yield its outputs (deltas) until it finishes. A ValueError
        the engine raises at submission is raised here, before anything was yielded. Leaving the
        iteration early (a client that went away) aborts the request."""
        with self._lock:
            if self.error is not None:
                raise EngineStopped(f"the engine stopped: {self.error}")
            if self._admitted >= self.max_requests:
                raise QueueFull(f"{self._admitted} requests in the server; the limit is {self.max_requests}")
            self._admitted += 1
        outputs: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Submit(request_id, prompt_token_ids, params, prompt, outputs, asyncio.get_running_loop()))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._admitted -= 1
            if not finished:
                self._commands.put(_Abort(request_id))

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.metrics.observe_step(self.engine)
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                self._apply(self._commands.get() if not busy else None)
                while True:                          # everything queued so far joins the next step
                    try:
                        self._apply(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
                self.metrics.observe_step(self.engine)
        except BaseException as exc:                 # the engine failed: every waiting handler hears it
            log.exception("engine thread stopped")
            with self._lock:                         # no submission after this one gets in
                self.error = exc
            waiting = list(self._live.values())
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Submit):
                    waiting.append(command)
            for sub in waiting:
                sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, EngineStopped(f"the engine stopped: {exc}"))

    def _apply(self, command) -> None:
        if isinstance(command, _Submit):
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                        prompt=command.prompt, stream=True)
            except ValueError as exc:
                command.loop.call_soon_threadsafe(command.outputs.put_nowait, exc)
                return
            except BaseException as exc:     # the engine failed: this handler is in neither _live nor the queue
                command.loop.call_soon_threadsafe(command.outputs.put_nowait,
                                                  EngineStopped(f"the engine stopped: {exc}"))
                raise
            self._live[command.request_id] = command
        elif isinstance(command, _Abort) and self._live.pop(command.request_id, None) is not None:
            self.engine.abort_request(command.request_id)
            self.metrics.observe_abort()

    def _deliver(self, out: RequestOutput | ValueError) -> None:
        if isinstance(out, ValueError):              # refused by a data-parallel rank at submission
            sub = self._live.pop(getattr(out, "request_id", None), None)
            if sub is not None:
                sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, out)
            return
        self.metrics.observe_output(out)
        sub = self._live.get(out.request_id)
        if sub is None:
            return
        if out.finished:
            del self._live[out.request_id]
        sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, out)
