#!/usr/bin/env bash
# Builds the OpenVINO GenAI peer environment for the benchmarks (its own virtual environment:
# optimum-intel needs transformers < 5, the project uses 5.x). Usage:
#   bash benchmarks/peers/make_openvino_venv.sh [VENV_DIR]
# The model is exported later by benchmarks/runners/openvino_run.py (optimum-cli, fp32 IR; the
# runtime picks bf16 on CPUs with avx512_bf16 unless INFERENCE_PRECISION_HINT says f32).
set -euo pipefail
VENV_DIR="${1:-$(dirname "$0")/.venv-openvino}"
PYTHON="${PYTHON:-python3}"

test -x "$VENV_DIR/bin/python" || "$PYTHON" -m venv "$VENV_DIR"
PY="$VENV_DIR/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CPU wheel of torch from local disk first, so optimum's export pulls nothing heavier.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q openvino-genai openvino-tokenizers "optimum-intel[openvino]" "transformers<5" numpy torch==2.13.0
# torchvision (pulled in by optimum) does not load against this torch and breaks transformers'
# model imports; text export does not need it.
"$PY" -m pip uninstall -q -y torchvision torchaudio 2>/dev/null || true
"$PY" -c "import transformers.modeling_utils; import openvino_genai as g; print('openvino_genai', g.__version__, 'ready in', '$VENV_DIR')"
