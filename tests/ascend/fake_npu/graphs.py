"""NPUGraph stand-in (aclgraph): `torch.npu.NPUGraph`, `torch.npu.graph(...)`,
`torch.npu.graph_pool_handle()`, `torch.npu.is_current_stream_capturing()`.

API as in Ascend/pytorch `torch_npu/npu/graphs.py` (spec §1.5): `NPUGraph()` (no `keep_graph`
argument, no `instantiate()`: the graph is ready at `capture_end`), `capture_begin(pool=None,
capture_error_mode="global"|"thread_local"|"relaxed")`, `capture_end()`, `replay()`, `reset()`,
`pool()`; `graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
capture_error_mode="global")`.

Design (alias mode, all tensors on the CPU):
* Capture runs the captured code eagerly once (unlike a real capture, so the static outputs hold
  the values of that first run) under a `TorchDispatchMode` that records every aten op with its
  argument and result tensors (by identity).
* `replay()` re-executes the recorded aten ops in order on the same tensor objects: in-place ops
  mutate their buffers again, out-of-place results are copied into the tensors captured as their
  outputs. So the graph reads whatever was copied into the static inputs since, and writes the
  static outputs, exactly like a replayed device graph; Python code is not re-run (host-side
  branches and scalars are baked in, as on the device).
* While capturing, host synchronisation raises `HostSyncError`: `aten._local_scalar_dense`
  (`.item()`, `bool(t)`, `int(t)`, `float(t)`), `Tensor.tolist/.cpu/.numpy`, `.to("cpu")`,
  `torch.npu.synchronize()`, `Event.synchronize()`; so do data-dependent-shape ops
  (`nonzero`, `masked_select`, `unique`), which a static graph cannot hold.
* A fake `torch_npu.npu_<op>` is one fused kernel on the device: its result depends on the
  current contents of its inputs, and whatever its plain-PyTorch reference does inside (host
  reads of lengths, data-dependent shapes) is the kernel's own business. So a fake op called
  during capture (`fused`) runs its validator and reference once with recording and the host-sync
  checks paused, and goes on the tape as ONE opaque node; replay re-runs the reference on the
  same argument tensors (their values then) and copies its results into the tensors captured as
  its outputs (the shapes must not change: an op whose output shape follows its input values
  cannot be captured, and replay says so).
"""
from __future__ import annotations

import contextlib
import itertools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .device import HostSyncError

_SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                 "__index__"}
_FORBIDDEN_ATEN = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                   "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                   "aten::unique_consecutive")
_ERROR_MODES = ("global", "thread_local", "relaxed")
_pools = itertools.count(1)


class _HostSyncGuard(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS:
            raise HostSyncError(f"Tensor.{name}() is a host sync: not allowed during NPUGraph "
                                "capture")
        if name == "to":
            dev = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu":
                raise HostSyncError("Tensor.to('cpu') during NPUGraph capture")
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, tape):
        super().__init__()
        self.tape = tape
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func._schema.name in _FORBIDDEN_ATEN:
            raise HostSyncError(f"{func._schema.name} during NPUGraph capture (a host sync or "
                                "a data-dependent shape)")
        out = func(*args, **kwargs)
        self.tape.append(_AtenNode(func, args, kwargs, out))
        return out


def _copy_results(name: str, old, new) -> None:
    """Write a re-run's results into the tensors the capture handed on (unless they alias)."""
    for old_t, new_t in zip(tree_flatten(old)[0], tree_flatten(new)[0]):
        if not isinstance(old_t, torch.Tensor) or old_t is new_t:
            continue
        if old_t.shape != new_t.shape:
            raise RuntimeError(f"NPUGraph.replay: {name} returned shape {tuple(new_t.shape)}, "
                               f"captured {tuple(old_t.shape)} (a data-dependent shape cannot be "
                               "replayed)")
        if old_t.data_ptr() != new_t.data_ptr():
            old_t.copy_(new_t)


