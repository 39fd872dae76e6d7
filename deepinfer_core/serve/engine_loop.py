"""The engine's own thread, beside the HTTP server's event loop.

The engine steps in a dedicated thread so that neither loop waits for the other: handlers submit and
abort requests through a command queue (never touching the engine), and each request's outputs come
back through an `Outputs` of its own: after each step the thread hands every output of the step to the
event loop in one `call_soon_threadsafe` (one wake-up per step, not one per request), and a delta that
arrives before the handler took the previous one is merged into it, so a handler that falls behind reads
fewer, larger deltas instead of a growing queue (as vLLM's output collector). The thread blocks on the
command queue when the engine is idle and drains it between steps otherwise, so a request submitted
mid-generation joins the next step. Detokenisation stays in the engine's output processing (a few
tokens per step for streamed requests); JSON and SSE framing stay in the handlers.

`engine` is the in-process `Engine`, or under data parallelism the front end of the ranks
(parallel/dp_online.py, `LLM.serving_engine()`): the same add / abort / step calls. Its `step` may also
return a ValueError carrying a `request_id` (a rank refused the request at submission), delivered to
that request's handler as the in-process engine's ValueError would have been; its `health_error()`
reports a dead rank while the system is idle. `reset_prefix_cache` runs on the engine thread between
steps, either way (the front end's asks every rank and waits for their answers).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from ..api.outputs import CompletionOutput, RequestOutput
from ..api.sampling_params import SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger("deepinfer.serve")


def _owned_completion(c: CompletionOutput) -> CompletionOutput:
    return replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))


def owned_copy(out: RequestOutput) -> RequestOutput:
    """A copy of an engine output whose completions (and their lists) `merge_into` may extend."""
    return replace(out, outputs=[_owned_completion(c) for c in out.outputs])


def merge_into(owned: RequestOutput, delta: RequestOutput) -> None:
    """Append a later delta of the same request to `owned` (an `owned_copy`): texts, tokens and logprobs
    joined per completion index, the latest finish state and metrics kept."""
    by_index = {c.index: c for c in owned.outputs}
    for c in delta.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            prev = by_index[c.index] = _owned_completion(c)
            owned.outputs.append(prev)
            continue
        prev.text += c.text
        prev.token_ids += c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.cumulative_logprob, prev.finish_reason, prev.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                         c.stop_reason)
    owned.outputs.sort(key=lambda c: c.index)
    owned.finished, owned.metrics = delta.finished, delta.metrics
    if owned.prompt_logprobs is None:
        owned.prompt_logprobs = delta.prompt_logprobs


class Outputs:
    """One request's outputs on the event loop's side, filled by `put` (on the loop) and read by `get`.
    Consecutive deltas the handler has not read yet are merged into one; an error stays a separate item
    after the outputs that came before it."""

    __slots__ = ("_items", "_owned", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._owned = False                  # the last item is our merged copy (not the engine's object)
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            if not self._owned:
                last = self._items[-1] = owned_copy(last)
                self._owned = True
            merge_into(last, item)
        else:
            self._items.append(item)
            self._owned = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self._waiter = None
        if len(self._items) == 1:
            self._owned = False
        return self._items.popleft()


def _put_all(items: list[tuple[Outputs, RequestOutput | BaseException]]) -> None:
    for outputs, item in items:
        outputs.put(item)


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cache_salt: str | None
    outputs: Outputs
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ResetPrefixCache:
    done: concurrent.futures.Future          # the engine's answer, or EngineStopped


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
                       prompt: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a streamed request and yield its outputs (deltas) until it finishes. A ValueError
        the engine raises at submission is raised here, before anything was yielded. Leaving the
        iteration early (a client that went away) aborts the request. `cache_salt`: the engine's
        (prefix caching shares prompts only between requests with the same salt)."""
        with self._lock:
            if self.error is not None:
                raise EngineStopped(f"the engine stopped: {self.error}")
            if self._admitted >= self.max_requests:
                raise QueueFull(f"{self._admitted} requests in the server; the limit is {self.max_requests}")
            self._admitted += 1
        outputs = Outputs()
        self._commands.put(_Submit(request_id, prompt_token_ids, params, prompt, cache_salt,
                                   outputs, asyncio.get_running_loop()))
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

    async def reset_prefix_cache(self) -> bool:
        """The engine's `reset_prefix_cache()` between two steps: True when no cached prefix is left
        (False: prefix caching is off, or running requests still hold some; under data parallelism,
        on any rank)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:                     # queued before a failure's drain, or refused here
            if self.error is not None:
                raise EngineStopped(f"the engine stopped: {self.error}")
            self._commands.put(_ResetPrefixCache(done))
        return await asyncio.wrap_future(done)

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
                    self._deliver(self.engine.step())
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
                elif isinstance(command, _ResetPrefixCache) \
                        and command.done.set_running_or_notify_cancel():
                    command.done.set_exception(EngineStopped(f"the engine stopped: {exc}"))
            for sub in waiting:
                sub.loop.call_soon_threadsafe(sub.outputs.put, EngineStopped(f"the engine stopped: {exc}"))

    def _apply(self, command) -> None:
        if isinstance(command, _Submit):
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                        prompt=command.prompt, stream=True,
                                        cache_salt=command.cache_salt)
            except ValueError as exc:
                command.loop.call_soon_threadsafe(command.outputs.put, exc)
                return
            except BaseException as exc:     # the engine failed: this handler is in neither _live nor the queue
                command.loop.call_soon_threadsafe(command.outputs.put, EngineStopped(f"the engine stopped: {exc}"))
                raise
            self._live[command.request_id] = command
        elif isinstance(command, _Abort) and self._live.pop(command.request_id, None) is not None:
            self.engine.abort_request(command.request_id)
            self.metrics.observe_abort()
        elif isinstance(command, _ResetPrefixCache) and command.done.set_running_or_notify_cancel():
            try:
                command.done.set_result(self.engine.reset_prefix_cache())
            except BaseException as exc:     # the engine failed: the thread stops, the caller hears
                command.done.set_exception(EngineStopped(f"the engine stopped: {exc}"))
                raise

    def _deliver(self, step_outputs: list[RequestOutput | ValueError]) -> None:
        """Hand a step's outputs to their handlers: one `call_soon_threadsafe` per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in step_outputs:
            if isinstance(out, ValueError):          # refused by a data-parallel rank at submission
                sub = self._live.pop(getattr(out, "request_id", None), None)
            else:
                self.metrics.observe_output(out)
                sub = self._live.get(out.request_id)
                if sub is not None and out.finished:
                    del self._live[out.request_id]
            if sub is not None:
                batches.setdefault(sub.loop, []).append((sub.outputs, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
