"""Which Triton kernels this process compiles, when, and which argument made a new variant.

Triton compiles a kernel once per specialisation of its arguments: each integer is specialised on
whether it is divisible by 16 (and whether it equals 1), each pointer on whether it is 16-byte
aligned, each constexpr on its value. An argument that follows the batch (a token count, a stride
of a per-batch tensor, a pointer into a packed buffer) makes new variants appear in the middle of
serving, seconds each; the engine's warm-up cannot cover every combination. The kernels therefore
mark batch-dependent integers `do_not_specialize` and the metadata buffers keep their parts
aligned. This watch checks that: `mark()` after the warm-up, run a workload, `since(mark)` must be
empty; each event names the arguments in which it differs from the closest earlier variant. The
engine's warm-up runs inside `expecting()` (through the nvidia attention backend's
`compiles_expected`); once a warm-up has finished, a compile outside one is logged as a warning.

    from deepinfer_kernels.compile_watch import compile_watch
    watch = compile_watch()          # installs Triton's JIT hooks once per process
    start = watch.mark()
    ...
    for event in watch.since(start): print(event)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class CompileEvent:
    kernel: str
    args: dict[str, str]               # parameter -> "i32", "i32 %16", "*bf16 aligned", "=3" (constexpr)
    seconds: float = 0.0
    differs: dict[str, str] = field(default_factory=dict)   # vs the closest earlier variant: "old -> new"
    expected: bool = True              # before any warm-up finished, or inside one (`expecting`)

    def __str__(self) -> str:
        what = ", ".join(f"{k}: {v}" for k, v in self.differs.items()) or "first variant"
        return f"{self.kernel} compiled in {self.seconds:.2f} s ({what})"


def describe_args(compile_info: dict) -> dict[str, str]:
    """Per parameter, its type and specialisation, from the keyword arguments of Triton's JIT hook."""
    attrs = (compile_info.get("configs") or [{}])[0]
    constants = compile_info.get("constants") or {}
    out = {}
    for i, (name, ty) in enumerate(compile_info["signature"].items()):
        if ty == "constexpr":
            out[name] = f"={constants.get((i,), '?')}"
            continue
        marks = {a[0] for a in attrs.get((i,), [])}
        if "tt.divisibility" in marks:
            ty += " aligned" if ty.startswith("*") else " %16"
        out[name] = ty
    return out


class CompileWatch:
    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self._started: dict[str, float] = {}
        self._expected = 0            # warm-ups in progress
        self.armed = False            # a warm-up has finished: later compiles stall requests

    def install(self) -> None:
        from triton import knobs
        pre, post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook   # chained, kept

        def before(**kw):
            self._on_start(kw)
            return pre(**kw) if pre is not None else False

        def after(**kw):
            self._on_end(kw)
            return post(**kw) if post is not None else False

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after

    @contextmanager
    def expecting(self) -> Iterator[None]:
        """Compiles inside are expected (an engine's warm-up); afterwards the watch is armed."""
        self._expected += 1
        try:
            yield
        finally:
            self._expected -= 1
            self.armed = True

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> list[CompileEvent]:
        return self.events[mark:]

    def _on_start(self, kw: dict) -> None:
        name = kw["fn"].name
        args = describe_args(kw["compile"])
        earlier = [e.args for e in self.events if e.kernel == name]
        event = CompileEvent(name, args, expected=not self.armed or self._expected > 0)
        if earlier:
            closest = min(earlier, key=lambda a: sum(a.get(k) != v for k, v in args.items()))
            event.differs = {k: f"{closest.get(k)} -> {v}" for k, v in args.items() if closest.get(k) != v}
        self.events.append(event)
        self._started[kw["key"]] = time.perf_counter()

    def _on_end(self, kw: dict) -> None:
        t0 = self._started.pop(kw["key"], None)
        if t0 is not None:
            event = next(e for e in reversed(self.events) if e.kernel == kw["fn"].name)
            event.seconds = time.perf_counter() - t0
            if not event.expected:
                log.warning("%s after the engine's warm-up: the requests of this step waited for it (a "
                            "kernel argument that follows the batch; please report it)", event)
            else:
                log.debug("%s", event)


_WATCH: CompileWatch | None = None


def compile_watch() -> CompileWatch:
    """The process's watch, its hooks installed on first use."""
    global _WATCH
    if _WATCH is None:
        _WATCH = CompileWatch()
        _WATCH.install()
    return _WATCH
