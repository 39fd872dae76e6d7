"""The simulated torch_npu in spawned rank processes (the data-parallel engine's ranks), for the
Ascend expert-parallel test.

A rank is a fresh interpreter: the test process's fake (installed by a fixture) is not there. It
gets one the way a rank on an Ascend host gets the real torch_npu: torch imports device extensions
listed under the `torch.backends` entry-point group when it is imported itself (its device-backend
autoload). `write_site(folder, env)` writes a temporary site folder with that entry point (and the
backend's `deepinfer.backends` one, unless deepinfer-ascend is installed); the test puts it on
sys.path, which spawn hands to every child, and sets the `ENV` variable to the rank settings. In a
rank, `autoload` (the entry point) then installs the fake in alias mode: the fake torch_npu, hccl as
the default backend of the alias device (the CPU; `fake_npu.hccl.hccl_for_cpu`), the backend's
runtime on device type cpu with the given NPU device node. The production code takes none of this
into account: the hook is torch's.

A rank records what only it can see when it exits (`atexit`): the hccl groups it created and the
operators the fake ran, in `<records>/rank-<pid>.json`; `read_records` collects them.
"""
from __future__ import annotations

import atexit
import json
import os
from collections import Counter
from importlib import metadata
from pathlib import Path

ENV = "FAKE_NPU_RANK_SETTINGS"       # JSON: {"soc", "devices", "node", "records"}


def write_site(folder: Path, settings: dict) -> tuple[Path, str]:
    """(the site folder to put on sys.path, the value of `ENV` for the ranks)."""
    folder.mkdir(parents=True, exist_ok=True)
    dists = {"fake_torch_npu_autoload": "[torch.backends]\nfake_npu = ep_npu_ranks:autoload\n"}
    try:
        metadata.distribution("deepinfer-ascend")
    except metadata.PackageNotFoundError:
        dists["deepinfer_ascend"] = "[deepinfer.backends]\nascend = deepinfer_ascend.plugin\n"
    for name, entry_points in dists.items():
        info = folder / f"{name}-0.1.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\n"
                                       "Version: 0.1.0\n")
        (info / "entry_points.txt").write_text(entry_points)
    return folder, json.dumps(settings)


def autoload() -> None:
    """torch's device-backend autoload calls this while a process imports torch: a no-op unless
    `ENV` is set (then this process is an NPU rank of the test)."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    settings = json.loads(raw)
    import fake_npu
    from fake_npu import hccl
    fake = fake_npu.install(settings["soc"], settings["devices"])
    hccl.hccl_for_cpu()
    from deepinfer_ascend import plugin, runtime
    runtime.DEVICE_TYPE = "cpu"                      # alias mode: the NPU's tensors are CPU tensors
    plugin.PROBE_PATHS = (settings["node"],)
    atexit.register(_record, fake, hccl.created, Path(settings["records"]))


def _record(fake, created: list, folder: Path) -> None:
    grouped = [args for name, args in fake.calls if name == "npu_grouped_matmul"]
    record = {"hccl_groups": [[rank, size] for rank, size, _ in created],
              "ops": Counter(name for name, _ in fake.calls),
              "gmm_groups": sorted({int(args["weight"][0].shape[0]) for args in grouped})}
    tmp = folder / f"rank-{os.getpid()}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(folder / f"rank-{os.getpid()}.json")


def read_records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]
