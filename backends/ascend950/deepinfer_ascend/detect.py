"""Import-light facts about this machine for the Ascend backend: run in every process (platform
detection, `deepinfer plugins`), so they look at device nodes, the environment and installed
distributions only -- never `import torch_npu` (which needs CANN, spec: torch_npu fails to import
without it) and never initialise ACL.
"""
from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os

NPU_PROBE_PATHS = ("/dev/davinci0",)     # the first NPU's device node (the driver creates it)
TORCH_NPU_DIST = "torch-npu"
# Where CANN's set_env.sh points; only read to word the listing's hint, never to decide anything.
CANN_HOME_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_DEFAULT_HOME = "/usr/local/Ascend/ascend-toolkit/latest"


def npu_present(probe_paths: tuple[str, ...] = NPU_PROBE_PATHS) -> bool:
    return any(os.path.exists(p) for p in probe_paths)


def torch_npu_version() -> str | None:
    """The installed torch-npu distribution's version, or None (read from its metadata)."""
    try:
        return metadata.version(TORCH_NPU_DIST)
    except metadata.PackageNotFoundError:
        return None


def torch_npu_importable() -> bool:
    """Whether `import torch_npu` would find a module (without importing it)."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):      # a None or spec-less entry in sys.modules
        return False


def cann_home(environ=os.environ) -> str | None:
    for var in CANN_HOME_VARS:
        if environ.get(var):
            return environ[var]
    return CANN_DEFAULT_HOME if os.path.isdir(CANN_DEFAULT_HOME) else None


def machine_summary(probe_paths: tuple[str, ...] = NPU_PROBE_PATHS, environ=os.environ) -> str:
    """One clause for `deepinfer plugins`: why this backend can or cannot be active here."""
    missing = []
    if not npu_present(probe_paths):
        missing.append(f"no Ascend NPU ({', '.join(probe_paths)} absent)")
    if not torch_npu_importable():
        missing.append("torch_npu not installed (pip install 'deepinfer-ascend[npu]')")
    if cann_home(environ) is None:
        missing.append("no CANN toolkit found (source CANN's set_env.sh)")
    if missing:
        return "not usable here: " + "; ".join(missing)
    version = torch_npu_version()
    return "usable here: NPU, torch_npu" + (f" {version}" if version else "") + " and CANN present"
