"""Start-up of the Ascend backend, once per process when the `ascend` platform is chosen (the
plugin's `deepinfer_configure`): environment defaults, `import torch_npu`, the SoC.

1. Environment defaults (`ENV_DEFAULTS`) with `os.environ.setdefault` *before* torch_npu is
   imported (it and CANN read them at import / runtime init); a value the user set is kept and
   logged, never overwritten.
2. `import torch_npu`. Every failure becomes one line naming what is missing -- torch_npu not
   installed, CANN (the `lib*.so` the loader could not open), or the torch build pairing (a CUDA
   torch, or a torch minor version other than torch_npu's) -- raised as the core's `PlatformError`
   without a chained traceback.
3. The SoC (`torch_npu.npu.get_soc_version()`, soc.py); an unknown one is refused.

The documented pairing (the one DeepSeek pins): torch 2.13.0 CPU build + torch_npu 2.13.0 + CANN 9.2
(`pip install 'deepinfer-ascend[npu]'`). Never run on Ascend hardware: the error texts of the real
torch_npu are those reported for 2.13.0 / 2.14.0 without CANN, not observed here.

`DEVICE_TYPE` is the one seam between the real NPU and the CPU tests: the torch device type the
backend's ops run on ("npu"). The tests' fake torch_npu keeps tensors on the CPU (alias mode) and
sets it to "cpu" before start-up; nothing else in the backend knows it is being tested.
"""
from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from deepinfer_core.plugins import PlatformError

from . import detect
from .soc import Soc, classify_soc

log = logging.getLogger("deepinfer.ascend")

DEVICE_TYPE = "npu"
TORCH_NPU_PIN = "2.13.0"          # the [npu] extra's torch-npu; torch must be 2.13.x, CPU build
INSTALL_HINT = ("pip install 'deepinfer-ascend[npu]' (torch_npu 2.13.0 on the CPU build of torch "
                "2.13.0, with CANN 9.2)")
CANN_HINT = ("install CANN 9.2 and source its set_env.sh "
             "(e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)")
# name -> (default, why); applied with setdefault before torch_npu is imported
ENV_DEFAULTS: dict[str, tuple[str, str]] = {
    "PYTORCH_NPU_ALLOC_CONF": ("expandable_segments:True",
                               "one of the four allocator options the 950DT supports"),
    "HCCL_CONNECT_TIMEOUT": ("240", "HCCL link set-up timeout in s (DeepSeek's default)"),
    "HCCL_EXEC_TIMEOUT": ("200", "HCCL op timeout in s (DeepSeek's default)"),
}


@dataclass(frozen=True)
class AscendRuntime:
    """What start-up resolved, once: the torch_npu module, the SoC, the ops' device type."""

    torch_npu: Any
    soc: Soc
    device_type: str                   # "npu" ("cpu" under the tests' alias mode)
    torch_npu_version: str


def apply_env_defaults(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set every unset `ENV_DEFAULTS` variable; returns one log line per variable."""
    environ = os.environ if environ is None else environ
    lines = []
    for name, (value, why) in ENV_DEFAULTS.items():
        if name in environ:
            kept = "" if environ[name] == value else f" (the backend's default would be {value})"
            lines.append(f"{name}={environ[name]} kept from the environment{kept}")
        else:
            environ[name] = value
            lines.append(f"{name}={value} set by default: {why}")
    return lines


def _minor(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:2])


def pairing_problem(torch_version: str, torch_cuda: str | None,
                    npu_version: str | None) -> str | None:
    """Why this torch cannot carry torch_npu `npu_version` (None: fine or unknown)."""
    if torch_cuda:
        pin = npu_version or TORCH_NPU_PIN
        return (f"torch {torch_version} is a CUDA build (CUDA {torch_cuda}); torch_npu needs the "
                f"CPU build of torch {_dotted(pin)} (pip install torch=={pin} "
                "--index-url https://download.pytorch.org/whl/cpu)")
    if npu_version and _minor(torch_version) != _minor(npu_version):
        return (f"torch {torch_version} does not pair with torch_npu {npu_version} (torch_npu "
                f"needs torch {_dotted(npu_version)}.*); install matching versions: {INSTALL_HINT}")
    return None


def _dotted(version: str | None) -> str:
    return ".".join(map(str, _minor(version))) if version else ""


def explain_import_failure(exc: BaseException) -> str:
    """One line saying what `import torch_npu` lacked, from the exception it raised."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch_npu":
        return f"torch_npu is not installed: {INSTALL_HINT}"
    lib = re.search(r"(lib[\w.+-]*?\.so(?:\.[\d.]+)?)", str(exc))
    if lib and isinstance(exc, (ImportError, OSError)):
        return f"CANN not found: torch_npu could not load {lib.group(1)} ({CANN_HINT})"
    if "Failed to load the backend extension" in text:
        return (f"torch could not autoload torch_npu, most likely because CANN is missing "
                f"({CANN_HINT}); torch said: {text}")
    if "Two accelerators" in text:
        return (f"torch_npu refuses this torch: it is built for another accelerator; install the "
                f"CPU build of torch (torch said: {text})")
    return f"import torch_npu failed: {type(exc).__name__}: {text}"


def _fail(what: str) -> PlatformError:
    return PlatformError(f"Ascend backend start-up: {what}")


def load_torch_npu(importer: Callable[[str], Any] = importlib.import_module) -> tuple[Any, str]:
    """(the torch_npu module, its version) or PlatformError with one line."""
    import torch
    version = detect.torch_npu_version()
    accelerator = torch.version.cuda or getattr(torch.version, "hip", None)
    problem = pairing_problem(torch.__version__, accelerator, version)
    if problem:
        raise _fail(problem)
    try:
        module = importer("torch_npu")
    except Exception as exc:     # ImportError, OSError, RuntimeError: all answered in one line
        raise _fail(explain_import_failure(exc)) from None
    version = version or str(getattr(module, "__version__", "") or "")
    problem = pairing_problem(torch.__version__, None, version or None)
    if problem:
        raise _fail(problem)
    return module, version


def read_soc(torch_npu: Any) -> Soc:
    try:
        return classify_soc(torch_npu.npu.get_soc_version())
    except ValueError as exc:
        raise _fail(str(exc)) from None
    except Exception as exc:
        raise _fail(f"torch_npu.npu.get_soc_version() failed: {type(exc).__name__}: "
                    f"{exc}") from None


_started: AscendRuntime | None = None
_import = importlib.import_module     # tests replace it to simulate import failures


def start() -> AscendRuntime:
    """The process's runtime, started on the first call (later calls return it)."""
    global _started
    if _started is None:
        for line in apply_env_defaults():
            log.info("ascend: %s", line)
        module, version = load_torch_npu(_import)
        soc = read_soc(module)
        _started = AscendRuntime(module, soc, DEVICE_TYPE, version)
        log.info("ascend: torch_npu %s, SoC %d = %s, ops on device type %r", version or "?",
                 soc.version, soc.name, DEVICE_TYPE)
    return _started


def started() -> AscendRuntime | None:
    return _started


def reset() -> None:
    """Forget the started runtime (tests: another fake SoC, another DEVICE_TYPE)."""
    global _started
    _started = None

