"""A simulated Ascend device for CPU tests: a fake `torch_npu`, installed only inside tests.

Contract of the fixtures in `tests/ascend/conftest.py`
------------------------------------------------------
* `fake_npu` (function scope) installs the fake for one test and yields the `FakeNpu` handle;
  default SoC 260 (Ascend 950 = A5). Choose another SoC with
  `@pytest.mark.parametrize("fake_npu", [223, 253, 260], indirect=True)`.
  `make_fake_npu(soc_version=260, device_count=1, mem_info=(free, total))` is the factory form
  (one installed fake at a time; whatever it installed is removed at teardown).
* Installed while active (and removed again on teardown, earlier entries restored):
  `sys.modules["torch_npu"]`, `["torch_npu.npu"]`, `["torch_npu.contrib"]`, `["torch_npu._C"]`,
  `["torch_npu._C._distributed_c10d"]`, `["torch.npu"]`, the attribute `torch.npu` (is the fake
  `torch_npu.npu`, as `torch._register_device_module("npu", ...)` makes it for the real one) and
  `torch.distributed.is_hccl_available` (-> True). `import torch_npu.contrib.transfer_to_npu`
  works and sets `fake.state.transfer_to_npu_imported` (it rewrites nothing).
* `torch_npu.npu`: is_available (True), device_count, set_device, current_device, synchronize,
  get_device_name, get_soc_version (-> the SoC int), get_device_capability (None unless
  TORCH_NPU_DEVICE_CAPABILITY="maj.min"), mem_get_info (-> the configured (free, total)),
  Stream (`.npu_stream` handle) / Event / ExternalEvent / current_stream / set_stream /
  `stream(s)` context as recording no-ops (log: `fake.state.log`), memory_allocated & co. (0),
  empty_cache, `config.allow_internal_format` (False until set), `set_compile_mode(jit_compile=)`.
  NPUGraph / graph() / graph_pool_handle() / is_current_stream_capturing(): graphs.py (capture
  runs eagerly and records aten ops; replay re-runs them on the same tensors; host syncs during
  capture raise HostSyncError; a fake `npu_<op>` called in capture is ONE opaque node whose
  reference each replay re-runs on its inputs' current values, host reads inside it allowed).
* The `hccl` process-group backend (hccl.py): gloo under HCCL's name, registered for device
  type cpu while installed, so `init_process_group("hccl", pg_options=ProcessGroupHCCL.Options())`
  works; each spawned worker must install the fake (e.g. `fake_npu.install()`) itself.
* `torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()`: a plain options object.
* dtype codes as module attributes: `torch_npu.float4_e2m1fn_x2 = 296`, `hifloat8 = 290`,
  `float8_e8m0fnu = 293`, `int4 = 285`, `float4_e1m2fn_x2 = 297` (ints, as the wheel's meta
  registrations compare them; the real objects' types are unconfirmed). Native torch dtypes
  passed for `int` schema arguments become their ScalarType codes (bfloat16 -> 15, fp8 e4m3 -> 24).
* Alias mode only: there is no `npu` device. Tensors stay on the CPU, the backend's platform must
  report device `cpu`, and every fake op takes CPU tensors. `Tensor.npu()` is not added and
  `torch.ops.npu.*` is not faked: call the ops as `torch_npu.npu_<op>(...)`.
* Ops (`torch_npu.npu_<op>`): each binds its arguments against the torch_npu 2.13.0 wheel's schema
  string (`schemas.py`; TypeError on a wrong keyword / extra positional / wrong type), checks the
  documented constraints for the installed SoC (ValueError "npu_<op>: <arg> <what>; documented:
  <rule>"), records the call, then returns a plain-PyTorch reference of the documented result.
  Which ops exist: `sorted(fake_npu.OPS)`; an op not implemented is absent (AttributeError).
  Implemented: npu_rms_norm, npu_add_rms_norm, npu_rotary_mul (ops_norm_rope.py);
  npu_dynamic_mx_quant (FP8), npu_quant_matmul (MXFP8 form only) (ops_quant.py);
  npu_lightning_indexer, npu_sparse_flash_attention (ops_attention.py); npu_mhc_pre,
  npu_mhc_sinkhorn, npu_mhc_post (ops_mhc.py); npu_top_k_top_p, npu_scatter_nd_update_
  (ops_misc.py); npu_moe_gating_top_k (softmax / sigmoid, groups, hash mode),
  npu_moe_init_routing_v2 (quant_mode -1, dropless), npu_moe_token_unpermute (padded_mode
  False; index convention [UNCONFIRMED], see the module) (ops_moe.py); npu_grouped_matmul
  (group_type 0, one output tensor: bf16/fp16/fp32, A5 W8A8 MXFP8 and W4A8 MXFP) (ops_gmm.py,
  imported by ops_moe.py).
  A form of an implemented op that the fake does not model raises NotImplementedError.
* Recorder: `torch_npu._calls` (== `fake.calls`) is a list of `(op name, bound arguments dict)`
  with defaults filled in and dtype arguments as int codes.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch
import torch.distributed as dist

from . import schema
from .device import DeviceState, HostSyncError, build_npu_module
from .graphs import install_graph_api
from .hccl import register_hccl_backend
from .schema import OPS
from .schemas import WHEEL_VERSION

DTYPE_CODES = {"int4": schema.INT4, "hifloat8": schema.HIFLOAT8,
               "float8_e8m0fnu": schema.FLOAT8_E8M0FNU,
               "float4_e2m1fn_x2": schema.FLOAT4_E2M1FN_X2,
               "float4_e1m2fn_x2": schema.FLOAT4_E1M2FN_X2}
SOC_A5, SOC_A2, SOC_A3 = 260, 223, 253
_MODULES = ("torch_npu", "torch_npu.npu", "torch_npu.contrib", "torch_npu._C",
            "torch_npu._C._distributed_c10d", "torch_npu.contrib.transfer_to_npu", "torch.npu")
_MISSING = object()


def _load_ops():
    from . import ops_norm_rope  # noqa: F401  (each module registers its ops in OPS)
    for name in ("ops_quant", "ops_moe", "ops_attention", "ops_mhc", "ops_misc"):
        try:
            __import__(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise


class _TransferToNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `import torch_npu.contrib.transfer_to_npu` and records that it happened."""

    name = "torch_npu.contrib.transfer_to_npu"

    def __init__(self, state: DeviceState):
        self.state = state

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.state.transfer_to_npu_imported = True
        self.state.record("import transfer_to_npu")