class _AtenNode:
    """One recorded aten op: re-run on the same argument tensors."""

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out
        self.name = func._schema.name

    def replay(self):
        _copy_results(self.name, self.out, self.func(*self.args, **self.kwargs))


class _FusedNode:
    """One fused fake op: its reference re-run as a single opaque kernel."""

    def __init__(self, name, run, out):
        self.name, self.run, self.out = name, run, out

    def replay(self):
        _copy_results(self.name, self.out, self.run())


class NPUGraph:
    """Records the aten ops of a capture and replays them on the same tensors."""

    def __init__(self, state):
        self._state = state
        self._tape: list = []
        self._modes: list = []
        self._pool = None
        self._ready = False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if capture_error_mode not in _ERROR_MODES:
            raise ValueError(f"NPUGraph.capture_begin: capture_error_mode "
                             f"{capture_error_mode!r} not in {_ERROR_MODES}")
        if self._state.capturing:
            raise RuntimeError("NPUGraph.capture_begin: a capture is already under way")
        if self._ready:
            raise RuntimeError("NPUGraph.capture_begin: this graph holds a capture; reset() it")
        self._pool = pool if pool is not None else (next(_pools),)
        self._tape = []
        self._modes = [_HostSyncGuard(), _Recorder(self._tape)]
        for m in self._modes:
            m.__enter__()
        self._state.capturing = True
        _capturing[id(self._state)] = self
        self._state.record("NPUGraph.capture_begin", self._pool, capture_error_mode)

    def capture_end(self):
        if not self._modes:
            raise RuntimeError("NPUGraph.capture_end without capture_begin")
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        self._modes = []
        self._state.capturing = False
        _capturing.pop(id(self._state), None)
        self._ready = True
        self._state.record("NPUGraph.capture_end", len(self._tape))

    def replay(self):
        if not self._ready:
            raise RuntimeError("NPUGraph.replay: nothing captured")
        self._state.record("NPUGraph.replay", len(self._tape))
        with torch.no_grad():
            for node in self._tape:
                node.replay()

    @contextlib.contextmanager
    def _paused(self):
        """Neither record nor check host syncs (a fused op's own work, see `fused`)."""
        for m in self._modes:
            m.paused = True
        try:
            yield
        finally:
            for m in self._modes:
                m.paused = False

    def _fused(self, name, run):
        with self._paused():
            out = run()
        self._tape.append(_FusedNode(name, run, out))
        return out

    def reset(self):
        self._tape, self._ready = [], False

    def pool(self):
        return self._pool

    @property
    def num_recorded_ops(self) -> int:
        return len(self._tape)

    @property
    def fused_ops(self) -> list[str]:
        """The fused fake ops on the tape, in order (each one opaque node)."""
        return [n.name for n in self._tape if isinstance(n, _FusedNode)]


_capturing: dict[int, NPUGraph] = {}     # id(DeviceState) -> the graph capturing on it


def fused(state, name: str, check, run):
    """Call a fused fake op on the device `state`: `check()` (its validator) then `run()` (its
    reference). Outside capture both simply run. During capture both run once with recording and
    host-sync checks paused, and `run` goes on the tape as one node that replay re-runs."""
    graph = _capturing.get(id(state))
    if graph is None:
        check()
        return run()
    with graph._paused():
        check()
    return graph._fused(name, run)


def install_graph_api(npu_module, state):
    """Add NPUGraph, graph(), graph_pool_handle(), is_current_stream_capturing() to `npu_module`."""

    class _BoundNPUGraph(NPUGraph):
        __doc__ = NPUGraph.__doc__

        def __init__(self):
            super().__init__(state)

    @contextlib.contextmanager
    def graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
              capture_error_mode="global"):
        state.record("graph.enter", getattr(stream, "npu_stream", None), auto_dispatch_capture)
        ctx = npu_module.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            npu_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                yield npu_graph
            finally:
                npu_graph.capture_end()

    npu_module.NPUGraph = _BoundNPUGraph
    npu_module.graph = graph
    npu_module.graph_pool_handle = lambda: (next(_pools),)
    npu_module.is_current_stream_capturing = lambda: state.capturing
