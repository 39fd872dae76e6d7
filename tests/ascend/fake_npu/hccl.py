"""The `hccl` process-group backend stand-in: gloo under HCCL's name, for CPU tests.

torch_npu registers `hccl` for device type `npu` (spec §1.2, §1.6); in alias mode tensors are on
the CPU, so the fake registers `hccl` for device type `cpu` through
`torch.distributed.Backend.register_backend("hccl", creator, extended_api=True, devices=["cpu"])`.
The creator receives (DistributedBackendOptions, pg_options) and returns a `ProcessGroupGloo` on
the same store, rank and size: `init_process_group("hccl", pg_options=ProcessGroupHCCL.Options())`
and the collectives then run on gloo. `pg_options` must be None or the fake
`ProcessGroupHCCL.Options` (a TypeError otherwise, as a real backend would reject foreign options).
Every group created is appended to `created` as (rank, size, pg_options).

torch keeps gloo as device type cpu's default backend whatever is registered, so the core's
`device_backend("cpu")` stays gloo while the fake is installed. A process that plays an NPU rank
(alias mode: its tensors, the NPU's, are CPU tensors) calls `hccl_for_cpu()`: hccl becomes cpu's
default, as the real torch_npu makes it npu's (`default_device_backend_map["npu"] = "hccl"`).
"""
from __future__ import annotations

import copy

import torch.distributed as dist

created: list = []


def _create_hccl(dist_opts, pg_options):
    from . import ProcessGroupHCCLOptions
    if pg_options is not None and not isinstance(pg_options, ProcessGroupHCCLOptions):
        raise TypeError(f"hccl backend: pg_options must be ProcessGroupHCCL.Options, "
                        f"not {type(pg_options).__name__}")
    created.append((dist_opts.group_rank, dist_opts.group_size, pg_options))
    return dist.ProcessGroupGloo(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                                 dist_opts.timeout)


def register_hccl_backend():
    """Register `hccl`; returns a function that restores the Backend registry as it was."""
    B = dist.Backend
    saved = {"attr": getattr(B, "HCCL", None), "list": list(B.backend_list),
             "device_map": dict(B.default_device_backend_map),
             "type_map": dict(B.backend_type_map), "capability": dict(B.backend_capability),
             "plugins": copy.copy(B._plugins)}
    B.register_backend("hccl", _create_hccl, extended_api=True, devices=["cpu"])

    def undo():
        if saved["attr"] is None:
            if hasattr(B, "HCCL"):
                delattr(B, "HCCL")
        else:
            B.HCCL = saved["attr"]
        B.backend_list[:] = saved["list"]
        for name, d in (("device_map", B.default_device_backend_map),
                        ("type_map", B.backend_type_map), ("capability", B.backend_capability),
                        ("plugins", B._plugins)):
            d.clear()
            d.update(saved[name])

    return undo


def hccl_for_cpu():
    """Make hccl device type cpu's default backend (an alias-mode NPU rank; the fake must be
    installed); returns a function that restores gloo."""
    B = dist.Backend
    if "hccl" not in B.backend_list:
        raise RuntimeError("hccl_for_cpu: hccl is not registered (install the fake first)")
    saved = B.default_device_backend_map.get("cpu")
    B.default_device_backend_map["cpu"] = "hccl"

    def undo():
        B.default_device_backend_map["cpu"] = saved

    return undo
