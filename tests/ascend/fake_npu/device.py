"""The fake `torch_npu.npu` device module (alias mode: every tensor stays on the CPU).

Follows Ascend/pytorch `torch_npu/npu/__init__.py` / `memory.py` as summarised in the repository's
Ascend notes: device queries, streams, events, memory, `config.allow_internal_format`,
`set_compile_mode`. Streams and events are recording no-ops: each call appends
`(name, args)` to `DeviceState.log`. `get_soc_version()` returns the configured SoC integer
(220-225 Atlas A2, 250-255 Atlas A3, 260 Ascend 950 = A5).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import types
from dataclasses import dataclass, field

_DEVICE_NAMES = {260: "Ascend950PR", 223: "Ascend910B3", 253: "Ascend910_9392"}


class HostSyncError(RuntimeError):
    """A host synchronisation attempted while a fake NPUGraph is capturing."""


@dataclass
class DeviceState:
    soc_version: int = 260
    device_count: int = 1
    mem_info: tuple[int, int] = (48 << 30, 64 << 30)        # (free, total) bytes
    current_device: int = 0
    log: list = field(default_factory=list)                 # (name, args) of device-API calls
    capturing: bool = False                                  # set by graphs.py during capture
    transfer_to_npu_imported: bool = False
    compile_mode: dict = field(default_factory=dict)

    def record(self, name, *args, **kwargs):
        self.log.append((name, args, kwargs))


_handles = itertools.count(0x1000)


def build_npu_module(state: DeviceState) -> types.ModuleType:
    """A fresh `torch_npu.npu` module bound to `state`."""
    m = types.ModuleType("torch_npu.npu")
    m.__doc__ = "fake torch_npu.npu (tests/ascend/fake_npu/device.py)"
    m._state = state

    def is_available():
        return True

    def device_count():
        return state.device_count

    def _check_device(device):
        idx = device.index if hasattr(device, "index") else device
        if isinstance(idx, str):
            idx = int(idx.split(":")[1]) if ":" in idx else 0
        idx = 0 if idx is None else int(idx)
        if not 0 <= idx < state.device_count:
            raise RuntimeError(f"torch.npu: invalid device ordinal {idx} "
                               f"(device_count={state.device_count})")
        return idx

    def set_device(device):
        state.current_device = _check_device(device)
        state.record("set_device", state.current_device)

    def current_device():
        return state.current_device

    def synchronize(device=None):
        if state.capturing:
            raise HostSyncError("torch.npu.synchronize() called during NPUGraph capture")
        state.record("synchronize", device)

    def get_device_name(device=None):
        return _DEVICE_NAMES.get(state.soc_version, f"Ascend(soc={state.soc_version})")

    def get_soc_version():
        return state.soc_version

    def get_device_capability(device=None):
        cap = os.environ.get("TORCH_NPU_DEVICE_CAPABILITY")
        if not cap:
            return None
        major, minor = cap.split(".")
        return int(major), int(minor)

    def mem_get_info(device=None):
        return tuple(state.mem_info)

    class Stream:
        """Recording no-op stream; `.npu_stream` is a fake raw handle."""

        def __init__(self, device=None, priority=0, **kwargs):
            self.device = device
            self.priority = priority
            self.npu_stream = next(_handles)
            state.record("Stream", self.npu_stream)

        def wait_stream(self, other):
            state.record("Stream.wait_stream", self.npu_stream, other.npu_stream)

        def wait_event(self, event):
            state.record("Stream.wait_event", self.npu_stream, event)

        def record_event(self, event=None):
            event = event or Event()
            event.record(self)
            return event

        def synchronize(self):
            synchronize()

        def query(self):
            return True

        def __eq__(self, other):
            return isinstance(other, Stream) and other.npu_stream == self.npu_stream

        def __hash__(self):
            return hash(self.npu_stream)

    class Event:
        """Recording no-op event (`enable_timing` accepted; elapsed_time returns 0.0)."""

        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            self.enable_timing = enable_timing

        def record(self, stream=None):
            state.record("Event.record", id(self), getattr(stream, "npu_stream", None))

        def wait(self, stream=None):
            state.record("Event.wait", id(self), getattr(stream, "npu_stream", None))

        def synchronize(self):
            if state.capturing:
                raise HostSyncError("Event.synchronize() called during NPUGraph capture")

        def query(self):
            return True

        def elapsed_time(self, end_event):
            return 0.0

    class ExternalEvent(Event):
        def reset(self, stream=None):
            state.record("ExternalEvent.reset", id(self), getattr(stream, "npu_stream", None))

    default_stream = Stream()
    current = {"stream": default_stream}

    def current_stream(device=None):
        return current["stream"]

    def default_stream_fn(device=None):
        return default_stream

    def set_stream(stream):
        current["stream"] = stream
        state.record("set_stream", stream.npu_stream)

    @contextlib.contextmanager
    def stream(s):
        prev = current["stream"]
        if s is not None:
            current["stream"] = s
        state.record("stream.enter", getattr(s, "npu_stream", None))
        try:
            yield s
        finally:
            current["stream"] = prev
            state.record("stream.exit", getattr(s, "npu_stream", None))

    def set_compile_mode(jit_compile=True):
        state.compile_mode["jit_compile"] = jit_compile
        state.record("set_compile_mode", jit_compile=jit_compile)

    def _zero(device=None):
        return 0

    def _noop(*args, **kwargs):
        return None

    m.config = types.SimpleNamespace(allow_internal_format=False)
    for fn in (is_available, device_count, set_device, current_device, synchronize,
               get_device_name, get_soc_version, get_device_capability, mem_get_info,
               current_stream, set_stream, stream, set_compile_mode):
        setattr(m, fn.__name__, fn)
    m.default_stream = default_stream_fn
    m.Stream, m.Event, m.ExternalEvent = Stream, Event, ExternalEvent
    m.is_initialized = is_available
    m.init = _noop
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(m, name, _zero)
    m.memory_stats = lambda device=None: {}
    m.empty_cache = _noop
    m.reset_peak_memory_stats = _noop
    m.set_per_process_memory_fraction = _noop
    m.HostSyncError = HostSyncError
    return m
