"""Grammar compilation off the step loop, with a compiled-grammar cache and a timeout.

At submission the grammar text is parsed on the caller's thread (a few milliseconds): a bad JSON
Schema, regex or EBNF is a ValueError there, naming the problem, and the request never runs. The
token-mask compilation, which depends on the tokenizer and can be slow for big grammars, runs in a
thread pool (DEEPINFER_SO_BUILDER_CPUS threads). Compiled grammars are cached per (tokenizer,
schema type, schema, whitespace setting), least recently used evicted past
DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES; concurrent requests for one schema share one compilation.
A request whose grammar has not compiled DEEPINFER_XGRAMMAR_TIMEOUT seconds after its submission is
refused (the compilation itself cannot be interrupted; its result still lands in the cache).
"""
from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from deepinfer_core.api.structured_outputs import SoArgs

from .tokenizer_info import tokenizer_info, tokenizer_key

_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")     # "[07:53:39] /project/cpp/x.cc:94: "


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ source location."""
    text = str(exc).strip().splitlines()
    first = _XGR_PREFIX.sub("", text[0]) if text else type(exc).__name__
    return first.replace("Check failed: (error.empty()) is false: ", "")


@dataclass(frozen=True)
class ServiceSettings:
    timeout_s: float = 20.0
    cache_limit_bytes: int = 10 << 30
    cache_enabled: bool = True
    builder_threads: int = 4
    json_max_whitespace: int = 16

    @classmethod
    def from_env(cls) -> "ServiceSettings":
        from deepinfer_core.envs import read_settings
        s = read_settings()
        return cls(float(s.xgrammar_timeout), s.xgrammar_cache_limit_bytes, not s.xgrammar_disable_cache,
                   s.so_builder_cpus, s.so_json_max_whitespace)


_NOT_SCHEMAS = ("enum", "const", "default", "examples")     # values that are data, not subschemas


def bounded_strings_fixed(schema: Any) -> Any:
    """xgrammar 0.2.9 compiles a length-bounded string ({"type": "string", "maxLength": n}) to raw
    characters that include TAB and the other control characters, which JSON forbids; its `pattern`
    path does it right. So such a string becomes the equivalent pattern of non-control characters
    (escapes stay excluded, as xgrammar's own bounded strings exclude them)."""
    if isinstance(schema, list):
        return [bounded_strings_fixed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS else bounded_strings_fixed(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if (out.get("type") == "string" and bounded
            and not any(k in out for k in ("pattern", "format", "enum", "const"))):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[^\\x00-\\x1f]{{{lo},{hi}}}$"
    return out


def parse_grammar(so: SoArgs, json_max_whitespace: int):
    """xgrammar's Grammar for so_args, or a ValueError naming what is wrong with the schema."""
    import xgrammar as xgr

    try:
        if so.schema_type == "json":
            # Strict mode (no properties or items beyond the schema's), as DS-DeepInfer compiles it.
            ws = ({"any_whitespace": True, "max_whitespace_cnt": json_max_whitespace}
                  if json_max_whitespace > 0 else {"any_whitespace": False})
            schema = json.dumps(bounded_strings_fixed(json.loads(so.schema)))
            return xgr.Grammar.from_json_schema(schema, strict_mode=True, **ws)
        if so.schema_type == "regex":
            return xgr.Grammar.from_regex(so.schema)
        return xgr.Grammar.from_ebnf(so.schema)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}[so.schema_type]
        raise ValueError(f"so_args: invalid {what}: {xgrammar_message(e)}") from None


class DaemonPool:
    """Daemon worker threads started on first use. An xgrammar compilation cannot be interrupted, and
    one still running past its timeout must not keep the interpreter from exiting, which a
    ThreadPoolExecutor (it joins its workers at exit) would do."""

    def __init__(self, threads: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads, self._name = threads, name
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        with self._lock:
            if not self._started:
                for i in range(self._threads):
                    threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True).start()
                self._started = True
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)


class GrammarService:
    """One per structured-outputs processor: the compile pool and the compiled-grammar cache."""

    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self._pool = DaemonPool(settings.builder_threads, "deepinfer-grammar")
        self._lock = threading.RLock()       # a done-callback may run inside submit()
        self._compilers: dict[tuple, Any] = {}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_bytes: dict[tuple, int] = {}
        self.num_compiles = 0                      # compilations started (tests, stats)

    def compiler(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None):
        import xgrammar as xgr

        key = tokenizer_key(tokenizer, vocab_size) + (eos_token_id,)
        with self._lock:
            comp = self._compilers.get(key)
        if comp is None:
            info = tokenizer_info(tokenizer, vocab_size, eos_token_id)
            # Our own cache sits in front (it also shares in-flight compilations); none inside.
            comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            with self._lock:
                comp = self._compilers.setdefault(key, comp)
        return comp

    def submit(self, so: SoArgs, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> Future:
        """The future compiled grammar for `so` (from the cache when it is there)."""
        key = (tokenizer_key(tokenizer, vocab_size), eos_token_id, so.cache_key, self.settings.json_max_whitespace)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
        grammar = parse_grammar(so, self.settings.json_max_whitespace)     # ValueError: refused now
        with self._lock:
            fut = self._cache.get(key)             # another thread may have started it meanwhile
            if fut is None:
                self.num_compiles += 1
                fut = self._pool.submit(self._compile, grammar, tokenizer, vocab_size, eos_token_id)
                if self.settings.cache_enabled:
                    self._cache[key] = fut
                    fut.add_done_callback(lambda f, k=key: self._settle(k, f))
        return fut

    def _compile(self, grammar: Any, tokenizer: Any, vocab_size: int, eos_token_id: int | None):
        return self.compiler(tokenizer, vocab_size, eos_token_id).compile_grammar(grammar)

    def _settle(self, key: tuple, fut: Future) -> None:
        """A compilation finished: keep it (evicting the least recently used past the limit), or
        forget a failed one so that a retry compiles again."""
        with self._lock:
            if fut.exception() is not None:
                self._cache.pop(key, None)
                return
            self._cache_bytes[key] = int(fut.result().memory_size_bytes)
            limit = self.settings.cache_limit_bytes
            for old in list(self._cache):
                if sum(self._cache_bytes.values()) <= limit:
                    break
                if old in self._cache_bytes:       # only finished entries are evicted
                    del self._cache[old]
                    del self._cache_bytes[old]

    @property
    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)


class GrammarConstraint:
    """One request's RequestConstraint: its (maybe still compiling) grammar and its deadline."""

    def __init__(self, processor: Any, so: SoArgs, future: Future, timeout_s: float):
        self.processor, self.so, self.future = processor, so, future
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

    def ready(self) -> bool:
        return self.future.done() and self.future.exception() is None

    def error(self) -> str | None:
        if self.future.done():
            exc = self.future.exception()
            return None if exc is None else f"so_args: grammar compilation failed: {xgrammar_message(exc)}"
        if time.monotonic() >= self.deadline:
            return (f"so_args: the grammar did not compile within {self.timeout_s:g} s "
                    f"(DEEPINFER_XGRAMMAR_TIMEOUT); simplify the schema or raise the timeout")
        return None

    def wait(self, timeout: float) -> None:
        remaining = self.deadline - time.monotonic()
        try:
            self.future.exception(timeout=max(0.0, min(timeout, remaining)))
        except FutureTimeout:
            pass

    def new_state(self, params: Any, eos_token_id: int | None):
        from .matcher_state import ConstraintState
        return ConstraintState(self.future.result(), self.so,
                               params.all_stop_token_ids(eos_token_id) | ({eos_token_id} - {None}))