class ProcessGroupHCCLOptions:
    """Stand-in for `ProcessGroupHCCL.Options`: accepts and keeps any attribute."""

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream
        self.hccl_config = {}
        self.global_ranks_in_group = []
        self.group_id = ""


class FakeNpu:
    """One installed fake; `uninstall()` restores everything it changed."""

    def __init__(self, soc_version=SOC_A5, device_count=1, mem_info=(48 << 30, 64 << 30)):
        self.soc_version = soc_version
        self.state = DeviceState(soc_version=soc_version, device_count=device_count,
                                 mem_info=tuple(mem_info))
        self.calls: list = []
        self.npu = build_npu_module(self.state)
        install_graph_api(self.npu, self.state)
        self.module = self._build_torch_npu()
        self._saved: dict = {}
        self._finder = _TransferToNpuFinder(self.state)
        self.installed = False

    def _build_torch_npu(self) -> types.ModuleType:
        m = types.ModuleType("torch_npu")
        m.__doc__ = __doc__
        m.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, is_package=True)
        m.__path__ = []
        m.__version__ = WHEEL_VERSION
        m.npu = self.npu
        m._calls = self.calls
        m._fake = self
        for k, v in DTYPE_CODES.items():
            setattr(m, k, v)
        for name, op in OPS.items():
            setattr(m, name, op)
        contrib = types.ModuleType("torch_npu.contrib")
        contrib.__path__ = []
        contrib.__spec__ = importlib.machinery.ModuleSpec("torch_npu.contrib", None,
                                                          is_package=True)
        m.contrib = contrib
        c = types.ModuleType("torch_npu._C")
        c.__path__ = []
        c10d = types.ModuleType("torch_npu._C._distributed_c10d")
        c10d.ProcessGroupHCCL = type("ProcessGroupHCCL", (), {"Options": ProcessGroupHCCLOptions})
        c._distributed_c10d = c10d
        m._C = c
        self.npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None)
        self._mods = {"torch_npu": m, "torch_npu.npu": self.npu, "torch_npu.contrib": contrib,
                      "torch_npu._C": c, "torch_npu._C._distributed_c10d": c10d,
                      "torch.npu": self.npu}
        return m

    def install(self) -> FakeNpu:
        if schema._active is not None:
            raise RuntimeError("a fake torch_npu is already installed")
        for name in _MODULES:
            self._saved[name] = sys.modules.pop(name, _MISSING)
        sys.modules.update(self._mods)
        self._saved["attr:torch.npu"] = getattr(torch, "npu", _MISSING)
        torch.npu = self.npu
        self._saved["attr:is_hccl_available"] = getattr(dist, "is_hccl_available", _MISSING)
        dist.is_hccl_available = lambda: True
        sys.meta_path.insert(0, self._finder)
        self._undo_hccl = register_hccl_backend()
        schema._active = self
        self.installed = True
        return self

    def uninstall(self) -> None:
        if not self.installed:
            return
        sys.meta_path.remove(self._finder)
        self._undo_hccl()
        for name in _MODULES:
            sys.modules.pop(name, None)
            saved = self._saved.pop(name)
            if saved is not _MISSING:
                sys.modules[name] = saved
        for attr, owner, key in (("npu", torch, "attr:torch.npu"),
                                 ("is_hccl_available", dist, "attr:is_hccl_available")):
            saved = self._saved.pop(key)
            if saved is _MISSING:
                if hasattr(owner, attr):
                    delattr(owner, attr)
            else:
                setattr(owner, attr, saved)
        schema._active = None
        self.installed = False


def install(soc_version=SOC_A5, device_count=1, mem_info=(48 << 30, 64 << 30)) -> FakeNpu:
    """Install a fake torch_npu now; call `.uninstall()` on the result to remove it."""
    return FakeNpu(soc_version, device_count, mem_info).install()


_load_ops()

__all__ = ["DTYPE_CODES", "FakeNpu", "HostSyncError", "OPS", "install", "SOC_A5", "SOC_A2",
           "SOC_A3"]
